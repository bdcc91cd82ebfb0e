"""What one desired file gave a load: its documents with their Volumes, its
diagnostics, the names it declares (frozen if it fails), and whether it was
refused unread; ``FieldPath``, a field's place in a document.

Imported by spec/loader.py (which fills and caches these), spec/claims.py
and spec/references.py (the checks across files, which add diagnostics).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from reconciler.spec.diagnostics import Diagnostic
from reconciler.spec.model import Volume
from reconciler.spec.yamldoc import Document

FieldPath = tuple[str | int, ...]


@dataclass
class FileResult:
    path: Path
    docs: list[tuple[Document, Volume]] = field(default_factory=list)
    diags: list[Diagnostic] = field(default_factory=list)
    names: set[str] = field(default_factory=set)
    untrusted: bool = False  # never read: see security.py
