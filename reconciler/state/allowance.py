"""``rbd-reconciler allow-removal``: let pending removals go without a restart.

The command writes ``stateDir/allow-removal.json`` (atomically); the daemon
reads it at its next pass and deletes it, used or not: an allowance is for
the removals pending now, never for a checkout that goes wrong tomorrow.

Imported by cli/run.py; daemon/asks.py, daemon/commands.py,
daemon/passes.py.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from reconciler.state.files import read_json, remove, write_json

FILENAME = "allow-removal.json"


@dataclass(frozen=True)
class Allowance:
    names: frozenset[str] = frozenset()
    all: bool = False  # every pending removal, past the mass-removal guard

    def allows(self, name: str) -> bool:
        return self.all or name in self.names


def grant(state_dir: Path, names: list[str], all_: bool) -> Allowance:
    """Add to the allowance waiting for the daemon; returns what now waits."""
    path = state_dir / FILENAME
    old = read_json(path, {}) or {}
    new = Allowance(frozenset(old.get("names", [])) | set(names), bool(old.get("all")) or all_)
    write_json(path, {"names": sorted(new.names), "all": new.all})
    return new


def take(state_dir: Path) -> Allowance:
    """The allowance waiting, consumed (the file is removed)."""
    path = state_dir / FILENAME
    try:
        data = read_json(path, None)
    except ValueError:  # a torn hand-written file: consume it, allow nothing
        data = None
    if data is None and not path.exists():
        return Allowance()
    with contextlib.suppress(FileNotFoundError):
        remove(path)
    if not isinstance(data, dict):
        return Allowance()
    return Allowance(frozenset(str(n) for n in data.get("names", [])), bool(data.get("all")))
