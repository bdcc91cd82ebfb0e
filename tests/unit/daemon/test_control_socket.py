"""The control socket without a daemon (daemon/control.py, daemon/protocol.py):
0600 in place, one request per connection, root only by SO_PEERCRED, a
stale socket replaced, a live one never taken over."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from reconciler.daemon import protocol
from reconciler.daemon.control import ControlServer, Reply, answering

NOBODY = 65534


def handler(request: dict[str, Any], reply: Reply) -> None:
    if request["command"] == "ping":
        reply.finish(0, result={"pid": os.getpid(), "stateDir": "/somewhere"})
        return
    reply.event("say", text="working")
    reply.finish(0, result={"kind": "echo", "doc": request.get("args")})


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ControlServer]:
    s = ControlServer(tmp_path / "run" / "control.sock", handler)
    s.start()
    yield s
    s.stop()


def ask(path: Path, request: dict[str, Any]) -> list[dict[str, Any]]:
    with protocol.connect(path, 10) as sock:
        sock.sendall(protocol.line(request))
        return list(protocol.lines(sock))


def test_one_request_its_events_and_a_final_line(server: ControlServer) -> None:
    st = server.path.lstat()
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert os.listdir(server.path.parent) == ["control.sock"]  # the private dir is gone
    got = ask(server.path, {"protocol": 1, "command": "status", "args": {"x": 1}})
    assert got == [{"event": "accepted"}, {"event": "say", "text": "working"},
                   {"exit": 0, "result": {"kind": "echo", "doc": {"x": 1}}}]
    bad = ask(server.path, {"protocol": 2, "command": "status"})
    assert bad == [{"exit": 64, "error": "bad request: protocol 2; this daemon speaks 1"}]
    assert ask(server.path, {"protocol": 1, "command": "rm -rf"})[0]["exit"] == 64


def test_a_live_daemon_is_never_taken_over_a_stale_socket_is(server: ControlServer,
                                                             tmp_path: Path) -> None:
    assert answering(server.path) == {"pid": os.getpid(), "stateDir": "/somewhere"}
    with pytest.raises(RuntimeError, match=r"another rbd-reconciler daemon answers there "
                                           rf"\(pid {os.getpid()}, stateDir /somewhere\)"):
        ControlServer(server.path, handler).start()
    stale = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(stale))
    s.close()  # a killed daemon's: nobody listens
    assert answering(stale) is None
    with pytest.raises(ConnectionRefusedError):
        protocol.connect(stale)
    second = ControlServer(stale, handler)
    second.start()
    try:
        assert ask(stale, {"protocol": 1, "command": "ping"})[-1]["exit"] == 0
    finally:
        second.stop()
    assert not stale.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a client of nobody's)")
def test_a_client_not_root_is_refused_by_its_uid(server: ControlServer) -> None:
    client = ("import socket, sys; s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); "
              "s.sendall(b'{\"protocol\": 1, \"command\": \"status\"}\\n'); "
              "print(s.makefile().read())")
    # The file's mode keeps nobody out; with CAP_DAC_OVERRIDE kept across the
    # uid change it gets through that, and the daemon refuses it by its uid.
    r = subprocess.run(["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY),
                        "--clear-groups", "--inh-caps", "+dac_override", "--ambient-caps",
                        "+dac_override", sys.executable, "-c", client, str(server.path)],
                       capture_output=True, text=True, timeout=60)
    assert json.loads(r.stdout) == {
        "exit": 1, "error": f"the control socket answers root only (this client runs as "
                            f"uid {NOBODY})"}, r.stderr


def test_the_client_refuses_a_socket_someone_else_could_have_placed(tmp_path: Path) -> None:
    d = tmp_path / "open"
    d.mkdir()
    d.chmod(0o777)
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(d / "control.sock"))
    s.listen(1)
    try:
        with pytest.raises(protocol.Untrusted, match="writable by group or others"):
            protocol.connect(d / "control.sock")
    finally:
        s.close()
    with pytest.raises(FileNotFoundError):
        protocol.connect(tmp_path / "none.sock")


# -- issue 37: every wait bounded, a client gone noticed ------------------------------
def wait_until(cond: Callable[[], object], what: str, timeout: float = 10.0) -> None:
    """Poll ``cond`` with a deadline (never a bare sleep as synchronisation)."""
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out after {timeout:g} s waiting for {what}"
        time.sleep(0.01)


class Slow:
    """A handler that works until the test lets it end, or its client is gone."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.saw_gone = threading.Event()

    def __call__(self, request: dict[str, Any], reply: Reply) -> None:
        if request["command"] == "ping":
            reply.finish(0, result={"connections": reply.others()})
            return
        while not self.release.wait(0.01):
            if reply.gone:
                self.saw_gone.set()
                return
        reply.finish(0, result={"kind": "done"})


@pytest.fixture
def slow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[ControlServer, Slow]]:
    monkeypatch.setattr(protocol, "KEEPALIVE_S", 0.05, raising=False)
    work = Slow()
    s = ControlServer(tmp_path / "run" / "control.sock", work)
    s.start()
    yield s, work
    work.release.set()
    s.stop()


def test_a_request_nested_too_deeply_is_a_bad_request_not_an_internal_error(
        server: ControlServer, caplog: pytest.LogCaptureFixture) -> None:
    deep = b'{"protocol": 1, "command": "status", "args": ' + b"[" * 30000 + b"\n"
    with protocol.connect(server.path, 10) as sock:
        sock.sendall(deep)
        got = list(protocol.lines(sock))
    assert got == [{"exit": 64, "error": "bad request: nested too deeply"}]
    assert not [r for r in caplog.records if r.exc_info], caplog.text  # no traceback logged
    with pytest.raises(ValueError, match="nested too deeply"):  # the client's parse too
        protocol.parse(b"[" * 30000)


def test_a_daemon_at_work_says_so_and_every_line_has_a_deadline(
        slow: tuple[ControlServer, Slow]) -> None:
    server, work = slow
    with protocol.connect(server.path, 10) as sock:
        sock.sendall(protocol.line({"protocol": 1, "command": "apply"}))
        sock.settimeout(5)
        answer = protocol.lines(sock)
        assert next(answer) == {"event": "accepted"}
        assert next(answer) == {"event": "working"}  # within KEEPALIVE_S, while it works
        assert next(answer) == {"event": "working"}
        work.release.set()
        rest = list(answer)
    assert rest[-1] == {"exit": 0, "result": {"kind": "done"}}
    assert set(map(str, rest[:-1])) <= {str({"event": "working"})}  # nothing after the final


def test_a_client_gone_is_noticed_and_its_connection_ends(
        slow: tuple[ControlServer, Slow]) -> None:
    server, work = slow
    sock = protocol.connect(server.path, 10)
    sock.sendall(protocol.line({"protocol": 1, "command": "apply"}))
    sock.settimeout(5)
    assert next(protocol.lines(sock)) == {"event": "accepted"}
    wait_until(lambda: server.serving() == 1, "the connection to be served")
    sock.close()  # Ctrl-C: the handler waits for nothing to say; the keepalive finds it gone
    wait_until(work.saw_gone.is_set, "the handler to see its client gone", 5)
    wait_until(lambda: server.serving() == 0, "the connection's thread to end", 5)
    assert not [t for t in threading.enumerate() if t.name == "control-keepalive"]
    [ping] = ask(server.path, {"protocol": 1, "command": "ping"})[1:]
    assert ping == {"exit": 0, "result": {"connections": 0}}  # the ping's own not counted


def test_a_silent_daemon_bounds_every_line_not_only_the_first(tmp_path: Path) -> None:
    path = tmp_path / "silent.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    listener.listen(1)
    try:
        with protocol.connect(path, 10) as sock:
            conn, _ = listener.accept()
            conn.sendall(protocol.line({"event": "accepted"}))  # then stopped: nothing more
            answer = protocol.lines(sock, every=0.2)
            assert next(answer) == {"event": "accepted"}
            t0 = time.monotonic()
            with pytest.raises(TimeoutError):
                next(answer)
            assert time.monotonic() - t0 < 2
            conn.close()
    finally:
        listener.close()


def test_a_full_listen_backlog_is_waited_for_within_the_deadline(tmp_path: Path) -> None:
    """A daemon that accepts nothing (stopped) fills its backlog: connect()
    on a unix socket then fails at once with EAGAIN, or, blocking, waits for
    ever. It is tried again until the deadline; room made meanwhile is taken."""
    path = tmp_path / "full.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    listener.listen(0)  # room for one connection not yet accepted
    queued = [socket.socket(socket.AF_UNIX)]
    try:
        queued[0].connect(str(path))
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            protocol.connect(path, 0.3)
        assert 0.3 <= time.monotonic() - t0 < 2
        result: list[object] = []
        waiting = threading.Thread(target=lambda: result.append(protocol.connect(path, 10)))
        waiting.start()
        conn, _ = listener.accept()  # room: the waiting connect gets in
        waiting.join(5)
        assert not waiting.is_alive() and isinstance(result[0], socket.socket)
        result[0].close()  # type: ignore[attr-defined]
        conn.close()
    finally:
        for s in queued:
            s.close()
        listener.close()


def test_a_daemon_stopped_at_the_socket_is_not_replaced(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from reconciler.daemon import control

    monkeypatch.setattr(control, "PROBE_TIMEOUT_S", 0.3)
    path = tmp_path / "run" / "control.sock"
    path.parent.mkdir(mode=0o700)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    listener.listen(1)  # it accepts nothing: SIGSTOPped
    try:
        with pytest.raises(RuntimeError, match="a daemon listens there but does not answer"):
            ControlServer(path, handler).start()
        assert path.exists()
    finally:
        listener.close()


def test_a_request_dripped_a_byte_at_a_time_is_cut_at_its_deadline(
        server: ControlServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """REQUEST_TIMEOUT_S bounds the whole request line, from the connection
    on: a client (buggy, or hostile) that sends a byte now and then, each
    within the bound, holds its thread no longer than that."""
    monkeypatch.setattr(protocol, "REQUEST_TIMEOUT_S", 1.0)
    req = protocol.line({"protocol": 1, "command": "status", "args": {}})
    with protocol.connect(server.path, 10) as sock:
        t0 = time.monotonic()
        sock.settimeout(0.3)
        answer = b""
        for b in req[:-1]:
            try:
                sock.sendall(bytes([b]))
                answer = sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                break
            if answer or time.monotonic() - t0 > 6:
                break
    took = time.monotonic() - t0
    assert b'"exit":64' in answer and took < 2.5, (answer, took)


def test_a_file_at_the_socket_path_is_a_refusal_to_start_not_a_crash(tmp_path: Path) -> None:
    """The daemon (service.py) refuses to start on RuntimeError or OSError
    with one line; the probe for a daemon already there must not raise
    anything else (protocol.Untrusted) past it."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    (run / "control.sock").write_text("not a socket")
    with pytest.raises(RuntimeError, match="not a socket"):
        ControlServer(run / "control.sock", handler).start()


def test_past_the_connections_it_serves_a_command_is_refused_at_once(
        slow: tuple[ControlServer, Slow], monkeypatch: pytest.MonkeyPatch) -> None:
    # A thread per connection: a loop of commands gone wrong must not take
    # the daemon's threads (review); past the cap, refused at once, not queued.
    from reconciler.daemon import control

    monkeypatch.setattr(control, "MAX_SERVING", 3)
    server, work = slow
    held = []
    for _ in range(3):
        sock = protocol.connect(server.path, 10)
        sock.sendall(protocol.line({"protocol": 1, "command": "apply"}))
        held.append(sock)
    wait_until(lambda: server.serving() == 3, "three connections served")
    with protocol.connect(server.path, 10) as sock:
        sock.settimeout(5)
        got = list(protocol.lines(sock))
    assert got == [{"exit": 1, "error": "the daemon serves 3 commands already; try again"}]
    work.release.set()
    for sock in held:
        sock.close()
    wait_until(lambda: server.serving() == 0, "the connections to end", 5)


def test_a_line_without_end_from_the_daemon_is_cut_at_its_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(protocol, "MAX_LINE_BYTES", 1 << 20)
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.settimeout(5)
        writer = threading.Thread(target=_send_quietly, args=(
            theirs, b'{"event": "accepted"}\n' + b"x" * (2 << 20)))
        writer.start()
        ours.settimeout(5)
        answer = protocol.lines(ours)
        assert next(answer) == {"event": "accepted"}
        with pytest.raises(ValueError, match="longer than"):
            next(answer)
        ours.shutdown(socket.SHUT_RDWR)  # the writer's send ends
        writer.join(5)


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    with contextlib.suppress(OSError):
        sock.sendall(data)
