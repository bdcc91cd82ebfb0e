"""The planner's rules for snapshots and clones (pure; no I/O).

Mixed into the volume planner: a ``kind: Snapshot`` document plans here
instead of the lifecycle; a Volume with ``image.source`` is created as a
clone; a delete of an image or snapshot respects what depends on it.

Imported by plan/planner.py.
"""

from __future__ import annotations

from collections.abc import Callable

from reconciler.facts import meta
from reconciler.facts.observed import ImageState, Observed, SnapState
from reconciler.plan.steps import (
    CloneImage,
    CreateSnapshot,
    DeleteSnapshot,
    FlattenImage,
    Step,
    Thaw,
)
from reconciler.plan.types import Context, Refused, VolumePlan, Waiting
from reconciler.spec.model import Phase, Volume
from reconciler.spec.units import format_size


def temp_snapshot(volume: str) -> str:
    """The snapshot a clone of a volume goes through (removed once flattened)."""
    return f"rbdr-clone-{volume}"


class SnapshotRules:
    v: Volume
    obs: Observed
    ctx: Context
    plan: VolumePlan
    img: ImageState | None
    plan_group_restore: Callable[[], None]  # plan/groups.py (mixed in after this)

    def add(self, step: Step) -> None:
        raise NotImplementedError

    def unknown(self) -> str | None:
        raise NotImplementedError

    # -- the node side: a freeze a crash left behind ---------------------------
    def image_mounts(self, pool: str, image: str
                     ) -> list[tuple[str, bool, str, tuple[int, int]]]:
        """(mount point, read-only, fs type, device) of each mount of the image's device."""
        out = []
        for mp in self.obs.mappings_by_image.get((pool, image), []):
            dev = self.obs.devices.get(mp.device) if mp.device else None
            if dev is None:
                continue
            for m in self.obs.mounts_by_dev.get((dev.major, dev.minor), []):
                out.append((m.mount_point, m.read_only, m.fs_type, (dev.major, dev.minor)))
        return sorted(out)

    def thaw_left_frozen(self) -> None:
        """A recorded freeze of a mount of ours: thaw it first (idempotent)."""
        if not self.obs.freezes:
            return
        for point, _ro, _fs, _dev in self.image_mounts(self.v.image.pool, self.v.image.name):
            if point in self.obs.freezes:
                self.add(Thaw(self.v.name, point))

    def freeze_target(self, pool: str, image: str) -> tuple[str, tuple[int, int]] | None:
        """A read-write filesystem mount of the image (and its device): frozen
        around a snapshot. One mount is enough (the superblock freezes)."""
        rw = [(point, dev) for point, ro, fs, dev in self.image_mounts(pool, image)
              if not ro and fs in ("ext4", "xfs")]
        if rw:
            return rw[0]
        if self.obs.mappings_by_image.get((pool, image)):
            self.plan.notes.append(f"{pool}/{image} has no read-write filesystem mounted: "
                                   "snapshotted as it is (block volumes are never frozen)")
        return None

    # -- kind: Snapshot -----------------------------------------------------------
    def run_snapshot(self) -> None:
        v, snap = self.v, self.v.snapshot
        assert snap is not None
        pool, image = v.image.pool, v.image.name
        self.plan.kind = "snapshot"
        self.plan.wanted = Phase.ABSENT if v.state == "absent" else Phase.CREATED
        why = self.unknown()
        if why:
            self.plan.unknown = why
            raise Refused(why)
        found = self.img.snap(snap.snap) if self.img else None
        self.plan.phase = Phase.CREATED if found else Phase.ABSENT
        self.thaw_left_frozen()
        if v.state == "absent":
            if found is not None and self.img is not None:
                self.delete_snapshot(self.img, found)
            return
        if found is not None:
            return  # a snapshot records a moment: never re-taken
        if self.img is None and snap.source_volume:
            raise Waiting(f"waits for volume {snap.source_volume} ({pool}/{image}) to exist")
        if self.img is None:
            raise Refused(f"its source image {pool}/{image} does not exist")
        self.add(self.take(v.name, pool, image, snap.snap))

    def take(self, name: str, pool: str, image: str, snap: str) -> CreateSnapshot:
        target = self.freeze_target(pool, image)
        return CreateSnapshot(name, pool, image, snap, target[0] if target else None,
                              target[1] if target else None)

    def delete_snapshot(self, img: ImageState, snap: SnapState) -> bool:
        """Steps that delete one snapshot (flattening its clones first when the
        config allows); a refusal is withheld. True when it will be deleted."""
        where = f"{img.pool}/{img.name}@{snap.name}"
        owner = img.meta.get(meta.snap_owner(snap.name))
        if owner != self.ctx.node_name:
            self.plan.withheld.append(f"refusing to delete snapshot {where}: it was not made "
                                      f"by this node (owner: {owner or 'none recorded'})")
            return False
        if snap.children and not self.ctx.flatten_on_delete:
            self.plan.withheld.append(
                f"refusing to delete snapshot {where}: clones depend on it "
                f"({', '.join(snap.children)}); flatten them first, or set "
                "clone.flattenOnDelete: true in the node config")
            return False
        for child in snap.children:
            pool, _, name = child.partition("/")
            self.add(FlattenImage(self.v.name, pool, name, f"before deleting {where}"))
        self.add(DeleteSnapshot(self.v.name, img.pool, img.name, snap.name))
        return True

    def delete_image_snapshots(self) -> bool:
        """Before an image is deleted: its snapshots go with it only when every
        one is ours. False: the delete is withheld."""
        img = self.img
        assert img is not None
        foreign = [s.name for s in img.snaps
                   if img.meta.get(meta.snap_owner(s.name)) != self.ctx.node_name]
        if foreign:
            self.plan.withheld.append(
                f"refusing to delete {img.pool}/{img.name}: it has snapshots this node did "
                f"not make ({', '.join(foreign)}); the image is kept")
            return False
        return all([self.delete_snapshot(img, s) for s in img.snaps])

    # -- a Volume with image.source ------------------------------------------------
    def plan_clone(self) -> None:
        v, src = self.v, self.v.image.source
        assert src is not None
        if src.group is not None:
            self.plan_group_restore()
            return
        key = (src.pool, src.image)
        if src.pool not in self.obs.pools_listed or key in self.obs.image_errors:
            why = self.obs.image_errors.get(key) or self.obs.pool_errors.get(src.pool,
                                                                             "not listed")
            raise Refused(f"cannot see the clone source {src.pool}/{src.image} ({why})")
        parent = self.obs.images.get(key)
        desired = src.kind != "image"  # named in the desired files: it may be on its way
        if parent is None:
            if desired:
                raise Waiting(f"waits for its source {src.kind} {src.ref} "
                              f"({src.pool}/{src.image}) to exist")
            raise Refused(f"clone source {src.pool}/{src.image} does not exist")
        if src.snap is None:
            self.plan_volume_clone(parent)
            return
        snap = parent.snap(src.snap)
        if snap is None:
            if desired:
                raise Waiting(f"waits for its source snapshot {src.ref} ({src.spec}) to be "
                              "taken")
            raise Refused(f"clone source snapshot {src.spec} does not exist")
        if v.image.size is not None and v.image.size < snap.size:
            raise Refused(f"a clone may be larger than its source, never smaller: "
                          f"{src.spec} is {format_size(snap.size)}, the volume wants "
                          f"{format_size(v.image.size)}")
        self.add(CloneImage(v.name, v.image.pool, v.image.name, src.pool, src.image, src.snap,
                            v.image.features, v.image.size))
        depth = parent.depth + 1
        policy, limit = self.ctx.clone_flatten, self.ctx.clone_max_depth
        if policy == "always" or (policy == "depth" and depth > limit):
            why = "clone.flatten: always" if policy == "always" else \
                f"depth {depth} > clone.maxDepth {limit}"
            self.add(FlattenImage(v.name, v.image.pool, v.image.name, why))

    def plan_volume_clone(self, parent: ImageState) -> None:
        """A clone of a volume: through a temporary snapshot, flattened at once
        so the source keeps no snapshot and no dependant."""
        v = self.v
        tmp = temp_snapshot(v.name)
        if v.image.size is not None and v.image.size < parent.size:
            raise Refused(f"a clone may be larger than its source, never smaller: "
                          f"{parent.pool}/{parent.name} is {format_size(parent.size)}")
        if parent.snap(tmp) is None:
            self.add(self.take(v.name, parent.pool, parent.name, tmp))
        self.add(CloneImage(v.name, v.image.pool, v.image.name, parent.pool, parent.name, tmp,
                            v.image.features, v.image.size))
        self.add(FlattenImage(v.name, v.image.pool, v.image.name, "a clone of a volume"))
        self.add(DeleteSnapshot(v.name, parent.pool, parent.name, tmp))

    def finish_volume_clone(self) -> None:
        """The clone exists but a crash cut the flatten or the temporary
        snapshot's removal short: finish them."""
        v, src, img = self.v, self.v.image.source, self.img
        if src is None or src.snap is not None or img is None:
            return
        parent = self.obs.images.get((src.pool, src.image))
        tmp = temp_snapshot(v.name)
        if img.parent is not None and img.parent.endswith(f"@{tmp}"):
            self.add(FlattenImage(v.name, v.image.pool, v.image.name, "a clone of a volume"))
        if parent is not None and (snap := parent.snap(tmp)) is not None and \
                parent.meta.get(meta.snap_owner(tmp)) == self.ctx.node_name and \
                set(snap.children) <= {v.image.spec}:
            self.add(DeleteSnapshot(v.name, parent.pool, parent.name, tmp))
