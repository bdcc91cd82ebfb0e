"""READY=1 (daemon/readiness.py): once the first pass's chains have ended,
or the limit passed; asked by the loop, never waited on."""

from __future__ import annotations

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
