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

The pass thread calls ``resolve``, ``looked`` and ``pass_ended``; a chain's
thread calls ``finished``; the control socket's thread reads the events.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from reconciler.apply.runner import VolumeOutcome
from reconciler.engine import MAX_FOLLOW_UP_PASSES, merge_outcomes
from reconciler.plan.planner import FROZEN
from reconciler.spec.loader import LoadResult
from reconciler.spec.model import Volume
from reconciler.state.allowance import Allowance
from reconciler.views import apply_doc, select

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
    inflight: dict[str, Inflight]
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
        self.counted: set[str] = set()  # the result of their chain in flight is the answer
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

    def emit(self, obj: dict[str, Any]) -> None:
        self._events.put(obj)


class Asks:
    def __init__(self, look_again: Callable[[set[str], str], None]) -> None:
        # Asks the daemon for one more pass over these names, at once.
        self.look_again = look_again
        # The pass thread and the chains' threads both move an ask along:
        # every change to one is made under this lock (re-entered when an
        # answer closes an ask and drops it).
        self._lock = threading.RLock()
        self._open: list[Ask] = []

    def add(self, ask: Ask) -> None:
        with self._lock:
            self._open.append(ask)

    def drop(self, ask: Ask) -> None:
        """No longer open: answered, failed, or a job's volume reserved."""
        with self._lock:
            if ask in self._open:
                self._open.remove(ask)

    def _current(self) -> list[Ask]:
        with self._lock:
            return list(self._open)

    # -- the pass thread ----------------------------------------------------------
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
                look |= self._first_look(a, n, ctx)
            self._check(a)
        return look

    def _pick(self, a: Ask, ctx: PassContext) -> set[str] | None:
        loaded = ctx.loaded
        sel = select(loaded.volumes, ctx.frozen, loaded.failed_files, loaded.diagnostics,
                     a.targets)
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

    def _first_look(self, a: Ask, name: str, ctx: PassContext) -> set[str]:
        if name in ctx.frozen:
            self._deliver(a, name, VolumeOutcome(name, status="failed", error=FROZEN))
            return set()
        if name in ctx.unrecorded:
            self._deliver(a, name, VolumeOutcome(
                name, status="failed", error=f"not converged: {ctx.state_line}"))
            return set()
        running = ctx.inflight.get(name)
        vol = ctx.current.get(name)
        if running is not None and (
                (a.kind == "apply" and running.purpose == "converge"
                 and vol is not None and running.spec_hash == vol.spec_hash)
                or (a.kind != "apply" and running.purpose == "release")):
            a.counted.add(name)  # that chain is the work asked for
            return set()
        # After a chain in flight (its end marks the volume), or now.
        return set() if running is not None else {name}

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
            else:
                self._deliver(a, name, outcome, waiting)

    def finished(self, name: str, outcome: VolumeOutcome) -> None:
        """A chain ended (its thread): the answer of the asks that count it."""
        with self._lock:
            for a in self._current():
                if name in a.counted:
                    a.counted.discard(name)
                    self._deliver(a, name, outcome)

    def pass_ended(self, pass_no: int, refused: str | None) -> None:
        """``refused``: why the pass did not get to the asks (it refused to
        look, or failed): those it should have answered fail with that."""
        with self._lock:
            for a in self._current():
                if a.closed or a.first > pass_no:
                    continue
                if refused is not None and (a.resolved_in is None or a.resolved_in == pass_no):
                    self._fail(a, refused)

    def stop(self, why: str) -> None:
        """The daemon stops: every ask still open ends with what it has."""
        with self._lock:
            for a in self._current():
                self._fail(a, why)

    # -- results ------------------------------------------------------------------
    def _deliver(self, a: Ask, name: str, outcome: VolumeOutcome, waiting: bool = False) -> None:
        if a.closed or name not in a.pending:
            return
        before = a.provisional.pop(name, None)
        merged = merge_outcomes([before], [outcome])[0] if before is not None else outcome
        if outcome.status == "changed":
            a.changed = True
        if waiting and a.kind == "apply":
            a.provisional[name] = merged  # looked at again if this ask changes something
        else:
            a.pending.discard(name)
            a.outcomes[name] = merged
            a.emit({"event": "volume", "volume": merged.as_dict()})
        self._check(a)

    def _check(self, a: Ask) -> None:
        """Done when nothing is pending but what waits for another object
        that no chain of this ask can bring any more."""
        if a.closed or a.counted or a.pending - set(a.provisional):
            return
        if a.provisional and a.changed and a.rounds < MAX_FOLLOW_UP_PASSES:
            a.rounds += 1
            a.changed = False
            self.look_again(set(a.provisional), "apply: one more pass for what waits")
            return
        for name, out in sorted(a.provisional.items()):
            a.pending.discard(name)
            a.outcomes[name] = out
            a.emit({"event": "volume", "volume": out.as_dict()})
        a.provisional.clear()
        doc = apply_doc((a.outcomes[n] for n in sorted(a.outcomes)), a.errors, [])
        if a.left:
            doc["notReleased"] = a.left
        failed = doc["recap"]["failed"] or doc["errors"]
        self._close(a, {"exit": 1 if failed else 0, "result": {"kind": "applied", "doc": doc}})

    def _fail(self, a: Ask, why: str) -> None:
        """The results that came were sent as they came; this says why no more will."""
        if not a.closed:
            self._close(a, {"exit": 1, "error": why})

    def _close(self, a: Ask, final: dict[str, Any]) -> None:
        a.closed = True
        a.emit(final)
        self.drop(a)
