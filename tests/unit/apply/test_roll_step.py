"""The roll step (apply/mapsteps.py ``roll``): one at a time on the node (the
lock), the claim then naming the new client only (the old one closed the
image at its detach: nothing blocklisted), and a second writer seen right
after it detached again."""

from __future__ import annotations

from typing import Any

import pytest
from test_reattach_step_review import OTHER, FakeClaims, FakeNbd, chain

from reconciler.apply.outcomes import StepRefused
from reconciler.drivers import nbdhelper
from reconciler.facts.claim import Claim
from reconciler.plan.steps import RollNbd

OLD, NEW = "10.0.0.1:0/111", "10.0.0.1:0/222"
STEP = RollNbd("pgdata", "rbd", "pgdata", "/dev/nbd0", "c00k1e", 4242, "16.2.11", ())


class RollingNbd(FakeNbd):
    def __init__(self, result: bool = True) -> None:
        super().__init__()
        self.result = result

    def roll(self, *args: Any) -> bool:
        self.calls.append(("roll", args))
        return self.result


@pytest.fixture(autouse=True)
def lock_here(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    path = tmp_path / "roll.lock"
    monkeypatch.setattr(nbdhelper, "ROLL_LOCK", path)
    monkeypatch.setattr(nbdhelper, "ROLL_LOCK_WAIT_S", 0.1)
    return path


def test_a_roll_records_the_new_client_and_blocklists_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    claims = FakeClaims(monkeypatch, Claim("node-a", (OLD,)), (NEW,))
    nbd = RollingNbd()
    assert chain(nbd).roll(STEP) == ("changed", "rolled /dev/nbd0 onto the rbd-nbd on disk")
    assert nbd.calls == [("roll", ("rbd", "pgdata", "/dev/nbd0", "c00k1e", 4242, ()))]
    assert claims.recorded == [(NEW,)] and claims.blocklisted == []


def test_a_roll_waits_for_another_one_and_then_leaves_it_to_a_later_pass(
        monkeypatch: pytest.MonkeyPatch, lock_here: Any) -> None:
    FakeClaims(monkeypatch, Claim("node-a", (OLD,)), (NEW,))
    nbd = RollingNbd()
    with nbdhelper.roll_lock(lock_here):
        status, message = chain(nbd).roll(STEP)
    assert status == "ok" and "another rbd-nbd roll" in message and nbd.calls == []


def test_a_second_writer_right_after_the_roll_is_detached_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    claims = FakeClaims(monkeypatch, Claim("node-a", (OLD,)), (NEW, OTHER))
    nbd = RollingNbd()
    with pytest.raises(StepRefused, match="detached again"):
        chain(nbd).roll(STEP)
    assert nbd.calls[-1] == ("detach", ("/dev/nbd0",)) and claims.recorded == []


def test_a_helper_current_by_now_is_ok_and_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    claims = FakeClaims(monkeypatch, Claim("node-a", (OLD,)), (OLD,))
    assert chain(RollingNbd(result=False)).roll(STEP)[0] == "ok"
    assert claims.recorded == []


def test_the_roll_metric_counts_changed_rolls_by_volume() -> None:
    from reconciler.apply.outcomes import StepOutcome, VolumeOutcome
    from reconciler.daemon.metrics import Metrics
    from reconciler.plan.types import VolumePlan

    m = Metrics()
    out = VolumeOutcome("pgdata")
    out.steps.append(StepOutcome(STEP, "changed", seconds=1.0))
    m.outcome(VolumePlan("pgdata", steps=[STEP]), out)
    assert m.rolls.labels("pgdata")._value.get() == 1
