"""``release --all``: give back everything of ours on this node.

For shutdown and reboot (systemd/rbd-reconciler-shutdown.service runs it while
the network is still up, after the daemon has stopped): sync, then unpublish,
unstage and unmap every volume of ours. A mapped RBD device left with dirty
data or a mounted filesystem when the network goes down hangs the reboot.

"Ours" is wider than the files: the operator's and the CSI adapter's volume
files, the daemon's records of volumes whose files vanished (or fail to load),
and what is ours by identity alone (an rbd-fuse mount under stateDir/fuse; a
kernel mapping whose image claim names this node), such as a
volume whose file was removed with ``onRemove: keep``. Nothing is deleted and
no file is written: the daemon maps everything again at the next boot.

This module does it: the config is read once, at the entry (``Ours``: the
files, the records, the node's drivers, the planner's context; the FUSE
mounts for the last resort); then thaw, sync, the state lock and the rounds:
look, ask plan/release.py for the round's ``ReleasePlan`` (what is provably
ours, the steps in order, which FUSE connections may be forced off), run
it, force off what its rule names, all within the deadline. Imported by the
CLI's ``release --all`` (cli/release.py) only.
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from reconciler.apply.outcomes import VolumeOutcome
from reconciler.drivers.freeze import THAW_WAIT_S
from reconciler.drivers.reaper import reap_later
from reconciler.drivers.run import KILL_WAIT_S, STOP_CHECK_S, Runner
from reconciler.engine import act, context, seen
from reconciler.engine.frozen import thaw_left
from reconciler.engine.unwedge import FuseMounts, unwedge
from reconciler.facts.observed import Mapping
from reconciler.observe.node import Node
from reconciler.plan.release import ReleasePlan, not_done, plan_release, volumes_of_ours
from reconciler.plan.types import Context, VolumePlan
from reconciler.spec.config import Config
from reconciler.spec.desired import load_desired
from reconciler.spec.model import Volume
from reconciler.state.files import read_json
from reconciler.state.lock import locked_within

log = logging.getLogger("reconciler.shutdown")  # the name log lines have always carried

# The whole of `release --all`: under rbd-reconciler-shutdown.service's
# TimeoutStopSec=300s, whose SIGKILL would cut off the report.
DEFAULT_DEADLINE_S = 240.0
# Before the deadline, the chains stop: a command still running is killed
# (noticed within STOP_CHECK_S, its exit waited for up to KILL_WAIT_S), and
# the report is written.
WIND_DOWN_S = STOP_CHECK_S + KILL_WAIT_S + 1.5
MIN_BUDGET_S = 0.1
REPORT_S = 0.5  # kept at the very end for printing the report


@dataclass
class Released:
    outcomes: list[VolumeOutcome] = field(default_factory=list)
    left: list[str] = field(default_factory=list)  # what is still held, one line each
    sync: str | None = None  # why sync did not finish, if it did not
    thawed: list[str] = field(default_factory=list)  # freezes a dead run left, one line each
    late: str | None = None  # the overall deadline passed: while doing what
    forced: list[str] = field(default_factory=list)  # FUSE connections ended, one line each
    # Progress, for a report at the deadline: what it does now, what it planned.
    phase: str = "starting"
    plans: list[VolumePlan] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    # The work did not return by the deadline: it is left behind, stuck
    # (``force_off_stuck``, then the process ends at once).
    stuck: bool = False
    fuse: FuseMounts | None = None  # where the last resort looks

    @property
    def ok(self) -> bool:
        return (self.late is None and not self.left and not self.forced
                and not any(o.status in ("failed", "aborted") for o in self.outcomes))


@dataclass(frozen=True)
class Ours:
    """What the rounds of a release need of the config, read once under the
    state lock: the rounds (and the layers below them) get this, never the
    config."""

    node: Node  # the drivers; each look builds them again over a runner of its own
    context: Context  # the planner's (this node's name, the mappers here, the clone rules)
    declared: tuple[Volume, ...]  # the operator's and the CSI adapter's volume files
    records: dict[str, Any]  # the daemon's (managed.json)
    step_timeout: float
    fuse: FuseMounts  # where the last resort looks


def _ours(config: Config, node: Node, step_timeout: float, fuse: FuseMounts) -> Ours:
    """The config read once: the files, the daemon's records, the planner's context."""
    return Ours(node, context(config, node), load_desired(config).volumes,
                read_json(config.state_dir / "managed.json", {}) or {}, step_timeout, fuse)


def sync_all(timeout: float) -> str | None:
    """sync(1) within ``timeout``. A sync stuck on a dead cluster (D state,
    unkillable) is left behind rather than waited for: the unmounts that
    follow flush each filesystem anyway, each under its own deadline."""
    # No output of ours handed to it: one stuck for good would hold the
    # journal stream (or a caller's pipe) open after we exit.
    proc = subprocess.Popen(["sync"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        reap_later(proc)  # in D state it is not gone yet, maybe never
        return f"sync did not finish within {timeout:g} s; releasing anyway"
    return None if proc.returncode == 0 else f"sync exited {proc.returncode}"


class CannotTell(Exception):
    """The dry run could not list what is mapped here: unknown, not nothing."""


def _mappings(node: Node, unlisted: list[str] | None = None) -> list[Mapping]:
    """``unlisted``: one line per listing that failed is added to it."""
    found = list(node.fuse.list())
    for kind in ("krbd", "nbd"):
        if kind in node.mappers_available:
            try:
                found += node.mapper(kind).list()
            except Exception as exc:  # listing is best effort: say what was not seen
                log.error("listing %s mappings failed: %s", kind, exc)
                if unlisted is not None:
                    unlisted.append(f"listing {kind} mappings failed: {exc}")
    return found


def _plan_release(ours: Ours, node: Node, unlisted: list[str] | None = None) -> ReleasePlan:
    """Look at what is ours now and ask plan/release.py what to do with it."""
    candidates, unreadable = volumes_of_ours(ours.declared, ours.records,
                                             _mappings(node, unlisted))
    for line in unreadable:
        log.warning("%s", line)
    return plan_release(candidates, seen(candidates, node), ours.context, ours.step_timeout)


class Deadline:
    """One deadline for the whole of ``release --all``, under the unit's stop
    timeout: each phase gets its own limit or what is left, whichever is
    less, and the chains are stopped ``WIND_DOWN_S`` before the end (the
    commands still running killed, the steps not started reported), so the
    report is printed before the deadline, not cut off by systemd's SIGKILL.
    A FUSE connection is forced off within what is left until the chains
    must stop (``left``), or, once they were stopped, until the end."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.end = time.monotonic() + seconds
        self.wind_down = min(WIND_DOWN_S, seconds / 4)

    def until_end(self) -> float:
        """Seconds until the deadline itself, less a moment for the report."""
        return self.end - time.monotonic() - REPORT_S

    def left(self) -> float:
        """Seconds until the chains must stop (negative: past that)."""
        return self.end - self.wind_down - time.monotonic()

    def budget(self, limit: float) -> float:
        """``limit``, or less: what is left before the chains must stop."""
        return max(MIN_BUDGET_S, min(limit, self.left()))

    def stop_chains_in_time(self, node: Node) -> threading.Timer:
        why = f"release --all deadline ({self.seconds:g} s) reached"
        timer = threading.Timer(max(0.0, self.end - self.wind_down - time.monotonic()),
                                node.runner.halt.begin, (0.0, why))
        timer.daemon = True
        timer.start()
        return timer


def release_all(config: Config, step_timeout: float,
                deadline: float = DEFAULT_DEADLINE_S) -> Released:
    """Thaw what a dead run left frozen, sync, release every volume of ours,
    then look again: whatever is still mounted or mapped is reported in
    ``left`` (the command prints it, so the journal has it). Takes the state
    lock (the daemon must not map while we unmap); Busy when it cannot. A
    volume whose release ran into a deadline on an rbd-fuse helper that does
    not answer has that helper's connection ended (engine/unwedge.py), and
    is released once more with the time left.

    Returns by ``deadline`` whatever happens: the work runs in a thread, and
    when it is stuck where no command can be killed (a thaw or an unmount in
    the kernel, a Ceph call), what it had done is reported (``stuck``: the
    caller prints, then ``force_off_stuck``, then ends the process at once,
    leaving that thread behind)."""
    fuse = FuseMounts(config.ceph, config.state_dir / "fuse")
    progress = Released(fuse=fuse)
    result: list[Released | BaseException] = []

    def work() -> None:
        try:
            result.append(_release(config, step_timeout, deadline, fuse, progress))
        except BaseException as exc:  # handed to the caller's thread, which raises it
            result.append(exc)

    worker = threading.Thread(target=work, name="release-all", daemon=True)
    worker.start()
    worker.join(deadline)
    if not result:
        return report_at_deadline(progress, deadline)
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def held_now(config: Config, step_timeout: float) -> tuple[list[str], list[str]]:
    """``release --all --dry-run``: what a release would take down (or
    refuses, when it may be ours) now, one line each, and apart the kernel
    mappings provably another tool's (which it leaves alone); nothing is
    done and no lock is taken (the daemon may hold it: the package's prerm
    asks while it runs). CannotTell when a listing of the mappings failed:
    what it would have shown (a volume found by identity alone) is unknown,
    and "nothing" would let a removal go on (safety rule 7)."""
    node = Node.from_config(config, Runner(timeout=step_timeout), read_only=True)
    ours = _ours(config, node, step_timeout, FuseMounts(config.ceph, config.state_dir / "fuse"))
    unlisted: list[str] = []
    planned = _plan_release(ours, node, unlisted)
    if unlisted:
        raise CannotTell("; ".join(unlisted))
    return planned.held_of_ours(), planned.not_ours


def force_off_stuck(done: Released) -> list[str]:
    """A thread stuck in the kernel on an rbd-fuse helper that does not
    answer would hold even the process's exit: end that connection. One
    line per mount forced."""
    return unwedge(done.fuse, set()) if done.fuse is not None else []


def _release(config: Config, step_timeout: float, deadline: float, fuse: FuseMounts,
             out: Released) -> Released:
    """``release_all``'s work; ``out`` shows the progress while it runs
    (``phase``, ``plans``), for a report at the deadline."""
    limit = Deadline(deadline)
    out.phase = "thawing what a killed snapshot run left frozen"
    out.thawed = thaw_left(config, limit.budget(THAW_WAIT_S))
    out.phase = "syncing"
    out.sync = sync_all(limit.budget(step_timeout))
    out.phase = "waiting for the state lock"
    with locked_within(config.state_dir, limit.budget(step_timeout)):
        out.phase = "looking at what is ours"  # the files and the records first
        node = Node.from_config(config, Runner(timeout=step_timeout))
        ours = _ours(config, node, step_timeout, fuse)
        for _ in range(2):  # once more only after forcing off what did not answer
            if _release_round(ours, limit, out):
                return out
            if not out.forced or limit.left() <= 0:
                break
        out.phase = "looking again"
        # Its own runner: the deadline's halt, had it come now, must not
        # refuse the listing commands of this last look.
        unlisted: list[str] = []  # what it could not list may still be held
        again = _plan_release(ours, node.anew(Runner(timeout=step_timeout)), unlisted)
    out.left = [*again.held(), *unlisted]
    # That look may itself have got stuck on a device nobody answers for:
    # the process could not end (engine/unwedge.py).
    out.forced += unwedge(fuse, set(), limit.until_end())
    out.phase = "done"
    return out


def _release_round(ours: Ours, limit: Deadline, out: Released) -> bool:
    """Plan and release what is ours, then force off the FUSE connections
    that the plan's rule names. True when the overall deadline stopped the
    chains (``out`` then says what was not done)."""
    node = ours.node.anew(Runner(timeout=ours.step_timeout))
    timer = limit.stop_chains_in_time(node)
    try:
        out.phase = "looking at what is ours"
        planned = _plan_release(ours, node)
        out.plans, out.skipped = planned.plans, planned.refused
        out.phase = "releasing"
        outcomes = act(planned.plans, planned.volumes, planned.observed, node)
        out.outcomes += outcomes
    finally:
        timer.cancel()
    stuck = planned.forced_off(outcomes)
    if node.runner.halt.stopping:
        # Stopped at the deadline: no time to look again. What the chains
        # did not do is still held; what hangs on a dead helper is ended
        # with the little time left, so that this process can end.
        out.late = f"deadline of {limit.seconds:g} s reached while releasing"
        out.left = planned.left(out.outcomes)
        out.forced += unwedge(ours.fuse, stuck, limit.until_end())
        return True
    out.phase = "ending the FUSE connections that do not answer"
    out.forced += unwedge(ours.fuse, stuck, limit.left())
    return False


def report_at_deadline(out: Released, deadline: float) -> Released:
    """``release_all`` has not returned by its deadline (stuck outside any
    command: the kernel, a Ceph call): what it had done is all there is to
    report, and everything it set out to do that is not known done is held."""
    late = Released(outcomes=list(out.outcomes), sync=out.sync, thawed=list(out.thawed),
                    plans=list(out.plans), skipped=list(out.skipped), phase=out.phase,
                    forced=list(out.forced), stuck=True, fuse=out.fuse)
    late.late = f"deadline of {deadline:g} s reached while {out.phase}"
    late.left = [*late.skipped, *not_done(late.plans, late.outcomes)]
    if not late.plans:
        late.left.append(f"{out.phase} did not end: what is ours was not listed")
    return late
