"""Review: nbdnetlink._request against replies a kernel should not send but
a fault injector can: every one ends as an OSError, in bounded time, never
another exception (refresh catches OSError and ValueError only) or a loop."""

from __future__ import annotations

import struct
import time

import pytest

from reconciler.drivers import nbdnetlink as nl


class FakeSocket:
    def __init__(self, replies: list[bytes], forever: bytes | None = None) -> None:
        self.replies, self.forever, self.calls = list(replies), forever, 0

    def send(self, data: bytes) -> int:
        return len(data)

    def settimeout(self, _t: float | None) -> None:
        pass

    def recv(self, _n: int) -> bytes:
        self.calls += 1
        if self.calls > 20000:
            raise AssertionError("still receiving: a loop with no end")
        if self.replies:
            return self.replies.pop(0)
        if self.forever is not None:
            time.sleep(0.0005)
            return self.forever
        raise TimeoutError("timed out")


def message(kind: int, seq: int, payload: bytes) -> bytes:
    return struct.pack("=IHHII", 16 + len(payload), kind, 0, seq, 0) + payload


def test_a_truncated_error_message_is_an_oserror() -> None:
    sock = FakeSocket([message(nl.NLMSG_ERROR, 2, b"\xff\xff")])
    with pytest.raises(OSError):
        nl._request(sock, 30, nl.NBD_CMD_RECONFIGURE, b"", 2)  # type: ignore[arg-type]


def test_answers_for_another_request_without_end_are_bounded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nl, "REPLY_TIMEOUT_S", 0.2)
    sock = FakeSocket([], forever=message(nl.NLMSG_ERROR, 7, struct.pack("=i", 0)))
    t0 = time.monotonic()
    with pytest.raises(OSError):
        nl._request(sock, 30, nl.NBD_CMD_RECONFIGURE, b"", 2)  # type: ignore[arg-type]
    assert time.monotonic() - t0 < 5


def test_empty_reads_do_not_spin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nl, "REPLY_TIMEOUT_S", 0.2)
    with pytest.raises(OSError):
        nl._request(FakeSocket([], forever=b""), 30, 3, b"", 2)  # type: ignore[arg-type]


def test_the_acknowledgement_of_our_request_ends_it() -> None:
    sock = FakeSocket([message(nl.NLMSG_ERROR, 1, struct.pack("=i", 0)),
                       message(nl.NLMSG_ERROR, 2, struct.pack("=i", 0) + b"\0" * 16)])
    assert nl._request(sock, 30, 3, b"", 2) == {}  # type: ignore[arg-type]
    sock = FakeSocket([message(nl.NLMSG_ERROR, 2, struct.pack("=i", -22) + b"\0" * 16)])
    with pytest.raises(OSError, match="Invalid argument"):
        nl._request(sock, 30, 3, b"", 2)  # type: ignore[arg-type]
