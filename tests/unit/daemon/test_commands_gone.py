"""What the daemon's commands (daemon/commands.py) do when their client goes
away (issue 37): the thread serving it ends within a few seconds (the
keepalive's failed send says so), what was asked of the passes goes on, a
job not yet begun is dropped; and ``ping`` counts the connections served."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from test_asks import Pass
from test_control_socket import wait_until

from reconciler.daemon import commands, protocol
from reconciler.daemon.asks import Asks
from reconciler.daemon.commands import Commands
from reconciler.daemon.control import ControlServer


class Daemon:
    """What of the running daemon the commands use: passes that never come."""

    def __init__(self, state_dir: Path) -> None:
        self.config = SimpleNamespace(state_dir=state_dir)
        self.asks = Asks(lambda _names, _why: None)
        self.looked: list[set[str] | None] = []
        self.unreserved: list[str] = []

    def first_pass_after_now(self) -> int:
        return 1

    def look_again(self, names: set[str] | None, _why: str) -> None:
        self.looked.append(names)

    def unreserve(self, name: str) -> None:
        self.unreserved.append(name)


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
           ) -> Iterator[tuple[ControlServer, Daemon]]:
    monkeypatch.setattr(protocol, "KEEPALIVE_S", 0.05, raising=False)
    monkeypatch.setattr(commands, "GONE_CHECK_S", 0.05, raising=False)
    d = Daemon(tmp_path / "state")
    server = ControlServer(tmp_path / "run" / "control.sock", Commands(d).handle)  # type: ignore[arg-type]
    server.start()
    yield server, d
    server.stop()


def request(server: ControlServer, command: str, **args: Any) -> Any:
    """The request sent and "accepted" read: the connection, left open."""
    sock = protocol.connect(server.path, 10)
    sock.sendall(protocol.line({"protocol": 1, "command": command,
                                "stateDir": str(server.path.parent.parent / "state"),
                                "args": args}))
    sock.settimeout(5)
    assert next(protocol.lines(sock)) == {"event": "accepted"}
    return sock


def ping(server: ControlServer) -> dict[str, Any]:
    with protocol.connect(server.path, 10) as sock:
        sock.sendall(protocol.line({"protocol": 1, "command": "ping"}))
        sock.settimeout(5)
        return list(protocol.lines(sock))[-1]["result"]


def test_an_apply_whose_client_went_away_frees_its_thread_and_goes_on(
        served: tuple[ControlServer, Daemon]) -> None:
    server, d = served
    sock = request(server, "apply", targets=[{"name": "a"}])
    wait_until(lambda: server.serving() == 1, "the apply to be served")
    assert ping(server) == {"pid": os.getpid(), "stateDir": str(d.config.state_dir),
                            "connections": 1}  # the apply; not the ping itself
    sock.close()  # Ctrl-C, a killed command: nothing it waits for has come yet
    wait_until(lambda: server.serving() == 0, "the apply's thread to end", 5)
    assert ping(server)["connections"] == 0
    assert len(d.asks._current()) == 1  # what it asked of the passes goes on without it


def test_a_job_whose_client_went_away_before_it_began_is_dropped(
        served: tuple[ControlServer, Daemon]) -> None:
    server, d = served
    sock = request(server, "takeover", name="a", sure=True)
    wait_until(lambda: len(d.asks._current()) == 1, "the job's ask")
    sock.close()
    wait_until(lambda: server.serving() == 0, "the job's thread to end", 5)
    assert d.asks._current() == []  # no pass holds the volume for it later
    p = Pass("a")
    d.asks.resolve(1, p.ctx)
    assert p.reserved == [] and d.unreserved == []


def test_a_job_reserved_as_its_client_went_away_gives_the_volume_back(tmp_path: Path) -> None:
    d = Daemon(tmp_path / "state")
    p = Pass("a")
    d.look_again = lambda _names, _why: d.asks.resolve(1, p.ctx)  # type: ignore[method-assign]
    # The pass reserved it, the client is gone: never run, the volume given back.
    gone = SimpleNamespace(gone=True, event=lambda *_a, **_k: False,
                           finish=lambda *_a, **_k: None)

    def work(_name: str, _say: object) -> bool:
        raise AssertionError("a job run for a command gone")

    Commands(d)._job("a", gone, work)  # type: ignore[arg-type]
    assert p.reserved == ["a"] and d.unreserved == ["a"] and d.asks._current() == []
