"""Which file claims what on the node: a volume name and an image once each,
no staging or publish path equal to or inside another. A clash fails both
files, or, with ``Settled`` (what each volume held at its last load), only
the file that brought it.

Imported by spec/loader.py (the checks across files of a load) and
spec/desired.py (``Settled``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from reconciler.spec.builder import under
from reconciler.spec.diagnostics import Diagnostic, excerpt, format_field
from reconciler.spec.fileresult import FieldPath, FileResult
from reconciler.spec.model import Volume
from reconciler.spec.yamldoc import Document

# The claims (kind, value) volume NAME held when it last loaded from FILE:
# none for a volume new to the node (or to that file).
Settled = Callable[[str, Path], Collection[tuple[str, str]]]


@dataclass(frozen=True)
class _Claim:
    kind: str  # "volume name", "image", "staging path", "publish path"
    value: str
    res: FileResult
    doc: Document
    field: FieldPath
    owner: str  # the volume's name

    def settled(self, settled: Settled | None) -> bool:
        return settled is not None and \
            (self.kind, self.value) in settled(self.owner, self.res.path)

    def where(self) -> str:
        line, col = self.doc.where(self.field)
        return f"{self.res.path}:{line}:{col}"

    def report(self, message: str) -> None:
        line, col = self.doc.where(self.field)
        self.res.diags.append(Diagnostic(self.res.path, line, col, format_field(self.field),
                                         message))


def _claims(res: FileResult, doc: Document, vol: Volume) -> list[_Claim]:
    name = vol.name
    out = [_Claim("volume name", vol.name, res, doc, ("metadata", "name"), name)]
    if vol.snapshot is not None or vol.group is not None:
        return out  # a snapshot shares its volumes' images; it claims only its name
    out.append(_Claim("image", vol.image.spec, res, doc, ("spec", "image"), name))
    if vol.stage is not None:
        written = bool(doc.data["spec"]["stage"].get("path"))
        out.append(_Claim("staging path", vol.stage.path, res, doc,
                          ("spec", "stage", "path") if written else ("spec", "stage"), name))
    out += [_Claim("publish path", p.path, res, doc, ("spec", "publish", i, "path"), name)
            for i, p in enumerate(vol.publish)]
    return out


class _Conflicts:
    """Reports a claim that clashes with another. Both fail, each naming the
    other's file:line:column; but with ``settled`` (the CSI adapter's files),
    when one of them is what its volume already held at its last load and the
    other is new, only the new one fails: the file that brought the clash
    is frozen, never the volume already there."""

    def __init__(self, settled: Settled | None) -> None:
        self.settled = settled
        self.decided = False  # a clash was decided by ``settled``

    def _fails(self, this: _Claim, other: _Claim) -> bool:
        if self.settled is None or this.res is other.res:
            return True
        if other.settled(self.settled) and not this.settled(self.settled):
            return True
        if this.settled(self.settled) and not other.settled(self.settled):
            self.decided = True
            return False
        return True

    def same(self, first: _Claim, second: _Claim) -> None:
        def line(this: _Claim, other: _Claim, verb: str) -> str:
            as_ = f" as a {other.kind}" if other.kind != this.kind else ""
            return f"{this.kind} {excerpt(this.value)} is {verb} claimed at {other.where()}{as_}"
        if self._fails(second, first):
            second.report(line(second, first, "already"))
        if self._fails(first, second):
            first.report(line(first, second, "also"))

    def nested(self, outer: _Claim, inner: _Claim) -> None:
        if self._fails(inner, outer):
            inner.report(f"{inner.kind} {excerpt(inner.value)} is inside {outer.kind} "
                         f"{excerpt(outer.value)} claimed at {outer.where()}")
        if self._fails(outer, inner):
            outer.report(f"{outer.kind} {excerpt(outer.value)} contains {inner.kind} "
                         f"{excerpt(inner.value)} claimed at {inner.where()}")


def cross_file_checks(results: list[FileResult], settled: Settled | None = None) -> bool:
    """Names and images are each claimed once on a node; no staging or publish
    path equals or nests in another (a mount inside another volume's mount
    hides it, or lands in its data, and teardown order breaks). True when
    ``settled`` spared a claim (see _Conflicts)."""
    conflicts = _Conflicts(settled)
    seen: dict[tuple[str, str], _Claim] = {}
    paths: list[_Claim] = []
    for res in results:
        for doc, vol in res.docs:
            for claim in _claims(res, doc, vol):
                if claim.kind.endswith("path"):
                    paths.append(claim)
                elif (first := seen.setdefault((claim.kind, claim.value), claim)) is not claim:
                    conflicts.same(first, claim)
    # Sorted component-wise, a path's descendants follow it directly, so a stack
    # of the open ancestors finds every nesting in O(n log n). "/" -> NUL (the
    # smallest character, never in a path) sorts component-wise as one string.
    paths.sort(key=lambda c: c.value.replace("/", "\0"))
    stack: list[_Claim] = []
    for claim in paths:
        while stack and not (claim.value == stack[-1].value
                             or under(claim.value, stack[-1].value)):
            stack.pop()
        if stack:
            (conflicts.same if stack[-1].value == claim.value else conflicts.nested)(
                stack[-1], claim)
        stack.append(claim)
    return conflicts.decided
