"""Execute planned steps through the drivers.

A volume's chain stops at its first failure. A half-done stage (mapped or
mounted in this run, but not yet staged) is undone in reverse so nothing
leaks; a later run starts again from a fresh observation. Each step checks
its safety condition again right before acting: the plan may be stale.

The chain is ``_VolumeRun``: what it holds and its undo in
apply/chainstate.py, its steps in apply/imagesteps.py, apply/mapsteps.py and
apply/devicesteps.py, what it gives in apply/outcomes.py. ``apply`` is the
entry: imported by engine.py only (the front doors go through it).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path

import rados
import rbd

from reconciler.apply import claims
from reconciler.apply.devicesteps import DeviceSteps
from reconciler.apply.imagesteps import ImageSteps
from reconciler.apply.logfmt import log_not_run, log_step
from reconciler.apply.mapsteps import MapSteps
from reconciler.apply.outcomes import (
    MOVED_ON,
    StepOutcome,
    StepRefused,
    VolumeOutcome,
    with_refusal,
)
from reconciler.drivers import ceph
from reconciler.drivers.bounded import NoAnswer
from reconciler.drivers.fs import OnlineGrowRefused
from reconciler.drivers.run import Aborted
from reconciler.facts import meta
from reconciler.facts.observed import Mapping, Observed
from reconciler.observe.ceph import Connecting
from reconciler.observe.node import Node
from reconciler.plan.groupsteps import GroupStep
from reconciler.plan.planner import VolumePlan
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
    ReattachNbd,
    RefreshDevice,
    ReleaseClaim,
    Remount,
    ResizeCrypt,
    ResizeImage,
    RollNbd,
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
# parallel chains (a thread pool).

log = logging.getLogger("reconciler.apply")  # the name log lines have always carried

CEPH_STEPS = (CreateImage, ResizeImage, SetImageMeta, SetQos, DeleteImage, FormatDevice,
              GrowFilesystem, MountStaging, CreateSnapshot, CloneImage, FlattenImage,
              DeleteSnapshot, MapImage, ClaimImage, ReleaseClaim, GroupStep, ReattachNbd,
              RollNbd)
# Failures here leave a stage half done: undo what this run acquired.
STAGE_CHAIN = (MapImage, RefreshDevice, FormatCrypt, OpenCrypt, ResizeCrypt, FormatDevice,
               MountStaging)


class _VolumeRun(ImageSteps, MapSteps, DeviceSteps):
    def run(self) -> VolumeOutcome:
        if not self.plan.refusal:
            self.run_steps()
        return with_refusal(self.plan, self.out)

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
                if status == "changed" and isinstance(step, CreateSnapshot | CreateImage |
                                                        CloneImage):
                    self.ask_gate_after(step)
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

    def ask_gate_after(self, step: CreateSnapshot | CreateImage | CloneImage) -> None:
        """What a step just made, asked again: a process paused between the
        check and the step (SIGSTOP, a frozen VM) may wake after its call was
        given up and another replica deleted the name (the history checker
        caught a snapshot so). Refused now: what it made goes (it made it this
        very step; no one was told of it, nothing uses it); a later call
        makes it again."""
        if self.gate is None or self.volume is None:
            return
        why = self.gate(self.volume.name, self.volume.source.file, step)
        if not why:
            return
        if MOVED_ON not in why:
            # Not known (a record that cannot be read may still be current,
            # its call still waiting): unknown is never absent. Nothing more
            # is done, and what it made stays.
            raise StepRefused(why)
        try:
            if isinstance(step, CreateSnapshot):
                ceph.remove_snapshot(self.need_cluster(), step.pool, step.image, step.snap)
            else:
                ceph.remove_image(self.need_cluster(), step.pool, step.image)
        except Exception as exc:
            raise StepRefused(f"{why}; what it had just made ({step.target}) after its "
                              f"controller record moved on could not be removed: {exc}"
                              ) from None
        raise StepRefused(f"{why}; what it had just made ({step.target}) after its controller "
                          "record moved on was removed")

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
            case ReattachNbd():
                return self.reattach(step)
            case RollNbd():
                return self.roll(step)
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
