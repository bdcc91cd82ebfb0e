"""What the command line asks of the daemon's passes (daemon/commands.py):
apply or release these volumes now, let these removals go, or hold one
volume for a job (rotate-key, takeover) while no chain runs for it.

An ask counts from the first pass that begins after it: a pass under way may
have read the node before the command was typed. That pass names its
volumes once it has loaded the files (by name, by file or directory, or
every one), and looks at them at once (their backoff forgotten). Each
volume's result is then what that pass, or the chain it started, did: a
chain is never run twice for one ask. A chain already running for the same
spec when the ask is named is the very work asked for: its result is the
answer (an ``apply`` typed right after a file was written waits for the
daemon's chain, and prints it). A volume whose plan waits for another one
(a clone for its snapshot) is looked at again after this ask's chains
changed something, as often as ``apply`` would (engine.MAX_FOLLOW_UP_PASSES).

Every ask ends, by construction: each volume it names is answered by a
chain it counts (``finished``), by a pass that looks at it (``looked``),
or, when the pass that was due to look at it ended without doing so (its
file and record gone, or frozen meanwhile), by ``pass_ended`` with what that
pass knew. Which chains run is kept here, under the same lock as the asks
(``started``, ``finished``): a chain is either running when an ask is
resolved, and its end is seen by it, or it is not, and a pass looks.

The pass thread calls ``started``, ``resolve``, ``looked`` and
``pass_ended``; a chain's thread (or a job's end) calls ``finished``; the
control socket's thread reads the events.

Imported by daemon/ (4 modules).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from reconciler.apply.outcomes import VolumeOutcome
from reconciler.engine import MAX_FOLLOW_UP_PASSES, merge_outcomes
from reconciler.plan.planner import FROZEN
from reconciler.spec.loader import LoadResult
from reconciler.spec.model import Volume
from reconciler.state.allowance import Allowance
from reconciler.views import apply_doc, apply_exit, select

Kind = Literal["apply", "release", "removal", "job"]


@dataclass(frozen=True)
class Inflight:
    """A chain (or a job) running for a volume."""

    spec_hash: str
    purpose: Literal["converge", "release", "job"]


@dataclass
class PassContext:
    """What a pass knows when it names the asks' volumes."""

    loaded: LoadResult
    current: dict[str, Volume]
    frozen: set[str]
    released: set[str]  # managed volumes whose files vanished, released by this pass
    held_back: dict[str, str]  # vanished, but held back: why
    unrecorded: set[str]  # new or changed, held back until stateDir takes their record
    state_line: str  # why they are held back
    hold: Callable[[set[str]], str | None]  # hold these down; None, or why it could not
    lift: Callable[[set[str] | None], str | None]  # lift these holds (None: all)
    reserve: Callable[[str], bool]  # a job's volume, if no chain runs for it


class Ask:
    def __init__(self, kind: Kind, targets: list[dict[str, str]], first: int,
                 allowance: Allowance | None = None) -> None:
        self.kind = kind
        self.targets = targets  # [] names every volume
        self.first = first  # the first pass that counts
        self.allowance = allowance  # removal: what allow-removal let go
        self._events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.resolved_in: int | None = None  # the pass that named its volumes
        self.order: list[str] = []
        self.pending: set[str] = set()  # named, no final result yet
        self.due: dict[str, int] = {}  # pending, not counted: the pass due to look at it
        self.counted: set[str] = set()  # the result of their chain in flight is the answer
        self.chains: dict[str, Inflight] = {}  # counted: which chain (started's)
        self.provisional: dict[str, VolumeOutcome] = {}  # waiting for another object
        self.outcomes: dict[str, VolumeOutcome] = {}
        self.errors: list[dict[str, Any]] = []
        self.left: list[str] = []  # removal: named, and not released (why)
        self.changed = False  # a result of this round changed something
        self.rounds = 0
        self.reserved: Volume | None = None  # job: the volume, while no chain may run
        self.closed = False

    def events(self) -> Iterator[dict[str, Any]]:
        """What to send, until (and with) the final line."""
        while True:
            ev = self._events.get()
            yield ev
            if "exit" in ev or ev.get("event") == "reserved":
                return

    def next_event(self, timeout: float) -> dict[str, Any] | None:
        """The next event to send, or None when none came within ``timeout``
        (the control socket's thread then looks whether its client is gone)."""
        try:
            return self._events.get(timeout=timeout)
        except queue.Empty:
            return None

    def overdue(self, pass_no: int, running: dict[str, Inflight]) -> list[str]:
        """Named, waiting for a look that pass ``pass_no`` was due to make,
        and no chain of theirs runs: that pass ended without answering them."""
        return sorted(n for n, due in self.due.items()
                      if due <= pass_no and n in self.pending and n not in self.counted
                      and n not in running)

    def emit(self, obj: dict[str, Any]) -> None:
        self._events.put(obj)


class Asks:
    def __init__(self, look_again: Callable[[set[str], str], None],
                 next_pass: Callable[[], int] = lambda: 0) -> None:
        # Asks the daemon for one more pass over these names, at once.
        self.look_again = look_again
        self.next_pass = next_pass  # the number of the first pass that begins after now
        # The pass thread and the chains' threads both move an ask along:
        # every change to one is made under this lock (re-entered when an
        # answer closes an ask and drops it).
        self._lock = threading.RLock()
        self._open: list[Ask] = []
        self._running: dict[str, Inflight] = {}  # the chains (and jobs) in flight
        self._stopped: str | None = None  # why no pass comes any more (``stop``)

    def add(self, ask: Ask) -> None:
        with self._lock:
            self._open.append(ask)
            if self._stopped is not None:
                self._fail(ask, self._stopped)

    def drop(self, ask: Ask) -> None:
        """No longer open: answered, failed, or a job's volume reserved."""
        with self._lock:
            if ask in self._open:
                self._open.remove(ask)

    def _current(self) -> list[Ask]:
        with self._lock:
            return list(self._open)

    # -- the pass thread ----------------------------------------------------------
    def started(self, name: str, what: Inflight) -> None:
        """A chain (or a job) starts for ``name``; ``finished`` ends it."""
        with self._lock:
            self._running[name] = what
    def allowance(self, pass_no: int) -> Allowance:
        """What the removal asks this pass answers let go (with the file's)."""
        with self._lock:
            return self._allowance(pass_no)

    def _allowance(self, pass_no: int) -> Allowance:
        names: set[str] = set()
        every = False
        for a in self._current():
            if a.kind == "removal" and a.resolved_in is None and a.first <= pass_no \
                    and a.allowance is not None:
                names |= a.allowance.names
                every = every or a.allowance.all
        return Allowance(frozenset(names), every)

    def resolve(self, pass_no: int, ctx: PassContext) -> set[str]:
        """Name the volumes of the asks this pass answers; returns the names
        to look at in this very pass."""
        with self._lock:
            return self._resolve(pass_no, ctx)

    def _resolve(self, pass_no: int, ctx: PassContext) -> set[str]:
        look: set[str] = set()
        for a in self._current():
            if a.resolved_in is not None or a.first > pass_no:
                continue
            if a.kind == "job":
                self._reserve(a, pass_no, ctx)
                continue
            if a.kind == "removal":
                names = self._removal(a, ctx)
            else:
                names = self._pick(a, ctx)
                if names is None:
                    continue
            a.resolved_in = pass_no
            a.order = sorted(names)
            a.pending = set(names)
            a.emit({"event": "started", "volumes": a.order, "errors": a.errors})
            for n in a.order:
                look |= self._first_look(a, n, ctx, pass_no)
            self._check(a)
        return look

    def _pick(self, a: Ask, ctx: PassContext) -> set[str] | None:
        loaded = ctx.loaded
        sel = select(loaded.volumes, ctx.frozen, loaded.failed_files, loaded.diagnostics,
                     a.targets, loaded.frozen_in)
        if sel.missing:
            self._fail(a, f"no volume {', '.join(sel.missing)} in the daemon's desiredDir or "
                          "csi.dir (nothing done)")
            return None
        names = set(sel.names)
        if not a.targets and a.kind == "apply":
            names |= ctx.released  # every volume: the removals this pass makes too
        a.errors = [d.as_dict() for d in sel.errors]
        live = {n for n in names if n in ctx.current}
        why = (ctx.hold(live) if a.kind == "release"
               else ctx.lift(None if not a.targets else live))
        if why is not None:
            self._fail(a, f"{why} (nothing done)")
            return None
        return names

    def _removal(self, a: Ask, ctx: PassContext) -> set[str]:
        allowed = a.allowance or Allowance()
        picked = {n for n in ctx.released if allowed.allows(n)}
        for n in sorted(allowed.names - picked):
            why = (ctx.held_back.get(n) or (f"still declared in {ctx.current[n].source.file}"
                                            if n in ctx.current else "not pending removal"))
            a.left.append(f"{n}: {why}")
        return picked

    def _first_look(self, a: Ask, name: str, ctx: PassContext, pass_no: int) -> set[str]:
        if name in ctx.frozen:
            self._deliver(a, name, VolumeOutcome(name, status="failed", error=FROZEN))
            return set()
        if name in ctx.unrecorded:
            self._deliver(a, name, VolumeOutcome(
                name, status="failed", error=f"not converged: {ctx.state_line}"))
            return set()
        running = self._running.get(name)  # now, under the lock ``finished`` takes
        vol = ctx.current.get(name)
        if running is not None and (
                (a.kind == "apply" and running.purpose == "converge"
                 and vol is not None and running.spec_hash == vol.spec_hash)
                # Its file is gone: the release running is the removal asked for.
                or (a.kind == "apply" and running.purpose == "release" and vol is None)
                or (a.kind != "apply" and running.purpose == "release")):
            a.counted.add(name)  # that chain is the work asked for
            a.chains[name] = running
            return set()
        if running is not None:
            return set()  # looked at after that chain: its end sets when (``finished``)
        a.due[name] = pass_no
        return {name}

    def _reserve(self, a: Ask, pass_no: int, ctx: PassContext) -> None:
        [name] = [t["name"] for t in a.targets]
        if name in ctx.frozen:
            self._fail(a, f"{name}: {FROZEN}")
        elif name not in ctx.current:
            self._fail(a, f"no volume {name!r} in the daemon's desiredDir or csi.dir")
        elif ctx.reserve(name):
            a.resolved_in = pass_no
            a.reserved = ctx.current[name]
            a.emit({"event": "reserved"})
            self.drop(a)  # the passes are done with it: its reserver ends it
        # else: a chain runs for it; its end marks it, and a later pass reserves it

    def looked(self, pass_no: int, name: str, waiting: bool,
               outcome: VolumeOutcome | None) -> None:
        """This pass planned ``name``: ``outcome`` when nothing was run (its
        result as apply would print it), None when a chain is being started."""
        with self._lock:
            self._looked(pass_no, name, waiting, outcome)

    def _looked(self, pass_no: int, name: str, waiting: bool,
                outcome: VolumeOutcome | None) -> None:
        for a in self._current():
            if a.resolved_in is None or pass_no < a.resolved_in or name not in a.pending \
                    or name in a.counted:
                continue
            if outcome is None:
                a.counted.add(name)
                if (chain := self._running.get(name)) is not None:
                    a.chains[name] = chain  # started before this, by the same pass
            else:
                self._deliver(a, name, outcome, waiting)

    def finished(self, name: str, outcome: VolumeOutcome | None,
                 chain: Inflight | None = None) -> None:
        """A chain ended (its thread; ``outcome`` None: a job ended): the
        answer of the asks that count it; those that waited for it to end
        are looked at by the next pass. ``chain``: the one given to
        ``started`` (the daemon drops a chain from its own books before it
        tells the asks, so a pass may have started the next one meanwhile:
        that one still runs, and its end is the answer of those counting it)."""
        with self._lock:
            replaced = chain is not None and self._running.get(name) is not chain
            if not replaced:
                self._running.pop(name, None)
            waited = False
            for a in self._current():
                if name in a.counted and outcome is not None \
                        and (chain is None or a.chains.get(name, chain) is chain):
                    a.counted.discard(name)
                    a.chains.pop(name, None)
                    self._deliver(a, name, outcome)
                elif replaced:
                    continue  # waited for the chain running now: its end says when
                elif a.kind == "job" and a.resolved_in is None and a.targets[0]["name"] == name:
                    waited = True  # a pass at once reserves it (no chain runs now)
                elif a.resolved_in is not None and name in a.pending \
                        and name not in a.counted and name not in a.provisional:
                    a.due[name] = self.next_pass()
                    waited = True
            if waited:
                self.look_again({name}, f"{name}: the chain an ask waited for ended")

    def pass_ended(self, pass_no: int, refused: str | None, *,
                   current: set[str] = frozenset(), released: set[str] = frozenset(),
                   frozen: set[str] = frozenset()) -> None:
        """``refused``: why the pass did not get to the asks (it refused to
        look, or failed): those it should have answered fail with that.
        Otherwise what it was due to look at and did not (``overdue``) is
        answered with what it knew: the volumes it declared (``current``),
        released and froze."""
        with self._lock:
            for a in self._current():
                if a.closed or a.first > pass_no:
                    continue
                overdue = a.overdue(pass_no, self._running)
                if refused is not None:
                    if a.resolved_in is None or a.resolved_in == pass_no or overdue:
                        self._fail(a, refused)
                    continue
                for name in overdue:
                    if name in a.provisional:  # its one more look did not come: as it was
                        a.due.pop(name)
                        self._settle(a, name, a.provisional.pop(name))
                        self._check(a)
                    else:
                        self._deliver(a, name, self._unlooked(a, name, pass_no, current,
                                                              released, frozen))

    @staticmethod
    def _unlooked(a: Ask, name: str, pass_no: int, current: set[str], released: set[str],
                  frozen: set[str]) -> VolumeOutcome:
        """The answer for a volume the pass due to look at it did not."""
        if name in frozen:
            return VolumeOutcome(name, status="failed", error=FROZEN)
        if name in current or name in released:
            return VolumeOutcome(name, status="failed", error=(
                f"pass {pass_no} did not get to it (the daemon's log says why); nothing done"))
        if a.kind == "apply" and a.targets:
            return VolumeOutcome(name, status="failed", error=(
                "its file is gone and it is no longer managed: nothing done"))
        # Every volume, a release or a removal: gone is what was asked.
        return VolumeOutcome(name, notes=["no longer declared nor managed: nothing to do"])

    def stop(self, why: str) -> None:
        """The daemon stops: every ask still open ends with what it has."""
        with self._lock:
            self._stopped = why  # and those asked later, at once
            for a in self._current():
                self._fail(a, why)

    # -- results ------------------------------------------------------------------
    def _deliver(self, a: Ask, name: str, outcome: VolumeOutcome, waiting: bool = False) -> None:
        if a.closed or name not in a.pending:
            return
        a.due.pop(name, None)
        before = a.provisional.pop(name, None)
        merged = merge_outcomes([before], [outcome])[0] if before is not None else outcome
        if outcome.status == "changed":
            a.changed = True
        if waiting and a.kind == "apply":
            a.provisional[name] = merged  # looked at again if this ask changes something
        else:
            self._settle(a, name, merged)
        self._check(a)

    @staticmethod
    def _settle(a: Ask, name: str, outcome: VolumeOutcome) -> None:
        a.pending.discard(name)
        a.outcomes[name] = outcome
        a.emit({"event": "volume", "volume": outcome.as_dict()})

    def _check(self, a: Ask) -> None:
        """Done when nothing is pending but what waits for another object
        that no chain of this ask can bring any more."""
        if a.closed or a.counted or a.pending - set(a.provisional):
            return
        if a.provisional and a.changed and a.rounds < MAX_FOLLOW_UP_PASSES:
            a.rounds += 1
            a.changed = False
            due = self.next_pass()
            for name in a.provisional:
                a.due[name] = due
            self.look_again(set(a.provisional), "apply: one more pass for what waits")
            return
        for name, out in sorted(a.provisional.items()):
            self._settle(a, name, out)
        a.provisional.clear()
        doc = apply_doc((a.outcomes[n] for n in sorted(a.outcomes)), a.errors, [])
        if a.left:
            doc["notReleased"] = a.left
        self._close(a, {"exit": apply_exit(doc), "result": {"kind": "applied", "doc": doc}})

    def _fail(self, a: Ask, why: str) -> None:
        """The results that came were sent as they came; this says why no more will."""
        if not a.closed:
            self._close(a, {"exit": 1, "error": why})

    def _close(self, a: Ask, final: dict[str, Any]) -> None:
        a.closed = True
        a.emit(final)
        self.drop(a)
