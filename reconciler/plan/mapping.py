"""The planner's rules for the mapping (pure; no I/O): map (one writer per
image: never where another node's claim or client is), remap a dead or
changed mapping when nothing is mounted from it, refresh a grown device,
close our LUKS2 device over it, io.max for the mapped device, and an
rbd-nbd of a binary replaced on disk rolled onto the new one.

Mixed into the volume planner by plan/planner.py; ``close_crypt`` is used
by the teardown's rules too. Imported by plan/planner.py only.
"""

from __future__ import annotations

from collections.abc import Callable

from reconciler.facts.luks import crypt_name
from reconciler.facts.observed import Mount
from reconciler.plan.steps import (
    ClaimImage,
    CloseCrypt,
    LimitDeviceIo,
    MapImage,
    ReattachNbd,
    RefreshDevice,
    RollNbd,
    Unmap,
    Unpublish,
    Unstage,
)
from reconciler.plan.types import Refused
from reconciler.plan.volumeview import VolumeView
from reconciler.spec import qos
from reconciler.spec.mapopts import check_map_options
from reconciler.spec.model import Phase, resolve_mapper

STALE_HELPER = "stale: binary replaced on disk"  # what status says of such a helper
HELPER_GONE = "HelperGone"  # the problem's key (the status's reason)
MAX_USERS_NAMED = 5


class MapRules(VolumeView):
    check_ours_on_top: Callable[[Mount], None]  # plan/teardown.py (mixed in too)

    def dead_mapping(self) -> bool:
        """A mapping that no longer answers (its rbd-fuse helper died; a FUSE
        connection dies with its process: nothing re-attaches to it). With
        nothing mounted from it, map it again. With mounts nobody uses (a
        fuse-loop volume, its users observed), take them down with it and
        bring all back in this plan: unpublish, unstage, unmap, then the
        forward rules map, stage and publish afresh. With users (or none
        known): report it, never pull a filesystem from under them (safety
        rule 7). True: the plan is complete as it is (nothing else to do)."""
        assert self.mapping is not None
        v, mp = self.v, self.mapping
        self.plan.notes.append(f"mapping of {v.image.spec} ({mp.device or 'no device'}) is "
                               f"dead: {mp.problem}")
        mounted = self.mounted_paths()
        if mounted:
            # Block mode is not repaired: a device node opened through its
            # bind is not told from any other file by /proc (the link names
            # the bind), so who uses it is not known.
            block = v.stage is not None and v.stage.mode == "block"
            users = self.obs.mount_users.get(mp.device) \
                if mp.kind == "fuse" and mp.device and not block else None
            why = (f"the mapping of {v.image.spec} is dead ({mp.problem}); "
                   f"{', '.join(mounted)} cannot do I/O")
            if users is None:
                raise Refused(
                    f"the mapping of {v.image.spec} is dead ({mp.problem}); "
                    f"{', '.join(mounted)} cannot do I/O. Nothing is formatted or unmounted "
                    "behind the applications' backs: stop what uses them, then "
                    "`rbd-reconciler release` this volume's file and apply again")
            if users:
                named = "; ".join(u.what for u in users[:MAX_USERS_NAMED]) + (
                    f"; and {len(users) - MAX_USERS_NAMED} more"
                    if len(users) > MAX_USERS_NAMED else "")
                if v.state == "absent" or v.wanted_phase < Phase.MAPPED:
                    raise Refused(f"the mapping of {v.image.spec} is dead ({mp.problem}); "
                                  f"{', '.join(mounted)} cannot do I/O, and it is in use "
                                  f"({named}): it is not unmounted while anything uses it")
                self.plan.problems[HELPER_GONE] = (
                    f"{why}, and it is in use: {named}. A filesystem in use is never "
                    "unmounted (safety rule 7): once nothing uses it, it is unmounted, "
                    "mapped again and mounted again by itself")
                return True
            if v.state == "absent" or v.wanted_phase < Phase.MAPPED:
                return False  # nobody uses it: the teardown takes it down
            self.plan.notes.append(f"nothing uses {', '.join(mounted)}: unmounted, mapped "
                                   "again and mounted again")
            self.unmount_dead()
        elif v.state == "absent" or v.wanted_phase < Phase.MAPPED:
            return False  # the teardown unmaps it
        self.close_crypt()
        self.add(Unmap(v.name, v.image.pool, v.image.name, mp.kind, mp.device, mp.fuse_mount,
                       release_claim=False))
        self.forget_mapping()
        return False

    def unmount_dead(self) -> None:
        """Unpublish and unstage a dead mapping's mounts (only ours, only on
        top); the forward rules mount them again at the same paths."""
        v = self.v
        for m in sorted(self.published_targets(), key=lambda m: m.mount_point, reverse=True):
            self.check_ours_on_top(m)
            self.add(Unpublish(v.name, m.mount_point, self.rdev))
            self.remounting.add(m.mount_point)
        if v.stage is not None and self.is_staged():
            if v.stage.mode != "block":
                self.check_ours_on_top(self.obs.mounts_by_point[v.stage.path])
            self.add(Unstage(v.name, v.stage.path, self.rdev))
            self.remounting.add(v.stage.path)

    def reattach(self) -> bool:
        """An nbd device whose rbd-nbd died and that the kernel keeps (with
        the cookie we recorded): a new rbd-nbd is attached to it, and that is
        the whole plan. Its stalled I/O and unreadable device are that death's
        doing; they are looked at again once it is served. True if planned."""
        v, mp, claim = self.v, self.mapping, self.claim
        if mp is None or mp.reattach is None or mp.device is None or v.state == "absent" \
                or v.wanted_phase < Phase.MAPPED:
            return False
        # Provably still ours: our claim, readable (a fence of its client is
        # seen before this, by check_not_fenced), and a blocklist that was
        # read. Else the old rules decide (a dead mapping, never a writer).
        if claim is None or claim.node != self.ctx.node_name or self.obs.blocklist is None \
                or self.meta_unreadable() is not None:
            return False
        self.plan.notes.append(f"{mp.problem}: re-attached")
        # Only what rbd-nbd may be given (a file that now names krbd had its
        # options checked for krbd only).
        options = tuple(o for o in v.map.options if not check_map_options("nbd", (o,)))
        self.add(ReattachNbd(v.name, v.image.pool, v.image.name, mp.device, mp.reattach,
                             options))
        return True

    def roll(self) -> None:
        """An rbd-nbd that runs a binary replaced on disk since it started (a
        package upgrade): replaced by one of the new binary (RollNbd), only
        when it is the whole plan: the volume otherwise converged, its device
        served and answering (a stall was refused before this), nothing
        wrong with it. Never without the device's recorded cookie (without
        netlink a detach would end the device), nor without our claim.
        At most one volume's roll in a plan (``one_roll``)."""
        v, mp = self.v, self.mapping
        h = mp.helper if mp is not None else None
        if mp is None or mp.device is None or h is None or not h.stale \
                or v.state == "absent" or v.wanted_phase < Phase.MAPPED:
            return
        why = f"rbd-nbd {h.pid} serving {mp.device} runs a binary replaced on disk"
        if not self.ctx.nbd_roll:
            self.plan.notes.append(f"{why}: not rolled (nbdRollUpgrades: false)")
            return
        if self.plan.steps or self.plan.withheld or self.plan.problems \
                or (self.dev is not None and (self.dev.problem or self.dev.unknown)):
            self.plan.notes.append(f"{why}: rolled once the volume is converged and healthy")
            return
        if h.cookie is None:
            self.plan.notes.append(f"{why}: not rolled (no cookie recorded: not attached "
                                   "through netlink, the device would end with it)")
            return
        claim = self.claim
        if claim is None or claim.node != self.ctx.node_name or self.obs.blocklist is None \
                or self.meta_unreadable() is not None:
            self.plan.notes.append(f"{why}: not rolled while this node's claim is not seen")
            return
        self.plan.notes.append(f"{why}: rolled (detach, attach)")
        options = tuple(o for o in v.map.options if not check_map_options("nbd", (o,)))
        self.add(RollNbd(v.name, v.image.pool, v.image.name, mp.device, h.cookie, h.pid,
                         h.version, options))

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
