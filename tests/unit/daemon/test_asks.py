"""What the command line asks of the daemon's passes (daemon/asks.py), pass
by pass, without a daemon: which volumes an ask names, when it answers,
and that a chain is never counted twice nor run twice for it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from reconciler.apply.runner import StepOutcome, VolumeOutcome
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
                 released: tuple[str, ...] = (), inflight: dict[str, Inflight] | None = None,
                 unrecorded: tuple[str, ...] = ()) -> None:
        self.current = {n: vol(n) for n in names}
        self.held: set[str] = set()
        self.lifted: list[set[str] | None] = []
        self.reserved: list[str] = []
        self.ctx = PassContext(
            loaded=LoadResult(volumes=tuple(self.current.values()), diagnostics=(),
                              files=(), failed_files=frozenset(), frozen_names=frozenset(frozen)),
            current=self.current, frozen=set(frozen), released=set(released), held_back={},
            unrecorded=set(unrecorded), state_line="stateDir is full",
            inflight=inflight or {}, hold=self.hold, lift=self.lift, reserve=self.reserve)

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
    running = {"a": Inflight(vol("a").spec_hash, "converge"), "b": Inflight("old", "converge")}
    p = Pass("a", "b", inflight=running)
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
