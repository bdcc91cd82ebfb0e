"""The planner: ``plan(desired, observed) -> [VolumePlan]``. Pure; no I/O.

Level-triggered: it looks only at what is wanted and what is there, never
at what happened before. Deterministic: volumes by name, steps in lifecycle
order (forward: create, map, stage, publish; back: unpublish, unstage,
unmap, delete). A volume that must not be touched gets a refusal and no
steps at all.
"""

from __future__ import annotations

from collections.abc import Iterable

from reconciler.facts import meta
from reconciler.facts.claim import Claim, parse
from reconciler.facts.luks import crypt_name
from reconciler.facts.observed import (
    CryptDevice,
    Device,
    ImageState,
    IoStall,
    Mapping,
    Mount,
    Observed,
)
from reconciler.facts.stall import stall_doc, stall_reason
from reconciler.plan.fence import BLOCKLISTED, Fence, fence_of
from reconciler.plan.groups import GroupRules, group_row
from reconciler.plan.snapshots import SnapshotRules
from reconciler.plan.steps import (
    ClaimImage,
    CloseCrypt,
    CreateImage,
    DeleteImage,
    FormatCrypt,
    FormatDevice,
    GrowFilesystem,
    LimitDeviceIo,
    MapImage,
    MountStaging,
    OpenCrypt,
    Publish,
    RefreshDevice,
    ReleaseClaim,
    Remount,
    ResizeCrypt,
    ResizeImage,
    SetImageMeta,
    SetQos,
    Step,
    Unmap,
    Unpublish,
    Unstage,
)
from reconciler.plan.types import Context, Refused, VolumePlan, Waiting
from reconciler.spec import mountflags, qos
from reconciler.spec.model import (
    Phase,
    Volume,
    resolve_mapper,
)
from reconciler.spec.units import format_size

# A filesystem this much smaller than its device is grown; less is alignment slack.
GROW_SLACK = 16 * 2**20


__all__ = ["Context", "Refused", "VolumePlan", "actual_state", "plan"]


def _same_device(mount: Mount | None, dev: Device | None) -> bool:
    return mount is not None and dev is not None and (mount.major, mount.minor) == (
        dev.major, dev.minor)


def _device_node_at(obs: Observed, path: str, dev: Device | None) -> bool:
    return dev is not None and obs.path_rdev.get(path) == (dev.major, dev.minor)


def _missing_options(mount: Mount, wanted: Iterable[str], fs_type: str | None
                     ) -> tuple[str, ...]:
    """What mountinfo shows is not in force (a default it hides is not missing)."""
    return mountflags.missing(wanted, mount.options | mount.super_options, fs_type)


class _VolumePlanner(SnapshotRules, GroupRules):
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
        return m if _same_device(m, self.dev) else None

    def is_staged(self) -> bool:
        st = self.v.stage
        if st is None:
            return False
        if st.mode == "block":
            return _device_node_at(self.obs, st.path, self.dev)
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
        if seen is None or seen.mount_id == m.mount_id or self._is_our_mount(seen):
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
        for dev in (self.raw, self.dev):
            if dev is not None and dev.unknown:
                return f"cannot read {dev.path}: {dev.unknown}"
        return None

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
        if fence is not None and fence.reason == BLOCKLISTED and self.mapping.problem:
            # Our own claim, and the blocklisted client is the one whose helper
            # is gone: nothing writes through it any more. The dead mapping is
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
            if self.mapping is not None and self.mapping.problem:
                self.dead_mapping()
            if self.v.state == "absent":
                self.teardown(Phase.ABSENT)
            else:
                self.teardown(self.v.wanted_phase)
                self.forward()
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

    def mounted_paths(self) -> list[str]:
        out = [m.mount_point for m in self.published_targets()]
        if self.is_staged() and self.v.stage is not None:
            out.insert(0, self.v.stage.path)
        return out

    def dead_mapping(self) -> None:
        """A mapping that no longer answers (its rbd-fuse helper died). With
        nothing mounted from it, map it again; with mounts, report and refuse:
        never reformat, never pull a filesystem from under its users."""
        assert self.mapping is not None
        v, mp = self.v, self.mapping
        self.plan.notes.append(f"mapping of {v.image.spec} ({mp.device or 'no device'}) is "
                               f"dead: {mp.problem}")
        mounted = self.mounted_paths()
        if mounted:
            raise Refused(
                f"the mapping of {v.image.spec} is dead ({mp.problem}); {', '.join(mounted)} "
                "cannot do I/O. Nothing is formatted or unmounted behind the applications' "
                "backs: stop what uses them, then `rbd-reconciler release` this volume's file "
                "and apply again")
        if v.state == "absent" or v.wanted_phase < Phase.MAPPED:
            return  # the teardown unmaps it
        self.close_crypt()
        self.add(Unmap(v.name, v.image.pool, v.image.name, mp.kind, mp.device, mp.fuse_mount,
                       release_claim=False))
        self.forget_mapping()

    def forget_mapping(self) -> None:
        """Unmapped by a step planned above: what follows maps it afresh."""
        self.mapping, self.raw, self.crypt, self.dev = None, None, None, None

    def close_crypt(self) -> None:
        """Close the open LUKS2 device over the mapping, if there is one (it
        holds the mapped device: nothing unmaps under it). Only ours."""
        c = self.crypt
        if c is None:
            return
        if c.name != crypt_name(self.v.name):
            raise Refused(f"{c.path} (LUKS2, not opened by this reconciler: its name is not "
                          f"{crypt_name(self.v.name)}) is open over {c.raw}; refusing to "
                          "close it. Close it by hand (cryptsetup close) if it is not in use")
        self.add(CloseCrypt(self.v.name, c.name, (c.major, c.minor)))
        self.crypt = None
        self.dev = self.raw if self.v.encryption is None else None

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

    def forward_io_limits(self, size: int | None) -> None:
        """io.max for the mapped device on the unit or cgroup the spec names:
        a kernel-mapped device's I/O never passes through librbd's limits.
        Set in place, never a remap."""
        v = self.v
        size = size if size is not None else (self.img.size if self.img else None)
        if v.qos is not None and v.qos.io_target is not None:
            self.limit_io(v.qos.io_target, qos.io_max(v.qos, size), required=True)
        # A publish's user (the CSI adapter: the pod) gets the volume's limits,
        # or the image's own (set through another file, another node, CSI).
        if v.wanted_phase >= Phase.PUBLISHED and self.img is not None:
            limits = qos.io_max(v.qos if v.qos is not None and v.qos.io_target is None
                                else qos.from_meta(self.img.meta), size)
            for p in v.publish:
                if p.io_cgroup:
                    self.limit_io(p.io_cgroup, limits, required=False)

    def limit_io(self, target: str, limits: dict[str, int], required: bool) -> None:
        """``required``: the spec names the target (cannot read it: refused);
        else a publish's user: a note, never a reason to keep a pod from its
        volume, and nothing at all while there is no limit to set."""
        v, want = self.v, tuple(sorted(limits.items()))
        if not required and not want:
            return
        if self.mapping is None or self.raw is None:  # mapped by this run
            self.add(LimitDeviceIo(v.name, target, None, (), want, required))
            return
        if target in self.obs.io_errors:
            if required:
                raise Refused(f"QoS: {self.obs.io_errors[target]}")
            self.plan.notes.append(f"QoS not set for {target}: {self.obs.io_errors[target]}")
            return
        rdev = f"{self.raw.major}:{self.raw.minor}"
        have = tuple(sorted(self.obs.io_limits.get(target, {}).get(rdev, {}).items()))
        if have != want:
            self.add(LimitDeviceIo(v.name, target, self.mapping.device, have, want, required))

    def claim_interrupted_create(self) -> bool:
        """Our create was cut off before the owner record: the intent says it is ours."""
        img = self.img
        if img is None or img.meta.get(meta.OWNER) is not None or \
                (img.pool, img.name) not in self.obs.intents:
            return False
        self.add(SetImageMeta(self.v.name, img.pool, img.name, meta.OWNER, None,
                              self.ctx.node_name))
        return True

    def forward_map(self, new_size: int | None) -> None:
        v = self.v
        assert v.map is not None
        if (self.mapping is not None and v.map.mapper != "auto"
                and self.mapping.kind != v.map.mapper):
            if v.wanted_phase >= Phase.STAGED and self.mounted_paths():
                raise Refused(
                    f"{v.image.spec} is mapped with {self.mapping.kind} and the spec now wants "
                    f"{v.map.mapper}: remapping would pull it from under its users. Release it "
                    "(`rbd-reconciler release FILE`) and apply again, or set mapper back to "
                    f"{self.mapping.kind}")
            mp = self.mapping
            self.close_crypt()
            self.add(Unmap(v.name, v.image.pool, v.image.name, mp.kind, mp.device,
                           mp.fuse_mount, release_claim=False))
            self.forget_mapping()
        if self.mapping is not None and self.mapping.device is None:
            # A fuse mount without its loop device: half mapped. Redo it.
            self.add(Unmap(v.name, v.image.pool, v.image.name, "fuse", None,
                           self.mapping.fuse_mount, release_claim=False))
            self.mapping = None
        if self.mapping is None:
            busy = self.foreign_watchers() if self.img is not None else 0
            users = f"{busy} other client(s) ({', '.join(self.img.watchers)})" if busy else ""
            other = self.claimed_elsewhere()
            if other is not None:
                self.plan.claimed_by = other.node
                raise Refused(
                    f"image {v.image.spec} is claimed by node {other.node}"
                    + (f" and is open by {users}" if busy else
                       f" (clients {', '.join(other.clients)})" if other.clients else "")
                    + ": one writer per image, so it is not mapped here. If that node is "
                    f"gone for good, `rbd-reconciler takeover {v.name} --yes-i-am-sure` on "
                    "this node blocklists its client and takes the claim")
            if busy:
                raise Refused(f"image {v.image.spec} is open by {users}; mapping it here "
                              "too could corrupt it")
            mapper = resolve_mapper(v.map.mapper, self.ctx.mappers_available)
            self.add(MapImage(v.name, v.image.pool, v.image.name, mapper, v.map.options))
            return
        if self.claim is None and self.img is not None:
            self.add(ClaimImage(v.name, v.image.pool, v.image.name, self.ctx.node_name))
        # A loop device over the rbd-fuse file keeps its old size until told
        # (losetup -c); krbd and rbd-nbd follow a resize by themselves, a moment
        # later: the step waits for it, so what grows next sees the new size.
        if self.raw is not None and new_size is not None and self.raw.size < new_size:
            self.add(RefreshDevice(v.name, self.mapping.device, self.mapping.kind, new_size))

    def forward_crypt(self, new_size: int | None) -> None:
        """Open the volume's LUKS2 container before staging; luksFormat it first
        when the mapped device is proven blank (again at apply time)."""
        v, enc = self.v, self.v.encryption
        assert enc is not None
        name = crypt_name(v.name)
        raw = self.raw
        if self.crypt is not None:
            c = self.crypt
            if c.name != name:
                raise Refused(f"{c.path} (LUKS2, not opened by this reconciler) is open over "
                              f"{c.raw}; refusing to stage through it")
            size = new_size if new_size is not None else raw.size if raw else None
            off = raw.luks_offset if raw else None
            if size is not None and off is not None and size - off > c.size:
                self.add(ResizeCrypt(v.name, name, c.size, size - off, enc.key_kind,
                                     enc.key_path, v.image.pool, v.image.name))
            return
        img_meta = self.img.meta if self.img else {}
        luks_done = img_meta.get(meta.CRYPT_FORMATTED)
        interrupted = bool(img_meta.get(meta.CRYPT_FORMATTING)) and not luks_done
        fmt = FormatCrypt(v.name, raw.path if raw else None, v.image.pool, v.image.name,
                          enc.key_kind, enc.key_path)
        if raw is not None:
            if raw.fs_type == "crypto_LUKS":
                pass
            elif interrupted:
                self.add(fmt)  # our own luksFormat was cut off
            elif raw.signature:
                raise Refused(f"{raw.path} ({v.image.spec}) carries {raw.signature}, not "
                              "LUKS2: encryption is never added to an image that holds "
                              "data; refusing to format it (fix by hand)")
            elif luks_done or img_meta.get(meta.FORMATTED):
                raise Refused(f"{v.image.spec} was formatted "
                              f"{luks_done or img_meta.get(meta.FORMATTED)} by this reconciler "
                              f"but {raw.path} shows no signature now; refusing to format "
                              "over possible data")
            else:
                self.add(fmt)
        elif img_meta.get(meta.FORMATTED) and not luks_done:
            raise Refused(f"{v.image.spec} holds a plain {img_meta[meta.FORMATTED]} "
                          "(image-meta): encryption is never added to an image that holds "
                          "data")
        elif not luks_done:
            self.add(fmt)
        self.add(OpenCrypt(v.name, raw.path if raw else None, name, v.image.pool,
                           v.image.name, enc.key_kind, enc.key_path))

    def forward_stage(self, new_size: int | None) -> None:
        v, st = self.v, self.v.stage
        assert st is not None
        if v.encryption is not None:
            self.forward_crypt(new_size)
            if new_size is not None and self.raw is not None and self.raw.luks_offset:
                new_size -= self.raw.luks_offset  # the plaintext the filesystem can span
            elif new_size is not None and self.dev is None:
                new_size = None  # opened in this run: its size is known once open
        elif self.crypt is not None:
            raise Refused(f"{self.crypt.path} (LUKS2) is open over {self.crypt.raw}, but the "
                          "spec has no encryption: refusing to stage the container itself. "
                          "Put the encryption section back, or release the volume")
        device = self.dev.path if self.dev else None
        img_meta = self.img.meta if self.img else {}
        encrypted = v.encryption is not None
        if st.mode == "block":
            want = mountflags.stage_options((), block=True)
            if not self.is_staged():
                self._check_path_free(st.path, "staging")
                self.add(MountStaging(v.name, device, st.path, "block", None, want, False))
            elif (m := self.obs.mounts_by_point.get(st.path)) is not None and \
                    _missing_options(m, want, None):
                # Made by an older version (or by hand) without nosuid.
                self.add(Remount(v.name, st.path, tuple(sorted(m.options)),
                                 ("ro" if m.read_only else "rw", *want), bind=True))
            return
        assert st.fs_type is not None
        formatted = img_meta.get(meta.FORMATTED)
        interrupted = bool(img_meta.get(meta.FORMATTING)) and not formatted
        fs_size = None
        if self.dev is not None:
            found = self.dev.fs_type
            if interrupted:
                # Our own mkfs was cut off; the image was never staged since.
                self.add(FormatDevice(v.name, device, st.fs_type, st.mkfs_options,
                                      v.image.pool, v.image.name, encrypted))
            elif found == st.fs_type:
                fs_size = self.dev.fs_size
            elif self.dev.signature:
                raise Refused(f"{self.dev.path} ({v.image.spec}) carries {self.dev.signature}, "
                              f"not {st.fs_type}; refusing to format over it (fix by hand)")
            elif formatted:
                raise Refused(f"{v.image.spec} was formatted {formatted} by this reconciler "
                              f"but {self.dev.path} shows no filesystem now; refusing to mkfs "
                              "over possible data")
            else:
                self.add(FormatDevice(v.name, device, st.fs_type, st.mkfs_options,
                                      v.image.pool, v.image.name, encrypted))
        elif formatted and formatted != st.fs_type:
            raise Refused(f"{v.image.spec} holds {formatted} (image-meta), not {st.fs_type}")
        elif not formatted:
            self.add(FormatDevice(v.name, None, st.fs_type, st.mkfs_options,
                                  v.image.pool, v.image.name, encrypted))
        size_after = new_size if new_size is not None else (self.dev.size if self.dev else None)
        smaller = fs_size is not None and size_after is not None and (
            size_after - fs_size > GROW_SLACK)
        mount = self.staged_mount()
        want = mountflags.stage_options(st.mount_options)
        if mount is None:
            self._check_path_free(st.path, "staging")
            self.add(MountStaging(v.name, device, st.path, "filesystem", st.fs_type,
                                  want, smaller and st.fs_type == "ext4"))
            if smaller and st.fs_type == "xfs":
                self.add(GrowFilesystem(v.name, device, st.path, "xfs", fs_size,
                                        size_after or 0))
            return
        if self.fs_refuses_writes(mount, st.mount_options):
            return  # no remount (it could make it read-write again) and no grow
        self.remount_staging(mount, want)
        if smaller:
            if st.fs_type == "ext4" and img_meta.get(meta.GROW_PENDING):
                self.plan.notes.append(
                    f"ext4 on {st.path} is {format_size(fs_size or 0)}, the device "
                    f"{format_size(size_after or 0)}: online grow was refused on this node; "
                    "it grows offline at the next stage")
            else:
                self.add(GrowFilesystem(v.name, device, st.path, st.fs_type, fs_size,
                                        size_after or 0))

    def fs_refuses_writes(self, mount: Mount, options: tuple[str, ...]) -> bool:
        """The filesystem gone read-only (errors=remount-ro after an I/O error,
        a fenced client, or a remount by hand) while the spec wants it
        writable: reported, never remounted read-write (over errors that
        could make things worse; and a spec cannot ask for read-only there)."""
        if not mount.fs_read_only or "ro" in options:
            return False
        how = ("shut down" if "shutdown" in mount.super_options else
               "read-only after an error (emergency_ro)" if "emergency_ro" in mount.super_options
               else "read-only")
        self.plan.problems["FilesystemReadOnly"] = (
            f"the {mount.fs_type} filesystem on {mount.source} is {how}: every write through "
            f"{mount.mount_point} and its publishes fails. It is not remounted read-write "
            "(after I/O errors that would make things worse): see the kernel log "
            f"(dmesg | grep {mount.source.rsplit('/', 1)[-1]}) and `rbd-reconciler explain "
            f"{self.v.name}`; docs/troubleshooting.md, RbdFilesystemReadOnly")
        return True

    def remount_staging(self, mount: Mount, want: tuple[str, ...]) -> None:
        """A staging mount without what the spec (and nosuid,nodev) asks:
        remounted. A remount sets the mount's flags anew, so it says every
        option a remount can change; one it cannot (ext4 data=, most of xfs's)
        waits for the next stage, noted, never remounted for in vain."""
        st = self.v.stage
        assert st is not None
        missing = _missing_options(mount, want, st.fs_type)
        later = [o for o in missing if not mountflags.remountable(o, st.fs_type)]
        if later:
            self.plan.notes.append(
                f"{st.path} is mounted without {', '.join(later)}: a remount does not change "
                "that; it takes effect the next time the volume is staged")
        if len(later) < len(missing):
            self.add(Remount(self.v.name, st.path, tuple(sorted(mount.options)),
                             tuple(o for o in want if mountflags.remountable(o, st.fs_type)),
                             bind=False))

    def _check_path_free(self, path: str, what: str) -> None:
        other = self.obs.mounts_by_point.get(path)
        if other is not None:
            raise Refused(f"{what} path {path} already has a mount of something else "
                          f"({other.source}, {other.fs_type}); refusing to stack on it")

    def forward_publish(self) -> None:
        v, st = self.v, self.v.stage
        assert st is not None
        ours = {m.mount_point: m for m in self.published_targets()}
        shadowed = []
        for p in v.publish:
            m = ours.get(p.path)
            want = mountflags.bind_options(st.mount_options, p.mount_options, st.mode == "block")
            if m is None:
                self._check_path_free(p.path, "publish")
                self.add(Publish(v.name, st.path, p.path, st.mode, p.read_only, want))
                continue
            if (top := self.shadowed_by(m)) is not None:
                # Someone else's mount: never unmounted (safety rule 8), and a
                # remount by path would act on it, not on ours.
                where = ("on top of it" if top.mount_point == p.path
                         else f"at {top.mount_point}, above it")
                shadowed.append(f"{p.path} is not served: {top.fs_type} {top.source} is "
                                f"mounted {where}")
                continue
            if m.read_only != p.read_only or _missing_options(m, want, None):
                self.add(Remount(v.name, p.path, tuple(sorted(m.options)),
                                 ("ro" if p.read_only else "rw", *want), bind=True))
        if shadowed:
            self.plan.problems["Shadowed"] = (
                "; ".join(shadowed) + ": applications there write into that mount, not the "
                "volume. It is someone else's and is left alone: unmount it by hand "
                "(docs/troubleshooting.md, RbdPublishShadowed)")

    def teardown(self, wanted: Phase) -> None:
        """Steps that take the volume down to ``wanted`` (reverse order)."""
        v = self.v
        keep_targets = {p.path for p in v.publish} if wanted >= Phase.PUBLISHED else set()
        # Unpublish binds that are not wanted (all of them below PUBLISHED).
        for m in sorted(self.published_targets(), key=lambda m: m.mount_point, reverse=True):
            if m.mount_point not in keep_targets:
                self._check_ours_on_top(m)
                self.add(Unpublish(v.name, m.mount_point, self.rdev))
        if wanted < Phase.STAGED and v.stage is not None and self.is_staged():
            self._check_ours_on_top(self.obs.mounts_by_point[v.stage.path])
            self.add(Unstage(v.name, v.stage.path, self.rdev))
        elif wanted < Phase.STAGED and v.stage is None:
            # The stage section was dropped: its mount sits at the default path.
            m = self.obs.mounts_by_point.get(self.staging_path)
            if _same_device(m, self.dev) or _device_node_at(self.obs, self.staging_path,
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

    def _check_ours_on_top(self, ours: Mount) -> None:
        """Safety rule 8: only the top mount at a path is unmounted, and only ours."""
        top = self.obs.visible_mount(ours.mount_point) or \
            self.obs.top_mounts.get(ours.mount_point)
        if top is not None and top.mount_id != ours.mount_id and not self._is_our_mount(top):
            where = ("on top of ours" if top.mount_point == ours.mount_point
                     else f"over {top.mount_point}, above ours")
            raise Refused(f"{ours.mount_point}: someone else's mount ({top.fs_type} "
                          f"{top.source}) sits {where}; refusing to unmount it "
                          "(unmount it by hand first)")

    def _is_our_mount(self, m: Mount) -> bool:
        return self.dev is not None and (
            (m.major, m.minor) == self.rdev
            or self.obs.path_rdev.get(m.mount_point) == self.rdev)

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
                f"(owner: {owner or 'none recorded'}); the image is kept")
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


def plan(desired: Iterable[Volume], observed: Observed, ctx: Context,
         frozen: Iterable[str] = (), release: Iterable[str] = ()) -> list[VolumePlan]:
    """Plan every desired volume; ``frozen`` names get a refusal and no steps;
    ``release`` names are only taken down to CREATED (unpublish, unstage, unmap)."""
    release = set(release)
    plans = {v.name: _VolumePlanner(v, observed, ctx).run(v.name in release) for v in desired}
    for name in frozen:
        plans[name] = frozen_plan(name)
    return [plans[n] for n in sorted(plans)]


FROZEN = "its file failed to load; left exactly as it is (see validate)"


def frozen_plan(name: str) -> VolumePlan:
    """A volume whose file fails to load: nothing may be done to it."""
    return VolumePlan(name, refusal=FROZEN)


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
    if problem is None and not unknown:
        if found is None:
            found = problems(vol, observed, ctx)
        problem = "; ".join(found.values()) or None
    stall = p.stall()
    fence = p.fence()
    return {
        "name": vol.name,
        # What to act on first: a fence, I/O that hangs; then what could not
        # be seen, never reported as a phase. A mapping that no longer
        # answers is not "PUBLISHED", whatever is mounted.
        "phase": ("FENCED" if fence else "STALLED" if stall else "UNKNOWN" if unknown
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
