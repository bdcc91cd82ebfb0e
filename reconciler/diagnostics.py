"""Load errors that point at a file, a line and a field."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


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
        return f"{self.file}:{self.line}:{self.column}: {self.field}: {self.message}"

    def as_dict(self) -> dict[str, object]:
        return {
            "file": str(self.file),
            "line": self.line,
            "column": self.column,
            "field": self.field,
            "message": self.message,
        }


def format_field(path: tuple[str | int, ...]) -> str:
    """``("spec", "publish", 1, "path")`` -> ``spec.publish[1].path``."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "(document)"
