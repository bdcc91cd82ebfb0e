"""The control socket without a daemon (daemon/control.py, daemon/protocol.py):
0600 in place, one request per connection, root only by SO_PEERCRED, a
stale socket replaced, a live one never taken over."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
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
