"""What the command line asks of the daemon's passes (daemon/asks.py), pass
by pass, without a daemon: which volumes an ask names, when it answers,
and that a chain is never counted twice nor run twice for it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from reconciler.apply.outcomes import StepOutcome, VolumeOutcome
from reconciler.daemon.asks import Ask, Asks, Inflight, PassContext
from reconciler.plan.planner import FROZEN
from reconciler.plan.steps import Unpublish
from reconciler.spec.loader import LoadResult
from reconciler.spec.model import ImageSpec, Source, Volume
from reconciler.state.allowance import Allowance


def vol(name: str) -> Volume:
    return Volume(name=name, state="present",
                  image=ImageSpec("rbd", name, 1 << 20, (), "Retain"), map=None, stage=None,
                  publish=(), on_remove=None,
                  source=Source(Path(f"/etc/rbd-reconciler/volumes.d/{name}.yaml"), 1))


class Pass:
    """One pass's context, and what the asks did to the daemon."""

    def __init__(self, *names: str, frozen: tuple[str, ...] = (),
                 released: tuple[str, ...] = (), unrecorded: tuple[str, ...] = ()) -> None:
        self.current = {n: vol(n) for n in names}
        self.held: set[str] = set()
        self.lifted: list[set[str] | None] = []
        self.reserved: list[str] = []
        self.ctx = PassContext(
            loaded=LoadResult(volumes=tuple(self.current.values()), diagnostics=(),
                              files=(), failed_files=frozenset(), frozen_names=frozenset(frozen)),
            current=self.current, frozen=set(frozen), released=set(released), held_back={},
            unrecorded=set(unrecorded), state_line="stateDir is full",
            hold=self.hold, lift=self.lift, reserve=self.reserve)

    def hold(self, names: set[str]) -> str | None:
        self.held |= names
        return None

    def lift(self, names: set[str] | None) -> str | None:
        self.lifted.append(names)
        return None

    def reserve(self, name: str) -> bool:
        self.reserved.append(name)
        return True


def changed(name: str) -> VolumeOutcome:
    step = Unpublish(name, f"/srv/{name}", (7, 0))
    return VolumeOutcome(name, status="changed", steps=[StepOutcome(step, "changed")])


def drain(ask: Ask) -> list[dict[str, Any]]:
    out = []
    while not ask._events.empty():  # the test reads what was sent so far
        out.append(ask._events.get())
    return out


def test_an_apply_counts_from_the_next_pass_and_answers_with_its_chain() -> None:
    again: list[set[str]] = []
    asks = Asks(lambda names, _why: again.append(names))
    ask = Ask("apply", [{"name": "a"}], first=2)
    asks.add(ask)
    p = Pass("a", "b")
    assert asks.resolve(1, p.ctx) == set()  # a pass under way counts for nothing
    assert asks.resolve(2, p.ctx) == {"a"}
    assert p.lifted == [{"a"}]  # apply lifts a release's hold
    asks.looked(2, "a", False, None)  # a chain started
    asks.looked(2, "b", False, VolumeOutcome("b"))  # not asked about
    assert [e["event"] for e in drain(ask)] == ["started"]
    asks.finished("a", changed("a"))
    asks.finished("a", changed("a"))  # counted once
    events = drain(ask)
    assert [e.get("event") for e in events] == ["volume", None]
    final = events[-1]
    assert final["exit"] == 0 and final["result"]["doc"]["recap"] == {
        "ok": 0, "changed": 1, "failed": 0}
    assert ask.closed and not again


def test_a_chain_in_flight_for_the_same_spec_is_the_answer() -> None:
    asks = Asks(lambda names, why: None)
    ask = Ask("apply", [], first=1)
    asks.add(ask)
    asks.started("a", Inflight(vol("a").spec_hash, "converge"))
    asks.started("b", Inflight("old", "converge"))
    p = Pass("a", "b")
    # a: adopted; b: its chain is for another spec, looked at after it ends.
    assert asks.resolve(1, p.ctx) == set()
    assert ask.counted == {"a"} and ask.pending == {"a", "b"}
    asks.finished("b", changed("b"))  # the old chain: not the answer
    assert "b" in ask.pending
    asks.finished("a", changed("a"))
    asks.looked(2, "b", False, VolumeOutcome("b"))
    assert drain(ask)[-1]["result"]["doc"]["recap"] == {"ok": 1, "changed": 1, "failed": 0}


def test_a_waiting_volume_is_looked_at_again_after_this_ask_changed_something() -> None:
    again: list[set[str]] = []
    asks = Asks(lambda names, _why: again.append(names))
    ask = Ask("apply", [], first=1)
    asks.add(ask)
    asks.resolve(1, Pass("clone", "snap").ctx)
    asks.looked(1, "clone", True, VolumeOutcome("clone"))  # waits for snap
    asks.looked(1, "snap", False, None)
    assert again == []
    asks.finished("snap", changed("snap"))
    assert again == [{"clone"}] and not ask.closed  # one more pass, for it
    asks.looked(2, "clone", False, changed("clone"))
    doc = drain(ask)[-1]["result"]["doc"]
    assert doc["recap"] == {"ok": 0, "changed": 2, "failed": 0}
    assert [v["name"] for v in doc["volumes"]] == ["clone", "snap"]


def test_frozen_unrecorded_missing_and_refused() -> None:
    asks = Asks(lambda names, why: None)
    ask = Ask("apply", [{"name": "f"}, {"name": "u"}], first=1)
    missing = Ask("apply", [{"name": "nope"}], first=1)
    refused = Ask("release", [], first=3)
    for a in (ask, missing, refused):
        asks.add(a)
    asks.resolve(1, Pass("u", frozen=("f",), unrecorded=("u",)).ctx)
    vols = {v["name"]: v for v in drain(ask)[-1]["result"]["doc"]["volumes"]}
    assert vols["f"]["error"] == FROZEN and "stateDir is full" in vols["u"]["error"]
    assert drain(missing)[-1] == {"exit": 1, "error": "no volume nope in the daemon's "
                                                      "desiredDir or csi.dir (nothing done)"}
    asks.pass_ended(3, "the daemon is not reconciling: untrusted")
    assert drain(refused)[-1] == {"exit": 1, "error": "the daemon is not reconciling: untrusted"}


def test_release_holds_and_removal_takes_what_this_pass_lets_go() -> None:
    asks = Asks(lambda names, why: None)
    release = Ask("release", [{"path": "/etc/rbd-reconciler/volumes.d/a.yaml"}], first=1)
    removal = Ask("removal", [], first=1, allowance=Allowance(frozenset({"gone", "kept"})))
    asks.add(release)
    asks.add(removal)
    assert asks.allowance(1) == Allowance(frozenset({"gone", "kept"}))
    p = Pass("a", "kept", released=("gone",))
    assert asks.resolve(1, p.ctx) == {"a", "gone"}
    assert p.held == {"a"}
    assert removal.left == ["kept: still declared in /etc/rbd-reconciler/volumes.d/kept.yaml"]
    assert asks.allowance(2) == Allowance()  # answered: not asked again


def test_a_job_reserves_its_volume_and_the_stop_ends_the_rest() -> None:
    asks = Asks(lambda names, why: None)
    job = Ask("job", [{"name": "a"}], first=1)
    other = Ask("apply", [], first=5)
    asks.add(job)
    asks.add(other)
    p = Pass("a")
    asks.resolve(1, p.ctx)
    assert p.reserved == ["a"] and job.reserved is not None
    assert [e["event"] for e in job.events()] == ["reserved"]
    assert job not in asks._current()  # reserved: the passes are done with it
    asks.stop("the daemon is stopping")
    assert drain(other)[-1]["exit"] == 1 and not drain(job)  # the job's reserver ends it


# -- every ask ends (issue 37) ----------------------------------------------------------
class Counter:
    """The daemon's pass numbers and its looks again, as the asks see them."""

    def __init__(self) -> None:
        self.next = 1
        self.again: list[set[str]] = []

    def asks(self) -> Asks:
        return Asks(lambda names, _why: self.again.append(names), lambda: self.next)


def test_apply_of_every_volume_counts_the_release_running_for_a_removed_file() -> None:
    # A commit removed gone.yaml: the daemon's release of it runs; root types
    # `apply`. The release is the removal asked for: its end is the answer
    # (before, the ask waited for a look no pass would make: its record is
    # dropped when the release ends).
    c = Counter()
    asks = c.asks()
    asks.started("gone", Inflight("h", "release"))
    ask = Ask("apply", [], first=1)
    asks.add(ask)
    assert asks.resolve(1, Pass("v1", released=("gone",)).ctx) == {"v1"}
    asks.looked(1, "v1", False, VolumeOutcome("v1"))
    asks.pass_ended(1, None, current={"v1"}, released={"gone"})
    assert not ask.closed
    asks.finished("gone", changed("gone"))
    final = drain(ask)[-1]
    assert final["exit"] == 0 and final["result"]["doc"]["recap"] == {
        "ok": 1, "changed": 1, "failed": 0}


def test_a_volume_the_due_pass_did_not_look_at_is_answered_when_that_pass_ends() -> None:
    # Every volume and a removal whose release ended before the pass looked:
    # record and file gone, no pass will ever plan it again.
    c = Counter()
    asks = c.asks()
    every, named = Ask("apply", [], first=2), Ask("apply", [{"name": "v2"}], first=2)
    asks.add(every)
    asks.add(named)
    assert asks.resolve(2, Pass("v1", "v2", released=("gone",)).ctx) == {"v1", "v2", "gone"}
    asks.looked(2, "v1", False, VolumeOutcome("v1"))
    asks.pass_ended(2, None, current={"v1"}, released=set())  # v2's file went meanwhile
    by = {v["name"]: v for v in drain(every)[-1]["result"]["doc"]["volumes"]}
    assert by["gone"]["status"] == "ok" and by["gone"]["notes"]
    assert by["v2"]["status"] == "ok"  # every volume: it is not declared, so nothing to do
    final = drain(named)[-1]
    assert final["exit"] == 1 and "its file is gone" in final["result"]["doc"]["volumes"][0][
        "error"]


def test_a_chain_an_ask_waited_for_ends_and_the_next_pass_must_answer() -> None:
    # apply v1 while a chain for v1's older spec runs: looked at after it
    # ends, at once (a failed chain's backoff forgotten), by the next pass.
    c = Counter()
    asks = c.asks()
    asks.started("v1", Inflight("old", "converge"))
    ask = Ask("apply", [{"name": "v1"}], first=1)
    asks.add(ask)
    assert asks.resolve(1, Pass("v1").ctx) == set()
    c.next = 2
    asks.finished("v1", VolumeOutcome("v1", status="failed", error="old spec"))
    assert c.again == [{"v1"}] and not ask.closed
    asks.pass_ended(1, None, current={"v1"})  # the pass under way: not due
    assert not ask.closed
    asks.pass_ended(2, None, current={"v1"})  # pass 2 was due and did not look
    final = drain(ask)[-1]
    assert final["exit"] == 1 and "did not get to it" in final["result"]["doc"]["volumes"][0][
        "error"]


def test_a_chain_that_ended_before_the_ask_was_resolved_is_never_counted() -> None:
    # The daemon used to hand the asks a copy of the chains in flight: one
    # that ended between the copy and the resolution was counted, and its
    # answer never came. Now the chains are kept under the asks' own lock.
    asks = Counter().asks()
    asks.started("a", Inflight(vol("a").spec_hash, "converge"))
    asks.finished("a", changed("a"))
    ask = Ask("apply", [{"name": "a"}], first=1)
    asks.add(ask)
    assert asks.resolve(1, Pass("a").ctx) == {"a"}
    assert ask.counted == set()
    asks.looked(1, "a", False, VolumeOutcome("a"))
    assert drain(ask)[-1]["exit"] == 0


def test_an_aborted_chain_fails_the_ask_and_the_recap_counts_it() -> None:
    # SIGTERM during the format: `apply v3 && start-app` must not start the app.
    asks = Counter().asks()
    ask = Ask("apply", [{"name": "v3"}], first=1)
    asks.add(ask)
    asks.resolve(1, Pass("v3").ctx)
    asks.looked(1, "v3", False, None)
    asks.finished("v3", VolumeOutcome("v3", status="aborted", error="daemon stopping"))
    final = drain(ask)[-1]
    assert final["exit"] == 1
    assert final["result"]["doc"]["recap"] == {"ok": 0, "changed": 0, "failed": 0, "aborted": 1}


def test_a_job_ending_lets_a_waiting_ask_be_looked_at() -> None:
    c = Counter()
    asks = c.asks()
    asks.started("a", Inflight("", "job"))
    ask = Ask("release", [{"name": "a"}], first=1)
    asks.add(ask)
    assert asks.resolve(1, Pass("a").ctx) == set()
    c.next = 3
    asks.finished("a", None)
    assert ask.due == {"a": 3} and c.again == [{"a"}]


# -- review of issue 37 (fault injection) ---------------------------------------------
def test_a_chain_whose_end_comes_late_never_answers_for_the_chain_that_replaced_it() -> None:
    # `apply a` while a chain for a's older spec runs: not counted, looked at
    # after it. That chain's thread drops it from the daemon's inflight
    # (_record_outcome) before it tells the asks (finished): a pass in that
    # window looks at `a` (dirty) and starts the chain for the new spec, and
    # the ask counts it. The old chain's late `finished` must neither answer
    # for the new one (its result, for the old spec, exit 0) nor forget that
    # the new one runs.
    c = Counter()
    asks = c.asks()
    old = Inflight("old", "converge")
    asks.started("a", old)
    ask = Ask("apply", [{"name": "a"}], first=1)
    asks.add(ask)
    assert asks.resolve(1, Pass("a").ctx) == set()
    new = Inflight(vol("a").spec_hash, "converge")
    # Pass 2, in the old chain's window: the chain for the new spec starts.
    asks.started("a", new)
    asks.looked(2, "a", False, None)
    assert ask.counted == {"a"}
    asks.finished("a", changed("a"), old)  # the old chain's end reaches the asks now
    assert not ask.closed, drain(ask)
    assert asks._running.get("a") is new  # the new chain still runs
    asks.finished("a", VolumeOutcome("a", status="failed", error="mkfs failed"), new)
    final = drain(ask)[-1]
    assert final["exit"] == 1 and final["result"]["doc"]["volumes"][0]["error"] == "mkfs failed"


def test_a_job_waiting_behind_a_chain_gets_a_pass_when_the_chain_ends() -> None:
    # `rotate-key a` while a's chain runs: the pass cannot reserve it and the
    # job waits. When the chain ends, a pass must come at once to reserve it
    # (else the job waits for the resync, or a failed chain's backoff: a
    # succeeded chain only marks the volume dirty, it wakes nothing).
    c = Counter()
    asks = c.asks()
    chain = Inflight(vol("a").spec_hash, "converge")
    asks.started("a", chain)
    job = Ask("job", [{"name": "a"}], first=1)
    asks.add(job)
    p = Pass("a")
    p.reserve = lambda name: False  # type: ignore[method-assign]  # a chain runs for it
    p.ctx.reserve = p.reserve
    asks.resolve(1, p.ctx)
    assert job.resolved_in is None and not job.closed
    c.next = 2
    asks.finished("a", changed("a"))
    assert c.again == [{"a"}]  # a pass at once, to reserve it


def test_an_ask_made_after_the_stop_ended_the_asks_ends_at_once() -> None:
    # SIGTERM: the chains end, `stop` answers the open asks; the control
    # socket still serves a few seconds (the other threads stop first). An
    # `apply` typed then was never answered: no pass would come.
    asks = Counter().asks()
    asks.stop("the daemon is stopping (SIGTERM)")
    late = Ask("apply", [{"name": "a"}], first=9)
    asks.add(late)
    assert late.closed and drain(late)[-1] == {"exit": 1,
                                               "error": "the daemon is stopping (SIGTERM)"}
