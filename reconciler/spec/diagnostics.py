"""Load errors that point at a file, a line and a field.

Imported by cli/release.py, cli/show.py; csi/errors.py, csi/records.py;
daemon/readiness.py; spec/ (14 modules); views.py.
"""

from __future__ import annotations

import re
import reprlib
from dataclasses import dataclass
from pathlib import Path

# Values quoted in messages are user input: a file may be anything (a private
# key behind a symlink, a megabyte of one string), so quote only the start.
EXCERPT_CHARS = 40
_SHORT = reprlib.Repr()  # Python 3.11: attributes, not constructor arguments
_SHORT.maxlevel, _SHORT.maxdict, _SHORT.maxlist = 2, 3, 3
_SHORT.maxstring = _SHORT.maxlong = _SHORT.maxother = EXCERPT_CHARS
_SHORT.fillvalue = "…"


# No value in a spec or config needs these, and in a path or a message they
# hide what it really says: C0/C1 controls (NUL, newline, ESC...), DEL, the
# line separators and the bidi overrides/isolates/marks (a "Trojan source" path).
FORBIDDEN_CHARS = re.compile(
    r"[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def escaped(text: str) -> str:
    """``text`` as is, or with control and bidi characters escaped (no quotes)."""
    return repr(text)[1:-1] if FORBIDDEN_CHARS.search(text) else text


def excerpt(value: object, limit: int = EXCERPT_CHARS) -> str:
    """``repr`` of a user value, escaped, at most ``limit`` characters of it plus "…"."""
    if isinstance(value, str):
        # repr escapes control, NUL and bidi characters (not printable).
        return repr(value) if len(value) <= limit else repr(value[:limit]) + "…"
    return _SHORT.repr(value)


@dataclass(frozen=True, order=True)
class Diagnostic:
    """One problem in an input file: ``file:line:column: field.path: message``.

    ``line`` and ``column`` are 1-based; ``field`` is a dotted path such as
    ``spec.publish[1].path``, or ``(document)`` / ``(file)`` when the problem is
    not inside one field.
    """

    file: Path
    line: int
    column: int
    field: str
    message: str

    def __str__(self) -> str:
        # A file name is the one part not built from excerpts: escape it too.
        return f"{escaped(str(self.file))}:{self.line}:{self.column}: {self.field}: {self.message}"

    def as_dict(self) -> dict[str, object]:
        return {
            "file": str(self.file),
            "line": self.line,
            "column": self.column,
            "field": self.field,
            "message": self.message,
        }


_PLAIN_KEY = re.compile(r"[A-Za-z0-9_-]{1,64}")


def format_field(path: tuple[str | int, ...]) -> str:
    """``("spec", "publish", 1, "path")`` -> ``spec.publish[1].path``.

    A key the user made up (an unknown field) that is not a plain word is shown
    as an escaped excerpt: ``spec["bad\\nkey"]``.
    """
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _PLAIN_KEY.fullmatch(part):
            out += f"[{excerpt(part)}]"
        else:
            out += f".{part}" if out else part
    return out or "(document)"
