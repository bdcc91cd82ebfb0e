"""READY=1 is not held up by a pass under way (review of issue 39).

Before issue 39 the pass thread waited on the first pass's chains itself:
READY=1 came within half a second of the last one's end, at READY_WAIT_S
at the latest (the unit's TimeoutStartSec sits 60 s above it), and at once
on a stop. Now the loop goes on with passes meanwhile and asks
daemon/readiness.py on each turn; a turn comes only after the pass under
way, so a long pass (Ceph stalling, observe running to its deadlines)
pushed READY=1 past the last chain's end and past the limit, toward
systemd's start timeout. These tests hold the old bounds with a pass that
outlasts them.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest

from reconciler.daemon import readiness
from reconciler.daemon.loop import PassLoop
from reconciler.daemon.readiness import FirstChains

LONG_PASS_S = 2.0


@pytest.fixture
def said(monkeypatch: pytest.MonkeyPatch) -> list[tuple[float, str]]:
    out: list[tuple[float, str]] = []
    monkeypatch.setattr(readiness.sdnotify, "notify",
                        lambda m: out.append((time.monotonic(), m)) or True)
    return out


def ready_at(said: list[tuple[float, str]]) -> float | None:
    return next((t for t, m in said if m == "READY=1"), None)


def _run_loop(limit: float, chain: Future[None], after_first: threading.Event
              ) -> tuple[PassLoop, threading.Thread, threading.Event]:
    loop = PassLoop(threading.Lock())
    loop.first_chains = FirstChains(limit=limit)
    stopping, passes = threading.Event(), [0]

    def one_pass() -> None:
        passes[0] += 1
        if passes[0] == 1:
            return
        after_first.set()
        time.sleep(LONG_PASS_S)  # a pass that takes its time (Ceph stalling)

    worker = threading.Thread(
        target=loop.run, daemon=True,
        args=(one_pass, lambda: {"vol": chain}, lambda: 3600.0, stopping,
              threading.Event(), lambda: None))
    worker.start()
    loop.wake()  # an event: a second pass at once, which runs long
    return loop, worker, stopping


def _stop(loop: PassLoop, worker: threading.Thread, stopping: threading.Event) -> None:
    stopping.set()
    loop.wake()
    worker.join(LONG_PASS_S + 2)


def test_ready_at_the_limit_even_inside_a_long_pass(said: list[tuple[float, str]]) -> None:
    chain: Future[None] = Future()
    chain.set_running_or_notify_cancel()  # stuck: never ends
    t0, in_pass = time.monotonic(), threading.Event()
    loop, worker, stopping = _run_loop(0.3, chain, in_pass)
    try:
        assert in_pass.wait(2.0)
        time.sleep(1.0)  # well past the limit, the second pass still running
        at = ready_at(said)
        assert at is not None, "READY=1 waited for the pass under way, past the limit"
        assert at - t0 < 1.0
    finally:
        _stop(loop, worker, stopping)
    assert [m for _, m in said].count("READY=1") == 1


def test_ready_when_the_last_chain_ends_during_a_pass(said: list[tuple[float, str]]) -> None:
    chain: Future[None] = Future()
    chain.set_running_or_notify_cancel()
    in_pass = threading.Event()
    loop, worker, stopping = _run_loop(240.0, chain, in_pass)
    try:
        assert in_pass.wait(2.0)
        assert ready_at(said) is None  # the chain still runs
        ended = time.monotonic()
        chain.set_result(None)  # ends while the long pass runs
        time.sleep(0.6)
        at = ready_at(said)
        assert at is not None, "READY=1 waited for the pass under way"
        assert at - ended < 0.6
    finally:
        _stop(loop, worker, stopping)
    assert [m for _, m in said].count("READY=1") == 1


def test_stop_before_the_chains_end_is_ready_once(said: list[tuple[float, str]]) -> None:
    chain: Future[None] = Future()
    chain.set_running_or_notify_cancel()
    first = FirstChains(limit=0.2)
    first.begin({"vol": chain})
    first.stopping()
    time.sleep(0.4)  # the limit passes after the stop: nothing more is said
    chain.set_result(None)
    assert [m for _, m in said].count("READY=1") == 1
