"""The control socket's protocol (README: The command line beside the daemon).

JSON lines over a unix stream socket, one request per connection. The
client writes one line, an object::

    {"protocol": 1, "command": "apply", "stateDir": "/var/lib/rbd-reconciler",
     "args": {"targets": [{"name": "pgdata"}], ...}}

The daemon answers with lines: ``{"event": "accepted"}`` at once, events
while the work goes on (``{"event": "started", ...}``, ``{"event":
"volume", ...}``, ``{"event": "say", ...}``), then exactly one final line, ``{"exit": N,
"result": {...}}`` or ``{"exit": N, "error": "..."}``, and closes. A
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

TYPE_CHECKING = False  # typing itself costs ~5 ms at start-up
if TYPE_CHECKING:
    import socket
    from collections.abc import Iterator
    from pathlib import Path
    from typing import Any

PROTOCOL = 1
MAX_REQUEST_BYTES = 64 * 1024  # a request names volumes and paths: far below this
REQUEST_TIMEOUT_S = 10.0  # the whole request line, from the connection on
ACCEPT_TIMEOUT_S = 10.0  # a daemon says "accepted" at once; past this it is stopped or stuck

# The commands the daemon answers; every other is refused.
COMMANDS = ("ping", "apply", "release", "plan", "status", "explain", "rotate-key", "takeover",
            "allow-removal")


def line(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, separators=(",", ":")) + "\n").encode()


def parse(raw: bytes) -> dict[str, Any]:
    """One line as an object; ValueError for anything else."""
    obj = json.loads(raw)
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    return obj


class Untrusted(Exception):
    """The socket, or its directory, may be someone else's than root's."""


def connect(path: Path | str, timeout: float | None = None) -> socket.socket:
    """A connection to the control socket at ``path``, through its
    directory's descriptor (so a path longer than a unix socket address may
    hold works too). FileNotFoundError or ConnectionRefusedError: no daemon
    serves there. Untrusted: the socket or its directory is not root's
    alone (whoever could place a socket there would get our requests)."""
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
            sock.settimeout(timeout)
            sock.connect(f"/proc/self/fd/{dfd}/{name}")
        except BaseException:
            sock.close()
            raise
        return sock
    finally:
        os.close(dfd)


def lines(sock: socket.socket) -> Iterator[dict[str, Any]]:
    """The answer's lines as objects, until the daemon closes."""
    buf = b""
    while True:
        chunk = sock.recv(1 << 16)
        if not chunk:
            if buf.strip():
                yield parse(buf)
            return
        buf += chunk
        while b"\n" in buf:
            raw, buf = buf.split(b"\n", 1)
            if raw.strip():
                yield parse(raw)
