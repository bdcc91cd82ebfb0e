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

This module is the glue: the ``Daemon`` (imported by cli/run.py, and the
tests) starts and stops everything, and is what the CSI adapter
(``engine.Served``) and the command line (daemon/commands.py ``Running``)
are given. Its rooms: daemon/loop.py (when a pass runs; READY=1 through
daemon/readiness.py), daemon/passes.py (one pass), daemon/chains.py (the
chains and what comes of them, worded by daemon/outcomes.py),
daemon/watchers.py (what says when to look), plan/removals.py (the removal
policy) and state/statusfiles.py (the status files and managed.json).
"""

from __future__ import annotations

import dataclasses
import faulthandler
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from pathlib import Path
from typing import Any

from reconciler.daemon import sdnotify
from reconciler.daemon.asks import Asks, Inflight
from reconciler.daemon.chains import Chains
from reconciler.daemon.claimpoll import ClaimPoll, Wait
from reconciler.daemon.commands import Commands
from reconciler.daemon.conditions import Conditions
from reconciler.daemon.control import ControlServer
from reconciler.daemon.dirwatch import DirWatcher
from reconciler.daemon.events import EventHub
from reconciler.daemon.follow import Follower
from reconciler.daemon.interest import VolumeInterest
from reconciler.daemon.liveview import LiveView
from reconciler.daemon.loop import PassLoop
from reconciler.daemon.metrics import Metrics
from reconciler.daemon.passes import Passes, PassKnew
from reconciler.daemon.watchers import Watchers
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
    look,
    state_lock,
)
from reconciler.facts.clock import now_iso
from reconciler.observe.node import Node
from reconciler.spec.config import Config, ConfigError, load_config
from reconciler.spec.loader import LoadCache, LoadResult
from reconciler.spec.reading import discover
from reconciler.spec.security import desired_dir_problems, directory_problems
from reconciler.state import holds
from reconciler.state.files import CannotWrite, read_json
from reconciler.state.status import VolumeStatus
from reconciler.state.statusfiles import StatusFiles

log = logging.getLogger("rbd-reconciler")

# A pass (load, bounded observe, plan) stuck longer than this is a bug or a
# hang the deadlines missed: stop pinging the watchdog so systemd restarts us.
STALL_MIN_S = 120.0
# Of timeouts.stopSeconds, kept for what follows the wait for the chains
# (the CSI server's own grace, the file watcher, the log lines).
STOP_RESERVE_S = 3.0


class Daemon(Passes, Chains, Watchers):
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
        self.stopping = threading.Event()
        self.reload_wanted = threading.Event()
        self.lock = threading.Lock()  # records, in-flight set, backoff
        self.inflight: dict[str, Future[None]] = {}
        self.records: dict[str, dict] = {}
        self.recorded: dict[str, tuple[str, Path]] = {}  # name -> what its record holds
        # Status files and managed.json, and what is not on disk yet.
        self.files = StatusFiles(lambda: self.config.state_dir, now_iso)
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
        self.gate: Gate | None = None  # the CSI adapter's say over its files, per step
        self.passes_started = 0  # passes run one after another: started - done <= 1
        self.passes_done = 0
        self.progress = threading.Condition()  # notified: pass finished, status written
        self.progress_seq = 0  # bumped with every notify: a waiter never misses one
        # When the next pass runs and what it looks at (daemon/loop.py).
        self.loop = PassLoop(self.lock)
        self.interest: dict[str, VolumeInterest] = {}
        self.events: EventHub | None = None
        self.follower: Follower | None = None  # the GitOps source (config.git)
        self.source_revision: str | None = None  # what the desired files came from
        # Volumes refused by another node's claim, and the claim they wait
        # on (daemon/claimpoll.py): name -> ((pool, image), what the pass saw).
        self.claim_waits: dict[str, tuple[tuple[str, str], Wait]] = {}
        self.claim_poll: ClaimPoll | None = None
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
        self.metrics.in_backoff.set_function(lambda: len(self.loop.backoff))
        self.metrics.state_writable.set_function(lambda: 0 if self.files.failing else 1)
        self.metrics.resync.set_function(lambda: self.config.resync_seconds)  # follows SIGHUP

    # -- hooks for the CSI adapter -------------------------------------------
    def wake_volume(self, name: str) -> None:
        """A pass at once, without the debounce, that tries ``name`` even if it
        is backing off: a CSI call (maybe the CO's retry) is waiting on it."""
        self.loop.wake_volume(name)

    def set_gate(self, gate: Gate | None) -> None:
        self.gate = gate

    @property
    def ready(self) -> bool:
        return self.passes_done > 0

    # -- hooks for the command line (daemon/commands.py) ----------------------
    def look_again(self, names: set[str] | None, why: str) -> None:
        """A pass at once over ``names`` (None: every volume), backoff
        forgotten, no debounce: the command line waits on it."""
        self.loop.look_again(names, why)

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

    def status(self, name: str) -> dict:
        return self.files.read(name)

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
            self.loop.wake()

        def reload(_signum: int, _frame: object) -> None:
            self.reload_wanted.set()
            self.loop.wake()

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
                self.records = read_json(self.files.records_path, {}) or {}
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
        self.loop.wake()
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
        def inflight() -> dict[str, Future[None]]:
            with self.lock:
                return dict(self.inflight)
        self.loop.run(self._pass, inflight, lambda: self.config.resync_seconds,
                      self.stopping, self.reload_wanted, self._reload)

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
        self.loop.mark_dirty(None, "config reloaded")

    def _write_status(self, name: str, status: VolumeStatus,
                      stalled_since: float | None = None) -> None:
        data = status.to_json()
        if self.source_revision is not None:
            data["sourceRevision"] = self.source_revision
        self.metrics.set_phase(name, status.phase, stalled_since)
        if self.files.write(name, data):
            self._progressed()

    def _progressed(self) -> None:
        """A status was written: whoever waits on one looks again."""
        with self.progress:
            self.progress_seq += 1
            self.progress.notify_all()

    def _retry_statuses(self) -> None:
        if self.files.retry():
            self._progressed()

    def _save_records(self) -> bool:
        return self.files.save_records(self.records)

    def _state_line(self) -> str:
        return self.files.line()

    def _state_condition(self) -> None:
        """Logged once when it starts (one line: the directory and the cause),
        and when it ends; rbd_reconciler_state_dir_writable says it meanwhile."""
        self.conditions.update("state", self.files.episode())
