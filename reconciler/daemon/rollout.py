"""The daemon's part in a fleet's rollout (issue 40; node config
``source.fleet``): the gate the source's sync asks before it applies a
revision of a rollout, and this node's report to the fleet.

The gate (``Rollouts.gate``, given to the Syncer by daemon/follow.py) reads
every node's report (drivers/fleetstore.py ``read_all``: only when there is
a revision to gate), keeps a ``Sighting`` of each on this node's monotonic
clock (plan/rollout.py ``sight``), and asks ``plan.rollout.decide`` with
this node's own hold; its decision is worded into the source's
``GateAnswer``. Reports it cannot read: Waiting (never Apply on no news).

The report (``Report``, facts/fleetreport.py) is written by a thread of its
own: whenever what it says changed (a sync, a pass, a volume's status) and
at least every ``source.intervalSeconds`` (so readers see the counter move;
idle: one write per interval, no read). Its counter grows with every report
made, is kept in ``<stateDir>/fleet-report.json`` (0600), and after a
restart starts above both that and the report in Ceph (``read_one``). A
write that fails (Ceph unreachable) is kept, the newest one only, and
written again every few seconds until Ceph answers: a report is never lost.

``fleet status`` asked of the daemon (``Rollouts.fleet_view``, from
daemon/commands.py) reads every report too, into the same sightings.

Built by daemon/service.py, which feeds it the statuses written
(daemon/progress.py) and the end of each pass.

Imported by daemon/ (4 modules).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from reconciler.daemon.fleethealth import health_of
from reconciler.daemon.metrics import Metrics
from reconciler.drivers.fleetstore import FleetStore, FleetUnavailable, Lent
from reconciler.engine.fleet import in_fleet, problems_of, summary_of
from reconciler.facts.clock import now_iso
from reconciler.facts.fleetreport import MAX_COUNTER, WAVE_NAME, Report, clip
from reconciler.observe.ceph import Session
from reconciler.plan.fleetstatus import document
from reconciler.plan.rollout import (
    Decision,
    Halted,
    Held,
    OutsideWindow,
    Sighting,
    Waiting,
    decide,
    describe,
    sight,
)
from reconciler.source.gating import GateAnswer, hold_of
from reconciler.source.layout import Layout
from reconciler.source.report import revision
from reconciler.spec.config import Config
from reconciler.spec.fleet import Rollout
from reconciler.spec.loader import LoadResult
from reconciler.state.files import read_json, write_json

log = logging.getLogger("rbd-reconciler")

COUNTER_FILE = "fleet-report.json"
INCOMPLETE = GateAnswer("Waiting", "not every report was read (too many objects where the "
                                   "reports are): waits until they are", {"waitingFor": []})
LOGGED_PROBLEMS = 5  # lines of a read's problems in the journal, and one more counting them
RETRY_S = 5.0  # a report not written yet is tried again this often (at most the interval)
SETTLE_S = 0.2  # wake-ups this close together make one report


@dataclass(frozen=True)
class Said:
    """What a report says, but its counter and time: a change is news."""

    applied: str | None
    health: str
    wave: str | None = None
    failed_volume: str | None = None
    failed_reason: str | None = None
    held_back: str | None = None
    held_back_why: str | None = None
    held: bool = False
    hold_reason: str | None = None
    phases: tuple[tuple[str, int], ...] = ()


def said_of(config: Config, looked: tuple[str | None, dict[str, str | None], str | None] | None,
            statuses: Mapping[str, Mapping[str, Any]]) -> Said:
    """This node's report, from its source's state and the last pass.
    ``looked``: (the revision the last pass applied, its volumes' spec
    hashes, why it refused to look)."""
    assert config.git is not None
    layout = Layout(config.source_dir)
    state, applied = layout.read_state(), layout.applied()
    commit = applied["commit"] if applied is not None else None
    rev = revision(config.git, commit)
    if looked is None or looked[0] != rev:
        health = health_of(rev, {}, {}, refusing="no pass under this revision yet")
    else:
        health = health_of(rev, looked[1], statuses, looked[2])
    meta = (applied or {}).get("fleet")
    wave = meta.get("wave") if isinstance(meta, dict) else None
    back = state.get("heldBack") if isinstance(state.get("heldBack"), dict) else {}
    back_commit = back.get("commit") if back.get("commit") != commit else None
    why = f"{back.get('state')}: {back.get('message')}" if back_commit else None
    hold = hold_of(state)
    return Said(
        applied=commit, health=health.health,
        wave=wave if isinstance(wave, str) and WAVE_NAME.fullmatch(wave) else None,
        failed_volume=health.failed_volume, failed_reason=health.failed_reason,
        held_back=back_commit if isinstance(back_commit, str) else None,
        held_back_why=clip(why) if isinstance(back_commit, str) and why else None,
        held=hold is not None, hold_reason=clip(hold) if hold is not None else None,
        phases=health.phases)


def answer_of(decision: Decision) -> GateAnswer:
    """plan/rollout.py's decision, as the source's sync takes it."""
    details: dict[str, Any] = {}
    match decision:
        case Waiting(wave=wave, waiting_for=nodes):
            details = {"wave": wave, "waitingFor": [
                {"node": w.node, "why": w.why, "detail": w.detail} for w in nodes]}
        case OutsideWindow(next_opening=at):
            details = {"nextOpening": at.isoformat() if at is not None else None}
        case Halted(node=node, volume=volume, reason=reason):
            details = {"halted": {"node": node, "volume": volume, "reason": reason}}
        case Held(reason=reason):
            details = {"hold": reason}
    return GateAnswer(decision.state, describe(decision), details)


class Rollouts:
    def __init__(self, config: Callable[[], Config], metrics: Metrics,
                 store: Callable[[Config], FleetStore] | None = None,
                 session: Callable[[], Session] | None = None,
                 mono: Callable[[], float] = time.monotonic,
                 wall: Callable[[], datetime] = lambda: datetime.now(UTC)) -> None:
        self.config = config  # the current one (SIGHUP may replace it)
        self.metrics = metrics
        # The daemon's kept Ceph connection, lent to the store for each call
        # (fleetstore.py: a second idle connection costs CPU every minute).
        self._make_store = store or (lambda c: _store(c, session))
        self._store: tuple[tuple[Any, ...], FleetStore] | None = None
        self._store_lock = threading.Lock()  # the gate's thread and the report's
        self.mono, self.wall = mono, wall
        self.lock = threading.Lock()  # what the pass, the chains and the source tell it
        # The gate's (the source thread), and fleet_view's (a control connection):
        # each replaces the dict whole, under self.lock (neither loses the other's).
        self.sightings: dict[str, Sighting] = {}
        self.first_read: float | None = None  # fleet_view's first (monotonic)
        self.answered: tuple[str, str, str] | None = None  # the gate's last answer (logged)
        self.statuses: dict[str, dict[str, Any]] = {}  # volume -> its last status
        # The last pass: its revision, its volumes' spec hashes, why it refused.
        self.looked: tuple[str | None, dict[str, str | None], str | None] | None = None
        # The report thread's own: the counter, the last written, the one waiting.
        self.counter = 0
        self.counter_known = False  # read back from Ceph since the start
        self.written: Said | None = None
        self.written_mono = float("-inf")
        self.pending: tuple[Said, Report] | None = None  # not written yet: the newest
        self.unreachable: str | None = None  # why the last write failed (logged once)
        self.problems: tuple[str, ...] = ()  # the last read's unreadable reports (logged once)
        self.wake = threading.Event()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="fleet", daemon=True)

    # -- what the daemon tells it -------------------------------------------------
    def status_written(self, name: str, data: Mapping[str, Any]) -> None:
        with self.lock:
            self.statuses[name] = dict(data)
        self.wake.set()

    def pass_ended(self, rev: str | None, loaded: LoadResult | None,
                   refusing: str | None) -> None:
        """A pass ended: the revision it applied, what it loaded from it (the
        volumes whose files are in desiredDir), why it refused to look."""
        desired = self.config().desired_dir
        specs: dict[str, str | None] = {}
        if loaded is not None:
            for path, frozen in loaded.frozen_in.items():
                if _inside(path, desired):
                    specs.update(dict.fromkeys(frozen))
            specs.update((v.name, v.spec_hash) for v in loaded.volumes
                         if _inside(v.source.file, desired))
        with self.lock:
            self.looked = (rev, specs, refusing)
        self.wake.set()

    def synced(self) -> None:
        self.wake.set()

    # -- the gate (the source's thread) ---------------------------------------------
    def gate(self, commit: str, rollout: Rollout) -> GateAnswer:
        config = self.config()
        hold = hold_of(Layout(config.source_dir).read_state())
        try:
            read = self.store(config).read_all()
        except FleetUnavailable as exc:
            answer = GateAnswer("Waiting", f"cannot read the fleet's reports ({exc}): waits "
                                           "until Ceph answers", {"waitingFor": []})
        else:
            with self.lock:  # fleet_view sights into the same map from a control thread
                now = self.mono()
                self.sightings = {node: sight(self.sightings.get(node), report, now)
                                  for node, report in read.reports.items()}
                seen = self.sightings
            if read.problems != self.problems:  # a few lines: junk renamed each sync
                for problem in read.problems[:LOGGED_PROBLEMS]:  # must not flood the journal
                    log.warning("fleet: a report is not read: %s", problem)
                if len(read.problems) > LOGGED_PROBLEMS:
                    log.warning("fleet: %d objects not read as reports in all (`fleet "
                                "status` lists them)", len(read.problems))
                self.problems = read.problems
            answer = answer_of(decide(rollout, config.node_name, commit, seen,
                                      hold, now, self.wall()))
            if not read.complete and answer.applies:  # an unseen node of a glob wave is
                answer = INCOMPLETE                    # not counted at all: never on this
        # The same wait worded anew ("healthy for only 12s") is no news.
        said = (commit, answer.state, str([(w["node"], w["why"]) for w in
                                           answer.details.get("waitingFor", ())]))
        if not answer.applies and said != self.answered:  # one line per change, not per sync
            log.info("fleet: %s not applied yet: %s", commit[:12], answer.message)
        self.answered = said
        return answer

    def store(self, config: Config) -> FleetStore:
        assert config.git is not None and config.git.fleet is not None
        key = (config.ceph, config.git.fleet)
        with self._store_lock:  # never self.lock: a close may wait for a call under way
            if self._store is None or self._store[0] != key:
                if self._store is not None:  # a reload changed where reports are
                    self._store[1].close()
                self._store = (key, self._make_store(config))
            return self._store[1]

    # -- fleet status (a control connection's thread) -------------------------------
    def fleet_view(self) -> dict[str, object]:
        """``fleet status`` as this daemon sees the fleet (daemon/commands.py):
        every report read now, on the caller's thread (never the loop's; the
        store's timeout bounds it), and sighted into the gate's sightings, so
        a node's healthy time and a report's age count on this node's clock
        from this daemon's first read, as its gate counts them.
        NotInFleet, FleetUnavailable."""
        config = self.config()
        in_fleet(config)
        read = self.store(config).read_all()
        with self.lock:  # two connections at once: one sighting each, in turn
            now = self.mono()
            old = self.sightings
            self.sightings = seen = {node: sight(old.get(node), report, now)
                                     for node, report in read.reports.items()}
            # Read since the first of these reads, or the gate's earliest sighting kept.
            first = min([now if self.first_read is None else self.first_read]
                        + [s.first_seen_mono for s in old.values()])
            self.first_read = first
        return document(summary_of(config, seen, now, observed_for=now - first,
                                   problems=problems_of(read)))

    # -- the report (its thread) ----------------------------------------------------
    def start(self) -> None:
        if self.thread.ident is None and not self.stopping.is_set():
            self.thread.start()

    def stop(self, timeout: float) -> None:
        self.stopping.set()
        self.wake.set()
        if self.thread.is_alive():
            self.thread.join(timeout)
        if self._store is not None and not self.thread.is_alive():
            self._store[1].close()  # the source thread has stopped before (watchers.py)

    def _loop(self) -> None:
        while not self.stopping.is_set():
            wait = 60.0
            try:
                wait = self.tick()
            except Exception:  # the daemon never dies of a report (a bug): say it, go on
                log.exception("fleet: the report failed")
            self.wake.wait(wait)
            self.wake.clear()
            self.stopping.wait(SETTLE_S)

    def tick(self) -> float:
        """Write this node's report if it is due; the time until the next look."""
        config = self.config()
        src = config.git
        if src is None or src.fleet is None:
            self.metrics.set_rollout(None, None)
            return 60.0
        with self.lock:
            said = said_of(config, self.looked, self.statuses)
        self._metric(config)
        due = (self.pending is not None or said != self.written
               or self.mono() - self.written_mono >= src.interval_seconds)
        if due and not self.flush(config, said):
            return min(RETRY_S, src.interval_seconds)
        return max(0.0, self.written_mono + src.interval_seconds - self.mono())

    def flush(self, config: Config, said: Said) -> bool:
        """Write ``said`` (or the report kept for it); False: kept for later."""
        store, me = self.store(config), config.node_name
        report = None
        try:
            if not self.counter_known:
                theirs = store.read_one(me)
                self.counter = max(self._local_counter(config),
                                   theirs.counter if theirs is not None else 0)
                self.counter_known = True
                self.pending = None  # made before the counter was known
            if self.pending is not None and self.pending[0] == said:
                report = self.pending[1]
            else:
                report = self._report(config, said)
            store.write(report)
        except FleetUnavailable as exc:
            if report is not None:
                self.pending = (said, report)  # the newest; an older one is dropped
            if self.unreachable is None:
                log.warning("fleet: this node's report is not written (%s): kept, and written "
                            "once Ceph answers", exc)
            self.unreachable = str(exc)
            return False
        if self.unreachable is not None:
            log.info("fleet: this node's report is written again (counter %d)", report.counter)
        self.unreachable, self.pending = None, None
        self.written, self.written_mono = said, self.mono()
        return True

    def _report(self, config: Config, said: Said) -> Report:
        # Past the most a report carries (its object written so by another
        # key, or damaged), start again: readers see a change by any field.
        self.counter = self.counter + 1 if self.counter < MAX_COUNTER else 1
        path = config.state_dir / COUNTER_FILE
        try:
            write_json(path, {"counter": self.counter})
        except OSError as exc:  # Ceph's copy still bounds it from below after a restart
            log.warning("fleet: %s: cannot keep the report counter: %s", path, exc)
        return Report(node=config.node_name, counter=self.counter, written_at=now_iso(),
                      **asdict(said))

    def _local_counter(self, config: Config) -> int:
        path = config.state_dir / COUNTER_FILE
        try:
            doc = read_json(path, {}) or {}
        except (OSError, ValueError) as exc:  # damaged: Ceph's copy still bounds it from below
            log.warning("fleet: %s: the report counter is not read (%s): counting from the "
                        "report in Ceph", path, exc)
            doc = {}
        n = doc.get("counter") if isinstance(doc, dict) else None
        ok = isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= MAX_COUNTER
        return max(self.counter, n if ok else 0)

    def _metric(self, config: Config) -> None:
        state = Layout(config.source_dir).read_state()
        back = state.get("heldBack") if isinstance(state.get("heldBack"), dict) else None
        if back is not None:
            self.metrics.set_rollout(str(back.get("state")), back.get("revision") or "")
        else:
            self.metrics.set_rollout("Held" if hold_of(state) is not None else "Applied", "")


def _store(config: Config, session: Callable[[], Session] | None = None) -> FleetStore:
    assert config.git is not None and config.git.fleet is not None
    borrow = None if session is None else lambda: _lend(session(), config)
    return FleetStore(config.ceph, config.git.fleet.pool, config.git.fleet.namespace,
                      borrow=borrow)


def _lend(session: Session, config: Config) -> Lent | None:
    """The session's kept connection, held for one call (None: none kept now;
    the store then uses its own)."""
    handle = session.take(config.ceph)
    if handle is None:
        return None
    if handle.cluster is None:
        handle.drop()
        return None

    def give_back(failed: bool) -> None:
        if failed:  # never lent again, nor used by the next pass: it connects anew
            session.forget(handle)
        handle.drop()
    return handle.cluster, give_back


def _inside(path: Path, directory: Path) -> bool:
    return path.parent == directory or directory in path.parents
