"""One pass of the daemon: load the desired files, decide the removals
(plan/removals.py), observe and plan the volumes due, write what is known,
start a chain for each volume with steps, and answer the command line's
asks. A part of the Daemon (daemon/service.py, its only importer), sharing
its state: the attributes below are the Daemon's.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reconciler.apply.outcomes import VolumeOutcome, without_steps
from reconciler.daemon import sdnotify
from reconciler.daemon.asks import Asks, PassContext
from reconciler.daemon.claimpoll import ClaimPoll, Wait
from reconciler.daemon.conditions import Conditions
from reconciler.daemon.events import EventHub
from reconciler.daemon.interest import VolumeInterest, combine, forget, volume_interest
from reconciler.daemon.liveview import LiveView
from reconciler.daemon.loop import PassLoop
from reconciler.daemon.metrics import Metrics, ceph_reachable
from reconciler.daemon.outcomes import Down
from reconciler.drivers.reaper import reap_zombies
from reconciler.engine import context, look
from reconciler.facts.observed import Observed
from reconciler.observe.node import Node
from reconciler.plan.planner import VolumePlan, actual_state
from reconciler.plan.removals import decide_removals
from reconciler.source.report import applied_revision, distrust
from reconciler.spec.config import Config
from reconciler.spec.desired import claims, forgettable, load_desired
from reconciler.spec.loader import LoadCache, LoadResult
from reconciler.spec.model import Volume, volume_from_dict, volume_to_dict
from reconciler.state import allowance, holds
from reconciler.state.allowance import Allowance
from reconciler.state.files import CannotWrite
from reconciler.state.status import VolumeStatus
from reconciler.state.statusfiles import StatusFiles

log = logging.getLogger("rbd-reconciler")


@dataclass
class PassKnew:
    """What the pass under way knew of the volumes, for the asks it was due
    to answer and did not look at (daemon/asks.py ``pass_ended``)."""

    current: set[str] = field(default_factory=set)  # declared
    released: set[str] = field(default_factory=set)  # vanished, released by it
    frozen: set[str] = field(default_factory=set)


class Passes:
    """The pass methods of the Daemon (daemon/service.py)."""

    config: Config
    node: Node
    lock: threading.Lock
    loop: PassLoop
    files: StatusFiles
    records: dict[str, dict]
    recorded: dict[str, tuple[str, Path]]
    holds: set[str]
    load_cache: LoadCache
    allow_mass_removal: bool
    conditions: Conditions
    metrics: Metrics
    asks: Asks
    view: LiveView
    progress: threading.Condition
    passes_started: int
    passes_done: int
    progress_seq: int
    interest: dict[str, VolumeInterest]
    events: EventHub | None
    claim_waits: dict[str, tuple[tuple[str, str], Wait]]
    claim_poll: ClaimPoll | None
    source_revision: str | None
    refusing: str
    pass_knew: PassKnew
    not_reconciling: str | None

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
                    self.loop.backoff.pop(name, None)
                self.loop.dirty |= look

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
            unrecorded = self.files.unrecorded & set(current)
            self.loop.dirty |= unrecorded  # looked at again once it can be recorded
        self.pass_knew = PassKnew(set(current), {v.name for v in release}, frozen)
        # What the command line asked for: its volumes are looked at in this pass.
        self._answer_asks(loaded, current, frozen, release, held, unrecorded)
        # Released by hand through the daemon: kept down until `apply` names them.
        holding = [current[n] for n in sorted(self.holds) if n in current and n not in frozen]
        if gone := {n for n in self.holds if n not in current and n not in self.records}:
            self._save_holds(self.holds - gone)  # no longer managed: nothing to keep down

        wanted, why = self.loop.take_dirty(current, release)
        for name in sorted(unrecorded):
            self._write_status(name, VolumeStatus(
                "Pending", reason="StateDirNotWritable",
                message=f"not converged: {self._state_line()}",
                observed_generation=current[name].spec_hash))
        # Those held back for their record are looked at too (status tells
        # what is there), but nothing is done to them.
        candidates = [v for v in [*current.values(), *release]
                      if v.name in wanted and self.loop.due(v, self.inflight)]
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
            self.loop.dirty |= again
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
            self.loop.dirty.add(vol.name)  # Ceph answering again comes with no event of ours
        return f"{vol.name}: stalled: {vp.stalled}"

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
        decided = decide_removals(vanished, failed_files, allowed.names, allowed.all,
                                  present=len(current) + len(frozen), managed=len(self.records),
                                  allow_mass_removal=self.allow_mass_removal,
                                  mass_removal_share=self.config.mass_removal_share)
        removing, held = decided.releasing, decided.held
        if decided.refused:
            sdnotify.notify(f"STATUS=mass removal refused: {decided.guarded} volume(s)")
        self.conditions.update("mass-removal", decided.refused)
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
                self.files.unrecorded.add(v.name)
                changed = True
            if changed or self.files.unsaved_records:
                self._save_records()
        return release, held


def _same_record(old: object, new: dict[str, Any]) -> bool:
    """``new`` is what ``old`` (read from managed.json) already says."""
    return old == json.loads(json.dumps(new))
