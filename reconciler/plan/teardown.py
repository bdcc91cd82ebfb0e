"""The planner's rules for taking a volume down to a phase (pure; no I/O),
in reverse order: unpublish, unstage, close the LUKS2 device, unmap (the
claim with the last mapping), delete the image; only the top mount at a
path, and only ours.

Mixed into the volume planner by plan/planner.py; imported by it only.
"""

from __future__ import annotations

from collections.abc import Callable

from reconciler.facts.observed import Mount
from reconciler.plan.steps import ReleaseClaim, Unmap, Unpublish, Unstage
from reconciler.plan.types import Refused
from reconciler.plan.volumeview import VolumeView, device_node_at, same_device
from reconciler.spec.model import Phase


class TeardownRules(VolumeView):
    close_crypt: Callable[[], None]  # plan/mapping.py (mixed in too)
    plan_delete: Callable[[], None]  # plan/image.py (mixed in too)

    def teardown(self, wanted: Phase) -> None:
        """Steps that take the volume down to ``wanted`` (reverse order)."""
        v = self.v
        keep_targets = {p.path for p in v.publish} if wanted >= Phase.PUBLISHED else set()
        # Unpublish binds that are not wanted (all of them below PUBLISHED).
        for m in sorted(self.published_targets(), key=lambda m: m.mount_point, reverse=True):
            if m.mount_point not in keep_targets:
                self.check_ours_on_top(m)
                self.add(Unpublish(v.name, m.mount_point, self.rdev))
        if wanted < Phase.STAGED and v.stage is not None and self.is_staged():
            self.check_ours_on_top(self.obs.mounts_by_point[v.stage.path])
            self.add(Unstage(v.name, v.stage.path, self.rdev))
        elif wanted < Phase.STAGED and v.stage is None:
            # The stage section was dropped: its mount sits at the default path.
            m = self.obs.mounts_by_point.get(self.staging_path)
            if same_device(m, self.dev) or device_node_at(self.obs, self.staging_path,
                                                          self.dev):
                self.add(Unstage(v.name, self.staging_path, self.rdev))
        if wanted < Phase.STAGED:
            self.close_crypt()  # after the unmounts above: nothing uses it now
        mappings = ([self.mapping] if self.mapping else []) + self.extra_mappings
        if wanted < Phase.MAPPED:
            for i, mp in enumerate(mappings):
                # The claim goes with the last mapping of the image.
                self.add(Unmap(v.name, mp.pool, mp.image, mp.kind, mp.device, mp.fuse_mount,
                               release_claim=i == len(mappings) - 1))
            if not mappings and self.claim is not None and not self.claimed_elsewhere():
                self.add(ReleaseClaim(v.name, v.image.pool, v.image.name, self.ctx.node_name))
            self.mapping = None
        if wanted < Phase.CREATED and self.img is not None:
            self.plan_delete()

    def check_ours_on_top(self, ours: Mount) -> None:
        """Safety rule 8: only the top mount at a path is unmounted, and only ours."""
        top = self.obs.visible_mount(ours.mount_point) or \
            self.obs.top_mounts.get(ours.mount_point)
        if top is not None and top.mount_id != ours.mount_id and not self.is_our_mount(top):
            where = ("on top of ours" if top.mount_point == ours.mount_point
                     else f"over {top.mount_point}, above ours")
            raise Refused(f"{ours.mount_point}: someone else's mount ({top.fs_type} "
                          f"{top.source}) sits {where}; refusing to unmount it "
                          "(unmount it by hand first)")
