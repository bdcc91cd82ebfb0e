"""The desired set the daemon converges: the operator's desiredDir plus the
CSI adapter's own directory.

The operator's files win: a CSI volume that claims a name, an image or a path
an operator file already claims is not loaded, and the diagnostic names the
CSI file (the CSI call that wrote it answers with that error).

Imported by csi/converge.py; daemon/passes.py; engine/orphans.py,
engine/release.py; source/sync.py.
"""

from __future__ import annotations

import bisect
import os
from pathlib import Path

from reconciler.spec.claims import Settled
from reconciler.spec.config import Config
from reconciler.spec.diagnostics import Diagnostic, excerpt
from reconciler.spec.loader import LoadCache, LoadResult, load
from reconciler.spec.model import Volume


def claims(v: Volume) -> list[tuple[str, str, str]]:
    """(kind, value, field) a volume holds on the node; each may be held once."""
    out = [("volume name", v.name, "metadata.name")]
    if v.kind != "Volume":
        return out  # it shares its volumes' images
    out.append(("image", v.image.spec, "spec.image"))
    if v.stage is not None:
        out.append(("staging path", v.stage.path, "spec.stage.path"))
    out += [("publish path", p.path, f"spec.publish[{i}].path") for i, p in enumerate(v.publish)]
    return out


def _path_clash(kind: str, value: str, paths: dict[str, tuple[str, Volume]],
                ordered: list[str]) -> str | None:
    """Why path ``value`` (a ``kind``) clashes with one of the operator's
    ``paths`` (``ordered``: the same, sorted): equal to, inside or around it."""
    if value in paths:
        okind, owner = paths[value]
        return (f"{kind} {excerpt(value)} is already claimed by the operator's {owner.source}"
                + (f" as a {okind}" if okind != kind else ""))
    parent = value
    while (parent := os.path.dirname(parent)) not in ("/", ""):
        if parent in paths:
            okind, owner = paths[parent]
            return (f"{kind} {excerpt(value)} is inside the operator's {okind} "
                    f"{excerpt(parent)} ({owner.source})")
    i = bisect.bisect_left(ordered, value + "/")
    if i < len(ordered) and ordered[i].startswith(value + "/"):
        okind, owner = paths[ordered[i]]
        return (f"{kind} {excerpt(value)} contains the operator's {okind} "
                f"{excerpt(ordered[i])} ({owner.source})")
    return None


def operator_conflicts(candidates: tuple[Volume, ...], operator: LoadResult) -> list[Diagnostic]:
    """Diagnostics for every CSI volume that claims what an operator file
    claims: a name, an image, or a path equal to, inside or around one of its
    paths (as the loader holds files to among themselves)."""
    held = {(kind, value): vol for vol in operator.volumes for kind, value, _ in claims(vol)
            if not kind.endswith("path")}
    paths = {value: (kind, vol) for vol in operator.volumes for kind, value, _ in claims(vol)
             if kind.endswith("path")}
    ordered = sorted(paths)
    diags = []
    for v in candidates:
        for kind, value, field in claims(v):
            if kind.endswith("path"):
                if (why := _path_clash(kind, value, paths, ordered)) is not None:
                    diags.append(Diagnostic(v.source.file, v.source.line, 1, field,
                                            f"{why}; this CSI volume is not loaded"))
                    break
                continue
            owner = held.get((kind, value))
            if owner is None and kind == "volume name" and value in operator.frozen_names:
                diags.append(Diagnostic(v.source.file, v.source.line, 1, field,
                                        f"{kind} {value!r} is declared by an operator file"))
                break
            if owner is not None:
                diags.append(Diagnostic(v.source.file, v.source.line, 1, field,
                                        f"{kind} {value!r} is already claimed by the operator's "
                                        f"{owner.source}; this CSI volume is not loaded"))
                break
    return diags


def load_desired(config: Config, cache: LoadCache | None = None,
                 settled: Settled | None = None) -> LoadResult:
    """``cache``: kept by the caller (the daemon) across passes, so a file
    that did not change is not read again; the checks across files still run.
    ``settled``: what each volume claimed at its last load. Between CSI files
    a clash then freezes only the file that brought it (the adapter refuses
    one before it writes it; two calls on two volumes at once can still make
    one): the volume already there goes on being served. Operator files keep
    failing both sides of a clash, each naming the other."""
    operator = load([config.desired_dir], config, cache)
    if not config.csi_dir.is_dir():
        return operator
    csi = load([config.csi_dir], config, cache, settled)
    conflicts = operator_conflicts(csi.volumes, operator)
    bad_files = {d.file for d in conflicts}
    bad = [v for v in csi.volumes if v.source.file in bad_files]
    operator_names = {v.name for v in operator.volumes}
    # A clash on a name leaves that name to the operator's volume; any other
    # clash freezes the CSI volume (it stays exactly as it is).
    frozen = set(operator.frozen_names) | (set(csi.frozen_names) - operator_names) | {
        v.name for v in bad if v.name not in operator_names}
    volumes = [*operator.volumes, *(v for v in csi.volumes if v.source.file not in bad_files)]
    return LoadResult(
        volumes=tuple(sorted(volumes, key=lambda v: v.name)),
        diagnostics=tuple(sorted({*operator.diagnostics, *csi.diagnostics, *conflicts})),
        files=operator.files + csi.files,
        failed_files=operator.failed_files | csi.failed_files | frozenset(bad_files),
        frozen_names=frozenset(frozen),
        refused=operator.refused or csi.refused,
    )


def forgettable(record: dict, config: Config) -> bool:
    """A vanished CSI file whose volume holds nothing on the node (deleted, or
    never mapped here) is the adapter's deliberate removal: forget it rather
    than release it, and never count it toward the mass-removal guard."""
    if Path(record["file"]).parent != config.csi_dir:
        return False
    vol = record["volume"]
    return vol.get("state") == "absent" or not vol.get("map")
