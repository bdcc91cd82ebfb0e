"""The planner: ``plan(desired, observed) -> [VolumePlan]``. Pure; no I/O.

Level-triggered: it looks only at what is wanted and what is there, never
at what happened before. Deterministic: volumes by name, steps in lifecycle
order (forward: create, map, stage, publish; back: unpublish, unstage,
unmap, delete). A volume that must not be touched gets a refusal and no
steps at all.

One volume is planned by ``_VolumePlanner``, made of the rules of each
phase: plan/volumeview.py (what is seen of the volume), plan/image.py,
plan/mapping.py, plan/staging.py, plan/publishing.py, plan/teardown.py,
plan/snapshots.py and plan/groups.py. ``plan``, ``actual_state`` and
``problems`` are the entry: imported by engine.py, views.py, apply/ and the
front doors.
"""

from __future__ import annotations

from collections.abc import Iterable

from reconciler.facts import meta
from reconciler.facts.observed import NbdHelper, Observed
from reconciler.facts.stall import stall_doc, stall_reason
from reconciler.plan.groups import GroupRules, group_row
from reconciler.plan.image import ImageRules
from reconciler.plan.mapping import HELPER_GONE, STALE_HELPER, MapRules
from reconciler.plan.publishing import PublishRules
from reconciler.plan.snapshots import SnapshotRules
from reconciler.plan.staging import StageRules
from reconciler.plan.steps import CreateImage, ResizeImage, RollNbd, SetImageMeta
from reconciler.plan.teardown import TeardownRules
from reconciler.plan.types import Context, Refused, VolumePlan, Waiting
from reconciler.spec import qos
from reconciler.spec.model import Phase, Volume
from reconciler.spec.units import format_size

__all__ = ["Context", "Refused", "VolumePlan", "actual_state", "plan"]


# The phase rules come before the snapshot and group rules: the view's
# ``add`` and ``unknown`` are what the stubs there stand for.
class _VolumePlanner(ImageRules, MapRules, StageRules, PublishRules, TeardownRules,
                     SnapshotRules, GroupRules):
    # -- planning ------------------------------------------------------------
    def run(self, release: bool = False) -> VolumePlan:
        if self.v.snapshot is not None or self.v.group is not None:
            return self.run_snapshot_plan(release)
        self.plan.phase = self.observed_phase()
        try:
            # Nothing is probed, unmounted, unmapped, remapped or formatted
            # while its I/O hangs (it would hang too); a release by hand still
            # tries, each command under its deadline (the daemon never does).
            if (stall := self.stall()) is not None:
                self.plan.stalled = stall_reason(stall)
            if release:
                # Give the node's resources back; the image is never touched.
                # A filesystem a dead run left frozen is thawed first: its
                # writers hold the mounts, and a frozen filesystem unmounted
                # lives on frozen in the kernel (mounted again, still frozen).
                # A fenced one is released by hand only (the daemon waits).
                if (fence := self.fence()) is not None:
                    self.plan.fenced = fence.message(self.v.image.spec, self.v.name)
                    self.plan.fence_reason = fence.reason
                self.plan.wanted = min(self.plan.phase, Phase.CREATED)
                self.thaw_left_frozen()
                self.teardown(Phase.CREATED)
                return self.plan
            self.plan.unknown = self.image_unknown()
            # Before the devices: a fenced node's mapping does not answer (its
            # client is blocklisted; its I/O may hang), and the fence is what
            # to act on. It takes Ceph to see one: a stall is seen without.
            if self.plan.unknown is None:
                self.check_not_fenced()
                if self.reattach():
                    # Its I/O stalls, its device does not read: its rbd-nbd's
                    # death is why. Served again, it is looked at anew.
                    self.plan.stalled = None
                    return self.plan
            if self.plan.stalled:
                raise Refused(f"{self.plan.stalled}: nothing that touches it is done until it "
                              "completes")
            if self.plan.unknown:
                raise Refused(self.plan.unknown)
            self.plan.unknown = self.unknown()
            if self.plan.unknown:
                raise Refused(self.plan.unknown)
            self.check_symlinks()
            self.thaw_left_frozen()
            if self.mapping is not None and self.mapping.problem and self.dead_mapping():
                return self.plan  # in use: reported, left as it is
            if self.v.state == "absent":
                self.teardown(Phase.ABSENT)
            else:
                self.teardown(self.v.wanted_phase)
                self.forward()
                self.roll()
        except Refused as exc:
            self.plan.refusal = str(exc)
            self.plan.steps = []
            self.plan.withheld = []
        except Waiting as exc:
            self.wait(str(exc))
        return self.plan

    def run_snapshot_plan(self, release: bool) -> VolumePlan:
        """A snapshot holds nothing on the node: releasing it does nothing."""
        self.plan.kind = "snapshot"
        if release:
            self.plan.wanted = self.plan.phase
            return self.plan
        try:
            if self.v.group is not None:
                self.run_group()
            else:
                self.run_snapshot()
        except Refused as exc:
            self.plan.refusal = str(exc)
            self.plan.steps = []
            self.plan.withheld = []
        except Waiting as exc:
            self.wait(str(exc))
        return self.plan

    def wait(self, why: str) -> None:
        self.plan.waiting = why
        self.plan.notes.append(why)
        self.plan.steps = []
        self.plan.withheld = []

    def check_symlinks(self) -> None:
        """Safety rule 8: a path with a symlink in it is never followed."""
        paths = [p.path for p in self.v.publish]
        if self.v.stage is not None:
            paths.insert(0, self.v.stage.path)
        for p in paths:
            link = self.obs.symlinks.get(p)
            if link is not None:
                raise Refused(f"{p}: {link} is a symlink; paths are used exactly as written "
                              "and never through a symlink (it could lead outside "
                              "allowedRoots)")

    def forward(self) -> None:
        v, img = self.v, self.v.image
        new_size = img.size
        if self.img is None and img.source is not None:
            self.plan_clone()
        elif self.img is None:
            if img.size is None:
                raise Refused(f"image {img.spec} does not exist and no size is given "
                              "(without a size the image is adopted, never created)")
            self.add(CreateImage(v.name, img.pool, img.name, img.size, img.features))
        else:
            if img.size is not None and img.size < self.img.size:
                raise Refused(f"shrinking {img.spec} from {format_size(self.img.size)} to "
                              f"{format_size(img.size)} is refused: it would cut off data")
            if img.size is not None and img.size > self.img.size:
                self.add(ResizeImage(v.name, img.pool, img.name, self.img.size, img.size))
            else:
                new_size = self.img.size
            owned = self.img.meta.get(meta.OWNER) == self.ctx.node_name
            if self.claim_interrupted_create():
                owned = True
            if owned and self.img.meta.get(meta.SPEC_HASH) != v.spec_hash:
                self.add(SetImageMeta(v.name, img.pool, img.name, meta.SPEC_HASH,
                                      self.img.meta.get(meta.SPEC_HASH), v.spec_hash))
            if owned:
                self.finish_volume_clone()
        self.forward_qos(new_size)
        if v.wanted_phase >= Phase.MAPPED:
            self.forward_map(new_size)
            self.forward_io_limits(new_size)
        if v.wanted_phase >= Phase.STAGED:
            self.forward_stage(new_size)
        if v.wanted_phase >= Phase.PUBLISHED:
            self.forward_publish()


def plan(desired: Iterable[Volume], observed: Observed, ctx: Context,
         frozen: Iterable[str] = (), release: Iterable[str] = ()) -> list[VolumePlan]:
    """Plan every desired volume; ``frozen`` names get a refusal and no steps;
    ``release`` names are only taken down to CREATED (unpublish, unstage, unmap)."""
    release = set(release)
    plans = {v.name: _VolumePlanner(v, observed, ctx).run(v.name in release) for v in desired}
    for name in frozen:
        plans[name] = frozen_plan(name)
    return one_roll([plans[n] for n in sorted(plans)])


def one_roll(plans: list[VolumePlan]) -> list[VolumePlan]:
    """At most one rbd-nbd rolled per plan (the first by name): each roll
    pauses its device's I/O, and two at once would pause two volumes (the
    apply's lock keeps concurrent plans apart too). The others wait for a
    later pass."""
    rolling = None
    for p in plans:
        roll = next((s for s in p.steps if isinstance(s, RollNbd)), None)
        if roll is None:
            continue
        if rolling is None:
            rolling = p.name
            continue
        p.steps = [s for s in p.steps if s is not roll]
        p.notes.append(f"{roll.device}: its rbd-nbd is rolled after {rolling}'s (one at a time)")
    return plans


FROZEN = "its file failed to load; left exactly as it is (see validate)"


def frozen_plan(name: str) -> VolumePlan:
    """A volume whose file fails to load: nothing may be done to it."""
    return VolumePlan(name, refusal=FROZEN)


def _helper_doc(h: NbdHelper) -> dict[str, object]:
    """The rbd-nbd serving the volume's device: status shows it."""
    return {"pid": h.pid, "version": h.version, "stale": h.stale,
            "state": (STALE_HELPER if h.stale else "current" if h.stale is False
                      else "unknown (its binary could not be compared)")}


def actual_state(vol: Volume, observed: Observed, ctx: Context,
                 found: dict[str, str] | None = None) -> dict[str, object]:
    """What is there for one desired volume, in the planner's own terms.
    ``found``: its plan's problems, when the caller has planned it already."""
    p = _VolumePlanner(vol, observed, ctx)
    if vol.group is not None:
        return group_row(vol, observed)
    if vol.snapshot is not None:
        return snapshot_state(p)
    staged = p.staged_mount()
    unknown = p.unknown()
    image_unknown = p.image_unknown()
    problem = (p.mapping.problem if p.mapping and p.mapping.problem else
               p.dev.problem if p.dev and p.dev.problem else None)
    # An nbd device the kernel keeps for a re-attach still serves its mounts:
    # its phase stands, and the problem says a new rbd-nbd is due.
    reattaching = bool(p.mapping and p.mapping.reattach) and not image_unknown
    if problem is None and not unknown:
        if found is None:
            found = problems(vol, observed, ctx)
        problem = "; ".join(found.values()) or None
    elif p.mapping is not None and p.mapping.problem and not unknown:
        # A dead mapping left as it is because it is in use: who uses it.
        if found is None:
            found = problems(vol, observed, ctx)
        problem = found.get(HELPER_GONE, problem)
    stall = p.stall()
    fence = p.fence()
    return {
        "name": vol.name,
        # What to act on first: a fence, I/O that hangs; then what could not
        # be seen, never reported as a phase. A mapping that no longer
        # answers is not "PUBLISHED", whatever is mounted.
        "phase": ("FENCED" if fence else p.observed_phase().name if reattaching
                  else "STALLED" if stall else "UNKNOWN" if unknown
                  else "DEGRADED" if problem else p.observed_phase().name),
        "unknown": unknown,
        "problem": problem,
        "stalled": stall_doc(stall) if stall else None,
        "stallReason": stall_reason(stall) if stall else None,
        "fence": fence.as_dict() if fence else None,
        "fenceReason": fence.message(vol.image.spec, vol.name) if fence else None,
        "wanted": vol.wanted_phase.name,
        "image": vol.image.spec,
        "size": p.img.size if p.img else None,
        "mapper": p.mapping.kind if p.mapping else None,
        "device": p.mapping.device if p.mapping else None,
        "helper": _helper_doc(p.mapping.helper) if p.mapping and p.mapping.helper else None,
        "filesystem": p.dev.fs_type if p.dev else None,
        "encryption": _encryption_state(vol, p),
        # The limits in force: librbd's keys on the image, whoever set them.
        "qos": qos.describe(p.img.meta) if p.img else {},
        "staging": (vol.stage.path if p.is_staged() and vol.stage else None),
        "stagingOptions": sorted(staged.options) if staged else None,
        "published": sorted((m.mount_point, p.publish_mode(m)) for m in p.published_targets()),
        # What only Ceph knows is null, not empty, while the image is unseen.
        "imageUnknown": image_unknown,
        "watchers": None if image_unknown else list(p.img.watchers) if p.img else [],
        "holder": p.claim.node if p.claim else None,
        "claim": p.claim.as_dict() if p.claim else None,
        # Image-meta values that are not text (the claim among them: then unknown).
        "unreadableMeta": dict(sorted(p.img.unreadable.items())) if p.img else {},
        "kind": "Volume",
        "clonedFrom": p.img.parent if p.img else None,
        "cloneDepth": p.img.depth if p.img else 0,
        "snapshots": [sn.name for sn in p.img.snaps] if p.img else [],
    }


def problems(vol: Volume, observed: Observed, ctx: Context) -> dict[str, str]:
    """What is wrong with a volume that no step may put right (the plan's
    ``problems``), for ``status`` and ``explain``."""
    return plan([vol], observed, ctx)[0].problems


def _encryption_state(vol: Volume, p: _VolumePlanner) -> dict[str, object] | None:
    """What status and explain say of the LUKS2 layer (never a key)."""
    if vol.encryption is None and p.crypt is None:
        return None
    enc = vol.encryption
    img_meta = p.img.meta if p.img else {}
    return {"type": enc.type if enc else "luks2",
            "key": f"{enc.key_kind} {enc.key_path}" if enc else None,
            "open": p.crypt.path if p.crypt else None,
            "container": ("LUKS2" if p.raw and p.raw.fs_type == "crypto_LUKS" else
                          None if p.raw is None else "none"),
            # A rotate-key cut short: its records say so until a rerun finishes it.
            "rotationInterrupted": any(k in img_meta for k in (
                meta.LUKS_KEY_NEXT, meta.LUKS_KEY_PREV, meta.LUKS_ROTATION))}


def snapshot_state(p: _VolumePlanner) -> dict[str, object]:
    """A Snapshot's row: same keys as a volume's (status prints one table)."""
    vol, img = p.v, p.img
    assert vol.snapshot is not None
    unknown = p.unknown() if vol.image.pool else "its source volume does not load"
    snap = img.snap(vol.snapshot.snap) if img else None
    return {
        "name": vol.name, "kind": "Snapshot",
        "phase": "UNKNOWN" if unknown else ("CREATED" if snap else "ABSENT"),
        "unknown": unknown, "problem": None,
        "imageUnknown": p.image_unknown() if vol.image.pool else unknown,
        "wanted": vol.wanted_phase.name,
        "image": f"{vol.image.spec}@{vol.snapshot.snap}",
        "source": vol.snapshot.source_volume or vol.image.spec,
        "size": snap.size if snap else None,
        "created": snap.created if snap else None,
        "protected": snap.protected if snap else None,
        "children": list(snap.children) if snap else [],
        "owner": img.meta.get(meta.snap_owner(vol.snapshot.snap)) if img else None,
        "mapper": None, "device": None, "filesystem": None, "staging": None,
        "stagingOptions": None, "published": [], "watchers": [], "holder": None, "claim": None,
    }
