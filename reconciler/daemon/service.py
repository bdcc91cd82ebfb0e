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
tests) builds the rooms, gives each what it uses, starts and stops
everything, and is what the CSI adapter (``engine.Served``) and the command
line (daemon/commands.py ``Running``) are given. Its rooms, each an object
of its own: daemon/loop.py ``PassLoop`` (when a pass runs; READY=1 through
daemon/readiness.py), daemon/passes.py ``Passes`` (one pass; the removal
policy is plan/removals.py's), daemon/chains.py ``Chains`` (the chains and
what comes of them, worded by daemon/outcomes.py), daemon/watchers.py
``Watchers`` (what says when to look), daemon/progress.py (the passes
begun and ended, the statuses written) and state/statusfiles.py (the status
files and managed.json).
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
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from pathlib import Path
from typing import Any

from reconciler.daemon import sdnotify
from reconciler.daemon.asks import Asks, Inflight
from reconciler.daemon.chains import Chains
from reconciler.daemon.commands import Commands
from reconciler.daemon.conditions import Conditions
from reconciler.daemon.control import ControlServer
from reconciler.daemon.liveview import LiveView
from reconciler.daemon.loop import PassLoop
from reconciler.daemon.metrics import Metrics
from reconciler.daemon.passes import Passes, awaiting_source, preflight
from reconciler.daemon.progress import Progress, Statuses
from reconciler.daemon.rollout import Rollouts
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
from reconciler.observe.ceph import observe_images
from reconciler.observe.node import Node
from reconciler.spec.config import Config, ConfigError, load_config
from reconciler.spec.loader import LoadResult
from reconciler.spec.model import volume_from_dict
from reconciler.state.files import CannotWrite, read_json
from reconciler.state.statusfiles import StatusFiles

log = logging.getLogger("rbd-reconciler")

# A pass (load, bounded observe, plan) stuck longer than this is a bug or a
# hang the deadlines missed: stop pinging the watchdog so systemd restarts us.
STALL_MIN_S = 120.0
# Of timeouts.stopSeconds, kept for what follows the wait for the chains
# (the CSI server's own grace, the file watcher, the log lines).
STOP_RESERVE_S = 3.0


class Daemon:
    def __init__(self, config: Config, config_path: Path | None,
                 allow_mass_removal: bool = False, csi_endpoint: str | None = None,
                 serve_csi: FrontDoor | None = None) -> None:
        self.config = config
        self.config_path = config_path
        # Set at SIGTERM: commands refused and killed after the grace (every
        # Node built here shares it: a reload leaves chains on the old one).
        self.halt = Halt()
        self.node = Node.from_config(config, halt=self.halt)
        self.abandoned = False  # a chain outlived the stop deadline: exit hard
        self.stopping = threading.Event()
        self.reload_wanted = threading.Event()
        self.lock = threading.Lock()  # records, in-flight set, backoff
        # managed.json's records, shared by the passes and the chains.
        self.records: dict[str, dict] = {}
        # Status files and managed.json, and what is not on disk yet.
        self.files = StatusFiles(lambda: self.config.state_dir, now_iso)
        self.pool = ThreadPoolExecutor(max_workers=config.parallel,
                                       thread_name_prefix="volume")
        self.conditions = Conditions(log)
        self.busy_since: float | None = None  # the pass thread is inside a pass
        # Hooks for the CSI adapter (reconciler/csi): a wake that skips the
        # debounce, and counts of passes begun and finished it can wait on.
        self.csi_endpoint = csi_endpoint
        self.serve_csi = serve_csi
        self.progress = Progress()
        # When the next pass runs and what it looks at (daemon/loop.py).
        self.loop = PassLoop(self.lock)
        # The command line's way in (daemon/control.py): what it asks of the
        # passes, and what they saw.
        self.control: ControlServer | None = None
        self.asks = Asks(self.look_again, self.first_pass_after_now)
        self.view = LiveView(self._look_for_view)
        self.metrics = Metrics()
        self.metrics.in_backoff.set_function(lambda: len(self.loop.backoff))
        self.metrics.state_writable.set_function(lambda: 0 if self.files.failing else 1)
        self.metrics.resync.set_function(lambda: self.config.resync_seconds)  # follows SIGHUP
        self.statuses = Statuses(self.files, self.metrics, self.progress)

        # The rooms, given what each uses; the config and the Node as they are
        # at each use (a reload replaces both).
        def current_config() -> Config:
            return self.config

        def current_node() -> Node:
            return self.node

        # A fleet's gate and this node's report to it (source.fleet).
        self.rollout = Rollouts(current_config, self.metrics,
                                session=lambda: current_node().ceph_session)
        self.statuses.listeners.append(self.rollout.status_written)
        self.watchers = Watchers(current_config, current_node, self.halt, self.loop,
                                 self.metrics, self.rollout)
        self.chains = Chains(current_config, current_node, self.halt, self.lock, self.loop,
                             self.pool, self.records, self.files, self.statuses, self.asks,
                             self.metrics)
        self.passes = Passes(current_config, current_node, self.lock, self.loop, self.progress,
                             self.records, self.files, self.statuses, self.chains,
                             self.watchers, self.asks, self.view, self.conditions,
                             self.metrics, allow_mass_removal)
        # READY=1 does not wait for a first chain whose pool stopped answering.
        self.loop.first_chains.probe = self._probe_first_chains

    # -- hooks for the CSI adapter -------------------------------------------
    def wake_volume(self, name: str) -> None:
        """A pass at once, without the debounce, that tries ``name`` even if it
        is backing off: a CSI call (maybe the CO's retry) is waiting on it."""
        self.loop.wake_volume(name)

    def set_gate(self, gate: Gate | None) -> None:
        self.chains.set_gate(gate)

    @property
    def ready(self) -> bool:
        return self.progress.done > 0

    # -- hooks for the command line (daemon/commands.py) ----------------------
    def look_again(self, names: set[str] | None, why: str) -> None:
        """A pass at once over ``names`` (None: every volume), backoff
        forgotten, no debounce: the command line waits on it."""
        self.loop.look_again(names, why)

    def first_pass_after_now(self) -> int:
        """The number of the first pass that begins after this call."""
        return self.progress.first_pass_after_now()

    def wait_pass(self, number: int, deadline: float) -> bool:
        """Wait until pass ``number`` has ended; False at ``deadline``, or
        when the daemon stops first."""
        return self.progress.wait_pass(number, deadline, self.stopping)

    @property
    def passes_done(self) -> int:
        return self.progress.done

    @property
    def not_reconciling(self) -> str | None:
        """Why the last pass refused to look; None: it looked."""
        return self.passes.not_reconciling

    @property
    def inflight_info(self) -> dict[str, Inflight]:
        """What each chain in flight is for (read under ``lock``)."""
        return self.chains.inflight_info

    def unreserve(self, name: str) -> None:
        """A job of the command line is done (daemon/chains.py)."""
        self.chains.unreserve(name)

    def _look_for_view(self, loaded: LoadResult, names: frozenset[str] | None,
                       all_watchers: bool) -> Pass:
        """A look for status, plan or explain (daemon/liveview.py), made as the
        command alone makes it, through this daemon's Node: its Ceph
        connection, probe cache and I/O history. What ``release`` holds down
        is planned released, as the passes plan it (what the daemon does)."""
        held = self.passes.held()
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
        # A pass under way now may have read the node before the change
        # the caller waits for: only one that begins after this point counts.
        first = self.progress.first_pass_after_now()
        self.wake_volume(name)
        while True:
            seq, passes = self.progress.seen()
            if passes >= first and not self.chains.busy(name):
                status = self.status(name)
                if covers(status):
                    return "covered", status
            left = deadline - time.monotonic()
            if left <= 0:
                return "deadline", {}
            if self.stopping.is_set():
                return "stopping", {}
            self.progress.wait_change(seq, min(left, 1.0))

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

    def run(self) -> int:
        # Waiting for the source's first revision is no reason not to start:
        # the source thread fetches it, the passes refuse until then.
        problems = [] if awaiting_source(self.config) else preflight(self.config)
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
                # The dict the passes and the chains were given, filled.
                self.records.update(read_json(self.files.records_path, {}) or {})
                self.passes.read_holds()
                # Early: a command typed while the first pass runs waits for it.
                try:
                    self.control = ControlServer(self.config.control_socket,
                                                 Commands(self).handle)
                    self.control.start()
                except (RuntimeError, OSError) as exc:
                    log.error("refusing to start: %s", exc)
                    return 1
                self.install_signals()
                self.watchers.watch()
                self.watchers.start_events()
                self.watchers.start_source()
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
        self.watchers.stop(deadline)
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
        inflight = self.chains.in_flight()
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
        self.loop.run(self._pass, self.chains.in_flight, lambda: self.config.resync_seconds,
                      self.stopping, self.reload_wanted, self._reload)

    def _probe_first_chains(self, names: list[str]) -> dict[str, str]:
        """For READY=1 (daemon/readiness.py, its own thread): of the volumes
        whose first chain still runs, those whose pool or image does not
        answer within observeTimeoutSeconds (name -> why). Their images
        only, read from their header, each pool and image bounded."""
        config, node = self.config, self.node
        images: dict[str, tuple[str, str]] = {}
        with self.lock:  # read as a whole, as a pass may change the records
            for n in names:
                if n not in self.records:
                    continue
                try:  # one record that does not load stops no other's probe
                    v = volume_from_dict(self.records[n]["volume"])
                except (AttributeError, KeyError, TypeError, ValueError) as exc:
                    log.warning("readiness: the record of %s does not load: %s", n, exc)
                    continue
                if v.image.pool:
                    images[n] = (v.image.pool, v.image.name)
        if not images:
            return {}
        timeout = config.observe_timeout_seconds
        view = observe_images(config.ceph, set(images.values()), timeout, set(),
                              node.ceph_session)
        out = {}
        for name, (pool, image) in images.items():
            if pool in view.errors:
                out[name] = (f"pool {pool!r} did not answer within {timeout:g} s "
                             f"({view.errors[pool]})")
            elif (pool, image) in view.image_errors:
                out[name] = (f"image {pool}/{image} did not answer within {timeout:g} s "
                             f"({view.image_errors[(pool, image)]})")
        return out

    def _pass(self) -> None:
        self.busy_since = time.monotonic()
        try:
            self.passes.reconcile()
            self.rollout.pass_ended(self.statuses.source_revision, self.view.loaded,
                                    self.passes.not_reconciling)
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
        self.watchers.reloaded()
        self.loop.mark_dirty(None, "config reloaded")
