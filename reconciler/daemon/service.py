"""``rbd-reconciler run``: watch the desired directory and converge continuously.

Level-triggered: events and the periodic resync only say *when* to look, and
at which volumes; every pass loads the files (unchanged ones from a stat-first
cache) and observes the volumes it looks at afresh. A pass looks at the dirty
volumes: new or changed files, volumes an event named (a mount, a device, a
helper, a resize: daemon/events.py), a CSI call, a retry that is due, a
chain that just finished; the resync marks them all. Volumes converge in
a bounded thread pool, one chain per volume at a time; a slow or failing
volume never holds up the others (a failing one backs off exponentially,
with jitter, until its spec changes).
"""

from __future__ import annotations

import dataclasses
import faulthandler
import json
import logging
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from reconciler.apply.outcomes import LEFT, VolumeOutcome, without_steps
from reconciler.daemon import sdnotify
from reconciler.daemon.asks import Asks, Inflight, PassContext
from reconciler.daemon.claimpoll import ClaimPoll, Wait, read_holders
from reconciler.daemon.commands import Commands
from reconciler.daemon.conditions import Conditions
from reconciler.daemon.control import ControlServer
from reconciler.daemon.dirwatch import DirWatcher
from reconciler.daemon.dirwatch import plan as watch_plan
from reconciler.daemon.events import EventHub
from reconciler.daemon.follow import Follower
from reconciler.daemon.interest import VolumeInterest, combine, forget, volume_interest
from reconciler.daemon.liveview import LiveView
from reconciler.daemon.metrics import Metrics, ceph_reachable
from reconciler.drivers.freeze import thaw_recorded
from reconciler.drivers.reaper import become_subreaper, reap_zombies
from reconciler.drivers.run import Aborted, Halt
from reconciler.engine import (
    Awaited,
    Busy,
    FrontDoor,
    Gate,
    Pass,
    Stoppable,
    act,
    context,
    look,
    state_lock,
)
from reconciler.facts.clock import now_iso
from reconciler.facts.observed import Observed
from reconciler.observe.ceph import observe_images
from reconciler.observe.node import Node
from reconciler.plan.planner import VolumePlan, actual_state
from reconciler.source.report import applied_revision, distrust
from reconciler.spec.config import Config, ConfigError, load_config
from reconciler.spec.desired import claims, forgettable, load_desired
from reconciler.spec.loader import LoadCache, LoadResult
from reconciler.spec.model import Phase, Volume, volume_from_dict, volume_to_dict
from reconciler.spec.reading import discover
from reconciler.spec.security import desired_dir_problems, directory_problems
from reconciler.state import allowance, holds
from reconciler.state.allowance import Allowance
from reconciler.state.files import CannotWrite, read_json, write_json
from reconciler.state.records import RecordsFile
from reconciler.state.status import UNSET, VolumeStatus, converged_conditions

log = logging.getLogger("rbd-reconciler")

DEBOUNCE_S = 0.05  # quiet time after an event burst (a git pull touching 50 files)
DEBOUNCE_MAX_S = 1.0  # ...but never wait longer than this after the first event
BACKOFF_BASE_S = 2.0
BACKOFF_MAX_S = 300.0
# A pass (load, bounded observe, plan) stuck longer than this is a bug or a
# hang the deadlines missed: stop pinging the watchdog so systemd restarts us.
STALL_MIN_S = 120.0
# READY=1 waits this long at most for the first pass's chains (the unit's
# TimeoutStartSec=300s sits above it: raise both together).
READY_WAIT_S = 240.0
# Of timeouts.stopSeconds, kept for what follows the wait for the chains
# (the CSI server's own grace, the file watcher, the log lines).
STOP_RESERVE_S = 3.0

# A status differing from the last written in none of these is not rewritten.
STATUS_KEYS = ("phase", "observedGeneration", "lastResult", "reason", "message",
               "sourceRevision")

# Why a volume is taken down: its file vanished, or `release` held it down
# through the daemon; None: converged to its file.
Down = Literal["vanished", "held"] | None

# The status of a volume held down (state/holds.py).
HELD = {"reason": "Held", "message": "released through the daemon (rbd-reconciler release); "
                                     "kept down until rbd-reconciler apply names it"}

PHASE_NAMES = {"ABSENT": "Absent", "CREATED": "Created", "MAPPED": "Mapped",
               "STAGED": "Staged", "PUBLISHED": "Published"}


@dataclass
class PassKnew:
    """What the pass under way knew of the volumes, for the asks it was due
    to answer and did not look at (daemon/asks.py ``pass_ended``)."""

    current: set[str] = field(default_factory=set)  # declared
    released: set[str] = field(default_factory=set)  # vanished, released by it
    frozen: set[str] = field(default_factory=set)


@dataclass
class Backoff:
    failures: int
    until: float
    spec_hash: str


class Daemon:
    def __init__(self, config: Config, config_path: Path | None,
                 allow_mass_removal: bool = False, csi_endpoint: str | None = None,
                 serve_csi: FrontDoor | None = None) -> None:
        self.config = config
        self.config_path = config_path
        self.allow_mass_removal = allow_mass_removal
        # Set at SIGTERM: commands refused and killed after the grace (every
        # Node built here shares it: a reload leaves chains on the old one).
        self.halt = Halt()
        self.node = Node.from_config(config, halt=self.halt)
        self.abandoned = False  # a chain outlived the stop deadline: exit hard
        self.wake_event = threading.Event()
        self.stopping = threading.Event()
        self.reload_wanted = threading.Event()
        self.lock = threading.Lock()  # records, in-flight set, backoff
        self.inflight: dict[str, Future[None]] = {}
        self.backoff: dict[str, Backoff] = {}
        self.records: dict[str, dict] = {}
        self.recorded: dict[str, tuple[str, Path]] = {}  # name -> what its record holds
        self.records_file = RecordsFile(self.records_path)
        # Files unchanged since the last pass (stat) are not read again.
        self.load_cache = LoadCache()
        self.pool = ThreadPoolExecutor(max_workers=config.parallel,
                                       thread_name_prefix="volume")
        self.dirwatch: DirWatcher | None = None  # inotify on the desired files' paths
        self.conditions = Conditions(log)
        self.busy_since: float | None = None  # the pass thread is inside a pass
        # Hooks for the CSI adapter (reconciler/csi): a wake that skips the
        # debounce, and counts of passes begun and finished it can wait on.
        self.csi_endpoint = csi_endpoint
        self.serve_csi = serve_csi
        self.urgent = threading.Event()
        self.gate: Gate | None = None  # the CSI adapter's say over its files, per step
        self.passes_started = 0  # passes run one after another: started - done <= 1
        self.passes_done = 0
        self.progress = threading.Condition()  # notified: pass finished, status written
        self.progress_seq = 0  # bumped with every notify: a waiter never misses one
        # What the next pass looks at (names); everything while ``dirty_all``.
        self.dirty: set[str] = set()
        self.dirty_all = True
        self.dirty_why: list[str] = []  # for the debug line of the next pass
        self.last_hash: dict[str, str] = {}  # name -> spec_hash at the last pass
        self.last_pass_start = 0.0
        self.interest: dict[str, VolumeInterest] = {}
        self.events: EventHub | None = None
        self.follower: Follower | None = None  # the GitOps source (config.git)
        self.source_revision: str | None = None  # what the desired files came from
        # Volumes refused by another node's claim, and the claim they wait
        # on (daemon/claimpoll.py): name -> ((pool, image), what the pass saw).
        self.claim_waits: dict[str, tuple[tuple[str, str], Wait]] = {}
        self.claim_poll: ClaimPoll | None = None
        # name -> the status fields compared before a write (no read per pass)
        self.written: dict[str, tuple] = {}
        # stateDir that cannot be written (full, read-only): the first failed
        # write of the episode, what is not on disk yet, and the volumes held
        # back meanwhile (their new or changed record is not on disk: what is
        # not recorded is not done, so a restart never loses track of it).
        self.state_error: str | None = None
        self.unsaved_records = False
        self.unrecorded: set[str] = set()
        self.unwritten: dict[str, dict[str, Any]] = {}  # name -> status not on disk yet
        # The command line's way in (daemon/control.py): what it asks of the
        # passes, what they saw, and what `release` holds down until `apply`.
        self.control: ControlServer | None = None
        self.asks = Asks(self.look_again, self.first_pass_after_now)
        self.view = LiveView(self._look_for_view)
        self.holds: set[str] = set()
        self.inflight_info: dict[str, Inflight] = {}  # what each chain in flight is for
        self.refusing = ""  # why the pass under way refused to look, for the asks
        self.pass_knew = PassKnew()  # what the pass under way knew, for the asks
        self.not_reconciling: str | None = None  # why the last pass refused; None: it looked
        self.metrics = Metrics()
        self.metrics.in_backoff.set_function(lambda: len(self.backoff))
        self.metrics.state_writable.set_function(lambda: 0 if self.state_failing else 1)
        self.metrics.resync.set_function(lambda: self.config.resync_seconds)  # follows SIGHUP

    @property
    def state_failing(self) -> bool:
        """Something under stateDir (records, a status) is not on disk yet."""
        return self.unsaved_records or bool(self.unwritten)

    # -- paths ----------------------------------------------------------------
    @property
    def records_path(self) -> Path:
        return self.config.state_dir / "managed.json"

    def status_path(self, name: str) -> Path:
        return self.config.state_dir / "status" / f"{name}.json"

    # -- lifecycle ------------------------------------------------------------
    def wake(self) -> None:
        self.wake_event.set()

    def mark_dirty(self, names: Iterable[str] | None, why: str) -> None:
        """Have the next pass look at ``names`` (None: at every volume)."""
        with self.lock:
            if names is None:
                self.dirty_all = True
            else:
                self.dirty.update(names)
            if len(self.dirty_why) < 20:
                self.dirty_why.append(why)
        self.wake_event.set()

    # -- hooks for the CSI adapter -------------------------------------------
    def wake_volume(self, name: str) -> None:
        """A pass at once, without the debounce, that tries ``name`` even if it
        is backing off: a CSI call (maybe the CO's retry) is waiting on it."""
        with self.lock:
            self.backoff.pop(name, None)
            self.dirty.add(name)
        self.urgent.set()
        self.wake_event.set()

    def set_gate(self, gate: Gate | None) -> None:
        self.gate = gate

    @property
    def ready(self) -> bool:
        return self.passes_done > 0

    def busy(self, name: str) -> bool:
        with self.lock:
            return name in self.inflight

    # -- hooks for the command line (daemon/commands.py) ----------------------
    def look_again(self, names: set[str] | None, why: str) -> None:
        """A pass at once over ``names`` (None: every volume), backoff
        forgotten, no debounce: the command line waits on it."""
        with self.lock:
            if names is None:
                self.dirty_all = True
                self.backoff.clear()
            else:
                for name in names:
                    self.backoff.pop(name, None)
                self.dirty |= names
            if len(self.dirty_why) < 20:
                self.dirty_why.append(why)
        self.urgent.set()
        self.wake_event.set()

    def first_pass_after_now(self) -> int:
        """The number of the first pass that begins after this call."""
        with self.progress:
            return self.passes_started + 1

    def wait_pass(self, number: int, deadline: float) -> bool:
        """Wait until pass ``number`` has ended; False at ``deadline``, or
        when the daemon stops first."""
        with self.progress:
            while self.passes_done < number:
                left = deadline - time.monotonic()
                if left <= 0 or self.stopping.is_set():
                    return False
                self.progress.wait(min(left, 1.0))
        return True

    def _look_for_view(self, loaded: LoadResult, names: frozenset[str] | None,
                       all_watchers: bool) -> Pass:
        """A look for status, plan or explain (daemon/liveview.py), made as the
        command alone makes it, through this daemon's Node: its Ceph
        connection, probe cache and I/O history. What ``release`` holds down
        is planned released, as the passes plan it (what the daemon does)."""
        held = self.holds  # replaced whole by the pass thread, never changed in place
        volumes = [v for v in loaded.volumes if names is None or v.name in names]
        # A stall judged as the command alone judges it (the same words).
        node = dataclasses.replace(self.node, io_watch=self.node.io_watch.as_a_command_judges())
        looked = look(volumes, self.config, node,
                      frozen=[n for n in loaded.frozen_names if names is None or n in names],
                      release=[v.name for v in volumes if v.name in held],
                      all_watchers=all_watchers)
        return Pass(loaded, looked.observed, looked.plans)

    def _reserve(self, name: str) -> bool:
        """For a job (rotate-key, takeover): no chain may start for ``name``
        until ``unreserve``; False while one runs."""
        with self.lock:
            if name in self.inflight:
                return False
            fut: Future[None] = Future()
            fut.set_running_or_notify_cancel()
            self.inflight[name] = fut
            self.inflight_info[name] = what = Inflight("", "job")
        self.asks.started(name, what)
        return True

    def unreserve(self, name: str) -> None:
        """The job is done: the volume is looked at again at once."""
        with self.lock:
            fut = self.inflight.pop(name, None)
            what = self.inflight_info.pop(name, None)
        if fut is not None and not fut.done():
            fut.set_result(None)  # a stop waiting for it goes on
        self.asks.finished(name, None, what)
        self.look_again({name}, f"{name}: after a job of the command line")

    def _answer_asks(self, loaded: LoadResult, current: dict[str, Volume], frozen: set[str],
                     release: list[Volume], held: dict[str, str], unrecorded: set[str]) -> None:
        look = self.asks.resolve(self.passes_started, PassContext(
            loaded=loaded, current=current, frozen=frozen,
            released={v.name for v in release}, held_back=held, unrecorded=unrecorded,
            state_line=self._state_line(), hold=self._hold_down,
            lift=self._lift_holds, reserve=self._reserve))
        if look:
            with self.lock:
                for name in look:
                    self.backoff.pop(name, None)
                self.dirty |= look

    def _hold_down(self, names: set[str]) -> str | None:
        return self._save_holds(self.holds | names)

    def _lift_holds(self, names: set[str] | None) -> str | None:
        return self._save_holds(set() if names is None else self.holds - names)

    def _save_holds(self, wanted: set[str]) -> str | None:
        """Recorded before it counts (what is not recorded is not done)."""
        if wanted == self.holds:
            return None
        try:
            holds.write(self.config.state_dir, wanted)
        except OSError as exc:
            return str(exc) if isinstance(exc, CannotWrite) else f"cannot record: {exc}"
        for name in self.holds - wanted:
            log.info("%s: no longer held down (apply)", name, extra={"volume": name})
        for name in wanted - self.holds:
            log.info("%s: held down (release): kept released until apply names it", name,
                     extra={"volume": name})
        self.holds = wanted
        return None

    def status(self, name: str) -> dict:
        return read_json(self.status_path(name), {}) or {}

    def await_status(self, name: str, covers: Callable[[dict[str, Any]], bool],
                     deadline: float) -> tuple[Awaited, dict[str, Any]]:
        """Wake the engine for ``name`` and wait for a status that ``covers``
        accepts: from a pass that began after this call (and the node was as
        the caller found it), with no chain for the volume still running."""
        with self.progress:
            # A pass under way now may have read the node before the change
            # the caller waits for: only one that begins after this point counts.
            first = self.passes_started + 1
        self.wake_volume(name)
        while True:
            with self.progress:
                seq = self.progress_seq
                passes = self.passes_done
            if passes >= first and not self.busy(name):
                status = self.status(name)
                if covers(status):
                    return "covered", status
            left = deadline - time.monotonic()
            if left <= 0:
                return "deadline", {}
            if self.stopping.is_set():
                return "stopping", {}
            with self.progress:
                if self.progress_seq == seq:
                    self.progress.wait(min(left, 1.0))

    def install_signals(self) -> None:
        def stop(signum: int, _frame: object) -> None:
            t = self.config.timeouts
            log.info("signal %d: stopping: no new step starts; steps in flight may run "
                     "commands for %g s, then what still runs is killed; exiting within %g s",
                     signum, t.stop_grace_seconds, t.stop_seconds)
            self.stopping.set()
            self.wake()

        def reload(_signum: int, _frame: object) -> None:
            self.reload_wanted.set()
            self.wake()

        # SIGUSR1 dumps every thread's stack to stderr: for "why is it stuck?"
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGHUP, reload)

    def _awaiting_source(self) -> bool:
        return self.config.git is not None and not os.path.lexists(self.config.desired_dir)

    def preflight(self, files: bool = True) -> list[str]:
        """Why the desired directories may not be trusted. ``files=False`` (a
        pass): the directories only, since the load that follows checks every
        file as it stats it, and refuses an untrusted one the same way."""
        dirs = [self.config.desired_dir]
        if self._awaiting_source():
            # Nothing applied yet (the first sync runs, or fails: source status).
            assert self.config.git is not None
            return [f"the git source {self.config.git.url} has no revision applied yet "
                    "(rbd-reconciler source status)"]
        if self.config.csi_dir.is_dir():  # the CSI adapter's files converge like the operator's
            dirs.append(self.config.csi_dir)
        problems = []
        for d in dirs:
            problems += desired_dir_problems(d, discover([d])[0] if files else [])
        if self.config.state_dir.is_dir():
            # Root's records, locks and mount points: whoever could change the
            # state dir could swap them (safety rule 6).
            problems += directory_problems(self.config.state_dir)
        return problems

    def run(self) -> int:
        # Waiting for the source's first revision is no reason not to start:
        # the source thread fetches it, the passes refuse until then.
        problems = [] if self._awaiting_source() else self.preflight()
        if problems:
            for p in problems:
                log.error("refusing to start: %s", p)
            return 1
        try:
            with state_lock(self.config):
                # Before any Ceph call: a freeze a dead run left hangs every
                # writer on it, and Ceph may not answer for a while.
                for line in thaw_recorded(self.config.state_dir):
                    log.warning("freeze: %s", line)
                become_subreaper()
                self.records = read_json(self.records_path, {}) or {}
                self.holds = holds.read(self.config.state_dir)
                # Early: a command typed while the first pass runs waits for it.
                try:
                    self.control = ControlServer(self.config.control_socket,
                                                 Commands(self).handle)
                    self.control.start()
                except (RuntimeError, OSError) as exc:
                    log.error("refusing to start: %s", exc)
                    return 1
                self.install_signals()
                self._watch()
                self._start_events()
                self._start_source()
                if self.config.metrics.listen:
                    try:
                        self.metrics.serve(self.config.metrics.listen)
                    except OSError as exc:  # a port in use is a config problem: say so
                        log.error("refusing to start: metrics.listen %s: %s",
                                  self.config.metrics.listen, exc)
                        return 1
                csi = self._start_csi()
                try:
                    rc = self._serve()
                finally:
                    if csi is not None:
                        csi.stop()
                    self.metrics.stop()
                    self.control.stop()
        except Busy as exc:
            log.error("%s", exc)
            return 1
        if self.abandoned:
            # A worker thread still stuck (in the kernel, or a Ceph call) would
            # hold the interpreter's exit past the stop deadline: exit now.
            logging.shutdown()
            os._exit(rc)
        return rc

    def _start_csi(self) -> Stoppable | None:
        endpoint = self.csi_endpoint or self.config.csi.endpoint
        if not endpoint:
            return None
        if self.serve_csi is None:
            log.error("CSI endpoint %s: no CSI server was given to this loop; not serving it",
                      endpoint)
            return None
        return self.serve_csi(self, endpoint)

    def _serve(self) -> int:
        """Passes run in their own thread; this one handles signals and pings the
        watchdog after a liveness check that never waits on Ceph (safety rule 10)."""
        worker = threading.Thread(target=self._loop, name="pass", daemon=True)
        worker.start()
        ping = sdnotify.watchdog_interval()
        rc = 0
        while not self.stopping.is_set():
            if not worker.is_alive():
                log.critical("the pass thread died; exiting")
                self.stopping.set()
                rc = 1
                break
            if ping is not None and self._alive():
                sdnotify.notify("WATCHDOG=1")
            self.stopping.wait(ping if ping is not None else 1.0)
        sdnotify.notify("STOPPING=1")
        deadline = time.monotonic() + self.config.timeouts.stop_seconds - STOP_RESERVE_S
        self._stop_chains(worker, deadline)
        if self.dirwatch is not None:
            self.dirwatch.stop(timeout=max(0.1, min(2.0, deadline + 1 - time.monotonic())))
        if self.events is not None:
            self.events.stop(timeout=max(0.1, min(2.0, deadline + 1 - time.monotonic())))
        if self.follower is not None:
            self.follower.stop(timeout=max(0.1, min(2.0, deadline + 1 - time.monotonic())))
        if self.claim_poll is not None:
            self.claim_poll.stop(timeout=max(0.1, min(2.0, deadline + 1 - time.monotonic())))
        reap_zombies()
        return rc

    def _stop_chains(self, worker: threading.Thread, deadline: float) -> None:
        """No new step starts; the steps in flight may run commands for the
        grace, then the commands still running are killed (their process
        groups) and their chains end. A chain still running at ``deadline``
        (stuck outside a command) is logged and abandoned: the exit does not
        wait for it."""
        self.halt.begin(self.config.timeouts.stop_grace_seconds)
        self.wake()
        worker.join(timeout=max(0.0, deadline - time.monotonic()))  # observe is bounded
        self.pool.shutdown(wait=False, cancel_futures=True)  # queued chains never start
        with self.lock:
            inflight = dict(self.inflight)
        _, pending = wait_futures(inflight.values(),
                                  timeout=max(0.0, deadline - time.monotonic()))
        with self.lock:
            cancelled = sorted(n for n, f in inflight.items() if f.cancelled())
        if cancelled:
            log.info("stop: not started: %s", ", ".join(cancelled))
        # What the command line waits for ends here, with what came.
        self.asks.stop("the daemon is stopping (SIGTERM): what it started ended or was "
                       "left as after a crash; the next start resumes")
        stuck = sorted(n for n, f in inflight.items() if f in pending)
        if stuck or worker.is_alive():
            self.abandoned = True
            log.error("stop: still running at the stop deadline, abandoned: %s%s; "
                      "commands: %s", ", ".join(stuck) or "(no chain)",
                      "; the pass thread" if worker.is_alive() else "",
                      "; ".join(self.halt.running()) or "none")

    def _alive(self) -> bool:
        """Liveness, for the watchdog: the pass thread is waiting, or inside a
        pass (bounded: observe has deadlines) for less than the stall limit."""
        since = self.busy_since
        limit = max(STALL_MIN_S, 3 * self.config.resync_seconds)
        return since is None or time.monotonic() - since < limit

    def _loop(self) -> None:
        self._pass()
        self._await_first_chains(READY_WAIT_S)
        sdnotify.notify("READY=1")
        next_resync = time.monotonic() + self.config.resync_seconds
        while not self.stopping.is_set():
            retry = self._next_retry()
            woke = self.wake_event.wait(max(0.0, min(next_resync, retry) - time.monotonic()))
            if self.stopping.is_set():
                break
            if woke and self.urgent.is_set():
                self.urgent.clear()
                self.wake_event.clear()
            elif woke:
                self._debounce()
            if self.reload_wanted.is_set():
                self._reload()
            now = time.monotonic()
            if now >= next_resync:
                self.mark_dirty(None, "resync")
                self.wake_event.clear()
                next_resync = now + self.config.resync_seconds
            if woke or now >= retry or self.dirty_all:
                self._pass()

    def _await_first_chains(self, limit: float) -> None:
        """READY=1 means the volumes were brought up: units ordered After= the
        daemon (applications, remote-fs.target) start at boot once the first
        pass's chains have ended (converged, failed or backing off), not while
        their volumes are still being mapped: an application started then
        writes into its empty publish directory, on the root filesystem,
        which the publish then hides (seen on a systemd node: the node tests).
        At most ``limit`` seconds, then READY=1 all the same, naming what
        still runs; a stop ends the wait at once."""
        with self.lock:
            pending = set(self.inflight.values())
            names = {id(f): n for n, f in self.inflight.items()}
        if not pending:
            return
        sdnotify.notify(f"STATUS=starting: bringing up {len(pending)} volume(s)")
        deadline = time.monotonic() + limit
        while pending and not self.stopping.is_set() and time.monotonic() < deadline:
            _, pending = wait_futures(pending, timeout=min(0.5, deadline - time.monotonic()))
        if pending and not self.stopping.is_set():
            log.warning("ready after %g s with volume(s) still converging: %s", limit,
                        ", ".join(sorted(names[id(f)] for f in pending)))

    def _next_retry(self) -> float:
        """When the next backoff ends that the last pass could not yet retry."""
        with self.lock:
            return min((b.until for b in self.backoff.values()
                        if b.until > self.last_pass_start), default=float("inf"))

    def _pass(self) -> None:
        self.busy_since = time.monotonic()
        try:
            self.reconcile()
        except Aborted as exc:  # SIGTERM: the pass's commands were refused
            log.info("pass cut short: %s", exc)
        except CannotWrite as exc:  # one line: the file and the cause are the news
            log.error("pass failed: %s", exc)
        except Exception:  # the daemon never dies of one pass (a file, a bug)
            log.exception("pass failed")
        finally:
            self.busy_since = None

    def _debounce(self) -> None:
        first = time.monotonic()
        self.wake_event.clear()
        while time.monotonic() - first < DEBOUNCE_MAX_S:
            if not self.wake_event.wait(DEBOUNCE_S):
                return
            self.wake_event.clear()
            if self.urgent.is_set():  # the command line waits: no more quiet time
                self.urgent.clear()
                return

    def _reload(self) -> None:
        self.reload_wanted.clear()
        try:
            config = load_config(self.config_path)
        except ConfigError as exc:
            log.error("reload refused, keeping the running config: %s", exc)
            return
        if config.control_socket != self.config.control_socket:
            log.warning("controlSocket %s: taken at the next start; serving %s until then",
                        config.control_socket, self.config.control_socket)
        self.config = config
        self.node = Node.from_config(config, halt=self.halt)
        log.info("config reloaded from %s", config.source or "built-in defaults")
        self._start_source()
        if self.follower is not None and config.git is None:
            self.follower.stop(timeout=1.0)
            self.follower = None
        elif self.follower is not None:
            self.follower.sync_now()
        self._watch()
        self.mark_dirty(None, "config reloaded")

    def _watch(self) -> None:
        """Watch what can change the desired files (daemon/dirwatch.py): the
        paths are resolved again every pass, so the watches follow a link
        swapped anywhere on the way (git-sync, a deploy keeping releases)."""
        if self.dirwatch is None:
            try:
                self.dirwatch = DirWatcher(self.wake, self._events_lost)
            except OSError as exc:  # no inotify left (fs.inotify.max_user_instances)
                log.warning("events: not watching the desired files (%s); they are looked "
                            "at every %g s", exc, self.config.resync_seconds)
                return
            self.dirwatch.start()
        self.dirwatch.watch(watch_plan([self.config.desired_dir], [self.config.csi_dir]))

    def _events_lost(self) -> None:
        """The kernel dropped file events (its queue overflowed): what changed
        is unknown, so the next pass looks at every volume."""
        self.mark_dirty(None, "file events lost (inotify queue overflow)")

    def _start_events(self) -> None:
        poll = self.config.events.image_poll_seconds
        self.events = EventHub(self.mark_dirty, self._image_sizes, poll,
                               io_watch=lambda: self.node.io_watch,
                               io_poll_seconds=self.config.events.io_poll_seconds)
        try:
            self.events.start()
        except OSError as exc:  # no /proc/self/mountinfo to poll: the resync still runs
            log.warning("events: not watching the node (%s); drift is repaired at the "
                        "resync, every %g s", exc, self.config.resync_seconds)
            self.events = None
        if self.config.events.claim_poll_seconds > 0:
            self.claim_poll = ClaimPoll(self._claim_moved, self._claim_holders,
                                        self.config.events.claim_poll_seconds)
            self.claim_poll.start()

    def _claim_holders(self, images: list[tuple[str, str]]) -> dict[tuple[str, str], str | None]:
        node = self.node  # the current one: a reload makes a new one
        return read_holders(node.config.ceph, node.config.observe_timeout_seconds,
                            node.ceph_session, images)

    def _claim_moved(self, names: Iterable[str], why: str) -> None:
        """The claim that refused these volumes is gone (or another node's
        now): what they were refused on no longer holds, so they are tried
        at once rather than when their backoff ends."""
        names = list(names)
        with self.lock:
            for name in names:
                self.backoff.pop(name, None)
        log.info("%s: %s; looking again", ", ".join(names), why)
        self.mark_dirty(names, why)

    def _start_source(self) -> None:
        """Follow the git source (docs/gitops-source.md) in a thread of its own."""
        if self.config.git is None or self.follower is not None:
            return
        self.follower = Follower(lambda: self.config, self.metrics, self.halt,
                                 lambda rev: self.mark_dirty(None, f"source applied {rev}"))
        self.follower.start()

    def _image_sizes(self, images: list[tuple[str, str]]) -> dict[tuple[str, str], int]:
        """Header reads (no open, no watch), bounded like observe's."""
        node = self.node
        view = observe_images(node.config.ceph, images, node.config.observe_timeout_seconds,
                              watchers_for=set(), session=node.ceph_session)
        return {key: img.size for key, img in view.images.items()}

    # -- one pass -------------------------------------------------------------
    def reconcile(self) -> None:
        with self.progress:
            self.passes_started += 1
        t0, result = time.monotonic(), "error"
        self.refusing = "its pass failed (the daemon's log says why)"
        self.pass_knew = PassKnew()
        try:
            result = "ok" if self._reconcile() else "refused"
        finally:
            # What the command line asked of this pass, if it never got to it.
            self.not_reconciling = None if result == "ok" else \
                f"the daemon is not reconciling: {self.refusing}"
            knew = self.pass_knew
            self.asks.pass_ended(self.passes_started, self.not_reconciling,
                                 current=knew.current, released=knew.released,
                                 frozen=knew.frozen)
            self.metrics.pass_done(time.monotonic() - t0, result)
            if self.config.metrics.textfile is not None:
                self.metrics.write_textfile(self.config.metrics.textfile)
            with self.progress:
                self.passes_done += 1
                self.progress_seq += 1
                self.progress.notify_all()

    def _reconcile(self) -> bool:
        """One pass; False when it refused to look (preflight, untrusted files)."""
        t0 = time.monotonic()
        self._watch()  # the link may point elsewhere now
        reap_zombies()
        self.source_revision = applied_revision(self.config)
        problems = self.preflight(files=False)
        if not problems and (why := distrust(self.config)) is not None:
            # The applied revision no longer verifies (a key revoked since):
            # its files are not acted on, and nothing is taken down either.
            problems = [f"the applied revision of the git source is held: {why}"]
        # Waiting for the source's first revision is expected at a first
        # start: said once, not as an error (source status says why if it lasts).
        self.conditions.update("preflight", [f"not reconciling: {p}" for p in problems],
                               level=logging.INFO if self._awaiting_source() else logging.ERROR)
        if problems:
            sdnotify.notify(f"STATUS=refusing: {problems[0]}")
            self.refusing = problems[0]
            return False
        loaded = load_desired(self.config, self.load_cache, self._settled)
        self.conditions.update("load", [str(d) for d in loaded.diagnostics])
        if loaded.refused:  # an untrusted file or directory: read nothing, touch nothing
            sdnotify.notify("STATUS=refusing: the desired directory is not trusted")
            self.refusing = "the desired directory is not trusted: " + "; ".join(
                str(d) for d in loaded.diagnostics)
            self.view.update(loaded)  # status says why
            return False
        current = {v.name: v for v in loaded.volumes}
        failed_files = sorted(str(f) for f in loaded.failed_files)
        frozen = set(loaded.frozen_names) | {
            n for n, r in self.records.items() if r["file"] in failed_files}
        self._retry_statuses()
        release, held = self._removals(current, frozen, failed_files,
                                       self.asks.allowance(self.passes_started))
        with self.lock:
            unrecorded = self.unrecorded & set(current)
            self.dirty |= unrecorded  # looked at again once it can be recorded
        self.pass_knew = PassKnew(set(current), {v.name for v in release}, frozen)
        # What the command line asked for: its volumes are looked at in this pass.
        self._answer_asks(loaded, current, frozen, release, held, unrecorded)
        # Released by hand through the daemon: kept down until `apply` names them.
        holding = [current[n] for n in sorted(self.holds) if n in current and n not in frozen]
        if gone := {n for n in self.holds if n not in current and n not in self.records}:
            self._save_holds(self.holds - gone)  # no longer managed: nothing to keep down

        wanted, why = self._take_dirty(current, release)
        for name in sorted(unrecorded):
            self._write_status(name, VolumeStatus(
                "Pending", reason="StateDirNotWritable",
                message=f"not converged: {self._state_line()}",
                observed_generation=current[name].spec_hash))
        # Those held back for their record are looked at too (status tells
        # what is there), but nothing is done to them.
        candidates = [v for v in [*current.values(), *release]
                      if v.name in wanted and self._due(v)]
        t_obs = time.monotonic()
        # Nothing to look at: nothing of the node is read (an idle pass).
        looked = look(candidates, self.config, self.node,
                      release=[v.name for v in [*release, *holding]])
        observed, plans = looked.observed, looked.plans
        t_obs = time.monotonic() - t_obs
        by_name = {v.name: v for v in candidates}
        self.view.update(loaded)
        self._update_interest(candidates, observed, current, plans)
        self.metrics.observed(plans, current.values(),
                              ceph_reachable(observed.pools_listed, observed.pool_errors))
        for name in sorted(frozen):
            self._write_status(name, VolumeStatus(
                "Frozen", reason="FileFailedToLoad",
                message="its file failed to load; left as it is"))
        for name, why in sorted(held.items()):
            self._write_status(name, VolumeStatus("Frozen", reason="RemovalHeld", message=why))
        busy = 0
        unknown: dict[str, str] = {}
        # Looked at again by the next pass, whatever wakes it: what they wait
        # on (Ceph answering, a source snapshot) comes with no event of ours.
        again = {vp.name for vp in plans if vp.unknown or vp.waiting}
        with self.lock:
            self.dirty |= again
        held_io: dict[str, str] = {}
        n = self.passes_started
        vanished, kept_down = {v.name for v in release}, {v.name for v in holding}
        for vp in plans:
            vol = by_name[vp.name]
            down: Down = ("vanished" if vol.name in vanished else
                          "held" if vol.name in kept_down else None)
            if vol.name in unrecorded:  # not recorded, not done (its status says so)
                self.asks.looked(n, vol.name, False, VolumeOutcome(
                    vol.name, status="failed", error=f"not converged: {self._state_line()}"))
                continue
            if vp.fenced or vp.stalled:
                # Never touched automatically, a release included: a fence
                # waits for `recover`, a stall for I/O to complete again.
                held_io[vol.name] = self._hold(vol, vp, observed)
                self.asks.looked(n, vol.name, False, without_steps(vp))
                continue
            if vp.unknown and down != "vanished":
                # Unknown is not absent: report it, act on nothing, look again.
                unknown[vol.name] = f"{vol.name}: unknown: {vp.unknown}"
                self._write_status(vol.name, VolumeStatus(
                    "Unknown", reason="CannotObserve", message=vp.unknown,
                    observed_generation=vol.spec_hash))
                self.asks.looked(n, vol.name, False, without_steps(vp))
                continue
            if not vp.steps and not vp.refused:
                self._converged(vol, vp, observed, down)
                self.asks.looked(n, vol.name, bool(vp.waiting), without_steps(vp))
                continue
            busy += 1
            self._submit(vol, vp, observed, down)
        # Volumes in backoff or in flight were not observed: they keep their state.
        still = {n: m for n, m in self.conditions.active("unknown").items()
                 if n in current and n not in by_name}
        self.conditions.update("unknown", {**still, **unknown}, level=logging.WARNING)
        held = {n: m for n, m in self.conditions.active("io").items()
                if n in current and n not in by_name}
        self.conditions.update("io", {**held, **held_io}, level=logging.WARNING)
        self.metrics.retain({*current, *frozen, *held, *(v.name for v in release)})
        self.metrics.frozen_files.set(len(failed_files))
        self.metrics.unknown.set(len(still) + len(unknown))
        self._state_condition()
        sdnotify.notify(f"STATUS={len(current)} volume(s), {busy} converging, "
                        f"{len(unknown)} unknown, {len(frozen)} frozen, "
                        f"{len(held)} removal(s) held")
        log.debug("pass %d: looked at %d volume(s): %s", self.passes_started, len(candidates),
                  "; ".join(why) or "nothing changed")
        log.info("pass %d: %d volume(s), %d observed, %d converging, %d unknown, %d frozen, "
                 "%d releasing, %d removal(s) held; observe and plan %.0f ms, pass %.0f ms",
                 self.passes_started, len(current), len(candidates), busy, len(unknown),
                 len(frozen),
                 len(release), len(held), t_obs * 1e3, (time.monotonic() - t0) * 1e3)
        return True

    def _hold(self, vol: Volume, vp: VolumePlan, observed: Observed) -> str:
        """Report a fenced or stalled volume (its status says what is known:
        the holder and the blocklist entries, or since when I/O is stuck) and
        leave it as it is; it is looked at again (a stall's end marks it)."""
        actual = actual_state(vol, observed, context(self.config, self.node))
        if vp.fenced:
            self._write_status(vol.name, VolumeStatus(
                "Fenced", reason=vp.fence_reason or "Fenced", message=vp.fenced,
                observed_generation=vol.spec_hash, fence=actual.get("fence")))
            return f"{vol.name}: fenced: {vp.fenced}"
        message = vp.stalled or ""
        if vp.unknown:
            message += f"; {vp.unknown}"
        stall = observed.stalled.get(str(actual.get("device")))
        self._write_status(vol.name, VolumeStatus(
            "Stalled", reason="IoStalled", message=message, observed_generation=vol.spec_hash,
            stalled=actual.get("stalled")), stall.since if stall else None)
        with self.lock:
            self.dirty.add(vol.name)  # Ceph answering again comes with no event of ours
        return f"{vol.name}: stalled: {vp.stalled}"

    def _take_dirty(self, current: dict[str, Volume], release: list[Volume]
                    ) -> tuple[set[str], list[str]]:
        """The names this pass looks at, and why; the dirty set starts afresh."""
        now = time.monotonic()
        with self.lock:
            every, names, why = self.dirty_all, self.dirty, self.dirty_why
            self.dirty, self.dirty_all, self.dirty_why = set(), False, []
            due = {n for n, b in self.backoff.items() if b.until <= now}
            self.last_pass_start = now
        changed = {n for n, v in current.items() if self.last_hash.get(n) != v.spec_hash}
        self.last_hash = {n: v.spec_hash for n, v in current.items()}
        if every:
            return set(current) | {v.name for v in release}, why
        if changed:
            why = [*why, f"{len(changed)} new or changed"]
        return names | changed | due | {v.name for v in release}, why

    def _update_interest(self, looked: list[Volume], observed: Observed,
                         current: dict[str, Volume], plans: list[VolumePlan]) -> None:
        """What the event sources and the claim poll map back to volumes, for
        the volumes this pass looked at; the others keep their entries."""
        helpers = self.node.fuse.helper_pids()
        for v in looked:
            self.interest[v.name] = volume_interest(v, observed, helpers)
        forget(self.interest, current)
        if self.events is not None:
            self.events.update(combine(self.interest))
        by_name = {v.name: v for v in looked}
        for vp in plans:
            v = by_name[vp.name]
            if vp.claimed_by is not None and v.name in current:
                key = (v.image.pool, v.image.name)
                self.claim_waits[v.name] = (key, Wait(v.name, vp.claimed_by,
                                                      self.passes_started))
            else:
                self.claim_waits.pop(vp.name, None)
        for name in [n for n in self.claim_waits if n not in current]:
            del self.claim_waits[name]
        if self.claim_poll is not None:
            self.claim_poll.update(dict(self.claim_waits.values()))

    def _settled(self, name: str, file: Path) -> frozenset[tuple[str, str]]:
        """What volume ``name`` claimed (kind, value) when it last loaded from
        ``file`` (its record): between CSI files, a clash with a claim that
        was already there freezes only the file that brought it."""
        rec = self.records.get(name)
        if rec is None or rec["file"] != str(file):
            return frozenset()
        return frozenset((kind, value) for kind, value, _ in
                         claims(volume_from_dict(rec["volume"])))

    def _removals(self, current: dict[str, Volume], frozen: set[str],
                  failed_files: list[str], asked: Allowance
                  ) -> tuple[list[Volume], dict[str, str]]:
        """Managed volumes whose files vanished: those to release now, and those
        held (name -> why). Records are updated to the current set. ``asked``:
        what allow-removal let go through the control socket (with the file's)."""
        vanished = sorted(set(self.records) - set(current) - frozen)
        with self.lock:
            for name in [n for n in vanished if forgettable(self.records[n], self.config)]:
                del self.records[name]  # the CSI adapter removed it on purpose
                vanished.remove(name)
        taken = allowance.take(self.config.state_dir)
        allowed = Allowance(taken.names | asked.names, taken.all or asked.all)
        held: dict[str, str] = {}
        removing: list[str] = []
        refused: dict[str, str] = {}  # keyed: a changed count is the same condition
        if vanished and failed_files:
            # A failed file may declare any of them (renamed and broken in one
            # change hides its names): while one fails, nothing is released
            # unless named by allow-removal (safety rule 3 holds across renames).
            more = f" (and {len(failed_files) - 1} more)" if len(failed_files) > 1 else ""
            why = f"removal held: {failed_files[0]}{more} fails to load"
            removing = [n for n in vanished if n in allowed.names]
            held = {n: why for n in vanished if n not in allowed.names}
        elif vanished:
            removing = [n for n in vanished if allowed.allows(n)]
            guarded = [n for n in vanished if not allowed.allows(n)]
            if guarded and self._mass_removal(len(guarded), len(current) + len(frozen)):
                refused["mass-removal"] = (
                    f"{len(guarded)} of {len(self.records)} managed volume(s) vanished in one "
                    f"pass; doing nothing to them (a checkout gone wrong?). To let them go: "
                    f"rbd-reconciler allow-removal --all (or NAME...)")
                sdnotify.notify(f"STATUS=mass removal refused: {len(guarded)} volume(s)")
            else:
                removing += guarded
        self.conditions.update("mass-removal", refused)
        self.conditions.update("held", sorted(set(held.values())))
        if allowed.names or allowed.all:
            log.info("allow-removal consumed: %s", ", ".join(sorted(allowed.names)) or "all")

        release: list[Volume] = []
        with self.lock:
            for name in removing:
                vol = volume_from_dict(self.records[name]["volume"])
                if (vol.on_remove or self.config.on_remove) == "keep":
                    log.info("%s: file removed; onRemove=keep leaves it as it is", name)
                    del self.records[name]
                    self._write_status(name, VolumeStatus("Released", reason="FileRemovedKept"))
                else:
                    release.append(vol)
            changed = bool(removing)
            for v in current.values():
                if self.recorded.get(v.name) == (v.spec_hash, v.source.file) \
                        and v.name in self.records:
                    continue  # recorded as it is: no conversion, no write
                rec = {"file": str(v.source.file), "volume": volume_to_dict(v)}
                self.recorded[v.name] = (v.spec_hash, v.source.file)
                if _same_record(self.records.get(v.name), rec):
                    continue  # on disk as it is (read at start-up)
                self.records[v.name] = rec
                self.unrecorded.add(v.name)
                changed = True
            if changed or self.unsaved_records:
                self._save_records()
        return release, held

    def _mass_removal(self, removing: int, present: int) -> bool:
        """``present``: managed volumes still declared, frozen ones included."""
        if self.allow_mass_removal:
            return False
        if present == 0:
            return True
        return removing > 1 and removing / max(1, len(self.records)) > \
            self.config.mass_removal_share

    def _due(self, v: Volume) -> bool:
        with self.lock:
            if v.name in self.inflight:
                return False
            b = self.backoff.get(v.name)
            if b is None:
                return True
            if b.spec_hash != v.spec_hash:  # a new spec deserves a try at once
                del self.backoff[v.name]
                return True
            return time.monotonic() >= b.until

    def _submit(self, vol: Volume, vp: VolumePlan, observed: object, down: Down) -> None:
        """``down``: "vanished" (its file is gone), "held" (released through
        the daemon, kept down), None (converged to its file)."""
        if self.halt.stopping:  # a pass that was under way at SIGTERM
            return
        if vp.refusal is None and not self.status_path(vol.name).exists():
            self._write_status(vol.name, VolumeStatus("Pending"))
        elif vol.state == "absent" and vp.refusal is None:
            self._write_status(vol.name, VolumeStatus("Deleting"))
        # Before the chain can end: its end is the answer of the asks counting
        # it (this chain: ``what``, a late end of the one before is not).
        purpose: Literal["converge", "release"] = "converge" if down is None else "release"
        what = Inflight(vol.spec_hash, purpose)
        self.asks.started(vol.name, what)
        self.asks.looked(self.passes_started, vol.name, False, None)
        with self.lock:
            fut = self.pool.submit(self._converge, vol, vp, observed, down, what)
            self.inflight[vol.name] = fut
            self.inflight_info[vol.name] = what

    def _converge(self, vol: Volume, vp: VolumePlan, observed: object, down: Down,
                  what: Inflight) -> None:
        log.info("%s: %d step(s) start", vol.name, len(vp.steps), extra={"volume": vol.name})
        crashed = False
        outcome = VolumeOutcome(vol.name, status="failed", error="the chain's thread failed")
        try:
            [outcome] = act([vp], {vol.name: vol}, observed, self.node,  # type: ignore[arg-type]
                            gate=self.gate)
        except Exception as exc:  # a driver bug must not kill the worker silently
            log.exception("%s: apply crashed", vol.name, extra={"volume": vol.name})
            outcome, crashed = VolumeOutcome(vol.name, status="failed", error=str(exc)), True
        try:
            self.metrics.outcome(vp, outcome, crashed)
            self._record_outcome(vol, vp, outcome, down)
        finally:  # whatever recording did: the asks counting it get their answer
            self.asks.finished(vol.name, outcome, what)

    def _record_outcome(self, vol: Volume, vp: VolumePlan, out: VolumeOutcome,
                        down: Down) -> None:
        if out.status == "aborted":
            self._record_aborted(vol, out)
            return
        released = down == "vanished"
        with self.lock:
            self.inflight.pop(vol.name, None)
            self.inflight_info.pop(vol.name, None)
            if out.status == "failed":
                prev = self.backoff.get(vol.name)
                n = (prev.failures + 1) if prev and prev.spec_hash == vol.spec_hash else 1
                delay = min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2 ** (n - 1))
                delay *= random.uniform(0.5, 1.0)  # jitter: failing volumes do not align
                self.backoff[vol.name] = Backoff(n, time.monotonic() + delay, vol.spec_hash)
                log.warning("%s: failed (%s); next try in %.0f s", vol.name, out.error, delay,
                            extra={"volume": vol.name, "result": "failed"})
            else:
                self.backoff.pop(vol.name, None)
                if released and vol.name in self.records:
                    del self.records[vol.name]
                    self._save_records()
                log.info("%s: %s", vol.name, out.status,
                         extra={"volume": vol.name, "result": out.status})
            if out.status != "failed":
                self.dirty.add(vol.name)  # the next pass confirms what the chain did
        # What no step fixes (a read-only filesystem, a covered publish) still
        # holds after the chain while the stage it concerns stays: the volume
        # is not what its phase would say (a CSI stage or publish waits on this).
        problems = vp.problems if (down is None and out.status != "failed" and vp.wanted
                                   is not None and vp.wanted >= Phase.STAGED) else {}
        phase = ("Released" if released or (down == "held" and out.status != "failed") else
                 "Failed" if out.status == "failed" else "Degraded" if problems else
                 PHASE_NAMES[vp.wanted.name] if vp.wanted is not None else "Pending")
        said = HELD if down == "held" and out.status != "failed" else (
            {"reason": next(iter(problems)), "message": "; ".join(problems.values())}
            if problems else {})
        self._write_status(vol.name, VolumeStatus(
            phase,
            **said,
            observed_generation=vol.spec_hash,
            last_result=out.status,
            last_error=out.error,
            refusal=vp.refused or (out.error if out.refused else None),
            notes=out.notes,
            undone=out.undone,
            steps=[s.as_dict() for s in out.steps],
            conditions=converged_conditions(problems, now_iso()) if problems else [
                {"type": "Converged", "status": out.status != "failed",
                 "reason": "Applied" if out.status != "failed" else "StepFailed",
                 "message": out.error or "", "lastTransitionTime": now_iso()}],
        ))
        self.wake()  # look again (a failed one when its backoff ends)

    def _record_aborted(self, vol: Volume, out: VolumeOutcome) -> None:
        """Cut short by SIGTERM: not a failure (no backoff, no alarm). What the
        chain acquired stays, as after a crash; the next start resumes."""
        with self.lock:
            self.inflight.pop(vol.name, None)
            self.inflight_info.pop(vol.name, None)
        left = [u.removesuffix(LEFT) for u in out.undone if u.endswith(LEFT)]
        log.warning("%s: stopped: %s%s", vol.name, out.error,
                    f"; not undone, for the next start: {', '.join(left)}" if left else "",
                    extra={"volume": vol.name, "result": "aborted"})
        self._write_status(vol.name, VolumeStatus(
            "Pending", reason="Interrupted",
            message=f"{out.error}; the next start resumes",
            observed_generation=vol.spec_hash, last_result="aborted",
            notes=out.notes, undone=out.undone,
            steps=[s.as_dict() for s in out.steps],
        ))

    def _converged(self, vol: Volume, vp: VolumePlan, observed: object, down: Down) -> None:
        with self.lock:
            self.backoff.pop(vol.name, None)
            if down == "vanished" and vol.name in self.records:
                del self.records[vol.name]
                self._save_records()
        problems = {} if down is not None else vp.problems
        actual = actual_state(vol, observed, context(self.config, self.node),  # type: ignore[arg-type]
                              problems)
        held = HELD if down == "held" else {}
        self._write_status(vol.name, VolumeStatus(
            # A clone whose source is still on its way is pending, not absent;
            # one with a problem no step can fix is not what it looks like.
            "Released" if down is not None else "Pending" if vp.waiting else
            "Degraded" if problems else PHASE_NAMES[vp.phase.name],
            reason=held.get("reason") or next(iter(problems), UNSET),
            message=held.get("message") or "; ".join(problems.values()) or UNSET,
            observed_generation=vol.spec_hash,
            notes=vp.notes,
            device=actual["device"], staging=actual["staging"],
            published=actual["published"], size=actual["size"],
            conditions=converged_conditions(problems, now_iso()),
        ))

    def _write_status(self, name: str, status: VolumeStatus,
                      stalled_since: float | None = None) -> None:
        data = status.to_json()
        if self.source_revision is not None:
            data["sourceRevision"] = self.source_revision
        self.metrics.set_phase(name, status.phase, stalled_since)
        key = tuple(data.get(k) for k in STATUS_KEYS)
        if "steps" not in data and self.written.get(name) == key:
            return  # unchanged since we wrote it: no read, no write
        path = self.status_path(name)
        old = read_json(path, {}) or {}
        merged = {**{k: v for k, v in old.items() if k in ("lastError",)}, **data,
                  "name": name, "updated": now_iso()}
        if all(old.get(k) == merged.get(k) for k in STATUS_KEYS) and "steps" not in data:
            self.written[name] = key
            self.unwritten.pop(name, None)
            return  # unchanged: spare the disk a write every resync
        if not self._write_status_file(name, merged):
            return
        self.written[name] = key
        with self.progress:
            self.progress_seq += 1
            self.progress.notify_all()

    def _write_status_file(self, name: str, content: dict[str, Any]) -> bool:
        """False: not on disk (kept, and written again by every pass until it is)."""
        try:
            write_json(self.status_path(name), content)
        except OSError as exc:
            self.unwritten[name] = content
            self._state_write_failed(exc)
            return False
        self.unwritten.pop(name, None)
        return True

    def _retry_statuses(self) -> None:
        for name, content in sorted(self.unwritten.items()):
            if self._write_status_file(name, {**content, "updated": now_iso()}):
                with self.progress:
                    self.progress_seq += 1
                    self.progress.notify_all()

    def _save_records(self) -> bool:
        """False: managed.json is behind (each pass tries again); the volumes
        whose record it lacks are held back until it is written."""
        if self.records_file.path != self.records_path:  # a reload moved stateDir
            self.records_file = RecordsFile(self.records_path)
        try:
            self.records_file.save(self.records)
        except OSError as exc:
            self.unsaved_records = True
            self._state_write_failed(exc)
            return False
        self.unsaved_records = False
        self.unrecorded.clear()
        return True

    def _state_write_failed(self, exc: OSError) -> None:
        if self.state_error is None:  # the first of the episode says why
            self.state_error = str(exc) if isinstance(exc, CannotWrite) else (
                f"cannot write {exc.filename or self.config.state_dir}: "
                f"{exc.strerror or exc}")

    def _state_line(self) -> str:
        return (f"stateDir {self.config.state_dir} cannot be written ({self.state_error}): "
                "new and changed volumes wait, not converged, until it can; what is up "
                "stays up")

    def _state_condition(self) -> None:
        """Logged once when it starts (one line: the directory and the cause),
        and when it ends; rbd_reconciler_state_dir_writable says it meanwhile."""
        failing = self.state_failing
        self.conditions.update("state", {"state": self._state_line()} if failing else {})
        if not failing:
            self.state_error = None


def _same_record(old: object, new: dict[str, Any]) -> bool:
    """``new`` is what ``old`` (read from managed.json) already says."""
    return old == json.loads(json.dumps(new))
