"""Execute planned steps through the drivers.

A volume's chain stops at its first failure. A half-done stage (mapped or
mounted in this run, but not yet staged) is undone in reverse so nothing
leaks; a later run starts again from a fresh observation. Each step checks
its safety condition again right before acting: the plan may be stale.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import rados
import rbd

from reconciler.apply import claims
from reconciler.apply.logfmt import log_not_run, log_step
from reconciler.drivers import ceph, keys, procfs, safepath
from reconciler.drivers.bounded import NoAnswer
from reconciler.drivers.fs import OnlineGrowRefused, block_device_size, is_ours
from reconciler.drivers.run import Aborted
from reconciler.facts import meta
from reconciler.facts.claim import Claim
from reconciler.facts.claim import parse as parse_claim
from reconciler.facts.observed import Mapping, Observed
from reconciler.facts.parsers import parse_mountinfo
from reconciler.observe.ceph import Connecting
from reconciler.observe.node import Node, open_crypts
from reconciler.plan.groupsteps import GroupStep
from reconciler.plan.planner import VolumePlan
from reconciler.plan.staging import GROW_SLACK
from reconciler.plan.steps import (
    ClaimImage,
    CloneImage,
    CloseCrypt,
    CreateImage,
    CreateSnapshot,
    DeleteImage,
    DeleteSnapshot,
    FlattenImage,
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
    Thaw,
    Unmap,
    Unpublish,
    Unstage,
)
from reconciler.spec.model import Volume
from reconciler.spec.qos import QOS_KEYS
from reconciler.state.registry import Intents, intent_key

# Imported where a step needs them, not at start-up (each module is ~0.05 s
# of a cold command in the VM of the kernel tests): the group snapshots
# (apply.groups), the freezes (drivers.freeze), io.max (drivers.iolimits),
# the sealed passphrases (apply.sealing), parallel chains (a thread pool).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from reconciler.apply.sealing import ImageSeals

log = logging.getLogger("reconciler.apply")  # the name log lines have always carried

CEPH_STEPS = (CreateImage, ResizeImage, SetImageMeta, SetQos, DeleteImage, FormatDevice,
              GrowFilesystem, MountStaging, CreateSnapshot, CloneImage, FlattenImage,
              DeleteSnapshot, MapImage, ClaimImage, ReleaseClaim, GroupStep)
# Failures here leave a stage half done: undo what this run acquired.
STAGE_CHAIN = (MapImage, RefreshDevice, FormatCrypt, OpenCrypt, ResizeCrypt, FormatDevice,
               MountStaging)
LEFT = ": left for the next start (daemon stopping)"  # an undo not done at a stop


class StepRefused(Exception):
    """A safety check at execution time said no."""


class FreezeExpired(Exception):
    """The watchdog thawed the filesystem before the snapshot was taken."""


@dataclass
class StepOutcome:
    step: Step
    status: str  # changed | ok | failed | aborted
    message: str = ""
    seconds: float = 0.0  # wall time of the step (the daemon's metrics observe it)

    def as_dict(self) -> dict[str, object]:
        return {**self.step.as_dict(), "status": self.status, "message": self.message}


@dataclass
class VolumeOutcome:
    name: str
    status: str = "ok"  # ok | changed | failed | aborted (the daemon is stopping)
    steps: list[StepOutcome] = field(default_factory=list)
    error: str | None = None
    notes: list[str] = field(default_factory=list)
    undone: list[str] = field(default_factory=list)
    refused: bool = False  # a safety check said no (StepRefused), not a failure to act

    def as_dict(self) -> dict[str, object]:
        return {"name": self.name, "status": self.status, "error": self.error,
                "notes": self.notes, "undone": self.undone,
                "steps": [s.as_dict() for s in self.steps]}


def _refused(plan: VolumePlan, out: VolumeOutcome) -> VolumeOutcome:
    """What was refused counts as a failure: the whole plan, or steps of it
    while the rest converged."""
    if plan.refusal:
        out.status, out.error = "failed", plan.refusal
    elif plan.withheld and out.status not in ("failed", "aborted"):
        out.status, out.error = "failed", "; ".join(plan.withheld)
    return out


def without_steps(plan: VolumePlan) -> VolumeOutcome:
    """The result ``apply`` reports for a plan it runs no step of (nothing
    to do, a refusal, a wait): for a front door that did not run it."""
    return _refused(plan, VolumeOutcome(plan.name, notes=list(plan.notes)))


class _VolumeRun:
    def __init__(self, node: Node, cluster: rados.Rados | None, plan: VolumePlan,
                 volume: Volume | None, observed: Observed) -> None:
        self.node = node
        self.cluster = cluster
        self.plan = plan
        self.volume = volume
        self.device: str | None = None
        self.crypt_device: str | None = None  # the open LUKS2 device over ``device``
        if volume is not None:
            maps = observed.mappings_by_image.get((volume.image.pool, volume.image.name), [])
            self.device = maps[0].device if maps else None
            crypt = observed.crypts.get(self.device) if self.device else None
            self.crypt_device = crypt.path if crypt else None
        self.acquired: list[tuple[str, Callable[[], None]]] = []
        self.out = VolumeOutcome(plan.name, notes=list(plan.notes))
        # A release drops its claims after every chain's node-side teardown
        # (``apply(claims_after=...)``): the Unmap that would drop it.
        self.claims_after = False
        self.claim_unmap: StepOutcome | None = None
        self.gate: Callable[[str, Path, Step], str | None] | None = None
        # LUKS2 passphrases this chain has unsealed already (a luksFormat, then
        # the open): each unsealing is an scrypt, ~0.6 s in the VM of the kernel tests.
        self._passphrases: dict[tuple[str, str, str, str], bytes] = {}

    def need_cluster(self) -> rados.Rados:
        if self.cluster is None:
            raise ceph.CephError("not connected to Ceph")
        return self.cluster

    def dev(self, step_device: str | None) -> str:
        dev = step_device or self.device
        if not dev:
            raise StepRefused("no mapped device for this volume")
        return dev

    def data_dev(self, step_device: str | None) -> str:
        """The device that holds the filesystem: an encrypted volume's open
        LUKS2 device (opened by this run or before it), else the mapped one."""
        if step_device:
            return step_device
        if self.volume is not None and self.volume.encryption is not None:
            if not self.crypt_device:
                raise StepRefused("the volume's LUKS2 device is not open")
            return self.crypt_device
        return self.dev(None)

    def run(self) -> VolumeOutcome:
        if not self.plan.refusal:
            self.run_steps()
        return _refused(self.plan, self.out)

    def run_steps(self) -> VolumeOutcome:
        steps = self.plan.steps
        for i, step in enumerate(steps):
            if self.node.runner.halt.stopping:
                why = self.node.runner.halt.reason
                self.abort(f"{why}: {step.action} {step.target} not started")
                log_not_run(log, steps[i:], why)
                return self.out
            t0 = time.monotonic()
            try:
                self.ask_gate(step)
                status, message = self.execute(step)
            except Aborted as exc:
                took = time.monotonic() - t0
                log_step(log, step, "aborted", took, str(exc))
                log_not_run(log, steps[i + 1:], f"{step.action} aborted")
                self.out.steps.append(StepOutcome(step, "aborted", str(exc), took))
                self.abort(f"{step.action} {step.target}: {exc}")
                return self.out
            except Exception as exc:  # every failure is reported, never raised past a volume
                took = time.monotonic() - t0
                refused = isinstance(exc, StepRefused)
                log_step(log, step, "refused" if refused else "failed", took, str(exc))
                log_not_run(log, steps[i + 1:], f"{step.action} failed")
                self.out.steps.append(StepOutcome(step, "failed", str(exc), took))
                self.out.status, self.out.error = "failed", f"{step.action} {step.target}: {exc}"
                self.out.refused = refused
                if isinstance(step, STAGE_CHAIN):
                    self.undo()
                return self.out
            took = time.monotonic() - t0
            log_step(log, step, status, took, message)
            self.out.steps.append(StepOutcome(step, status, message, took))
            if isinstance(step, Unmap) and step.release_claim:
                self.claim_unmap = self.out.steps[-1]
            if status == "changed":
                self.out.status = "changed"
        return self.out

    def ask_gate(self, step: Step) -> None:
        """Right before a step: may this volume's file still take it?"""
        if self.gate is not None and self.volume is not None and \
                (why := self.gate(self.volume.name, self.volume.source.file, step)):
            raise StepRefused(why)

    def abort(self, why: str) -> None:
        """The daemon is stopping. A half stage is not undone: its commands may
        be what is stuck, and what it leaves is what a crash leaves, which the
        next start resumes (an interrupted mkfs is redone: image-meta says so)."""
        self.out.status, self.out.error = "aborted", why
        for what, _ in reversed(self.acquired):
            self.out.undone.append(f"{what}{LEFT}")
        self.acquired.clear()

    def undo(self) -> None:
        """Reverse order, stopping at the first undo that fails: each thing
        acquired earlier is what the later ones stand on (never unmap under a
        mount that stayed, never release the claim of an image still mapped)."""
        failed = None
        for what, fn in reversed(self.acquired):
            if failed is not None:
                self.out.undone.append(f"{what}: not undone ({failed} failed)")
                continue
            try:
                fn()
                self.out.undone.append(what)
            except Exception as exc:  # report what stayed; the next pass sees it
                self.out.undone.append(f"{what} FAILED: {exc}")
                failed = what
        self.acquired.clear()

    # -- one step --------------------------------------------------------------
    def execute(self, step: Step) -> tuple[str, str]:
        node, fs = self.node, self.node.fs
        match step:
            case CreateImage():
                self.create(step)
            case ResizeImage():
                ceph.resize_image(self.need_cluster(), step.pool, step.image, step.new_size)
            case SetImageMeta():
                ceph.set_meta(self.need_cluster(), step.pool, step.image, step.key, step.new)
                if step.key == meta.OWNER:  # an interrupted create, now finished
                    Intents(node.config.state_dir).forget(intent_key(step.pool, step.image))
            case SetQos():
                ceph.set_qos(self.need_cluster(), step.pool, step.image, QOS_KEYS,
                             dict(step.new))
            case LimitDeviceIo():
                from reconciler.drivers import iolimits

                device = self.dev(step.device)
                try:
                    iolimits.write(node.runner, step.target_name, device, dict(step.new))
                except iolimits.IoLimitError as exc:
                    if step.required:
                        raise
                    return "ok", f"not set: {exc}"
            case MapImage():
                return self.map(step)
            case ClaimImage():
                cluster = self.need_cluster()
                self.take_claim(cluster, step.pool, step.image)
                with cluster.open_ioctx(step.pool) as ioctx:
                    clients = claims.watchers(ioctx, step.image)
                claims.record_clients(cluster, step.pool, step.image, step.node, clients)
            case ReleaseClaim():
                if not claims.release(self.need_cluster(), step.pool, step.image, step.node):
                    return "ok", "not claimed by this node"
            case RefreshDevice():
                node.mapper(step.mapper).refresh(self.dev(step.device), step.new_size)
            case FormatCrypt():
                return self.format_crypt(step)
            case OpenCrypt():
                return self.open_crypt(step)
            case ResizeCrypt():
                node.crypt.resize(step.name, self.key(step.key_kind, step.key_path,
                                                      step.pool, step.image))
            case CloseCrypt():
                return self.close_crypt(step)
            case FormatDevice():
                return self.format(step)
            case MountStaging():
                return self.stage(step)
            case Remount():
                if step.bind:
                    ro = "ro" in step.options
                    rest = tuple(o for o in step.options if o not in ("ro", "rw"))
                    fs.remount_bind(step.path, ro, rest)
                else:
                    fs.remount(step.path, step.options)
            case GrowFilesystem():
                dev = self.data_dev(step.device)
                try:
                    fs.grow_online(dev, step.path, step.fs_type)
                except OnlineGrowRefused as exc:
                    assert self.volume is not None
                    ceph.set_meta(self.need_cluster(), self.volume.image.pool,
                                  self.volume.image.name, meta.GROW_PENDING, "offline")
                    return "ok", f"online grow refused ({exc}); grows offline at next stage"
            case Publish():
                rdev = self.check_staged(step.staging, step.mode)
                fs.bind(step.staging, step.path, step.mode == "block", step.read_only,
                        step.options, rdev)
            case Unpublish() | Unstage():
                if not fs.unmount(step.path, step.rdev):
                    return "ok", "already not mounted"
            case Unmap():
                node.mapper(step.mapper).unmap(
                    Mapping(step.mapper, step.pool, step.image, step.device, step.fuse_mount),
                    force=step.force)
                self.device = None
                if step.release_claim and not self.claims_after:
                    return "changed", self.release_claim(step.pool, step.image)
            case DeleteImage():
                self.delete(step)
            case CreateSnapshot():
                return self.snapshot(step)
            case CloneImage():
                self.clone(step)
            case FlattenImage():
                return self.flatten(step)
            case DeleteSnapshot():
                return self.delete_snapshot(step)
            case Thaw():
                from reconciler.drivers import freeze

                thawed = freeze.thaw_left(node.config.state_dir, step.path)
                if thawed is None:
                    return "ok", "frozen by a snapshot in progress: left to it"
                if not thawed:
                    return "ok", "was not frozen"
            case GroupStep():
                from reconciler.apply.groups import run_group_step

                return run_group_step(step, self.need_cluster, node.config.node_name,
                                      node.config.state_dir,
                                      node.config.snapshots.freeze_timeout_seconds,
                                      self.owner_meta, self.seal_copy)
            case _:
                raise NotImplementedError(type(step).__name__)
        return "changed", ""

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

    def map(self, step: MapImage) -> tuple[str, str]:
        """One writer per image: the claim is taken (atomically, in the OSD)
        before the map, and checked again after it, before anything is
        mounted: a loser unmaps and refuses, naming the holder."""
        cluster, me = self.need_cluster(), self.node.config.node_name
        held, fresh = self.take_claim(cluster, step.pool, step.image)
        if fresh:  # a claim this node held before (a takeover's) is kept on failure
            self.acquired.append(("release claim", lambda: claims.release(
                cluster, step.pool, step.image, me)))
        if not fresh and held.clients:
            self.fence_former_clients(cluster, step, held)
        mapper = self.node.mapper(step.mapper)
        self.device = mapper.map(step.pool, step.image, step.options)
        mapping = Mapping(step.mapper, step.pool, step.image, self.device,
                          str(self.node.fuse.mount_point(step.pool, step.image))
                          if step.mapper == "fuse" else None)
        self.acquired.append((f"unmap {self.device}", lambda: mapper.unmap(mapping)))
        with cluster.open_ioctx(step.pool) as ioctx:
            # A watch of our own earlier helper (dead, its watch not yet
            # expired) is no other writer: the claim names it.
            after = tuple(a for a in claims.watchers(ioctx, step.image)
                          if a not in held.clients)
        if len(after) > 1:  # our helper is one; someone opened it meanwhile
            raise StepRefused(f"image {step.pool}/{step.image} is open by {len(after)} "
                              f"clients ({', '.join(after)}) right after mapping it: another "
                              "client opened it at the same time; unmapped here")
        try:
            claims.record_clients(cluster, step.pool, step.image, me, after)
        except claims.ClaimedElsewhere as exc:
            raise StepRefused(f"{step.pool}/{step.image} is claimed by node {exc.holder.node} "
                              "(taken while mapping here); unmapped here") from None
        return "changed", self.device

    def fence_former_clients(self, cluster: rados.Rados, step: MapImage, held: Claim) -> None:
        """Mapping an image this node's claim already names: its recorded
        clients served a mapping here that is gone (a helper that died; a
        live one would have been observed, and nothing would be mapped).
        One still watching holds the image's exclusive lock until Ceph times
        its watch out (30 s), and the new helper's I/O waits for it: fence
        exactly those client instances (ip:port/nonce), as a takeover does."""
        with cluster.open_ioctx(step.pool) as ioctx:
            stale = {a for a in claims.watchers(ioctx, step.image) if a in held.clients}
        if not stale:
            return
        for addr in sorted(stale):
            claims.blocklist_add(cluster, addr)
        left = claims.wait_watchers_gone(cluster, step.pool, step.image, stale, timeout=10.0)
        self.out.notes.append(f"fenced this node's former client(s) {', '.join(sorted(stale))} "
                          "of a mapping that is gone"
                          + (f"; still watching: {', '.join(left)}" if left else ""))

    def take_claim(self, cluster: rados.Rados, pool: str, image: str) -> tuple[Claim, bool]:
        try:
            return claims.take(cluster, pool, image, self.node.config.node_name)
        except claims.ClaimedElsewhere as exc:
            raise StepRefused(f"{pool}/{image} is claimed by node {exc.holder.node}"
                              + (f" (clients {', '.join(exc.holder.clients)})"
                                 if exc.holder.clients else "")
                              + ": one writer per image, so it is not mapped here") from None

    def release_claim(self, pool: str, image: str) -> str:
        """After an unmap. Without Ceph the unmap still counts; the claim stays
        until a pass that reaches Ceph sees it with no mapping here."""
        if self.cluster is None:
            return "claim kept (Ceph not reachable); a later pass releases it"
        try:
            claims.release(self.cluster, pool, image, self.node.config.node_name)
        except (rados.Error, rbd.Error, ceph.CephError) as exc:
            log.warning("%s/%s: claim not released: %s", pool, image, exc)
            return f"claim kept ({exc}); a later pass releases it"
        return ""

    def format(self, step: FormatDevice) -> tuple[str, str]:
        """mkfs only over a device proven readable and blank (safety rule 1).

        Blank means: the start of the device reads back (a dead helper's EIO
        is *unknown*, never blank), blkid finds no signature, and Ceph has no
        block of the image allocated (an adopted image with data no signature
        explains is not blank either). The only exception is the remains of
        our own interrupted mkfs: FORMATTING set (only ever set on a device so
        proven), FORMATTED not.
        """
        dev = self.data_dev(step.device)
        # blkid says "nothing found" for a path that is no device at all too.
        if not stat.S_ISBLK(os.stat(dev).st_mode):
            raise StepRefused(f"{dev} is not a block device")
        probe = self.node.fs.probe(dev)  # raises when the device does not read
        cluster = self.need_cluster()
        image_meta = ceph.get_meta(cluster, step.pool, step.image)
        formatted = image_meta.get(meta.FORMATTED)
        interrupted = bool(image_meta.get(meta.FORMATTING)) and not formatted
        if step.encrypted and not image_meta.get(meta.CRYPT_FORMATTED):
            raise StepRefused(f"{dev} is a LUKS2 container this reconciler did not format "
                              "(no luks-formatted record): refusing to mkfs inside it")
        if not interrupted:
            if probe.fs_type == step.fs_type:
                return "ok", f"{dev} already carries {step.fs_type}; not formatted"
            if probe.signature:
                raise StepRefused(f"{dev} carries {probe.signature}, not {step.fs_type}; "
                                  "refusing to format over it")
            if formatted:
                raise StepRefused(f"image-meta says it was formatted {formatted} but {dev} "
                                  "is blank; refusing to mkfs over possible data")
            # Encrypted: the container was formatted by us over an image proven
            # blank (format_crypt), and nothing but our mkfs writes inside it
            # before FORMATTED; its header is the only data on the image.
            if not step.encrypted and ceph.has_data(cluster, step.pool, step.image):
                raise StepRefused(
                    f"{step.pool}/{step.image} has data written to it but no signature blkid "
                    f"knows; refusing to format it (to reuse it, zero it by hand first)")
        ceph.set_meta(cluster, step.pool, step.image, meta.FORMATTING, step.fs_type)
        try:
            self.node.fs.mkfs(dev, step.fs_type, step.mkfs_options, force=bool(probe.signature))
        except Exception:
            # Nothing reached the image (mkfs failed before writing, or the device
            # died under it): the marker would claim a mkfs that never happened.
            with contextlib.suppress(Exception):
                if not interrupted and (step.encrypted or not ceph.has_data(
                        cluster, step.pool, step.image)) and not self.node.fs.probe(
                        dev).signature:
                    ceph.remove_meta(cluster, step.pool, step.image, meta.FORMATTING)
            raise
        _mark_done(cluster, step.pool, step.image, meta.FORMATTED, meta.FORMATTING, step.fs_type)
        redo = " (redoing an interrupted mkfs)" if interrupted else ""
        return "changed", f"mkfs.{step.fs_type} {dev}{redo}"

    # -- LUKS2 ------------------------------------------------------------------
    def key(self, kind: str, path: str, pool: str, image: str, seal: bool = False) -> bytes:
        """The volume's LUKS2 passphrase. ``wrappedBy``: unsealed from image-meta
        with the node key (the record bound to this image, or to a parent Ceph
        lists for it: then sealed again for this image); ``seal``: made and
        sealed first when there is none (only ever before our own luksFormat)."""
        enc = self.node.config.encryption
        if (known := self._passphrases.get((kind, path, pool, image))) is not None:
            return known
        try:
            key = keys.read_key_file(path, enc.key_root)
            if kind == "file":
                return key
            cluster = self.need_cluster()
            seals = _seals(cluster, pool, image, enc.accept_unbound)
            sealed = ceph.get_meta(cluster, pool, image).get(meta.LUKS_KEY)
            if sealed is None:
                if not seal:
                    raise StepRefused(
                        f"{pool}/{image} has no sealed passphrase (image-meta {meta.LUKS_KEY}): "
                        "it was not formatted with key wrappedBy; see docs/encryption.md, "
                        "Recovery")
                passphrase = keys.new_passphrase()
                ours = seals.wrap(passphrase, key, path)
                sealed = ceph.set_meta_once(cluster, pool, image, meta.LUKS_KEY, ours)
                if sealed == ours:  # ours stands, sealed for this image: nothing to unseal
                    self._passphrases[(kind, path, pool, image)] = passphrase
                    return passphrase
            got = seals.unwrap(sealed, key, path)
            seals.reseal(sealed, got, key, path)
            self._passphrases[(kind, path, pool, image)] = got.passphrase
            return got.passphrase
        except keys.KeyProblem as exc:
            raise StepRefused(str(exc)) from None

    def seal_candidates(self) -> list[str]:
        """Node key files that may open a clone's inherited record: the
        volume's own (wrappedBy); the records name theirs too."""
        enc = self.volume.encryption if self.volume else None
        return [enc.key_path] if enc is not None and enc.key_kind == "wrappedBy" else []

    def flatten(self, step: FlattenImage) -> tuple[str, str]:
        """A flatten drops the parent link a clone's inherited passphrase
        record opens through: sealed again for the clone first, or refused."""
        cluster, enc = self.need_cluster(), self.node.config.encryption
        try:
            note = _seals(cluster, step.pool, step.image, enc.accept_unbound).bind_all(
                self.seal_candidates(), enc.key_root)
        except keys.KeyProblem as exc:
            raise StepRefused(f"not flattened: {exc}") from None
        if not ceph.flatten_image(cluster, step.pool, step.image):
            return "ok", note or "already independent"
        return "changed", note or ""

    def seal_copy(self, pool: str, image: str, source: tuple[str, str]) -> None:
        """A group-snapshot copy (no parent link): its records, sealed for
        its source (``source``: pool, image), sealed for the copy before it
        gets its name. KeyProblem: no node key here opens them."""
        from reconciler.apply.sealing import ImageSeals

        cluster, enc = self.need_cluster(), self.node.config.encryption
        if not any(k in ImageSeals.RECORDS for k in ceph.get_meta(cluster, pool, image)):
            return
        also = [ceph.image_ref(cluster, *source), *ceph.lineage(cluster, *source)]
        ImageSeals(cluster, pool, image, enc.accept_unbound, also=also).bind_all(
            self.seal_candidates(), enc.key_root)

    def format_crypt(self, step: FormatCrypt) -> tuple[str, str]:
        """luksFormat under the same proofs as mkfs (safety rule 1): the device
        reads, carries no signature, and Ceph has no block of it allocated;
        or it is the remains of our own interrupted luksFormat."""
        dev = self.dev(step.device)
        if not stat.S_ISBLK(os.stat(dev).st_mode):
            raise StepRefused(f"{dev} is not a block device")
        probe = self.node.fs.probe(dev)
        cluster = self.need_cluster()
        image_meta = ceph.get_meta(cluster, step.pool, step.image)
        done = image_meta.get(meta.CRYPT_FORMATTED)
        interrupted = bool(image_meta.get(meta.CRYPT_FORMATTING)) and not done
        if not interrupted:
            if probe.fs_type == "crypto_LUKS":
                return "ok", f"{dev} already carries LUKS; not formatted"
            if probe.signature:
                raise StepRefused(f"{dev} carries {probe.signature}, not LUKS2; refusing to "
                                  "format over it")
            if done or image_meta.get(meta.FORMATTED):
                raise StepRefused(f"image-meta says it was formatted "
                                  f"{done or image_meta.get(meta.FORMATTED)} but {dev} is "
                                  "blank; refusing to luksFormat over possible data")
            if ceph.has_data(cluster, step.pool, step.image):
                raise StepRefused(
                    f"{step.pool}/{step.image} has data written to it but no signature blkid "
                    "knows; refusing to luksFormat it (to reuse it, zero it by hand first)")
        key = self.key(step.key_kind, step.key_path, step.pool, step.image, seal=True)
        ceph.set_meta(cluster, step.pool, step.image, meta.CRYPT_FORMATTING, "luks2")
        try:
            self.node.crypt.format(dev, key)
        except Exception:
            with contextlib.suppress(Exception):
                if not interrupted and not ceph.has_data(cluster, step.pool, step.image):
                    ceph.remove_meta(cluster, step.pool, step.image, meta.CRYPT_FORMATTING)
            raise
        _mark_done(cluster, step.pool, step.image, meta.CRYPT_FORMATTED, meta.CRYPT_FORMATTING,
                   "luks2")
        redo = " (redoing an interrupted luksFormat)" if interrupted else ""
        return "changed", f"luksFormat {dev}{redo}"

    def open_crypt(self, step: OpenCrypt) -> tuple[str, str]:
        dev = self.dev(step.device)
        path = f"/dev/mapper/{step.name}"
        found = open_crypts([dev]).get(dev)
        if found is not None:
            if found.name != step.name:
                raise StepRefused(f"{found.path} (LUKS2, not ours) is open over {dev}")
            self.crypt_device = found.path
            return "ok", f"{path} already open"
        if os.path.lexists(path):
            raise StepRefused(f"{path} exists but is not open over {dev}: another device "
                              "holds this volume's name; refusing to open it twice")
        self.node.crypt.open(dev, step.name,
                             self.key(step.key_kind, step.key_path, step.pool, step.image))
        self.crypt_device = path
        self.acquired.append((f"close {path}", lambda: self.node.crypt.close(step.name)))
        return "changed", f"opened {dev} as {path}"

    def close_crypt(self, step: CloseCrypt) -> tuple[str, str]:
        path = f"/dev/mapper/{step.name}"
        try:
            rdev = os.stat(path).st_rdev
        except FileNotFoundError:
            return "ok", "already closed"
        if (os.major(rdev), os.minor(rdev)) != step.rdev:
            raise StepRefused(f"{path} is {os.major(rdev)}:{os.minor(rdev)}, not the device "
                              f"{step.rdev[0]}:{step.rdev[1]} planned; refusing to close it")
        self.node.crypt.close(step.name)
        self.crypt_device = None
        return "changed", ""

    def stage(self, step: MountStaging) -> tuple[str, str]:
        dev = self.data_dev(step.device)
        fs = self.node.fs
        if step.mode == "block":
            fs.expose_device(dev, step.path, step.options)
        else:
            assert step.fs_type is not None
            message = ""
            # Decided here, not only in the plan: an unmapped device's size was
            # unknown at plan time. ext4 cannot always grow online (it needs
            # CAP_SYS_RESOURCE), but it always can before it is mounted.
            fs_size = fs.fs_size(dev, "ext4") if step.fs_type == "ext4" else None
            if step.grow_offline or (
                    fs_size is not None and block_device_size(dev) - fs_size > GROW_SLACK):
                fs.grow_offline(dev, step.fs_type)
                if self.volume is not None and self.cluster is not None:
                    with contextlib.suppress(rados.Error):
                        ceph.remove_meta(self.cluster, self.volume.image.pool,
                                         self.volume.image.name, meta.GROW_PENDING)
                message = "grew ext4 offline before mounting"
            fs.mount(dev, step.path, step.fs_type, step.options)
        self.acquired.append((f"unstage {step.path}", lambda: fs.unmount(step.path, None)))
        return "changed", message if step.mode != "block" else ""

    def check_staged(self, staging: str, mode: str) -> tuple[int, int]:
        """Safety rule 2: publish only from a staging path whose top mount is
        our device (or, in block mode, a bind of its node). An empty staging
        directory bound into an app writes to the root disk. Returns the rdev."""
        dev = self.data_dev(None)
        rdev = os.stat(dev).st_rdev
        want = (os.major(rdev), os.minor(rdev))
        with safepath.opened(staging) as fd:
            st, mid = os.fstat(fd), safepath.mount_id(fd)
        top = {m.mount_id: m for m in parse_mountinfo(
            procfs.mountinfo())}.get(mid)
        if mode == "block":
            if not stat.S_ISBLK(st.st_mode) or (os.major(st.st_rdev),
                                                os.minor(st.st_rdev)) != want:
                raise StepRefused(f"staging path {staging} is not the device node of {dev}")
            return want
        if top is None or top.mount_point != staging or not is_ours(top, st, want):
            raise StepRefused(f"staging path {staging} is not a mount of {dev}; refusing to "
                              "publish it (it would expose the node's own disk)")
        return want

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
            raise StepRefused(f"{step.pool}/{step.image} is owned by {owner or 'nobody'}")
        holder = parse_claim(found.meta.get(meta.HOLDER))
        if holder is not None and holder.node != self.node.config.node_name:
            raise StepRefused(f"{step.pool}/{step.image} is claimed by node {holder.node}")
        if found.watchers:
            raise StepRefused(f"{step.pool}/{step.image} is still open by "
                              f"{', '.join(found.watchers)}")
        if found.snaps:
            raise StepRefused(f"{step.pool}/{step.image} still has snapshots: "
                              f"{', '.join(s.name for s in found.snaps)}")
        ceph.remove_image(cluster, step.pool, step.image)


def _mark_done(cluster: rados.Rados, pool: str, image: str, done: str, doing: str,
               value: str) -> None:
    """After a format: ``done`` set and ``doing`` removed in one write on the
    header (no moment with both or neither, one round trip instead of six);
    as two writes where that cannot be (no header object, or ``doing`` was
    changed meanwhile: then as before, done first)."""
    try:
        if ceph.update_meta(cluster, pool, image, {doing: value}, {done: value, doing: None}):
            return
    except ceph.CephError:
        pass
    ceph.set_meta(cluster, pool, image, done, value)
    ceph.remove_meta(cluster, pool, image, doing)


def _seals(cluster: rados.Rados, pool: str, image: str, accept_unbound: bool) -> ImageSeals:
    from reconciler.apply.sealing import ImageSeals

    return ImageSeals(cluster, pool, image, accept_unbound)


def apply(plans: list[VolumePlan], volumes: dict[str, Volume], observed: Observed,
          node: Node, parallel: int | None = None,
          claims_after: Connecting | None = None,
          gate: Callable[[str, Path, Step], str | None] | None = None
          ) -> list[VolumeOutcome]:
    """Run each volume's chain; up to ``parallel`` (default: the config's)
    volumes at a time, each chain in order. Outcomes come back in plan order.

    ``claims_after``: a release planned from the node alone (``observe(...,
    ceph=False)``): every chain runs without Ceph, then this one connection
    drops this node's claim of each image no longer mapped here.

    ``gate``: asked right before each step (name, file, step): a reason stops the
    chain there, refused (a front door's file that must not act any more)."""
    needed = any(isinstance(s, CEPH_STEPS) for p in plans for s in p.steps)
    # An unmap releases its claim through the connection observe kept; it
    # never waits to connect: the unmap matters, a later pass drops the claim.
    unmaps = claims_after is None and any(
        isinstance(s, Unmap) and s.release_claim for p in plans for s in p.steps)
    with contextlib.ExitStack() as stack:
        cluster = None
        if needed or unmaps:
            # The connection observe kept (the daemon's, or this command's own
            # pass), held until the chains end: a second connect costs ~15 ms.
            handle = node.ceph_session.take(node.config.ceph)
            if handle is not None and handle.cluster is not None:
                cluster = handle.cluster
                stack.callback(handle.drop)
            elif handle is not None:
                handle.drop()
        if needed and cluster is None:
            try:
                cluster = stack.enter_context(ceph.connect(node.config.ceph))
            except ceph.CephError as exc:
                # Each volume that needs Ceph fails at its first Ceph step, saying why.
                log.error("%s", exc)
        runs = [_VolumeRun(node, cluster, p, volumes.get(p.name), observed) for p in plans]
        for r in runs:
            r.claims_after = claims_after is not None
            r.gate = gate
        workers = min(parallel or node.config.parallel, sum(bool(p.steps) for p in plans))
        if workers <= 1:
            out = [r.run() for r in runs]
        else:
            from concurrent.futures import ThreadPoolExecutor

            # librados handles are thread-safe; chains share nothing else but
            # the registries, which lock.
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="apply") as pool:
                out = list(pool.map(_VolumeRun.run, runs))
    if claims_after is not None:
        _drop_claims(runs, node, claims_after)
    return out


def _drop_claims(runs: list[_VolumeRun], node: Node, connecting: Connecting) -> None:
    """A release's Ceph side, after every chain's node side: this node's claim
    of each image that is no longer mapped here (its chain unmapped it, or
    nothing was mapped) is dropped (never another node's: compared in the
    OSD). A chain that failed keeps its claim: something may still be mapped."""
    me = node.config.node_name
    todo = [r for r in runs if r.volume is not None and r.volume.kind == "Volume"
            and r.out.status not in ("failed", "aborted") and not r.plan.refusal
            and not r.plan.waiting and (r.claim_unmap is not None or not any(
                isinstance(s, Unmap) for s in r.plan.steps))]
    if not todo:
        connecting.close()
        return
    try:
        cluster = connecting.cluster()
    except (NoAnswer, ceph.CephError) as exc:
        for r in todo:
            if r.claim_unmap is not None:
                r.claim_unmap.message = f"claim kept ({exc}); a later pass releases it"
        connecting.close()
        return
    try:
        for r in todo:
            assert r.volume is not None
            pool, image = r.volume.image.pool, r.volume.image.name
            t0 = time.monotonic()
            try:
                dropped = claims.release(cluster, pool, image, me)
            except (rados.Error, rbd.Error, ceph.CephError) as exc:
                log.warning("%s/%s: claim not released: %s", pool, image, exc)
                if r.claim_unmap is not None:
                    r.claim_unmap.message = f"claim kept ({exc}); a later pass releases it"
                continue
            if dropped and r.claim_unmap is None:  # nothing was mapped, the claim stayed
                step = ReleaseClaim(r.volume.name, pool, image, me)
                took = time.monotonic() - t0
                log_step(log, step, "changed", took, "")
                r.out.steps.append(StepOutcome(step, "changed", "", took))
                r.out.status = "changed"
    finally:
        connecting.close()
