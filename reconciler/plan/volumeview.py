"""What the planner sees of one volume (pure; no I/O): its image, claim,
mapping and devices found in ``Observed``, and the questions every phase
asks of them (staged? published where? fenced? unknown?).

``VolumeView`` is the base of the planner's phase rules (plan/image.py,
plan/mapping.py, plan/staging.py, plan/publishing.py, plan/teardown.py),
which plan/planner.py mixes into one volume planner; imported by those only.
"""

from __future__ import annotations

from collections.abc import Iterable

from reconciler.facts import meta
from reconciler.facts.claim import Claim, parse
from reconciler.facts.observed import (
    CryptDevice,
    Device,
    ImageState,
    IoStall,
    Mapping,
    Mount,
    Observed,
)
from reconciler.plan.fence import BLOCKLISTED, Fence, fence_of
from reconciler.plan.steps import Step
from reconciler.plan.types import Context, Refused, VolumePlan
from reconciler.spec import mountflags, qos
from reconciler.spec.model import Phase, Volume


def same_device(mount: Mount | None, dev: Device | None) -> bool:
    return mount is not None and dev is not None and (mount.major, mount.minor) == (
        dev.major, dev.minor)


def device_node_at(obs: Observed, path: str, dev: Device | None) -> bool:
    return dev is not None and obs.path_rdev.get(path) == (dev.major, dev.minor)


def missing_options(mount: Mount, wanted: Iterable[str], fs_type: str | None
                    ) -> tuple[str, ...]:
    """What mountinfo shows is not in force (a default it hides is not missing)."""
    return mountflags.missing(wanted, mount.options | mount.super_options, fs_type)


class VolumeView:
    """One desired volume and what is there for it."""

    def __init__(self, vol: Volume, obs: Observed, ctx: Context) -> None:
        self.v = vol
        self.obs = obs
        self.ctx = ctx
        self.plan = VolumePlan(vol.name, wanted=vol.wanted_phase)
        key = (vol.image.pool, vol.image.name)
        self.img: ImageState | None = obs.images.get(key)
        self.claim: Claim | None = parse(self.img.meta.get(meta.HOLDER)) if self.img else None
        maps = obs.mappings_by_image.get(key, [])
        self.mapping: Mapping | None = maps[0] if maps else None
        self.extra_mappings = maps[1:]
        self.staging_path = vol.stage.path if vol.stage else f"{ctx.staging_root}/{vol.name}"
        # Paths whose mount of ours this plan unmounts before it mounts them
        # again (a dead mapping's repair): free for the forward rules.
        self.remounting: set[str] = set()
        # The mapped device; and an open LUKS2 device over it, if any.
        self.raw: Device | None = (
            obs.devices.get(self.mapping.device) if self.mapping and self.mapping.device
            else None)
        self.crypt: CryptDevice | None = (
            obs.crypts.get(self.mapping.device) if self.mapping and self.mapping.device
            else None)
        # The device that holds the filesystem (or is staged in block mode):
        # an open LUKS2 device over the mapping (whatever the spec says now:
        # what is mounted is where it is), else the mapped one, unless the
        # volume is encrypted (then there is none until the container opens).
        self.dev: Device | None = (
            obs.devices.get(self.crypt.path) if self.crypt is not None
            else self.raw if vol.encryption is None else None)

    @property
    def rdev(self) -> tuple[int, int]:
        assert self.dev is not None
        return self.dev.major, self.dev.minor

    # -- observation ---------------------------------------------------------
    def staged_mount(self) -> Mount | None:
        st = self.v.stage
        if st is None or self.dev is None:
            return None
        m = self.obs.mounts_by_point.get(st.path)
        return m if same_device(m, self.dev) else None

    def is_staged(self) -> bool:
        st = self.v.stage
        if st is None:
            return False
        if st.mode == "block":
            return device_node_at(self.obs, st.path, self.dev)
        return self.staged_mount() is not None

    def published_targets(self) -> list[Mount]:
        """Mounts of our device outside the staging path: our binds."""
        if self.dev is None:
            return []
        rdev = (self.dev.major, self.dev.minor)
        found = list(self.obs.mounts_by_dev.get(rdev, ()))
        # Block mode binds a device node: the mount is of /dev's filesystem.
        found += [self.obs.mounts_by_point[p] for p in self.obs.paths_by_rdev.get(rdev, ())
                  if p in self.obs.mounts_by_point]
        return [m for m in found if m.mount_point != self.staging_path]

    def shadowed_by(self, m: Mount) -> Mount | None:
        """The mount an application at ``m``'s path reaches instead of ``m``
        (None: it reaches ``m``): one mounted on top of it, or over a
        directory above it. Such a publish serves nobody."""
        seen = self.obs.visible_mount(m.mount_point)
        if seen is None or seen.mount_id == m.mount_id or self.is_our_mount(seen):
            return None  # ours on ours (a bind made twice) still serves the volume
        return seen

    def publish_mode(self, m: Mount) -> str:
        """What an application at the bind gets: rw, ro, or nothing (shadowed)."""
        if self.shadowed_by(m) is not None:
            return "shadowed"
        return "ro" if m.read_only or m.fs_read_only else "rw"

    def observed_phase(self) -> Phase:
        if self.img is None:
            return Phase.ABSENT
        if self.mapping is None:
            return Phase.CREATED
        if self.v.stage is not None and self.is_staged():
            wanted_targets = {p.path for p in self.v.publish}
            # A shadowed bind is there, but serves nobody: not published.
            if any(m.mount_point in wanted_targets and self.shadowed_by(m) is None
                   for m in self.published_targets()):
                return Phase.PUBLISHED
            return Phase.STAGED
        return Phase.MAPPED

    def image_unknown(self) -> str | None:
        """Why the image (its size, watchers, claim, snapshots) was not seen."""
        pool = self.v.image.pool
        if pool not in self.obs.pools_listed:
            why = self.obs.pool_errors.get(pool, "not listed")
            return f"cannot see pool {pool!r} ({why}); an image there is unknown, not absent"
        why = self.obs.image_errors.get((pool, self.v.image.name))
        if why is not None:
            return f"cannot see image {self.v.image.spec} ({why}); unknown, not absent"
        return None

    def unknown(self) -> str | None:
        """Why the volume's state cannot be known, if it cannot (safety rule 7)."""
        if (why := self.image_unknown()) is not None:
            return why
        if (why := self.meta_unreadable()) is not None:
            return why
        if (why := self.mapping_unlisted()) is not None:
            return why
        for dev in (self.raw, self.dev):
            if dev is not None and dev.unknown:
                return f"cannot read {dev.path}: {dev.unknown}"
        return None

    def mapping_unlisted(self) -> str | None:
        """Not found mapped while a listing of mappings failed: it may be
        mapped all the same, by that mapper whatever the spec says now (it
        may have changed). "Unmapped" would lead to a second map, or to the
        delete of an image in use."""
        if self.mapping is not None or not self.obs.mappings_unlisted:
            return None
        kind, why = sorted(self.obs.mappings_unlisted.items())[0]
        return (f"listing the {kind} mappings failed ({why}): whether "
                f"{self.v.image.spec} is mapped here is unknown, not unmapped")

    def meta_unreadable(self) -> str | None:
        """A value of ours (or a QoS limit) in the image's image-meta that is
        not text: what it records (the claim, the owner, a format) is unknown,
        never absent. Another tool's key that is not text is none of ours."""
        img = self.img
        bad = sorted(k for k in img.unreadable if meta.ours(k) or k in qos.QOS_KEYS) \
            if img is not None else []
        if not bad:
            return None
        assert img is not None
        spec = self.v.image.spec
        return (f"image-meta {'; '.join(f'{k} of {spec} is {img.unreadable[k]}' for k in bad)}"
                f": what it records is unknown, not absent. Nothing is done to the volume "
                f"until it is set right or removed by hand (`rbd image-meta get {spec} "
                f"{bad[0]}`)")

    def claimed_elsewhere(self) -> Claim | None:
        """The claim of another node, if another node holds it."""
        c = self.claim
        return c if c is not None and c.node != self.ctx.node_name else None

    def stall(self) -> IoStall | None:
        """The mapped device's I/O does not complete (Ceph out of reach)."""
        if self.mapping is None or self.mapping.device is None:
            return None
        return self.obs.stalled.get(self.mapping.device)

    def fence(self) -> Fence | None:
        """Mapped here, but another node holds the claim (it took over, and
        blocklisted our client; or the image was mapped twice before claims),
        or Ceph blocklisted the client doing our I/O."""
        if self.mapping is None:
            return None
        fence = fence_of(self.claim, self.ctx.node_name, self.obs.blocklist, self.staged_mount()
                         or self.obs.mounts_by_point.get(self.staging_path))
        if fence is not None and fence.reason == BLOCKLISTED and self.mapping.problem \
                and self.mapping.reattach is None:
            # Our own claim, and the blocklisted client is the one whose helper
            # is gone: nothing writes through it any more. (Not a device kept
            # for a re-attach: a new rbd-nbd would write through it again, so
            # a fence of its client stands.) The dead mapping is
            # what to act on (a remap fences that client itself, and records
            # the new one), as for any dead helper.
            return None
        return fence

    def check_not_fenced(self) -> None:
        """Fenced: nothing but a release (or ``recover``) may touch it."""
        fence = self.fence()
        if fence is None:
            return
        self.plan.fenced = fence.message(self.v.image.spec, self.v.name)
        self.plan.fence_reason = fence.reason
        raise Refused(self.plan.fenced)

    def foreign_watchers(self) -> int:
        assert self.img is not None
        ours = len(self.obs.mappings_by_image.get((self.v.image.pool, self.v.image.name), []))
        return max(0, len(self.img.watchers) - ours)

    # -- planning ------------------------------------------------------------
    def add(self, step: Step) -> None:
        self.plan.steps.append(step)

    def mounted_paths(self) -> list[str]:
        out = [m.mount_point for m in self.published_targets()]
        if self.is_staged() and self.v.stage is not None:
            out.insert(0, self.v.stage.path)
        return out

    def check_path_free(self, path: str, what: str) -> None:
        if path in self.remounting:
            return
        other = self.obs.mounts_by_point.get(path)
        if other is not None:
            raise Refused(f"{what} path {path} already has a mount of something else "
                          f"({other.source}, {other.fs_type}); refusing to stack on it")

    def is_our_mount(self, m: Mount) -> bool:
        return self.dev is not None and (
            (m.major, m.minor) == self.rdev
            or self.obs.path_rdev.get(m.mount_point) == self.rdev)
