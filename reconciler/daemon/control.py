"""The daemon's control socket: how the command line reaches the running
daemon (README: The command line beside the daemon; the protocol is in
daemon/protocol.py).

Root only: the socket is 0600 in a directory only root may change
(drivers/privsock.py), and each connection's peer is checked with
SO_PEERCRED (uid 0) whatever let it reach the socket. Each connection is
served in a thread of its own: one request, its events, one final line,
and meanwhile a line every KEEPALIVE_S (a keepalive thread), so the client
can bound its wait for every line (a stopped daemon sends nothing) and a
client gone is noticed by the failed send. A client that goes away
(Ctrl-C) costs nothing but its thread, for a few seconds: what it asked for
goes on in the daemon.

Imported by daemon/commands.py, daemon/service.py.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from reconciler.daemon import protocol
from reconciler.drivers.privsock import PrivateSocket

log = logging.getLogger("rbd-reconciler.control")

SEND_TIMEOUT_S = 60.0  # a client that stops reading is dropped, never waited on for ever
PROBE_TIMEOUT_S = 5.0  # asking a socket found at start-up whether a daemon answers there
BACKLOG = 64
MAX_SERVING = 256  # connections served at once (a thread each)


class Reply:
    """What a handler writes to its client: events, then one final line.
    The handler's thread and the keepalive's send under one lock, whole
    lines each; nothing is sent after the final line."""

    def __init__(self, conn: socket.socket, others: Callable[[], int] = lambda: 0) -> None:
        self.conn = conn
        self.others = others  # the other connections being served (ping says it)
        self.gone = False  # the client went away: later lines are dropped
        self.finished = False
        self._lock = threading.Lock()
        self._over = threading.Event()  # final line sent, or the client gone

    def send(self, obj: dict[str, Any]) -> bool:
        return self._send(obj, final=False)

    def _send(self, obj: dict[str, Any], final: bool) -> bool:
        with self._lock:
            if self._over.is_set():  # final line sent, client gone, or closing
                return False
            self.finished = final
            try:
                self.conn.sendall(protocol.line(obj))
            except OSError:  # EPIPE, ECONNRESET, or a client that stopped reading
                self.gone = True
            if self.gone or final:
                self._over.set()
            return not self.gone

    def event(self, name: str, **fields: Any) -> bool:
        return self.send({"event": name, **fields})

    def finish(self, exit_code: int, **fields: Any) -> None:
        self._send({"exit": exit_code, **fields}, final=True)

    def keep_alive(self, every: float) -> None:
        """A ``working`` line every ``every`` s until the final line: a daemon
        at work is told from a stopped one, and a client gone is noticed
        (its send fails) while the handler waits for something to say."""
        def beat() -> None:
            while not self._over.wait(every):
                if not self.event("working"):
                    return

        threading.Thread(target=beat, name="control-keepalive", daemon=True).start()

    def close(self) -> None:
        """Nothing more is sent: the connection is about to close (under the
        lock: never while a keepalive writes to it)."""
        with self._lock:
            self._over.set()


Handler = Callable[[dict[str, Any], Reply], None]


def peer_uid(conn: socket.socket) -> int:
    """The connecting process's uid, as the kernel recorded it at connect."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


def answering(path: Path) -> dict[str, Any] | None:
    """What a daemon answering at ``path`` says of itself (ping), or None
    when none does (no socket, or a stale one nobody listens on)."""
    try:
        sock = protocol.connect(path, PROBE_TIMEOUT_S)
    except (FileNotFoundError, ConnectionRefusedError):
        return None
    with sock:
        sock.sendall(protocol.line({"protocol": protocol.PROTOCOL, "command": "ping"}))
        for obj in protocol.lines(sock):
            if "exit" in obj:
                return obj.get("result") or {}
    return {}


class ControlServer:
    def __init__(self, path: Path, handler: Handler) -> None:
        self.path = path
        self.handler = handler
        self.listener: socket.socket | None = None
        self.socket: PrivateSocket | None = None
        self.thread: threading.Thread | None = None
        self._serving = 0  # connections whose thread has not ended
        self._count = threading.Lock()

    def start(self) -> None:
        """Serve at ``path``; RuntimeError if another daemon answers there (a
        socket nobody listens on, left by a killed daemon, is replaced)."""
        try:
            other = answering(self.path)
        except (TimeoutError, ValueError):  # it listens, but is stopped or stuck
            raise RuntimeError(
                f"controlSocket {self.path}: a daemon listens there but does not answer "
                "(stopped or stuck?); stop it, or give each daemon its own "
                "controlSocket") from None
        except protocol.Untrusted as exc:  # not a socket, or a directory not root's alone
            raise RuntimeError(str(exc)) from None
        if other is not None:
            raise RuntimeError(
                f"controlSocket {self.path}: another rbd-reconciler daemon answers there "
                f"(pid {other.get('pid', '?')}, stateDir {other.get('stateDir', '?')}); "
                "give each daemon its own controlSocket")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)

        def listen(path: str) -> None:
            listener.bind(path)
            listener.listen(BACKLOG)

        sock = PrivateSocket(self.path, "the control socket")
        try:
            sock.bind(listen)
        except BaseException:
            listener.close()
            raise
        self.listener, self.socket = listener, sock
        self.thread = threading.Thread(target=self._accept, name="control", daemon=True)
        self.thread.start()
        log.info("control socket ready at %s (root only)", self.path)

    def stop(self) -> None:
        """No new connection; those being served end with the daemon."""
        if self.socket is not None:
            self.socket.remove()
            self.socket = None
        if self.listener is not None:
            with contextlib.suppress(OSError):
                self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept
            self.listener.close()
            self.listener = None
        if self.thread is not None:
            self.thread.join(timeout=2.0)
            self.thread = None

    def _accept(self) -> None:
        listener = self.listener
        assert listener is not None
        while True:
            try:
                conn, _ = listener.accept()
            except OSError as exc:
                if exc.errno in (errno.EINTR, errno.ECONNABORTED):
                    continue
                return  # closed: stopping
            with self._count:  # counted here: a burst cannot outrun the count
                busy = self._serving >= MAX_SERVING
                self._serving += 0 if busy else 1
            if busy:
                # A thread each: past this, commands in a loop gone wrong, not
                # an operator. Refused at once, by this thread, never queued.
                self._busy(conn)
                continue
            try:
                threading.Thread(target=self._serve, args=(conn,), name="control-client",
                                 daemon=True).start()
            except RuntimeError:  # no thread to be had: refused, and not counted
                with self._count:
                    self._serving -= 1
                self._busy(conn)

    @staticmethod
    def _busy(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            conn.settimeout(0.5)
            conn.sendall(protocol.line({"exit": 1, "error": (
                f"the daemon serves {MAX_SERVING} commands already; try again")}))

    def serving(self) -> int:
        """Connections being served now (each in a thread of its own)."""
        with self._count:
            return self._serving

    def _serve(self, conn: socket.socket) -> None:
        try:
            self._serve_one(conn)
        finally:
            with self._count:
                self._serving -= 1

    def _serve_one(self, conn: socket.socket) -> None:
        with conn:
            reply = Reply(conn, lambda: self.serving() - 1)
            try:
                self._answer(conn, reply)
            finally:
                reply.close()

    def _answer(self, conn: socket.socket, reply: Reply) -> None:
        try:
            uid = peer_uid(conn)
            if uid != 0:
                self._refuse(conn, reply, uid)
                return
            request = self._read(conn)
            conn.settimeout(SEND_TIMEOUT_S)
            # At once, from this thread: the client tells a daemon at work
            # from one that is stopped or stuck (nothing would come). A
            # client gone meanwhile gave up on it: its request is dropped.
            if not reply.event("accepted"):
                log.info("control: %s dropped: its client went away before the daemon "
                         "read it", request["command"])
                return
            reply.keep_alive(protocol.KEEPALIVE_S)
            self.handler(request, reply)
        except (ValueError, TimeoutError) as exc:
            reply.finish(64, error=f"bad request: {exc}")
        except Exception as exc:  # one request never takes the daemon down
            log.exception("control socket: request failed")
            reply.finish(1, error=f"internal error in the daemon: {type(exc).__name__}: {exc}")
        if not reply.finished:
            reply.finish(1, error="internal error in the daemon: no answer")

    def _refuse(self, conn: socket.socket, reply: Reply, uid: int) -> None:
        log.warning("control socket: refused a client of uid %d (root only)", uid)
        # Its request read first (and dropped): closing on unread data would
        # reset the connection before it reads why.
        with contextlib.suppress(OSError, ValueError):
            self._read(conn)
        reply.finish(1, error=f"the control socket answers root only (this client runs as "
                              f"uid {uid})")

    def _read(self, conn: socket.socket) -> dict[str, Any]:
        # The whole line within REQUEST_TIMEOUT_S: a client that sends a byte
        # now and then does not hold its thread for longer.
        deadline = time.monotonic() + protocol.REQUEST_TIMEOUT_S
        buf = b""
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the request line did not come in time")
            conn.settimeout(left)
            chunk = conn.recv(4096)
            if not chunk:
                break
            buf += chunk
            if len(buf) > protocol.MAX_REQUEST_BYTES:
                raise ValueError(f"longer than {protocol.MAX_REQUEST_BYTES} bytes")
        request = protocol.parse(buf.split(b"\n", 1)[0])
        if request.get("protocol") != protocol.PROTOCOL:
            raise ValueError(f"protocol {request.get('protocol')!r}; this daemon speaks "
                             f"{protocol.PROTOCOL}")
        if request.get("command") not in protocol.COMMANDS:
            raise ValueError(f"no command {request.get('command')!r}")
        if not isinstance(request.get("args", {}), dict):
            raise ValueError("args is not an object")
        return request
