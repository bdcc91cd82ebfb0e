"""The command line's waits on the daemon are bounded, and what came is
never lost (cli/ask.py; issue 37): a daemon that goes silent after
"accepted" or after some results, one whose listen backlog is full, one
that dies mid-answer or answers nonsense; Ctrl-C anywhere."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from reconciler.cli import ask
from reconciler.daemon import protocol

ROOT = Path(__file__).resolve().parents[3]
ACCEPTED = {"event": "accepted"}


def volume(name: str, status: str = "changed") -> dict[str, Any]:
    return {"event": "volume", "volume": {"name": name, "status": status, "error": None,
                                          "steps": [], "undone": [], "notes": []}}


class FakeDaemon:
    """A control socket that answers every request with ``lines``, then
    ``then``: "close" (it died), "silent" (stopped: the connection held
    open, nothing sent) or "beat" (at work: ``working`` every 0.02 s)."""

    def __init__(self, path: Path, lines: list[dict[str, Any] | bytes], then: str) -> None:
        self.lines, self.then = lines, then
        self.connections = 0
        self.done = threading.Event()
        self.listener = socket.socket(socket.AF_UNIX)
        self.listener.bind(str(path))
        self.listener.listen(8)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.makefile("rb").readline()
            try:
                for obj in self.lines:
                    conn.sendall(obj if isinstance(obj, bytes) else protocol.line(obj))
                while self.then == "silent" and not self.done.wait(0.02):
                    pass
                while self.then == "beat" and not self.done.wait(0.02):
                    conn.sendall(protocol.line({"event": "working"}))
            except OSError:
                pass  # the client went away

    def close(self) -> None:
        self.done.set()
        self.listener.close()


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    d = tmp_path / "run"
    d.mkdir(mode=0o700)
    return d


@pytest.fixture
def daemon(run_dir: Path) -> Iterator[Callable[..., FakeDaemon]]:
    made: list[FakeDaemon] = []

    def make(lines: list[dict[str, Any] | bytes], then: str = "close") -> FakeDaemon:
        made.append(FakeDaemon(run_dir / "control.sock", lines, then))
        return made[-1]

    yield make
    for d in made:
        d.close()


@pytest.fixture(autouse=True)
def short_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """The documented bounds (10 s), made short for the test."""
    monkeypatch.setattr(protocol, "LINE_TIMEOUT_S", 0.5, raising=False)
    monkeypatch.setattr(protocol, "CONNECT_TIMEOUT_S", 0.5, raising=False)
    if hasattr(ask, "begin"):
        ask.begin()  # a command starts now


def bounded(fn: Callable[[], Any], seconds: float = 10.0) -> Any:
    """``fn()`` in a thread: its result, or a failure when it has not ended
    within ``seconds`` (a wait without a bound fails, never hangs the test)."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # handed to the test
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still waiting on the daemon after {seconds:g} s"
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


def asked(run_dir: Path, command: str, output: str = "human", observe: float = 5.0,
          **args: Any) -> Any:
    kw = {"observe_timeout": observe} if observe != 5.0 else {}
    return bounded(lambda: ask.ask_at(run_dir / "control.sock", "/var/lib/x", command, args,
                                      output, **kw))


def test_a_daemon_silent_after_accepted_is_not_waited_for(
        daemon: Callable[..., FakeDaemon], run_dir: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    daemon([ACCEPTED], then="silent")
    assert asked(run_dir, "status") is None  # looked at here instead
    err = capsys.readouterr().err
    assert "does not answer (stopped or stuck?); looking without it" in err, err
    ask.begin()
    assert asked(run_dir, "apply", targets=[]) == 1
    out, err = capsys.readouterr()
    assert out == "" and "said nothing for 0.5 s (stopped or stuck?" in err, err
    assert "no volume's result came" in err and "Traceback" not in err


def test_results_that_came_are_printed_when_the_daemon_dies(
        daemon: Callable[..., FakeDaemon], run_dir: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """apply a5 b5: b5's result came, then the daemon was killed while a5
    formatted. b5 is printed (it was done), a5 said to have no answer."""
    daemon([ACCEPTED, {"event": "started", "volumes": ["a5", "b5"], "errors": []},
            volume("b5")])
    assert asked(run_dir, "apply", targets=[{"name": "a5"}, {"name": "b5"}]) == 1
    out, err = capsys.readouterr()
    assert out == "changed: [b5]\n", out
    assert "the daemon's answer broke off (it closed the connection before its last line)" \
        in err and "no result came for a5" in err, err
    ask.begin()
    assert asked(run_dir, "apply", "json", targets=[{"name": "a5"}, {"name": "b5"}]) == 1
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert [v["name"] for v in doc["volumes"]] == ["b5"] and doc["notAnswered"] == ["a5"]
    assert doc["recap"] == {"ok": 0, "changed": 1, "failed": 0}


def test_results_that_came_are_printed_when_the_daemon_stops_answering(
        daemon: Callable[..., FakeDaemon], run_dir: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    daemon([ACCEPTED, {"event": "started", "volumes": ["a5", "b5", "c5"], "errors": []},
            volume("b5"), volume("a5", "ok")], then="silent")
    assert asked(run_dir, "release", targets=[]) == 1
    out, err = capsys.readouterr()
    assert out == "ok: [a5]\nchanged: [b5]\n", out
    assert "said nothing for 0.5 s" in err and "no result came for c5" in err, err


def test_a_daemon_stopping_mid_answer_still_says_what_did_not_come(
        daemon: Callable[..., FakeDaemon], run_dir: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    daemon([ACCEPTED, {"event": "started", "volumes": ["a5", "b5"], "errors": []},
            volume("b5"), {"exit": 1, "error": "the daemon is stopping (SIGTERM)"}])
    assert asked(run_dir, "apply", "json", targets=[]) == 1
    out, err = capsys.readouterr()
    assert json.loads(out)["notAnswered"] == ["a5"], out
    assert "the daemon is stopping (SIGTERM)" in err and "no result came for a5" in err


def test_a_look_waits_for_the_daemon_within_its_bound_only(
        daemon: Callable[..., FakeDaemon], run_dir: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """At work (it says so) but slower than twice observeTimeoutSeconds
    and a margin: the command looks on its own."""
    monkeypatch.setattr(ask, "VIEW_MARGIN_S", 0.2, raising=False)
    daemon([ACCEPTED], then="beat")
    t0 = time.monotonic()
    assert asked(run_dir, "explain", observe=0.1, name="a") is None
    assert time.monotonic() - t0 < 2
    err = capsys.readouterr().err
    assert "has not answered within 0.4 s; looking without it" in err, err


def test_a_line_that_is_not_the_protocol_breaks_the_answer_not_the_command(
        daemon: Callable[..., FakeDaemon], run_dir: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    daemon([ACCEPTED, b"[" * 30000 + b"\n"])
    assert asked(run_dir, "plan", targets=[]) is None
    assert "answer broke off (nested too deeply); looking without it" in capsys.readouterr().err
    ask.begin()
    assert asked(run_dir, "takeover", name="a", sure=True) == 1
    err = capsys.readouterr().err
    assert "broke off (nested too deeply)" in err and "takeover had not begun" in err, err


def full_backlog(path: Path) -> tuple[socket.socket, socket.socket]:
    """A listener that accepts nothing (a stopped daemon), its backlog full."""
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    listener.listen(0)
    queued = socket.socket(socket.AF_UNIX)
    queued.connect(str(path))
    return listener, queued


def test_a_full_listen_backlog_is_a_daemon_that_does_not_answer(
        run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    listener, queued = full_backlog(run_dir / "control.sock")
    try:
        assert asked(run_dir, "status") is None
        assert "does not answer (stopped or stuck?); looking without it" in \
            capsys.readouterr().err
        ask.begin()
        assert asked(run_dir, "apply", targets=[]) == 1
        assert "nothing asked of it" in capsys.readouterr().err
    finally:
        queued.close()
        listener.close()


def cli(config: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "reconciler", "--config", str(config),
                             *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT)


def node_config(tmp_path: Path, run_dir: Path) -> Path:
    for d in ("desired", "state"):
        (tmp_path / d).mkdir(mode=0o755)
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"desiredDir: {tmp_path}/desired\nstateDir: {tmp_path}/state\n"
                   f"controlSocket: {run_dir}/control.sock\nallowedRoots: [{tmp_path}]\n")
    return cfg


@pytest.mark.skipif(os.geteuid() != 0, reason="the daemon's commands are root's")
def test_a_command_asks_a_daemon_that_failed_it_once(
        daemon: Callable[..., FakeDaemon], run_dir: Path, tmp_path: Path) -> None:
    """The short way (cli/fast.py) asked, the daemon's answer broke off:
    the long way looks on its own, without asking again (one wait, one
    warning)."""
    fake = daemon([ACCEPTED])
    proc = cli(node_config(tmp_path, run_dir), "status")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert err.count("looking without it") == 1, err
    assert fake.connections == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="the daemon's commands are root's")
def test_ctrl_c_while_connecting_is_one_line_and_130(run_dir: Path, tmp_path: Path) -> None:
    listener, queued = full_backlog(run_dir / "control.sock")
    try:
        proc = cli(node_config(tmp_path, run_dir), "status")
        fds = Path(f"/proc/{proc.pid}/fd")

        def connecting() -> bool:  # its socket made: it is in connect() or about to be
            try:
                return any(os.readlink(f).startswith("socket:") for f in fds.iterdir())
            except OSError:
                return False

        end = time.monotonic() + 30
        while not connecting():
            assert proc.poll() is None and time.monotonic() < end, proc.communicate()
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=5)
    finally:
        queued.close()
        listener.close()
    assert proc.returncode == 130, err
    assert err == "rbd-reconciler: interrupted; nothing asked of the daemon\n", err


APPLIED_0 = {"exit": 0, "result": {"kind": "applied",
                                   "doc": {"recap": {"ok": 0, "changed": 0, "failed": 0}}}}


@pytest.mark.parametrize("said", [
    {"exit": None}, {"exit": 1e400}, {"exit": "0"}, {"exit": [0]}, {"exit": True},
    {"event": "volume"}, {"event": "volume", "volume": 5}, {"event": "started", "volumes": 5},
    {"event": "say"}, {"exit": 0, "result": 5}, {"exit": 0, "result": {"kind": "applied"}},
])
def test_a_line_of_the_wrong_shape_breaks_the_answer_not_the_command(
        daemon: Callable[..., FakeDaemon], run_dir: Path, said: dict[str, Any],
        capsys: pytest.CaptureFixture[str]) -> None:
    """A daemon (a bug, another version) whose line parses but is not what
    the protocol says: the answer broke off (exit 1, what did not come
    said), never a traceback, never exit 0."""
    daemon([ACCEPTED, said])
    assert asked(run_dir, "apply", targets=[]) == 1
    assert "answer broke off" in capsys.readouterr().err


@pytest.mark.parametrize("code", [256, -256, 512])
def test_an_exit_code_out_of_range_is_not_taken_for_0(
        daemon: Callable[..., FakeDaemon], run_dir: Path, code: int) -> None:
    """exit(256) is a process's 0: only 0..255 is an exit code."""
    daemon([ACCEPTED, {**APPLIED_0, "exit": code}])
    assert asked(run_dir, "apply", targets=[]) == 1


def test_exit_0_is_never_taken_while_a_named_volume_got_no_result(
        daemon: Callable[..., FakeDaemon], run_dir: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The daemon named a5 and b5, sent b5's result, then exit 0 (a bug):
    a5 was not seen converged, so the command does not exit 0."""
    daemon([ACCEPTED, {"event": "started", "volumes": ["a5", "b5"], "errors": []},
            volume("b5"), APPLIED_0])
    assert asked(run_dir, "apply", targets=[]) == 1
    out, err = capsys.readouterr()
    assert out.startswith("changed: [b5]\n") and "no result came for a5" in err, (out, err)


@pytest.mark.skipif(os.geteuid() != 0, reason="the daemon's commands are root's")
def test_no_traceback_on_the_short_way_whatever_the_daemon_says(
        daemon: Callable[..., FakeDaemon], run_dir: Path, tmp_path: Path) -> None:
    daemon([ACCEPTED, {"exit": None}])
    proc = cli(node_config(tmp_path, run_dir), "apply")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "Traceback" not in err, err


def test_ctrl_c_while_the_final_document_prints_adds_no_second_one(
        daemon: Callable[..., FakeDaemon], run_dir: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """-o json: Ctrl-C lands while the daemon's document is printed. Exit
    130, and no second document (what came, notAnswered) after it: every
    result had come."""
    daemon([ACCEPTED, {"event": "started", "volumes": ["a5"], "errors": []}, volume("a5"),
            {**APPLIED_0, "result": {"kind": "applied", "doc": {"recap": {}, "volumes": []}}}])
    from reconciler.cli import show

    def cut(doc: dict[str, Any]) -> None:
        monkeypatch.undo()
        print('{"recap"', end="")
        raise KeyboardInterrupt

    monkeypatch.setattr(show, "as_json", cut)
    assert asked(run_dir, "apply", "json", targets=[]) == 130
    out, err = capsys.readouterr()
    assert out == '{"recap"', out
    assert "no result came" not in err, err
