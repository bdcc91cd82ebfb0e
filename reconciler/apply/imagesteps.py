"""The chain's steps on the image in Ceph: create and clone (an intent
recorded first, so a crash leaves an image the next pass knows as ours), a
snapshot under a bounded freeze, and the deletes, each re-checked right
before acting (ours, unclaimed, unopened, nothing depending on it).

Mixed into the chain by apply/runner.py; imported by it only.
"""

from __future__ import annotations

from collections.abc import Callable

from reconciler.apply.chainstate import ChainState
from reconciler.apply.outcomes import FreezeExpired, StepRefused
from reconciler.drivers import ceph
from reconciler.facts import meta
from reconciler.facts.claim import parse as parse_claim
from reconciler.facts.text import shown_name
from reconciler.plan.steps import (
    CloneImage,
    CreateImage,
    CreateSnapshot,
    DeleteImage,
    DeleteSnapshot,
)
from reconciler.state.registry import Intents, intent_key


class ImageSteps(ChainState):
    def create(self, step: CreateImage) -> None:
        self.with_intent(step.pool, step.image, lambda: ceph.create_image(
            self.need_cluster(), step.pool, step.image, step.size, step.features,
            self.owner_meta()))

    def with_intent(self, pool: str, image: str, make: Callable[[], None]) -> None:
        """Intent first, so a crash between the create (or clone) and the owner
        record leaves an image the next pass recognises as ours (and finishes)."""
        intents = Intents(self.node.config.state_dir)
        key = intent_key(pool, image)
        interrupted = intents.get(key) is not None  # an earlier run died creating it
        intents.record(key, {"node": self.node.config.node_name})
        try:
            make()
        except ceph.ImageExists:
            # Killed inside librbd's create (after its id object, before its
            # directory entry) leaves an image nobody can list or open, whose
            # name is taken. Only our own recorded attempt is cleared away;
            # a listed image is someone's, never ours to claim.
            if not (interrupted and ceph.remove_unlisted(self.need_cluster(), pool, image)):
                intents.forget(key)
                raise
            make()
        intents.forget(key)

    def owner_meta(self) -> dict[str, str]:
        return {meta.OWNER: self.node.config.node_name,
                meta.SPEC_HASH: self.volume.spec_hash if self.volume else ""}

    def snapshot(self, step: CreateSnapshot) -> tuple[str, str]:
        """The filesystem is frozen around the snapshot only, and never longer
        than snapshots.freezeTimeoutSeconds: a watchdog thaws it then, even
        while the call hangs, and the snapshot fails. The owner is recorded
        before the snapshot (ceph driver)."""
        from reconciler.drivers import freeze

        cluster = self.need_cluster()
        limit = self.node.config.snapshots.freeze_timeout_seconds
        with freeze.frozen(step.freeze, self.node.config.state_dir, step.freeze_rdev,
                           limit) as hold:
            try:
                result = ceph.create_snapshot(cluster, step.pool, step.image, step.snap,
                                              self.node.config.node_name)
            except Exception as exc:
                if hold is not None and hold.expired:
                    raise FreezeExpired(f"froze {step.freeze} for more than {limit:g} s: "
                                        f"thawed; snapshot not taken ({exc})") from exc
                raise
        if hold is not None and hold.expired and result == "changed":
            raise FreezeExpired(self.late_snapshot(step, limit))
        if result == "ok":
            return "ok", "already taken by this node"
        return "changed", f"frozen {step.freeze}" if step.freeze else ""

    def late_snapshot(self, step: CreateSnapshot, limit: float) -> str:
        """The call returned after the watchdog's thaw: the snapshot is not of
        the frozen moment. Removed, so the next pass takes it properly."""
        why = (f"froze {step.freeze} for more than {limit:g} s: thawed; the snapshot "
               "completed only after the thaw (not under the freeze)")
        try:
            ceph.remove_snapshot(self.need_cluster(), step.pool, step.image, step.snap)
        except Exception as exc:
            return f"{why}, and removing it failed ({exc}): {step.target} is kept, not frozen"
        return f"{why}: removed it; the next pass takes it again"

    def clone(self, step: CloneImage) -> None:
        self.with_intent(step.pool, step.image, lambda: ceph.clone_image(
            self.need_cluster(), (step.parent_pool, step.parent_image, step.parent_snap),
            step.pool, step.image, step.features, step.size, self.owner_meta()))

    def delete_snapshot(self, step: DeleteSnapshot) -> tuple[str, str]:
        """Re-checked right before acting: ours, and no clone depends on it."""
        cluster = self.need_cluster()
        found = ceph.observe_images(cluster, [(step.pool, step.image)]).images.get(
            (step.pool, step.image))
        snap = found.snap(step.snap) if found else None
        if found is None or snap is None:
            return "ok", "already gone"
        owner = found.meta.get(meta.snap_owner(step.snap))
        if owner != self.node.config.node_name:
            raise StepRefused(f"snapshot {step.target} is owned by {owner or 'nobody'}")
        if snap.children:
            raise StepRefused(f"snapshot {step.target} still has clones: "
                              f"{', '.join(snap.children)}")
        ceph.remove_snapshot(cluster, step.pool, step.image, step.snap)
        return "changed", ""

    def delete(self, step: DeleteImage) -> None:
        cluster = self.need_cluster()
        found = ceph.observe_images(cluster, [(step.pool, step.image)]).images.get(
            (step.pool, step.image))
        if found is None:
            return
        if bad := sorted(k for k in found.unreadable if meta.ours(k)):
            raise StepRefused(f"{step.pool}/{step.image}: image-meta {', '.join(bad)} is not "
                              "UTF-8 text; unknown, not absent")
        owner = found.meta.get(meta.OWNER)
        if owner != self.node.config.node_name:
            raise StepRefused(f"{step.pool}/{step.image} is owned by "
                              f"{shown_name(owner) if owner else 'nobody'}")
        holder = parse_claim(found.meta.get(meta.HOLDER))
        if holder is not None and holder.node != self.node.config.node_name:
            raise StepRefused(f"{step.pool}/{step.image} is claimed by node {holder.node}")
        if found.watchers:
            raise StepRefused(f"{step.pool}/{step.image} is still open by "
                              f"{', '.join(found.watchers)}")
        if found.snaps:
            raise StepRefused(f"{step.pool}/{step.image} still has snapshots: "
                              f"{', '.join(shown_name(s.name) for s in found.snaps)}")
        ceph.remove_image(cluster, step.pool, step.image)

