"""READY=1 (daemon/readiness.py): once the first pass's chains have ended,
or the limit passed; asked by the loop, never waited on."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest

from reconciler.daemon import readiness
from reconciler.daemon.readiness import FirstChains


@pytest.fixture
def said(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    out: list[str] = []
    monkeypatch.setattr(readiness.sdnotify, "notify", out.append)
    return out


def running() -> Future[None]:
    f: Future[None] = Future()
    f.set_running_or_notify_cancel()
    return f


def test_no_chain_ready_at_once(said: list[str]) -> None:
    first = FirstChains()
    first.begin({})
    assert said == ["READY=1"]
    assert first.check() == float("inf")
    first.stopping()
    assert said == ["READY=1"]  # once


def test_ready_when_the_last_chain_ends(said: list[str]) -> None:
    a, b = running(), running()
    first = FirstChains()
    first.begin({"a": a, "b": b})
    assert said == ["STATUS=starting: bringing up 2 volume(s)"]
    assert 0 < first.check() <= readiness.CHECK_S  # asked again soon, never waited on
    a.set_result(None)
    first.check()
    assert "READY=1" not in said
    b.set_result(None)
    assert first.check() == float("inf")
    assert said[-1] == "READY=1"


def test_ready_at_the_limit_naming_what_runs(said: list[str],
                                             caplog: pytest.LogCaptureFixture) -> None:
    first = FirstChains(limit=0.05)
    first.begin({"stuck": running()})
    time.sleep(0.06)
    assert first.check() == float("inf")
    assert said[-1] == "READY=1"
    assert "still converging: stuck" in caplog.text


def test_a_stop_ends_the_wait(said: list[str]) -> None:
    first = FirstChains()
    first.begin({"a": running()})
    first.stopping()
    assert said[-1] == "READY=1"


# --- issue: a boot with Ceph unreachable ----------------------------------------
# What is known not to come up soon (its pool or image did not answer within
# observeTimeoutSeconds) is not waited for, and READY=1 says so.


def test_unknown_volumes_are_not_waited_for_and_named(
        said: list[str], caplog: pytest.LogCaptureFixture) -> None:
    first = FirstChains()
    why = "unknown: cannot see pool 'rbd' (cannot reach Ceph: no answer within 5 s)"
    first.not_waiting({"b": why, "a": why, "c": "unknown: cannot read /dev/x: EIO"})
    first.begin({})
    assert said[-1] == "READY=1"
    assert said[-2] == (f"STATUS=ready; 3 volume(s) not waited for: a, b ({why}); "
                        "c (unknown: cannot read /dev/x: EIO)")
    assert "not waited for: a, b (unknown: cannot see pool 'rbd'" in caplog.text


def test_a_volume_seen_again_is_no_longer_named(said: list[str]) -> None:
    first = FirstChains()
    first.not_waiting({"a": "unknown: no answer"})
    first.seen({"a"})
    first.begin({})
    assert said == ["READY=1"]


def probing(said: list[str], answers: dict[str, str], calls: list[list[str]]
            ) -> FirstChains:
    def probe(names: list[str]) -> dict[str, str]:
        calls.append(names)
        return {n: w for n, w in answers.items() if n in names}
    return FirstChains(probe=probe, probe_every=0.02)


def wait_until(cond: object, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_a_chain_whose_pool_stops_answering_is_not_waited_for(
        said: list[str], caplog: pytest.LogCaptureFixture) -> None:
    calls: list[list[str]] = []
    gone = "pool 'dead' did not answer within 5 s (no answer within 5 s)"
    first = probing(said, {"stuck": gone}, calls)
    healthy, stuck = running(), running()
    first.begin({"healthy": healthy, "stuck": stuck})
    wait_until(lambda: calls)
    # The healthy one is still waited for: its pool answers.
    assert "READY=1" not in said
    healthy.set_result(None)
    wait_until(lambda: "READY=1" in said)
    assert not stuck.done()  # its chain runs on; READY=1 did not wait for it
    assert said[-2] == f"STATUS=ready; 1 volume(s) not waited for: stuck ({gone})"
    assert "stuck not waited for: its chain runs on" in caplog.text


def test_chains_on_a_cluster_that_answers_are_waited_for(said: list[str]) -> None:
    calls: list[list[str]] = []
    first = probing(said, {}, calls)
    a = running()
    first.begin({"a": a})
    wait_until(lambda: len(calls) >= 3)
    assert "READY=1" not in said and calls[0] == ["a"]
    a.set_result(None)
    first.check()
    assert said[-1] == "READY=1"
    n = len(calls)
    time.sleep(0.1)  # the prober stopped with READY=1 (bounded: it would have probed 5 times)
    assert len(calls) <= n + 1


def test_a_hanging_probe_holds_nothing_up(said: list[str]) -> None:
    release, entered = threading.Event(), threading.Event()

    def probe(names: list[str]) -> dict[str, str]:
        entered.set()
        release.wait(10)
        return {}

    first = FirstChains(probe=probe, probe_every=0.01)
    a = running()
    first.begin({"a": a})
    assert entered.wait(10)  # the probe is under way, hanging
    a.set_result(None)  # the chain's end says READY=1, probe or not
    assert said[-1] == "READY=1"
    release.set()


def test_a_failing_probe_is_logged_and_the_wait_goes_on(
        said: list[str], caplog: pytest.LogCaptureFixture) -> None:
    def probe(names: list[str]) -> dict[str, str]:
        raise RuntimeError("boom")

    first = FirstChains(probe=probe, probe_every=0.01)
    a = running()
    first.begin({"a": a})
    wait_until(lambda: "probe of a failed: boom" in caplog.text)
    assert "READY=1" not in said
    a.set_result(None)
    assert said[-1] == "READY=1"


def test_a_reason_cannot_smuggle_assignments_into_sd_notify(said: list[str]) -> None:
    """sd_notify is newline-separated assignments: a reason (Ceph's error
    text, an unknown condition's message) holding a newline would add its
    own (MAINPID=, WATCHDOG=trigger, STOPPING=1...) to STATUS=."""
    first = FirstChains()
    first.not_waiting({"x": "unknown: boom\nMAINPID=1\nWATCHDOG=trigger"})
    first.begin({})
    status = [s for s in said if s.startswith("STATUS=")]
    assert len(status) == 1 and "\n" not in status[0] and "\x1b" not in status[0]
    assert "MAINPID=1" in status[0]  # said, escaped, on the one line
    assert said[-1] == "READY=1"


def test_an_unknown_volume_whose_chain_starts_before_ready_is_waited_for(
        said: list[str]) -> None:
    """Unknown at the first pass (Ceph not answering), then seen by a pass
    while other first chains still run (Ceph back): its chain is converging
    on a cluster that answers, so READY=1 waits for it too. Else READY=1
    came at the others' end, its volume still being mapped, and, its name
    taken back by ``seen``, said nothing of it: an application ordered
    After= the daemon wrote into its empty publish directory."""
    first = FirstChains()
    first.not_waiting({"late": "unknown: cannot see pool 'rbd'"})
    a, late = running(), running()
    first.begin({"a": a})
    first.seen({"late"}, {"a": a, "late": late})  # the next pass: its chain started
    a.set_result(None)
    first.check()
    assert "READY=1" not in said
    late.set_result(None)
    assert said[-1] == "READY=1"
    assert not [s for s in said if "not waited for" in s]


def test_a_record_that_does_not_load_stops_no_other_probe(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """service._probe_first_chains: one record that does not load (written
    by another version) is left out; the others are probed as ever, so a
    volume whose pool does not answer is still not waited for."""
    import threading
    from types import SimpleNamespace

    from test_plan import volume

    from reconciler.daemon import service
    from reconciler.observe.ceph import CephView
    from reconciler.spec.model import volume_to_dict

    asked: list[set[tuple[str, str]]] = []

    def observe_images(_ceph: object, wanted: set[tuple[str, str]], *_a: object) -> CephView:
        asked.append(wanted)
        return CephView(errors={"rbd": "timed out"})

    monkeypatch.setattr(service, "observe_images", observe_images)
    good = volume_to_dict(volume())
    fake = SimpleNamespace(
        config=SimpleNamespace(ceph=None, observe_timeout_seconds=5.0),
        node=SimpleNamespace(ceph_session=None), lock=threading.Lock(),
        records={"pgdata": {"volume": good}, "bad": {"volume": {"name": "bad"}},
                 "worse": {"volume": "not a mapping"}})
    got = service.Daemon._probe_first_chains(fake, ["bad", "worse", "pgdata"])  # type: ignore[arg-type]
    assert asked == [{("rbd", "pgdata")}]
    assert list(got) == ["pgdata"] and "did not answer within 5 s" in got["pgdata"]
