"""The planner's rules for the image itself (pure; no I/O): librbd's QoS
limits in its metadata, an interrupted create taken as ours, and the delete
(only what this node created, unclaimed, unopened).

Mixed into the volume planner by plan/planner.py; imported by it only.
"""

from __future__ import annotations

from collections.abc import Callable

from reconciler.facts import meta
from reconciler.facts.text import shown_name
from reconciler.plan.steps import DeleteImage, SetImageMeta, SetQos
from reconciler.plan.types import Refused
from reconciler.plan.volumeview import VolumeView
from reconciler.spec import qos


class ImageRules(VolumeView):
    delete_image_snapshots: Callable[[], bool]  # plan/snapshots.py (mixed in too)

    def forward_qos(self, size: int | None) -> None:
        """librbd's limits in the image's metadata, changed in place: every
        librbd client applies them live, nothing is remapped."""
        v = self.v
        if v.qos is None:
            return
        if (why := qos.too_large(v.qos, size)) is not None:
            raise Refused(why)  # before any key is set: never half the limits
        want = qos.librbd_meta(v.qos, size)
        have = {k: val for k, val in (self.img.meta if self.img else {}).items()
                if k in qos.QOS_KEYS}
        if want != have:
            self.add(SetQos(v.name, v.image.pool, v.image.name, tuple(sorted(have.items())),
                            tuple(sorted(want.items()))))

    def claim_interrupted_create(self) -> bool:
        """Our create was cut off before the owner record: the intent says it is ours."""
        img = self.img
        if img is None or img.meta.get(meta.OWNER) is not None or \
                (img.pool, img.name) not in self.obs.intents:
            return False
        self.add(SetImageMeta(self.v.name, img.pool, img.name, meta.OWNER, None,
                              self.ctx.node_name))
        return True

    def plan_delete(self) -> None:
        v, img = self.v, self.img
        assert img is not None
        if v.image.reclaim_policy != "Delete":
            self.plan.notes.append(f"image {v.image.spec} kept: reclaimPolicy is Retain")
            return
        owner = img.meta.get(meta.OWNER)
        if self.claim_interrupted_create():
            owner = self.ctx.node_name
        # A refused delete withholds the delete only: the node's side is torn down.
        if owner != self.ctx.node_name:
            self.plan.withheld.append(
                f"refusing to delete {v.image.spec}: it was not created by this node "
                f"(owner: {shown_name(owner) if owner else 'none recorded'}); the image is kept")
            return
        if (other := self.claimed_elsewhere()) is not None:
            self.plan.claimed_by = other.node
            self.plan.withheld.append(
                f"refusing to delete {v.image.spec}: it is claimed by node {other.node} "
                "(mapped there); the image is kept")
            return
        if self.foreign_watchers():
            self.plan.withheld.append(
                f"refusing to delete {v.image.spec}: it is open by {self.foreign_watchers()} "
                f"other client(s) ({', '.join(img.watchers)}); the image is kept")
            return
        if img.snaps and not self.delete_image_snapshots():
            return
        self.add(DeleteImage(v.name, v.image.pool, v.image.name))
