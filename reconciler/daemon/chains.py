"""The chains: one per volume at a time, in the daemon's thread pool. Each
runs a volume's steps (engine.act), then records what came of it: the
backoff of a failure, the record of a released volume, its status
(daemon/outcomes.py), the asks counting it. Also the reservations of the
command line's jobs (rotate-key, takeover), and the chains in flight.
Built by daemon/service.py; imported by it and daemon/passes.py.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Literal

from reconciler.apply.outcomes import LEFT, VolumeOutcome
from reconciler.daemon.asks import Asks, Inflight
from reconciler.daemon.loop import PassLoop, next_backoff
from reconciler.daemon.metrics import Metrics
from reconciler.daemon.outcomes import Down, chain_aborted, chain_ended, nothing_to_do
from reconciler.daemon.progress import Statuses
from reconciler.drivers.run import Halt
from reconciler.engine import Gate, act, context
from reconciler.observe.node import Node
from reconciler.plan.planner import VolumePlan, actual_state
from reconciler.spec.config import Config
from reconciler.spec.model import Volume
from reconciler.state.status import VolumeStatus
from reconciler.state.statusfiles import StatusFiles

log = logging.getLogger("rbd-reconciler")


class Chains:
    def __init__(self, config: Callable[[], Config], node: Callable[[], Node], halt: Halt,
                 lock: threading.Lock, loop: PassLoop, pool: ThreadPoolExecutor,
                 records: dict[str, dict], files: StatusFiles, statuses: Statuses,
                 asks: Asks, metrics: Metrics) -> None:
        self.config = config  # the current one: a reload (SIGHUP) replaces it
        self.node = node  # likewise: read as a chain starts
        self.halt = halt  # set at SIGTERM: no chain starts
        self.lock = lock  # the daemon's: records, in-flight set, backoff
        self.loop = loop  # the backoff, and what the next pass looks at
        self.pool = pool
        self.records = records  # managed.json's, shared with the passes
        self.files = files
        self.statuses = statuses
        self.asks = asks
        self.metrics = metrics
        self.inflight: dict[str, Future[None]] = {}
        self.inflight_info: dict[str, Inflight] = {}  # what each chain in flight is for
        self.gate: Gate | None = None  # the CSI adapter's say over its files, per step

    def set_gate(self, gate: Gate | None) -> None:
        self.gate = gate

    def in_flight(self) -> dict[str, Future[None]]:
        """A copy of the chains in flight, taken under the lock."""
        with self.lock:
            return dict(self.inflight)

    def may_start(self, vol: Volume) -> bool:
        """No chain of ``vol`` in flight, and not backing off (daemon/loop.py)."""
        return self.loop.due(vol, self.inflight)

    def busy(self, name: str) -> bool:
        with self.lock:
            return name in self.inflight

    def reserve(self, name: str) -> bool:
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
        self.loop.look_again({name}, f"{name}: after a job of the command line")

    def submit(self, vol: Volume, vp: VolumePlan, observed: object, down: Down,
               pass_number: int) -> None:
        """A chain for ``vol``, from pass ``pass_number``. ``down``:
        "vanished" (its file is gone), "held" (released through the daemon,
        kept down), None (converged to its file)."""
        if self.halt.stopping:  # a pass that was under way at SIGTERM
            return
        if vp.refusal is None and not self.files.status_path(vol.name).exists():
            self.statuses.write(vol.name, VolumeStatus("Pending"))
        elif vol.state == "absent" and vp.refusal is None:
            self.statuses.write(vol.name, VolumeStatus("Deleting"))
        # Before the chain can end: its end is the answer of the asks counting
        # it (this chain: ``what``, a late end of the one before is not).
        purpose: Literal["converge", "release"] = "converge" if down is None else "release"
        what = Inflight(vol.spec_hash, purpose)
        self.asks.started(vol.name, what)
        self.asks.looked(pass_number, vol.name, False, None)
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
            [outcome] = act([vp], {vol.name: vol}, observed, self.node(),  # type: ignore[arg-type]
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
                self.loop.backoff[vol.name], delay = next_backoff(
                    self.loop.backoff.get(vol.name), vol.spec_hash)
                log.warning("%s: failed (%s); next try in %.0f s", vol.name, out.error, delay,
                            extra={"volume": vol.name, "result": "failed"})
            else:
                self.loop.backoff.pop(vol.name, None)
                if released and vol.name in self.records:
                    del self.records[vol.name]
                    self.files.save_records(self.records)
                log.info("%s: %s", vol.name, out.status,
                         extra={"volume": vol.name, "result": out.status})
            if out.status != "failed":
                self.loop.dirty.add(vol.name)  # the next pass confirms what the chain did
        self.statuses.write(vol.name, chain_ended(vol, vp, out, down))
        self.loop.wake()  # look again (a failed one when its backoff ends)

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
        self.statuses.write(vol.name, chain_aborted(vol, out))

    def converged(self, vol: Volume, vp: VolumePlan, observed: object, down: Down) -> None:
        with self.lock:
            self.loop.backoff.pop(vol.name, None)
            if down == "vanished" and vol.name in self.records:
                del self.records[vol.name]
                self.files.save_records(self.records)
        problems = {} if down is not None else vp.problems
        actual = actual_state(vol, observed, context(self.config(), self.node()),  # type: ignore[arg-type]
                              problems)
        self.statuses.write(vol.name, nothing_to_do(vol, vp, down, problems, actual))
