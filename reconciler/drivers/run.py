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

Every command's output is bounded, whoever runs it (a git server that floods
ssh's stderr took the daemon from 54 MB to 1.2 GB; a fast one sends
gigabytes within one deadline):

- stderr: its first and its last ``STDERR_KEEP`` bytes (32 KiB each: the
  first error and the last lines, hundreds of lines of either, more than any
  diagnostic of ours; an error shows its last three) are kept, and what fell
  between is counted and said: ``[... N bytes dropped ...]``. Past
  ``STDERR_KILL`` in all (64 MiB: no command of ours says that much) the
  command's process group is killed and the call fails saying so: a flood
  costs neither memory nor a whole deadline of CPU (ours, and ssh's
  decrypting it). The kill is at once: 64 MiB is read in well under a second.
- stdout is parsed, so it is never cut short: past its bound (``max_stdout``,
  ``DEFAULT_MAX_STDOUT`` unless the caller knows better) the process group
  is killed at once and the call fails: "printed more than N bytes on
  stdout: killed". The largest legitimate answers are a LUKS2 header's JSON
  (``cryptsetup luksDump``, at most 4 MiB) and a node's ``rbd device list``;
  ``git cat-file --batch`` of a revision passes its own bound (the tree's
  listed sizes), as may any caller that expects more. A stdout nothing
  parses (``max_stdout=None``: e2fsck's report of what it fixed) is kept as
  stderr is, head and tail, and never a reason to kill: the deadline ends it.

Long-lived helpers (rbd-fuse) are started elsewhere, in their own session,
and never through a Runner: nothing here kills them.

Imported by apply/rotate.py, apply/runner.py; daemon/ (4 modules); drivers/
(6 modules); engine/ (4 modules); observe/leftovers.py, observe/node.py;
source/ (6 modules).
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

from reconciler.drivers.reaper import reap_group, reap_group_later
from reconciler.spec.units import KiB, MiB

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 120.0
DEFAULT_LONG_TIMEOUT = 600.0  # mkfs, e2fsck, offline resize2fs: whole-device work
KILL_WAIT_S = 2.0  # after the SIGKILL: the longest wait for the group's exit and output
TIMED_OUT = 124  # a CommandError's returncode when the command ran into its deadline
TOO_MUCH_OUTPUT = 125  # ... when it printed past a bound and was killed
STDERR_KEEP = 32 * KiB  # kept of stderr: this much of its head, and of its tail
STDERR_KILL = 64 * MiB  # stderr past this in all: killed
DEFAULT_MAX_STDOUT = 16 * MiB  # 4x the largest legitimate answer (a LUKS2 header's JSON)
SHOWN_LINE = 400  # an error's line is clipped to this many characters
READ_SIZE = 65536
# The waiting thread looks at the stop flag this often while a command runs
# (a command that ends sooner costs nothing extra: its exit wakes the wait;
# no helper thread).
STOP_CHECK_S = 0.5


class CommandError(Exception):
    def __init__(self, argv: Sequence[str], returncode: int, stderr: str) -> None:
        said = last_lines(stderr) or "(no output)"
        super().__init__(f"{' '.join(argv)}: exit {returncode}: {said}")
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr = stderr


class OutputTooLarge(CommandError):
    """Killed at an output bound (returncode ``TOO_MUCH_OUTPUT``). Unlike a
    failure, the same command on the same input prints as much again: a
    caller whose input is a revision refuses that revision."""


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
    stderr: str  # bounded: head and tail, with what was dropped between said
    raw: bytes = b""  # stdout as it came (a git blob is bytes, not text)
    stderr_dropped: int = 0  # bytes of stderr not kept (a parser of stderr must refuse)


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
            pass_fds: Sequence[int] = (), stdin: bytes | None = None,
            max_stdout: int | None = DEFAULT_MAX_STDOUT) -> Result:
        """``pass_fds``: descriptors the command reaches as ``/proc/self/fd/N``
        (paths resolved without symlinks, see ``safepath``). ``stdin``: bytes
        the command reads on its standard input (a key: never on argv).
        ``max_stdout``: past this many bytes on stdout it is killed (and
        CommandError raised): what is returned is always whole. None: stdout
        is not parsed (e2fsck's list of what it fixed): kept as stderr is,
        its head and its tail, and never a reason to kill."""
        argv = [str(a) for a in argv]
        self.history.append(argv)
        log.debug("run: %s", " ".join(argv))
        self.halt.check(argv)
        limit = timeout or self.timeout
        proc = _start(argv, env, pass_fds, stdin is not None)
        with self.halt.tracking(proc.pid, argv):
            out = self._wait(proc, argv, limit, stdin, max_stdout)
        if out.returncode not in ok_codes:
            raise CommandError(argv, out.returncode, out.stderr)
        return out

    def _wait(self, proc: subprocess.Popen[bytes], argv: list[str], limit: float,
              stdin: bytes | None, max_stdout: int | None) -> Result:
        t0 = time.monotonic()
        deadline = t0 + limit
        pump = _Pump(proc, stdin, max_stdout)
        try:
            while pump.over is None:
                until = min(deadline, self.halt.kill_at)
                left = until - time.monotonic()
                if left <= 0:
                    break
                if pump.step(min(left, STOP_CHECK_S)):
                    assert proc.returncode is not None
                    return pump.result(proc.returncode)
            over = pump.over
            stopping = time.monotonic() < deadline  # killed for the stop, not its deadline
            said = _kill(proc, pump)
        finally:
            pump.close()
        took = time.monotonic() - t0
        if over is not None:  # the bound, not a stop or the deadline: this command's fault
            raise OutputTooLarge(argv, TOO_MUCH_OUTPUT, f"{over}: killed (its process group)"
                                                        f"{said}")
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

    def __init__(self, proc: subprocess.Popen[bytes], stdin: bytes | None,
                 max_stdout: int | None = DEFAULT_MAX_STDOUT) -> None:
        self.proc = proc
        self.out, self.err = bytearray(), HeadTail(STDERR_KEEP)
        self.max_stdout = max_stdout
        # stdout nobody parses: its head and tail, as stderr (None: parsed)
        self.out_kept = HeadTail(STDERR_KEEP) if max_stdout is None else None
        self.over: str | None = None  # which bound it passed: "printed more than ..."
        self._sel = selectors.PollSelector()
        self._input = memoryview(stdin or b"")
        assert proc.stdout is not None and proc.stderr is not None
        self._out_fd, self._err_fd = proc.stdout.fileno(), proc.stderr.fileno()
        for fd in (self._out_fd, self._err_fd):
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

    def step(self, timeout: float, *, until_over: bool = True) -> bool:
        """Move data for up to ``timeout`` s; True once the command is done.
        ``until_over``: False as soon as a bound is passed (see ``over``)."""
        end = time.monotonic() + timeout
        while self._sel.get_map():
            left = end - time.monotonic()
            if left <= 0:
                return False
            for key, _ in self._sel.select(left):
                self._ready(key.fd)
                if until_over and self.over is not None:
                    return False  # before its exit is reaped: its group can be killed
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
            data = os.read(fd, READ_SIZE)
            if not data:
                self._sel.unregister(fd)
            elif fd == self._err_fd:
                self.err.add(data)
                if self.err.total > STDERR_KILL and self.over is None:
                    self.over = f"printed more than {_size(STDERR_KILL)} on stderr"
            elif self.out_kept is not None:
                self.out_kept.add(data)
            elif self.over is None:  # past a bound, stdout is only drained
                assert self.max_stdout is not None
                if len(self.out) + len(data) > self.max_stdout:
                    self.over = f"printed more than {_size(self.max_stdout)} on stdout"
                else:
                    self.out += data

    def result(self, returncode: int) -> Result:
        if self.out_kept is not None:
            return Result(returncode, self.out_kept.text(), self.err.text(), b"",
                          self.err.dropped)
        return Result(returncode, _text(self.out), self.err.text(), bytes(self.out),
                      self.err.dropped)

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


class HeadTail:
    """The first and the last ``keep`` bytes of a stream; what fell between is
    counted, not kept."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.head, self.tail = bytearray(), bytearray()
        self.total = 0  # bytes seen
        self.dropped = 0  # bytes neither in head nor in tail

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = self.keep - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            extra = len(self.tail) - self.keep
            if extra > 0:
                del self.tail[:extra]  # a bytearray drops its front without copying
                self.dropped += extra

    def text(self) -> str:
        if not self.dropped:
            return _text(self.head + self.tail)
        return f"{_text(self.head)}\n[... {self.dropped} bytes dropped ...]\n{_text(self.tail)}"


def _size(n: int) -> str:
    return f"{n // MiB} MiB" if n and n % MiB == 0 else f"{n} bytes"


def _kill(proc: subprocess.Popen[bytes], pump: _Pump) -> str:
    """SIGKILL the command's process group, then wait a bounded time for it.
    Returns what to add to the error: its last output, or that it was abandoned."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    if not pump.step(KILL_WAIT_S, until_over=False):
        # A process outside the group (it made its own session) holds the
        # pipes, or the command is stuck in the kernel: give up on it honestly.
        pump.close()
        log.warning("%s (pid %d): still not gone %g s after SIGKILL; output abandoned",
                    proc.args, proc.pid, KILL_WAIT_S)
        # Stuck in the kernel (D state), it may never exit: reaped from a
        # thread whenever it does (its whole group: a shell's stuck child
        # comes back to us), so no caller waits on it.
        reap_group_later(proc)
        return f"; output abandoned{_tail(pump.err.text())}"
    # Its orphans came back to us if we are a subreaper; one still stuck in
    # the kernel (a shell's child reading a device) is reaped when it dies.
    reap_group(proc.pid)
    reap_group_later(proc)
    return _tail(pump.err.text())


def last_lines(text: str, n: int = 3) -> str:
    """The last ``n`` lines of ``text``, each clipped to ``SHOWN_LINE``, as one."""
    return " | ".join(clip_line(ln) for ln in text.strip().splitlines()[-n:])


def clip_line(line: str) -> str:
    """``line`` as an error shows it: at most ``SHOWN_LINE`` characters."""
    return line if len(line) <= SHOWN_LINE else line[:SHOWN_LINE] + "..."


def _tail(stderr: str) -> str:
    said = last_lines(stderr)
    return f"; it said: {said}" if said else ""


def _text(b: bytes | bytearray | None) -> str:
    return b.decode("utf-8", "replace") if b else ""
