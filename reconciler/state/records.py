"""The daemon's managed.json (its records): what it manages, one volume a line.

Written whenever a volume is added, changed or dropped. A line is encoded
again only when its record object was replaced: with 1,000 volumes, encoding
all of them (with an indent, in the pure-Python encoder) took ~20 ms of each
pass that added one. One line each keeps the file readable and diffable.

Imported by state/statusfiles.py.
"""

from __future__ import annotations

import json
from pathlib import Path

from reconciler.state.files import write_atomic


class RecordsFile:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._lines: dict[str, tuple[dict, str]] = {}  # name -> (record, its line)

    def save(self, records: dict[str, dict]) -> None:
        lines = []
        for name in sorted(records):
            rec = records[name]
            kept = self._lines.get(name)
            if kept is None or kept[0] is not rec:
                kept = self._lines[name] = (
                    rec, f"{json.dumps(name)}: {json.dumps(rec, sort_keys=True)}")
            lines.append(kept[1])
        for name in self._lines.keys() - records.keys():
            del self._lines[name]
        body = "{\n" + ",\n".join(lines) + "\n}\n" if lines else "{}\n"
        write_atomic(self.path, body.encode(), make_dir=True)
