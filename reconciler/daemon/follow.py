"""The daemon's side of the GitOps source: a thread that syncs every
``source.intervalSeconds`` (backing off after failures), feeds the metrics,
and wakes a pass over every volume when a revision is applied.

A CLI's ``source sync`` takes the same lock and switches the same link; the
daemon's file watch sees that switch like its own.

Imported by daemon/watchers.py.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable
from datetime import datetime

from reconciler.daemon.metrics import Metrics
from reconciler.daemon.rollout import Rollouts
from reconciler.drivers.run import Aborted, Halt, Runner
from reconciler.source.layout import SourceBusy
from reconciler.source.outcome import Outcome
from reconciler.source.report import applied_revision, distrust, revision
from reconciler.source.sync import Syncer
from reconciler.spec.config import Config

log = logging.getLogger("rbd-reconciler")

BACKOFF_FIRST_S = 5.0
BACKOFF_MAX_S = 300.0


def backoff(failures: int, interval: float) -> float:
    """After ``failures`` failed syncs in a row: 5, 10, 20 ... s, never past
    the larger of the interval and 5 minutes, with jitter (a fleet that lost
    its server does not come back in step)."""
    cap = max(interval, BACKOFF_MAX_S)
    wait = min(cap, BACKOFF_FIRST_S * 2 ** max(0, failures - 1), interval)
    return wait * random.uniform(0.8, 1.0)


class Follower:
    def __init__(self, config: Callable[[], Config], metrics: Metrics, halt: Halt,
                 applied: Callable[[str], None], rollout: Rollouts | None = None) -> None:
        self.config = config  # the current config (SIGHUP may replace it)
        self.metrics = metrics
        self.halt = halt
        self.applied = applied  # called with the new revision after a switch
        self.rollout = rollout  # a fleet's gate, and the report told of each sync
        self.wake = threading.Event()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="source", daemon=True)
        self.failures = 0  # failed syncs in a row (the backoff's count)
        self.wait = 0.0  # until the next sync
        self.last: tuple[str, str, str | None] | None = None  # what was last logged

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float) -> None:
        self.stopping.set()
        self.wake.set()
        self.thread.join(timeout)

    def sync_now(self) -> None:
        self.wake.set()

    def _loop(self) -> None:
        while not self.stopping.is_set():
            config = self.config()
            src = config.git
            if src is None:  # a reload removed the source
                return
            try:
                self.once(config)
            except Aborted:
                return
            except SourceBusy as exc:  # a CLI sync holds the lock: its result stands
                log.info("source: %s", exc)
                self._schedule("unchanged", src.interval_seconds)
            except Exception:  # the daemon never dies of a sync (a bug): say it, retry
                log.exception("source: sync failed")
                self._schedule("failed", src.interval_seconds)
            self.wake.wait(self.wait)
            self.wake.clear()

    def _schedule(self, result: str, interval: float) -> int:
        """Set the wait before the next sync: a refusal waits for a new push
        (the interval); a failure to reach the server backs off from 5 s up
        to the interval. Returns the failures in a row before this result."""
        before = self.failures
        self.failures = before + 1 if result == "failed" else 0
        self.wait = backoff(self.failures, interval) if self.failures else interval
        return before

    def once(self, config: Config) -> Outcome:
        src = config.git
        assert src is not None
        gate = self.rollout.gate if self.rollout is not None and src.fleet is not None else None
        syncer = Syncer(config, Runner(timeout=src.timeout_seconds, halt=self.halt), gate=gate)
        was_distrusted = distrust(config) is not None
        said_distrusted = self.last is not None and self.last[0] == "distrusted"
        out = syncer.sync()
        if self.rollout is not None:
            self.rollout.synced()
        failed_before = self._schedule(out.result, src.interval_seconds)
        self._report(config, out, failed_before)
        if out.result == "applied":
            rev = revision(src, out.commit) or ""
            who = ", ".join(f"{s['name']} ({s['fingerprint']})" for s in out.signers)
            log.info("source: applied %s, signed by %s", rev, who or "nobody (not verified)")
            self.applied(rev)
        elif (was_distrusted != (distrust(config) is not None)
              or said_distrusted != (out.result == "distrusted")):
            # Held, or trusted again by a policy change (whatever the sync's
            # result: a fetch that failed still verified what is applied
            # under the new policy; or a CLI's sync that did): a pass says so now.
            self.applied(applied_revision(config) or "")
        return out

    def _report(self, config: Config, out: Outcome, failed_before: int) -> None:
        src = config.git
        assert src is not None
        now = datetime.now().timestamp()
        m = self.metrics
        m.source_interval.set(src.interval_seconds)
        if out.fetched:
            m.source_fetch.set(now)
        if out.ok:
            m.source_success.set(now)
        else:
            m.source_refusals.labels(out.reason or "Unknown").inc()
        applied = applied_revision(config)
        m.source_info.clear()
        m.source_info.labels(src.url, src.ref.label, applied or "").set(1)
        key = (out.result, out.reason, out.commit)
        if out.ok:
            if self.last is not None and self.last[0] not in ("applied", "unchanged", "held",
                                                              "waiting"):
                log.info("source: %s again (%s)%s", out.result, revision(src, out.commit),
                         f" after {failed_before} failed attempt(s)" if failed_before else "")
        elif key != self.last:  # one line per new failure, not one per retry
            if out.result == "failed":
                level, then = logging.WARNING, (
                    f"retrying with backoff (in {self.wait:.1f} s, then at most every "
                    f"{src.interval_seconds:g} s; logged again when the result changes)")
            else:
                level, then = logging.ERROR, f"looking again every {src.interval_seconds:g} s"
            held = out.result == "distrusted" or distrust(config) is not None
            stays = "stays applied, held" if held else "stays applied"
            log.log(level, "source: %s %s: %s; %s %s; %s", out.result, out.reason,
                    out.message, applied or "nothing", stays, then)
        self.last = key
