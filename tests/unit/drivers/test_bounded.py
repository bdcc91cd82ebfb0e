"""Bounded reuses a few worker threads instead of starting one per call, and
keeps its promises: a stuck call is written off and replaced, never blocks
the others, and at most ``max_running`` calls run at once."""

from __future__ import annotations

import threading

import pytest

from reconciler.drivers.bounded import Bounded, NoAnswer

FOREVER = float("inf")


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the threads started while the test runs."""
    names: list[str] = []
    real = threading.Thread.start

    def start(self: threading.Thread) -> None:
        names.append(self.name)
        real(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    return names


def test_many_calls_start_at_most_max_running_threads(started: list[str]) -> None:
    calls = Bounded(max_running=4, name="t")
    running, most = [0], [0]
    lock = threading.Lock()

    def work(i: int) -> int:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        with lock:
            running[0] -= 1
        return i

    for _ in range(3):  # passes: the workers of the first serve the next
        tasks = [calls.submit(i, lambda i=i: work(i)) for i in range(200)]
        assert [calls.wait(t, 5, FOREVER) for t in tasks] == list(range(200))
    assert len(started) <= 4
    assert most[0] <= 4
    assert calls.inflight() == 0


def test_a_written_off_worker_is_replaced_and_others_still_run(started: list[str]) -> None:
    calls = Bounded(max_running=2, name="t")
    gates = [threading.Event(), threading.Event()]
    stuck = [calls.submit(f"stuck{i}", gates[i].wait) for i in range(2)]
    for t in stuck:
        try:
            calls.wait(t, 0.05, FOREVER)
        except NoAnswer:
            continue
        raise AssertionError("a stuck call answered")
    # Both workers are stuck with their calls: new ones get new workers.
    tasks = [calls.submit(i, lambda i=i: i * 2) for i in range(50)]
    assert [calls.wait(t, 5, FOREVER) for t in tasks] == [i * 2 for i in range(50)]
    assert len(started) <= 4
    for g in gates:
        g.set()
    assert [calls.wait(t, 5, FOREVER) for t in stuck] == [True, True]


def test_a_busy_key_that_is_not_stuck_still_runs_a_second_call() -> None:
    """Two CSI requests observing one pool at once: both get an answer (the
    second was once refused "still waiting", and its pool reported unknown)."""
    calls = Bounded(max_running=2, name="t")
    gate = threading.Event()
    first = calls.submit("pool", gate.wait)
    second = calls.submit("pool", lambda: "listed")
    assert calls.wait(second, 5, FOREVER) == "listed"
    gate.set()
    assert calls.wait(first, 5, FOREVER) is True
    assert calls.inflight() == 0
