"""Documents that name other desired documents, resolved across files: a
Snapshot's volume, a clone's source (no cycle, never smaller than its
source), a SnapshotGroup's member volumes, a restore from a desired group's
snapshot. A reference that does not resolve is an error of the file that
names it.

Imported by spec/loader.py only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from reconciler.spec.diagnostics import Diagnostic, excerpt, format_field
from reconciler.spec.fileresult import FieldPath, FileResult
from reconciler.spec.model import Volume
from reconciler.spec.units import format_size
from reconciler.spec.yamldoc import Document


def resolve_sources(results: list[FileResult]) -> None:
    """Point each Snapshot at its Volume's image and each clone at its source
    image and snapshot; a source that is not among the desired objects, of the
    wrong kind, smaller than the clone wants, or part of a cycle is an error
    of the file that names it."""
    by_name = {vol.name: vol for res in results for _, vol in res.docs}
    where = {vol.name: (res, doc) for res in results for doc, vol in res.docs}

    def report(res: FileResult, doc: Document, field: FieldPath, message: str) -> None:
        line, col = doc.where(field)
        res.diags.append(Diagnostic(res.path, line, col, format_field(field), message))

    def chain(name: str) -> list[str] | None:
        """The names from ``name`` through its sources; None when it loops."""
        seen: list[str] = []
        while name in by_name and name not in seen:
            seen.append(name)
            v = by_name[name]
            nxt = (v.snapshot.source_volume if v.snapshot else
                   v.image.source.ref if v.image.source and
                   v.image.source.kind not in ("image", "group") else None)
            if nxt is None:
                return seen
            name = nxt
        return None if name in seen else seen

    # Snapshots first: a clone of a snapshot needs the snapshot's image.
    for pass_ in ("snapshot", "volume"):
        for res in results:
            for i, (doc, vol) in enumerate(res.docs):
                if pass_ == "snapshot" and vol.group and vol.group.volumes:
                    if (new := _resolve_group(vol, by_name, lambda f, m, r=res, d=doc:
                                              report(r, d, f, m))) is None:
                        continue
                elif pass_ == "snapshot" and vol.snapshot and vol.snapshot.source_volume:
                    field: FieldPath = ("spec", "source", "volume")
                    target = by_name.get(vol.snapshot.source_volume)
                    if target is None or target.snapshot is not None:
                        report(res, doc, field, f"no desired Volume named "
                               f"{excerpt(vol.snapshot.source_volume)} (a Snapshot's source "
                               "volume must be declared in the desired files)")
                        continue
                    if target.state == "absent" and vol.state == "present":
                        # Its image would take the snapshot with it: the volume's file
                        # fails (and so is left alone) until the snapshot goes first.
                        t_res, t_doc = where[target.name]
                        report(t_res, t_doc, ("spec", "state"),
                               f"{target.name} has a Snapshot {vol.name} (state: present, "
                               f"{vol.source}); set that one to absent first")
                    new = replace(vol, image=replace(vol.image, pool=target.image.pool,
                                                     name=target.image.name))
                elif pass_ == "volume" and vol.image.source and \
                        vol.image.source.kind == "group":
                    if (new := _resolve_group_source(vol, by_name, lambda f, m, r=res, d=doc:
                                                     report(r, d, f, m))) is None:
                        continue
                elif pass_ == "volume" and vol.image.source and \
                        vol.image.source.kind not in ("image", "group"):
                    src = vol.image.source
                    field = ("spec", "image", "source", src.kind)
                    if chain(vol.name) is None:
                        report(res, doc, field, f"source {excerpt(src.ref)} leads back to "
                               f"{vol.name}: a clone cannot start from itself")
                        continue
                    target = by_name.get(src.ref)
                    want_snapshot = src.kind == "snapshot"
                    if target is None or (target.snapshot is not None) != want_snapshot:
                        report(res, doc, field, f"no desired {src.kind.capitalize()} named "
                               f"{excerpt(src.ref)}")
                        continue
                    if not target.image.pool:
                        report(res, doc, field, f"{src.kind} {excerpt(src.ref)} does not load")
                        continue
                    if not want_snapshot and target.image.size and vol.image.size and \
                            vol.image.size < target.image.size:
                        report(res, doc, ("spec", "image", "size"),
                               f"a clone may be larger than its source, never smaller "
                               f"({src.ref} is {format_size(target.image.size)})")
                        continue
                    new = replace(vol, image=replace(vol.image, source=replace(
                        src, pool=target.image.pool, image=target.image.name,
                        snap=target.snapshot.snap if target.snapshot else None)))
                else:
                    continue
                res.docs[i] = (doc, new)
                by_name[vol.name] = new


def _resolve_group(vol: Volume, by_name: dict[str, Volume],
                   report: Callable[[FieldPath, str], None]) -> Volume | None:
    """A SnapshotGroup's members named by volume: their images, each in the
    group's pool and named once. None: an error was reported."""
    assert vol.group is not None
    members: list[tuple[str, str]] = []
    ok = True
    for i, name in enumerate(vol.group.volumes):
        if name in vol.group.volumes[:i]:
            continue  # reported by the builder
        field: FieldPath = ("spec", "volumes", i)
        target = by_name.get(name)
        if target is None or target.kind != "Volume":
            report(field, f"no desired Volume named {excerpt(name)} (a SnapshotGroup's "
                          "volumes must be declared in the desired files)")
            ok = False
            continue
        member = (target.image.pool, target.image.name)
        if member[0] != vol.image.pool:
            report(field, f"volume {name}'s image {member[0]}/{member[1]} is not in the "
                          f"group's pool {excerpt(vol.image.pool)} (an RBD group holds "
                          "images of its own pool only)")
            ok = False
        elif member in members:
            report(field, f"volume {name}'s image {member[0]}/{member[1]} is already a member")
            ok = False
        members.append(member)
    if not ok:
        return None
    return replace(vol, group=replace(vol.group, members=tuple(members)))


def _resolve_group_source(vol: Volume, by_name: dict[str, Volume],
                          report: Callable[[FieldPath, str], None]) -> Volume | None:
    """A restore from a group snapshot that a desired SnapshotGroup takes: its
    ``ref`` becomes that document's name (so it waits for it, as a clone
    waits for a desired Snapshot). One not among the desired files is taken
    as it is. None: an error was reported."""
    src = vol.image.source
    assert src is not None and src.group is not None
    target = by_name.get(src.group)
    if target is None or target.group is None:
        return vol
    field: FieldPath = ("spec", "image", "source", "groupSnapshot")
    members = target.group.members
    if target.image.pool != src.pool or (src.pool, src.image) not in members:
        report(field, f"SnapshotGroup {src.group} has no member {src.pool}/{src.image} "
                      f"(its members: {', '.join(f'{p}/{i}' for p, i in members) or 'none'})")
        return None
    if (vol.image.pool, vol.image.name) in members:
        report(field, f"{vol.image.spec} is itself a member of SnapshotGroup {src.group}: "
                      "a restore cannot start from its own group snapshot")
        return None
    return replace(vol, image=replace(vol.image, source=replace(src, ref=src.group)))
