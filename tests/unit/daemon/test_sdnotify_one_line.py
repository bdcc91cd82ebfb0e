"""daemon/sdnotify.py: one assignment per datagram, whatever its text. The
protocol is newline-separated assignments: a STATUS= whose text holds a
newline (passes.py's "refusing: <why>", the git source's verification
problem among them) would send assignments of its own (MAINPID=,
WATCHDOG=trigger, STOPPING=1)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from reconciler.daemon import sdnotify


def test_one_assignment_per_datagram(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(str(path))
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        assert sdnotify.notify("STATUS=refusing: bad\nMAINPID=1\r\nWATCHDOG=trigger")
        got = s.recv(4096).decode()
        assert got.startswith("STATUS=refusing: bad") and "\n" not in got and "\r" not in got
        assert sdnotify.notify("READY=1")
        assert s.recv(4096) == b"READY=1"


def test_a_status_shows_no_control_or_bidi_character_and_is_bounded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`systemctl status` prints STATUS= to the operator's terminal; a reason
    quoting a file name or image-meta may hold ESC, a bidi override, or a
    lone surrogate (which could not even be encoded)."""
    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(str(path))
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        assert sdnotify.notify("STATUS=refusing: a\x1b]0;x\x07b\u202ec\udc80" + "d" * 10000)
        got = s.recv(65536).decode()
        assert "\x1b" not in got and "\u202e" not in got and "\x07" not in got
        assert got.startswith("STATUS=refusing: a\\x1b]0;x\\x07b\\u202ec\\udc80d")
        assert len(got) <= sdnotify.MAX_MESSAGE
