"""The control socket's protocol (README: The command line beside the daemon).

JSON lines over a unix stream socket, one request per connection. The
client writes one line, an object::

    {"protocol": 1, "command": "apply", "stateDir": "/var/lib/rbd-reconciler",
     "args": {"targets": [{"name": "pgdata"}], ...}}

The daemon answers with lines: ``{"event": "accepted"}`` at once, events
while the work goes on (``{"event": "started", ...}``, ``{"event":
"volume", ...}``, ``{"event": "say", ...}``, and ``{"event": "working"}``
every KEEPALIVE_S while nothing else is said), then exactly one final line,
``{"exit": N, "result": {...}}`` or ``{"exit": N, "error": "..."}``, and
closes. A daemon that is stopped or stuck sends nothing at all: the client
bounds the wait for every line, not only the first. A
final ``{"exit": N, "elsewhere": "..."}`` says this daemon does not serve
the client's stateDir, ``{"exit": N, "alone": "..."}`` that its view is
not what is there (it refuses to reconcile): the client then works without
it.

Imported by the command line whenever it may ask the daemon: nothing heavy.
"""

from __future__ import annotations

import json
import os
import stat
import time

TYPE_CHECKING = False  # typing itself costs ~5 ms at start-up
if TYPE_CHECKING:
    import socket
    from collections.abc import Iterator
    from pathlib import Path
    from typing import Any

PROTOCOL = 1
MAX_REQUEST_BYTES = 64 * 1024  # a request names volumes and paths: far below this
MAX_LINE_BYTES = 64 * 1024 * 1024  # an answer's line: a volume's result, or a status of many
REQUEST_TIMEOUT_S = 10.0  # the whole request line, from the connection on
KEEPALIVE_S = 2.0  # a daemon at work says so this often ({"event": "working"})
# Every line of an answer (the first, "accepted", comes at once; the others
# at least every KEEPALIVE_S): past this without one, the daemon is stopped
# (SIGSTOP, a frozen cgroup) or stuck (a call holding the GIL).
LINE_TIMEOUT_S = 10.0
# A daemon that stopped accepting fills its listen backlog; a connect then
# fails at once (EAGAIN) and is tried again until this has passed.
CONNECT_TIMEOUT_S = 10.0

# The commands the daemon answers; every other is refused.
COMMANDS = ("ping", "apply", "release", "plan", "status", "explain", "rotate-key", "takeover",
            "allow-removal", "fleet-status")


def line(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, separators=(",", ":")) + "\n").encode()


def parse(raw: bytes) -> dict[str, Any]:
    """One line as an object; ValueError for anything else."""
    try:
        obj = json.loads(raw)
    except RecursionError:  # nested deeper than the parser goes: not a request of ours
        raise ValueError("nested too deeply") from None
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    return obj


class Untrusted(Exception):
    """The socket, or its directory, may be someone else's than root's."""


def connect(path: Path | str, timeout: float = CONNECT_TIMEOUT_S) -> socket.socket:
    """A connection to the control socket at ``path``, through its
    directory's descriptor (so a path longer than a unix socket address may
    hold works too), made within ``timeout`` (then the socket's timeout).
    FileNotFoundError or ConnectionRefusedError: no daemon serves there.
    TimeoutError: its listen backlog stayed full (it does not accept).
    Untrusted: the socket or its directory is not root's alone (whoever
    could place a socket there would get our requests)."""
    from reconciler.state.files import foreign, open_dir

    path = os.fspath(path)
    parent, name = os.path.split(path)
    dfd = open_dir(parent)  # type: ignore[arg-type]  # symlinks followed only where root placed them
    try:
        if (why := foreign(os.fstat(dfd))) is not None:
            raise Untrusted(f"controlSocket {path}: its directory is {why}; not talking to it")
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        if not stat.S_ISSOCK(st.st_mode):
            raise Untrusted(f"controlSocket {path} is not a socket")
        if st.st_uid not in (0, os.geteuid()):
            raise Untrusted(f"controlSocket {path} is owned by uid {st.st_uid}, not root")
        import socket  # only once there is a socket to talk to (a cold command without
        # a daemon finds none: the module is not loaded for nothing)

        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            _connect_within(sock, f"/proc/self/fd/{dfd}/{name}", timeout)
            sock.settimeout(timeout)
        except BaseException:
            sock.close()
            raise
        return sock
    finally:
        os.close(dfd)


def _connect_within(sock: socket.socket, address: str, timeout: float) -> None:
    """connect(), tried again while the listen backlog is full: on a unix
    socket a non-blocking connect then fails at once with EAGAIN (it never
    waits for room, and a blocking one would wait for ever)."""
    sock.setblocking(False)
    deadline = time.monotonic() + timeout
    pause = 0.005
    while True:
        try:
            sock.connect(address)
            return
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"its listen backlog stayed full for {timeout:g} s "
                                   "(it does not accept)") from None
            time.sleep(min(pause, left))
            pause = min(2 * pause, 0.1)


def lines(sock: socket.socket, every: float | None = None, deadline: float | None = None
          ) -> Iterator[dict[str, Any]]:
    """The answer's lines as objects, until the daemon closes. ``every``:
    each line within that many seconds of the one before (the first, of
    the call); ``deadline`` (time.monotonic()): every line by then.
    TimeoutError past either; without them, the socket's own timeout.
    ValueError for a line longer than MAX_LINE_BYTES (a daemon gone wrong:
    its lines are volumes' results, far below it)."""
    buf = b""
    due = _due(every, deadline)
    while True:
        if due is not None:
            left = due - time.monotonic()
            if left <= 0:
                raise TimeoutError("no line in time")
            sock.settimeout(left)
        chunk = sock.recv(1 << 16)
        if not chunk:
            if buf.strip():
                yield parse(buf)
            return
        if b"\n" not in chunk:  # only the new bytes are searched: never quadratic
            buf += chunk
            if len(buf) > MAX_LINE_BYTES:
                raise ValueError(f"a line longer than {MAX_LINE_BYTES} bytes")
            continue
        buf += chunk
        while b"\n" in buf:
            raw, buf = buf.split(b"\n", 1)
            if raw.strip():
                yield parse(raw)
                due = _due(every, deadline)  # from now: the reader's own time is not the daemon's
        if len(buf) > MAX_LINE_BYTES:
            raise ValueError(f"a line longer than {MAX_LINE_BYTES} bytes")


def _due(every: float | None, deadline: float | None) -> float | None:
    """When the next line is due, or None: no bound of ours."""
    dues = [d for d in (None if every is None else time.monotonic() + every, deadline)
            if d is not None]
    return min(dues) if dues else None
