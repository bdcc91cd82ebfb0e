"""One pass of the daemon: load the desired files, decide the removals
(plan/removals.py), observe and plan the volumes due, write what is known,
start a chain for each volume with steps (daemon/chains.py), and answer the
command line's asks; the holds of `release`; and the preflight, why the
desired directories may not be trusted (at start and every pass). Built by
daemon/service.py, its only importer.

Imported by daemon/service.py.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reconciler.apply.outcomes import VolumeOutcome, without_steps
from reconciler.daemon import sdnotify
from reconciler.daemon.asks import Asks, PassContext
from reconciler.daemon.chains import Chains
from reconciler.daemon.claimpoll import Wait
from reconciler.daemon.conditions import Conditions
from reconciler.daemon.interest import VolumeInterest, forget, volume_interest
from reconciler.daemon.liveview import LiveView
from reconciler.daemon.loop import PassLoop
from reconciler.daemon.metrics import Metrics, ceph_reachable
from reconciler.daemon.outcomes import Down
from reconciler.daemon.progress import Progress, Statuses
from reconciler.daemon.watchers import Watchers
from reconciler.drivers.reaper import reap_zombies
from reconciler.engine import context, look, orphans
from reconciler.facts.observed import Observed
from reconciler.observe.node import Node
from reconciler.plan.planner import VolumePlan, actual_state
from reconciler.plan.removals import decide_removals
from reconciler.source.report import applied_revision, distrust
from reconciler.spec.config import Config
from reconciler.spec.desired import claims, forgettable, load_desired
from reconciler.spec.loader import LoadCache, LoadResult
from reconciler.spec.model import Volume, volume_from_dict, volume_to_dict
from reconciler.spec.reading import discover
from reconciler.spec.security import desired_dir_problems, directory_problems
from reconciler.state import allowance, holds
from reconciler.state.allowance import Allowance
from reconciler.state.files import CannotWrite
from reconciler.state.status import VolumeStatus
from reconciler.state.statusfiles import StatusFiles

log = logging.getLogger("rbd-reconciler")
# rbd_reconciler_unaccounted is counted again this often (a walk of /proc and
# sysfs; a leftover is a slow thing: its alert waits 30 minutes).
LEFTOVERS_EVERY_S = 60.0



def awaiting_source(config: Config) -> bool:
    return config.git is not None and not os.path.lexists(config.desired_dir)


def preflight(config: Config, files: bool = True) -> list[str]:
    """Why the desired directories may not be trusted. ``files=False`` (a
    pass): the directories only, since the load that follows checks every
    file as it stats it, and refuses an untrusted one the same way."""
    dirs = [config.desired_dir]
    if awaiting_source(config):
        # Nothing applied yet (the first sync runs, or fails: source status).
        assert config.git is not None
        return [f"the git source {config.git.url} has no revision applied yet "
                "(rbd-reconciler source status)"]
    if config.csi_dir.is_dir():  # the CSI adapter's files converge like the operator's
        dirs.append(config.csi_dir)
    problems = []
    for d in dirs:
        problems += desired_dir_problems(d, discover([d])[0] if files else [])
    if config.state_dir.is_dir():
        # Root's records, locks and mount points: whoever could change the
        # state dir could swap them (safety rule 6).
        problems += directory_problems(config.state_dir)
    return problems


@dataclass
class PassKnew:
    """What the pass under way knew of the volumes, for the asks it was due
    to answer and did not look at (daemon/asks.py ``pass_ended``)."""

    current: set[str] = field(default_factory=set)  # declared
    released: set[str] = field(default_factory=set)  # vanished, released by it
    frozen: set[str] = field(default_factory=set)


class Passes:
    def __init__(self, config: Callable[[], Config], node: Callable[[], Node],
                 lock: threading.Lock, loop: PassLoop, progress: Progress,
                 records: dict[str, dict], files: StatusFiles, statuses: Statuses,
                 chains: Chains, watchers: Watchers, asks: Asks, view: LiveView,
                 conditions: Conditions, metrics: Metrics, allow_mass_removal: bool) -> None:
        self.config = config  # the current one: a reload (SIGHUP) replaces it between passes
        self.node = node  # likewise
        self.lock = lock  # the daemon's: records, in-flight set, backoff
        self.loop = loop  # what this pass looks at
        self.progress = progress  # the passes begun and ended
        self.records = records  # managed.json's, shared with the chains
        self.files = files
        self.statuses = statuses
        self.chains = chains  # started for the volumes with steps
        self.watchers = watchers  # told what of the node belongs to which volume
        self.asks = asks
        self.view = view  # the files as this pass loaded them
        self.conditions = conditions
        self.metrics = metrics
        self.allow_mass_removal = allow_mass_removal
        self.number = 0  # of the pass under way (or the last)
        self.recorded: dict[str, tuple[str, Path]] = {}  # name -> what its record holds
        # What `release` holds down until `apply` (state/holds.py).
        self.holds: set[str] = set()
        # Files unchanged since the last pass (stat) are not read again.
        self.load_cache = LoadCache()
        self.interest: dict[str, VolumeInterest] = {}
        # Volumes refused by another node's claim, and the claim they wait
        # on (daemon/claimpoll.py): name -> ((pool, image), what the pass saw).
        self.claim_waits: dict[str, tuple[tuple[str, str], Wait]] = {}
        self.refusing = ""  # why the pass under way refused to look, for the asks
        self.pass_knew = PassKnew()  # what the pass under way knew, for the asks
        self.not_reconciling: str | None = None  # why the last pass refused; None: it looked
        self.leftovers_next = 0.0  # when rbd_reconciler_unaccounted is counted again

    def read_holds(self) -> None:
        """At start: what `release` held down before."""
        self.holds = holds.read(self.config().state_dir)

    def held(self) -> set[str]:
        """What `release` holds down now (replaced whole, never changed in place)."""
        return self.holds

    def _answer_asks(self, loaded: LoadResult, current: dict[str, Volume], frozen: set[str],
                     release: list[Volume], held: dict[str, str], unrecorded: set[str]) -> None:
        look = self.asks.resolve(self.number, PassContext(
            loaded=loaded, current=current, frozen=frozen,
            released={v.name for v in release}, held_back=held, unrecorded=unrecorded,
            state_line=self.files.line(), hold=self._hold_down,
            lift=self._lift_holds, reserve=self.chains.reserve))
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
            holds.write(self.config().state_dir, wanted)
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
        self.number = self.progress.begin()
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
            self.asks.pass_ended(self.number, self.not_reconciling,
                                 current=knew.current, released=knew.released,
                                 frozen=knew.frozen)
            self.metrics.pass_done(time.monotonic() - t0, result)
            if self.config().metrics.textfile is not None:
                self.metrics.write_textfile(self.config().metrics.textfile)
            self.progress.end()

    def _reconcile(self) -> bool:
        """One pass; False when it refused to look (preflight, untrusted files)."""
        t0 = time.monotonic()
        config = self.config()  # a reload comes between passes, never during one
        self.watchers.watch()  # the link may point elsewhere now
        reap_zombies()
        self.statuses.from_revision(applied_revision(config))
        problems = preflight(config, files=False)
        if not problems and (why := distrust(config)) is not None:
            # The applied revision no longer verifies (a key revoked since):
            # its files are not acted on, and nothing is taken down either.
            problems = [f"the applied revision of the git source is held: {why}"]
        # Waiting for the source's first revision is expected at a first
        # start: said once, not as an error (source status says why if it lasts).
        self.conditions.update("preflight", [f"not reconciling: {p}" for p in problems],
                               level=logging.INFO if awaiting_source(config) else logging.ERROR)
        if problems:
            sdnotify.notify(f"STATUS=refusing: {problems[0]}")
            self.refusing = problems[0]
            return False
        loaded = load_desired(self.config(), self.load_cache, self._settled)
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
        self.statuses.retry()
        release, held = self._removals(current, frozen, failed_files,
                                       self.asks.allowance(self.number))
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
            self.statuses.write(name, VolumeStatus(
                "Pending", reason="StateDirNotWritable",
                message=f"not converged: {self.files.line()}",
                observed_generation=current[name].spec_hash))
        # Those held back for their record are looked at too (status tells
        # what is there), but nothing is done to them.
        candidates = [v for v in [*current.values(), *release]
                      if v.name in wanted and self.chains.may_start(v)]
        t_obs = time.monotonic()
        # Nothing to look at: nothing of the node is read (an idle pass).
        looked = look(candidates, self.config(), self.node(),
                      release=[v.name for v in [*release, *holding]])
        observed, plans = looked.observed, looked.plans
        t_obs = time.monotonic() - t_obs
        by_name = {v.name: v for v in candidates}
        self.view.update(loaded)
        self._update_interest(candidates, observed, current, plans)
        self.metrics.observed(plans, current.values(),
                              ceph_reachable(observed.pools_listed, observed.pool_errors))
        for name in sorted(frozen):
            self.statuses.write(name, VolumeStatus(
                "Frozen", reason="FileFailedToLoad",
                message="its file failed to load; left as it is"))
        for name, why in sorted(held.items()):
            self.statuses.write(name, VolumeStatus("Frozen", reason="RemovalHeld", message=why))
        busy = 0
        unknown: dict[str, str] = {}
        unknown_why: dict[str, str] = {}  # name -> why, for READY=1
        # Looked at again by the next pass, whatever wakes it: what they wait
        # on (Ceph answering, a source snapshot) comes with no event of ours.
        again = {vp.name for vp in plans if vp.unknown or vp.waiting}
        with self.lock:
            self.loop.dirty |= again
        held_io: dict[str, str] = {}
        n = self.number
        vanished, kept_down = {v.name for v in release}, {v.name for v in holding}
        for vp in plans:
            vol = by_name[vp.name]
            down: Down = ("vanished" if vol.name in vanished else
                          "held" if vol.name in kept_down else None)
            if vol.name in unrecorded:  # not recorded, not done (its status says so)
                self.asks.looked(n, vol.name, False, VolumeOutcome(
                    vol.name, status="failed", error=f"not converged: {self.files.line()}"))
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
                unknown_why[vol.name] = f"unknown: {vp.unknown}"
                self.statuses.write(vol.name, VolumeStatus(
                    "Unknown", reason="CannotObserve", message=vp.unknown,
                    observed_generation=vol.spec_hash))
                self.asks.looked(n, vol.name, False, without_steps(vp))
                continue
            if not vp.steps and not vp.refused:
                self.chains.converged(vol, vp, observed, down)
                self.asks.looked(n, vol.name, bool(vp.waiting), without_steps(vp))
                continue
            busy += 1
            self.chains.submit(vol, vp, observed, down, n)
        # READY=1 (daemon/readiness.py) does not wait for what is unknown:
        # its pool or image did not answer (Ceph unreachable at boot).
        self.loop.first_chains.not_waiting(unknown_why)
        self.loop.first_chains.seen({vp.name for vp in plans} - set(unknown),
                                    self.chains.in_flight())
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
        self._count_leftovers(loaded)
        sdnotify.notify(f"STATUS={len(current)} volume(s), {busy} converging, "
                        f"{len(unknown)} unknown, {len(frozen)} frozen, "
                        f"{len(held)} removal(s) held")
        log.debug("pass %d: looked at %d volume(s): %s", self.number, len(candidates),
                  "; ".join(why) or "nothing changed")
        log.info("pass %d: %d volume(s), %d observed, %d converging, %d unknown, %d frozen, "
                 "%d releasing, %d removal(s) held; observe and plan %.0f ms, pass %.0f ms",
                 self.number, len(current), len(candidates), busy, len(unknown),
                 len(frozen),
                 len(release), len(held), t_obs * 1e3, (time.monotonic() - t0) * 1e3)
        return True

    def _count_leftovers(self, loaded: LoadResult) -> None:
        """rbd_reconciler_unaccounted, from a look at most every
        LEFTOVERS_EVERY_S (a /proc walk: not on every event's pass). A thing
        being made by a chain under way is its volume's, accounted for."""
        now = time.monotonic()
        if now < self.leftovers_next:
            return
        self.leftovers_next = now + LEFTOVERS_EVERY_S
        with self.lock:  # the chains change the records meanwhile
            records = dict(self.records)
        try:
            found = orphans.find(self.config(), self.node(), loaded, records)
        except Exception as exc:  # a count is never worth a failed pass
            log.warning("leftovers not looked at: %s", exc)
            self.metrics.set_unaccounted({("unknown", False): 1})
            return
        counts: dict[tuple[str, bool], int] = {}
        for o in found.orphans:
            counts[(o.kind, o.ours)] = counts.get((o.kind, o.ours), 0) + 1
        if found.unknown:
            counts[("unknown", False)] = len(found.unknown)
        self.metrics.set_unaccounted(counts)

    def _state_condition(self) -> None:
        """Logged once when it starts (one line: the directory and the cause),
        and when it ends; rbd_reconciler_state_dir_writable says it meanwhile."""
        self.conditions.update("state", self.files.episode())

    def _hold(self, vol: Volume, vp: VolumePlan, observed: Observed) -> str:
        """Report a fenced or stalled volume (its status says what is known:
        the holder and the blocklist entries, or since when I/O is stuck) and
        leave it as it is; it is looked at again (a stall's end marks it)."""
        actual = actual_state(vol, observed, context(self.config(), self.node()))
        if vp.fenced:
            self.statuses.write(vol.name, VolumeStatus(
                "Fenced", reason=vp.fence_reason or "Fenced", message=vp.fenced,
                observed_generation=vol.spec_hash, fence=actual.get("fence")))
            return f"{vol.name}: fenced: {vp.fenced}"
        message = vp.stalled or ""
        if vp.unknown:
            message += f"; {vp.unknown}"
        stall = observed.stalled.get(str(actual.get("device")))
        self.statuses.write(vol.name, VolumeStatus(
            "Stalled", reason="IoStalled", message=message, observed_generation=vol.spec_hash,
            stalled=actual.get("stalled")), stall.since if stall else None)
        with self.lock:
            self.loop.dirty.add(vol.name)  # Ceph answering again comes with no event of ours
        return f"{vol.name}: stalled: {vp.stalled}"

    def _update_interest(self, looked: list[Volume], observed: Observed,
                         current: dict[str, Volume], plans: list[VolumePlan]) -> None:
        """What the event sources and the claim poll map back to volumes, for
        the volumes this pass looked at; the others keep their entries."""
        helpers = self.node().fuse.helper_pids()
        for v in looked:
            self.interest[v.name] = volume_interest(v, observed, helpers)
        forget(self.interest, current)
        self.watchers.follow_interest(self.interest)
        by_name = {v.name: v for v in looked}
        for vp in plans:
            v = by_name[vp.name]
            if vp.claimed_by is not None and v.name in current:
                key = (v.image.pool, v.image.name)
                self.claim_waits[v.name] = (key, Wait(v.name, vp.claimed_by,
                                                      self.number))
            else:
                self.claim_waits.pop(vp.name, None)
        for name in [n for n in self.claim_waits if n not in current]:
            del self.claim_waits[name]
        self.watchers.poll_claims(dict(self.claim_waits.values()))

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
            for name in [n for n in vanished if forgettable(self.records[n], self.config())]:
                del self.records[name]  # the CSI adapter removed it on purpose
                vanished.remove(name)
        taken = allowance.take(self.config().state_dir)
        allowed = Allowance(taken.names | asked.names, taken.all or asked.all)
        decided = decide_removals(vanished, failed_files, allowed.names, allowed.all,
                                  present=len(current) + len(frozen), managed=len(self.records),
                                  allow_mass_removal=self.allow_mass_removal,
                                  mass_removal_share=self.config().mass_removal_share)
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
                if (vol.on_remove or self.config().on_remove) == "keep":
                    log.info("%s: file removed; onRemove=keep leaves it as it is", name)
                    del self.records[name]
                    self.statuses.write(name, VolumeStatus("Released", reason="FileRemovedKept"))
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
                self.files.save_records(self.records)
        return release, held


def _same_record(old: object, new: dict[str, Any]) -> bool:
    """``new`` is what ``old`` (read from managed.json) already says."""
    return old == json.loads(json.dumps(new))
