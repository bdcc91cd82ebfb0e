"""Running node commands with a deadline and honest errors.

Every command the drivers run goes through a ``Runner`` so that tests can
record the exact command lines of mappers that cannot run here (krbd, nbd).

Why ``subprocess`` and not ``sh``: with a timeout, ``sh`` polls in a helper
thread every 100 ms and joins it after the command ends, so each command
costs at least ~100 ms (measured: ``true`` takes 106 ms through it, 1.2 ms
through ``subprocess.run``). A publish runs six commands and every observe
two per device; the standard library does this job better.

Why not ``subprocess.run(timeout=...)``: at the deadline it kills the child
only (a grandchild the command forked lives on, holding its pipes), then
waits for the child without a limit (one stuck in the kernel hangs the
caller). So each command runs in its own process group (session), the
whole group is killed (SIGKILL) at its deadline, and the wait after the
kill is bounded: output still held then is abandoned, and said so.

Long-lived helpers (rbd-fuse) are started elsewhere, in their own session,
and never through a Runner: nothing here kills them.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import select
import selectors
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from reconciler.drivers.reaper import reap_group, reap_later

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 120.0
DEFAULT_LONG_TIMEOUT = 600.0  # mkfs, e2fsck, offline resize2fs: whole-device work
KILL_WAIT_S = 2.0  # after the SIGKILL: the longest wait for the group's exit and output
TIMED_OUT = 124  # a CommandError's returncode when the command ran into its deadline
# The waiting thread looks at the stop flag this often while a command runs
# (a command that ends sooner costs nothing extra: its exit wakes the wait;
# no helper thread).
STOP_CHECK_S = 0.5


class CommandError(Exception):
    def __init__(self, argv: Sequence[str], returncode: int, stderr: str) -> None:
        tail = stderr.strip().splitlines()[-3:]
        said = " | ".join(tail) or "(no output)"
        super().__init__(f"{' '.join(argv)}: exit {returncode}: {said}")
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr = stderr


class Aborted(Exception):
    """The daemon is stopping (or ``release --all`` reached its deadline): the
    command was not started, or was killed.
    Not a failure of the volume: nothing backs off, the next start resumes."""


class Halt:
    """Shared by every Runner of a daemon: set once, when it stops.

    From ``begin(grace)`` on, a command may still start and run for ``grace``
    seconds (a short step in flight finishes: a bind and its ro remount are
    one step); after that none starts and those still running are killed.
    """

    def __init__(self) -> None:
        self._kill_at = math.inf
        self._lock = threading.Lock()
        self._running: dict[int, tuple[str, float]] = {}  # pid -> command, started
        self.reason = "daemon stopping"  # what the aborted steps and commands say

    def begin(self, grace: float, reason: str | None = None) -> None:
        if reason is not None and not self.stopping:
            self.reason = reason
        self._kill_at = min(self._kill_at, time.monotonic() + grace)

    @property
    def stopping(self) -> bool:
        return self._kill_at != math.inf

    @property
    def kill_at(self) -> float:
        """Monotonic time from which commands are refused and killed (inf: never)."""
        return self._kill_at

    def check(self, argv: Sequence[str]) -> None:
        if time.monotonic() >= self._kill_at:
            raise Aborted(f"{self.reason}: {' '.join(argv)} not started")

    @contextlib.contextmanager
    def tracking(self, pid: int, argv: Sequence[str]) -> Iterator[None]:
        with self._lock:
            self._running[pid] = (" ".join(argv), time.monotonic())
        try:
            yield
        finally:
            with self._lock:
                self._running.pop(pid, None)

    def running(self) -> list[str]:
        """Commands still running (for the stop log): 'pid N: ARGV (for S s)'."""
        now = time.monotonic()
        with self._lock:
            return [f"pid {pid}: {cmd} (for {now - t0:.0f} s)"
                    for pid, (cmd, t0) in sorted(self._running.items())]


@dataclass(frozen=True)
class Result:
    returncode: int
    stdout: str
    stderr: str
    raw: bytes = b""  # stdout as it came (a git blob is bytes, not text)


@dataclass
class Runner:
    """Runs commands; ``ok_codes`` are exit codes the caller interprets itself.
    ``timeout``: a command's deadline; ``long_timeout``: for whole-device work."""

    timeout: float = DEFAULT_TIMEOUT
    history: list[list[str]] = field(default_factory=list)
    long_timeout: float = DEFAULT_LONG_TIMEOUT
    halt: Halt = field(default_factory=Halt)

    def run(self, argv: Sequence[str], *, ok_codes: Sequence[int] = (0,),
            timeout: float | None = None, env: dict[str, str] | None = None,
            pass_fds: Sequence[int] = (), stdin: bytes | None = None) -> Result:
        """``pass_fds``: descriptors the command reaches as ``/proc/self/fd/N``
        (paths resolved without symlinks, see ``safepath``). ``stdin``: bytes
        the command reads on its standard input (a key: never on argv)."""
        argv = [str(a) for a in argv]
        self.history.append(argv)
        log.debug("run: %s", " ".join(argv))
        self.halt.check(argv)
        limit = timeout or self.timeout
        proc = _start(argv, env, pass_fds, stdin is not None)
        with self.halt.tracking(proc.pid, argv):
            out = self._wait(proc, argv, limit, stdin)
        if out.returncode not in ok_codes:
            raise CommandError(argv, out.returncode, out.stderr)
        return out

    def _wait(self, proc: subprocess.Popen[bytes], argv: list[str], limit: float,
              stdin: bytes | None = None) -> Result:
        t0 = time.monotonic()
        deadline = t0 + limit
        pump = _Pump(proc, stdin)
        try:
            while True:
                until = min(deadline, self.halt.kill_at)
                left = until - time.monotonic()
                if left <= 0:
                    break
                if pump.step(min(left, STOP_CHECK_S)):
                    assert proc.returncode is not None
                    return Result(proc.returncode, _text(pump.out), _text(pump.err),
                                  bytes(pump.out))
            stopping = time.monotonic() < deadline  # killed for the stop, not its deadline
            said = _kill(proc, pump)
        finally:
            pump.close()
        took = time.monotonic() - t0
        if stopping:
            raise Aborted(f"{self.halt.reason}: {' '.join(argv)} killed after {took:.0f} s"
                          f"{said}")
        raise CommandError(argv, TIMED_OUT, f"timed out after {limit:g} s: killed (its process "
                           f"group){said}")


# Where each command was found on PATH (a miss is looked up again next time).
# Under emulation every stat on the way costs: PATH is searched once per
# command name, and the command is started by its path (no execvp search).
_FOUND: dict[tuple[str, str], str] = {}


def _start(argv: list[str], env: dict[str, str] | None, pass_fds: Sequence[int],
           stdin: bool) -> subprocess.Popen[bytes]:
    """The command, in its own session (its whole group can be killed)."""
    key = (argv[0], (os.environ if env is None else env).get("PATH", os.defpath))
    for _ in (1, 2):
        exe = _FOUND.get(key) or shutil.which(key[0], path=key[1])
        if exe is None:
            break
        try:
            proc = subprocess.Popen(argv, executable=exe,
                                    stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                    pass_fds=pass_fds, start_new_session=True)
        except FileNotFoundError:
            _FOUND.pop(key, None)  # gone since it was found: look again, once
            continue
        _FOUND[key] = exe
        return proc
    raise CommandError(argv, 127, f"{argv[0]}: command not found")


class _Pump:
    """A command's output read as it comes, its input written, and its exit
    seen on a pidfd: ``step`` returns as soon as the command is done (pipes
    closed and exited), never on a polling tick (``Popen.communicate`` with a
    timeout sleeps up to 50 ms at a time waiting for the exit)."""

    def __init__(self, proc: subprocess.Popen[bytes], stdin: bytes | None) -> None:
        self.proc = proc
        self.out, self.err = bytearray(), bytearray()
        self._sel = selectors.PollSelector()
        self._input = memoryview(stdin or b"")
        assert proc.stdout is not None and proc.stderr is not None
        self._bufs = {proc.stdout.fileno(): self.out, proc.stderr.fileno(): self.err}
        for fd in self._bufs:
            self._sel.register(fd, selectors.EVENT_READ)
        self._stdin = proc.stdin.fileno() if proc.stdin is not None else None
        if self._stdin is not None:
            if self._input:
                self._sel.register(self._stdin, selectors.EVENT_WRITE)
            else:
                self._close_stdin()
        try:
            self._pidfd: int | None = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):  # no pidfd here: wait() polls, as before
            self._pidfd = None
        else:
            self._sel.register(self._pidfd, selectors.EVENT_READ)

    def step(self, timeout: float) -> bool:
        """Move data for up to ``timeout`` s; True once the command is done."""
        end = time.monotonic() + timeout
        while self._sel.get_map():
            left = end - time.monotonic()
            if left <= 0:
                return False
            for key, _ in self._sel.select(left):
                self._ready(key.fd)
        if self._pidfd is None:  # pipes closed; the exit, the old way
            try:
                self.proc.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                return False
        else:
            self.proc.wait()  # the pidfd said it exited: no wait here
        return True

    def _ready(self, fd: int) -> None:
        if fd == self._pidfd:
            self._sel.unregister(fd)
        elif fd == self._stdin:
            try:
                n = os.write(fd, self._input[:select.PIPE_BUF])
            except BrokenPipeError:  # it stopped reading: as communicate, not an error
                n = len(self._input)
            self._input = self._input[n:]
            if not self._input:
                self._close_stdin()
        else:
            data = os.read(fd, 65536)
            if data:
                self._bufs[fd] += data
            else:
                self._sel.unregister(fd)

    def _close_stdin(self) -> None:
        if self._stdin is not None and self._stdin in self._sel.get_map():
            self._sel.unregister(self._stdin)
        with contextlib.suppress(OSError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()

    def close(self) -> None:
        """Release every descriptor (what is still unread is abandoned)."""
        self._sel.close()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()


def _kill(proc: subprocess.Popen[bytes], pump: _Pump) -> str:
    """SIGKILL the command's process group, then wait a bounded time for it.
    Returns what to add to the error: its last output, or that it was abandoned."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    if not pump.step(KILL_WAIT_S):
        # A process outside the group (it made its own session) holds the
        # pipes, or the command is stuck in the kernel: give up on it honestly.
        pump.close()
        log.warning("%s (pid %d): still not gone %g s after SIGKILL; output abandoned",
                    proc.args, proc.pid, KILL_WAIT_S)
        # Stuck in the kernel (D state), it may never exit: reaped from a
        # thread whenever it does, so no caller waits on it.
        reap_later(proc)
        return f"; output abandoned{_tail(pump.err)}"
    reap_group(proc.pid)  # its orphans came back to us if we are a subreaper
    return _tail(pump.err)


def _tail(stderr: bytes | bytearray | str | None) -> str:
    text = stderr.decode("utf-8", "replace") if isinstance(stderr, bytes | bytearray) \
        else stderr or ""
    lines = text.strip().splitlines()[-3:]
    return f"; it said: {' | '.join(lines)}" if lines else ""


def _text(b: bytes | bytearray | None) -> str:
    return b.decode("utf-8", "replace") if b else ""
