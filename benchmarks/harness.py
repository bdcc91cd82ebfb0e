"""What the benchmarks share: running commands with a deadline, reading
mounts, loop devices and rbd-fuse processes under a work directory, taking
everything down after a run (or a failure), signals during cleanup, the CLI
under test, and P1's shell baseline (P7 runs it too). Benchmarks import this
module, never each other."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout: import this tree's reconciler

from reconciler.drivers.reaper import reap_zombies  # noqa: E402
from reconciler.testing.devcluster import DevCluster  # noqa: E402

FEATURES = ("layering", "exclusive-lock", "object-map", "fast-diff", "deep-flatten")

SIZE = "256M"  # the shell's spelling; the Volume says 256Mi (the same 268435456 bytes)

MKFS_EXT4 = "-q -m0 -E nodiscard,lazy_itable_init=1,lazy_journal_init=1"

CMD_TIMEOUT = 300.0  # a full memstore makes writes hang forever: never wait unbounded

FUSE_EXIT_TIMEOUT = 30.0

CONFIG_YAML = """\
desiredDir: {desired}
stateDir: {state}
controlSocket: {state}/control.sock
nodeName: p1-bench
ceph:
  conf: {conf}
  user: {user}
  keyring: {keyring}
allowedRoots: [{root}]
"""

# The shell baseline. Arguments: $1 conf, $2 pool, $3 image, $4 fuse mount dir,
# $5 staging dir, $6 target dir, $7 rbd-fuse log. Prints fuse_pid= and dev= lines.
SHELL_SEQUENCE = f"""\
set -euo pipefail
conf=$1 pool=$2 img=$3 mnt=$4 staging=$5 target=$6 log=$7
rbd create -c "$conf" --size {SIZE} {" ".join(f"--image-feature {f}" for f in FEATURES)} \\
    "$pool/$img"
mkdir -p "$mnt" "$staging" "$target"
setsid rbd-fuse -c "$conf" -p "$pool" -r "$img" "$mnt" -f </dev/null >"$log" 2>&1 &
fuse_pid=$!
echo "fuse_pid=$fuse_pid"
until mountpoint -q "$mnt"; do
    kill -0 "$fuse_pid" 2>/dev/null || {{ echo "rbd-fuse exited" >&2; exit 1; }}
    sleep 0.01
done
dev=$(losetup --find --show --direct-io=on "$mnt/$img")
echo "dev=$dev"
mkfs.ext4 {MKFS_EXT4} "$dev"
mount "$dev" "$staging"
mount --bind "$staging" "$target"
"""

class BenchError(RuntimeError):
    pass

@dataclass
class Env:
    root: Path
    cluster: DevCluster
    config: Path
    cli: Path

    @property
    def pool(self) -> str:
        return self.cluster.pool

def run(argv: list[str], timeout: float = CMD_TIMEOUT, check: bool = True
        ) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                       timeout=timeout)
    if check and r.returncode != 0:
        raise BenchError(f"{shlex.join(argv)} exited {r.returncode}:\n{r.stdout}{r.stderr}")
    return r

def _unescape(s: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), s)

@dataclass(frozen=True)
class MountLine:
    mount_id: int
    rdev: tuple[int, int]
    point: str
    fs_type: str

def mounts() -> list[MountLine]:
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        f = line.split(" ")
        sep = f.index("-", 6)
        major, minor = f[2].split(":")
        out.append(MountLine(int(f[0]), (int(major), int(minor)), _unescape(f[4]), f[sep + 1]))
    return out

def mounts_under(root: Path) -> list[MountLine]:
    prefix = f"{root}/"
    return [m for m in mounts() if m.point.startswith(prefix)]

def loops_under(root: Path) -> list[str]:
    """Loop devices backed by a file under root. Read from sysfs, not `losetup --list`:
    nothing here may touch a file inside a FUSE mount (a dead rbd-fuse hangs it)."""
    prefix = f"{root}/"
    out = []
    for f in sorted(Path("/sys/block").glob("loop*/loop/backing_file")):
        with contextlib.suppress(OSError):
            if f.read_text().strip().startswith(prefix):
                out.append(f"/dev/{f.parent.parent.name}")
    return out

def fuse_pids_under(root: Path) -> list[int]:
    """rbd-fuse processes whose mount point lies under root: only ones we started."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            argv = cmdline.read_bytes().split(b"\0")
            if argv and os.path.basename(argv[0]) == b"rbd-fuse" and any(
                    a.startswith(f"{root}/".encode()) for a in argv):
                pids.append(int(cmdline.parent.name))
    return pids

def wait_exit(pid: int, timeout: float = FUSE_EXIT_TIMEOUT) -> None:
    """Wait for a process to exit; reap it if it is our child (we are a subreaper)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                return
        except ChildProcessError:  # not our child: watch /proc instead
            if not Path(f"/proc/{pid}").exists():
                return
        if time.monotonic() > deadline:
            print(f"  warning: pid {pid} did not exit in {timeout:.0f}s; killing it",
                  file=sys.stderr)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
            return
        time.sleep(0.01)

def umount(point: str) -> None:
    """umount, retrying EBUSY (right after losetup -d the kernel may still hold it)."""
    deadline = time.monotonic() + 10
    while True:
        r = run(["umount", point], timeout=60, check=False)
        if r.returncode == 0:
            return
        if "busy" not in r.stderr.lower() or time.monotonic() > deadline:
            raise BenchError(f"umount {point}: {r.stderr.strip()}")
        time.sleep(0.05)

def assert_published(target: Path, staging: Path | None = None) -> None:
    by_point = {m.point: m for m in mounts()}
    t = by_point.get(str(target))
    if t is None or t.fs_type != "ext4":
        raise BenchError(f"{target} is not an ext4 mount after the run")
    if staging is not None:
        s = by_point.get(str(staging))
        if s is None or s.rdev != t.rdev:
            raise BenchError(f"{target} is not a bind of the staging mount {staging}")

def assert_clean(root: Path) -> None:
    left = [m.point for m in mounts_under(root)] + loops_under(root) + [
        f"rbd-fuse pid {p}" for p in fuse_pids_under(root)]
    if left:
        raise BenchError(f"teardown left behind: {', '.join(left)}")

def sweep(root: Path) -> list[str]:
    """Take down everything under root, whatever state a failed run left. Returns problems."""
    problems = []
    # 1. filesystems and binds (everything but the FUSE mounts), newest first
    for m in sorted(mounts_under(root), key=lambda m: -m.mount_id):
        if m.fs_type.startswith("fuse"):
            continue
        try:
            umount(m.point)
        except (BenchError, subprocess.TimeoutExpired) as e:
            problems.append(str(e))
    # 2. loop devices over files under root (the rbd-fuse image files)
    for dev in loops_under(root):
        try:
            r = run(["losetup", "-d", dev], timeout=60, check=False)
            if r.returncode:
                problems.append(f"losetup -d {dev}: {r.stderr.strip()}")
        except subprocess.TimeoutExpired:
            problems.append(f"losetup -d {dev}: timed out")
    # 3. the FUSE mounts, then their rbd-fuse processes (by pid)
    for m in sorted(mounts_under(root), key=lambda m: -m.mount_id):
        try:
            umount(m.point)
        except (BenchError, subprocess.TimeoutExpired) as e:
            problems.append(str(e))
    for pid in fuse_pids_under(root):
        wait_exit(pid, timeout=10)
    reap_zombies()
    return problems

@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP unwind like Ctrl-C, so the finally-cleanup runs."""
    def on_signal(signum: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
    # Also when started in the background, where SIGINT arrives ignored.
    old[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)

@contextlib.contextmanager
def signals_ignored() -> Iterator[None]:
    """Cleanup must finish: a second Ctrl-C must not leave mounts half torn down."""
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    old = {s: signal.signal(s, signal.SIG_IGN) for s in sigs}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)

def find_cli() -> Path:
    for cand in (Path(sys.executable).parent / "rbd-reconciler",
                 REPO / ".venv" / "bin" / "rbd-reconciler"):
        if cand.exists():
            return cand
    raise BenchError("rbd-reconciler CLI not found (expected .venv/bin/rbd-reconciler)")

def cleanup(root: Path, cluster: DevCluster | None, problems: list[str] | None = None) -> int:
    """Returns 1 if something could not be removed (and says what).
    ``problems``: what the caller's own clean-up already could not do."""
    problems = [*(problems or []), *sweep(root)]
    if cluster is not None:
        try:
            cluster.stop()
        except Exception as e:  # report, then still try to remove what we can
            problems.append(f"cluster stop: {e}")
    left = mounts_under(root)
    if left:
        problems.append(f"mounts still under {root}, left in place: "
                        f"{', '.join(m.point for m in left)}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    for msg in problems:
        print(f"{Path(sys.argv[0]).stem}: cleanup: {msg}", file=sys.stderr)
    return 1 if problems else 0


STOP_TIMEOUT = 30.0
READY_TIMEOUT = 60.0


class DaemonProc:
    """The daemon under test: a subprocess logging JSON lines to a file."""

    def __init__(self, root: Path, cli: Path, config: Path,
                 args: tuple[str, ...] = ("--allow-mass-removal",)) -> None:
        self.log = root / "daemon.log"
        self.notify_path = root / "notify.sock"
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(str(self.notify_path))
        self.notify.setblocking(False)
        self.logf = open(self.log, "ab")  # noqa: SIM115 - closed in stop()
        self.reader = open(self.log, "rb")  # noqa: SIM115 - closed in stop()
        self.buf = b""
        env = {**os.environ, "NOTIFY_SOCKET": str(self.notify_path)}
        # setpriv --pdeathsig: a SIGKILLed benchmark takes its daemon along.
        self.proc = subprocess.Popen(
            ["setpriv", "--pdeathsig", "KILL", str(cli), "--config", str(config), "run",
             "--log-format", "json", *args],
            env=env, stdin=subprocess.DEVNULL, stdout=self.logf, stderr=self.logf)

    def tail(self, n: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-n:]
        return ""

    def drain_notify(self) -> list[bytes]:
        """Read what the daemon sent to NOTIFY_SOCKET. It must be read: the datagram
        queue holds net.unix.max_dgram_qlen (10) messages, then the daemon's sendto blocks."""
        out = []
        while self.notify.fileno() != -1:
            try:
                out.append(self.notify.recv(4096))
            except BlockingIOError:
                break
        return out

    def check_alive(self) -> None:
        self.drain_notify()
        if self.proc.poll() is not None:
            raise BenchError(f"daemon exited {self.proc.returncode}; log:\n{self.tail()}")

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        while True:
            if any(m.startswith(b"READY=1") for m in self.drain_notify()):
                return
            if self.proc.poll() is not None:
                raise BenchError(f"daemon exited {self.proc.returncode}; log:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise BenchError(f"no READY=1 from the daemon; log:\n{self.tail()}")
            time.sleep(0.01)

    def new_lines(self) -> list[dict]:
        """JSON log records appended since the last call (non-JSON lines skipped)."""
        self.buf += self.reader.read()
        *complete, self.buf = self.buf.split(b"\n")
        out = []
        for line in complete:
            with contextlib.suppress(ValueError):
                rec = json.loads(line)
                if isinstance(rec, dict):
                    out.append(rec)
        return out

    def stop(self) -> int | None:
        """SIGTERM, wait for the chains in flight; after STOP_TIMEOUT dump every thread's
        stack (SIGUSR1: the daemon's faulthandler), print it, SIGKILL."""
        rc = None
        self.notify.close()  # its STOPPING=1 then fails at once instead of blocking
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            size = self.log.stat().st_size
            self.proc.send_signal(signal.SIGUSR1)
            time.sleep(1)
            with open(self.log, "rb") as f:
                f.seek(size)
                stacks = f.read().decode(errors="replace")
            print(f"{Path(sys.argv[0]).stem}: daemon ignored SIGTERM for {STOP_TIMEOUT:.0f} s; "
                  f"its threads:\n{stacks}\nkilling it", file=sys.stderr)
            self.proc.kill()
            rc = self.proc.wait()
        finally:
            self.logf.close()
            self.reader.close()
        return rc


def status(state: Path, name: str) -> dict:
    try:
        return json.loads((state / "status" / f"{name}.json").read_text())
    except (FileNotFoundError, ValueError):
        return {}


def pct(xs: list[float], p: float) -> float:
    """Nearest-rank percentile."""
    s = sorted(xs)
    return s[max(0, math.ceil(p / 100 * len(s)) - 1)]


def line(label: str, xs: list[float]) -> str:
    return (f"{label:<34} p50 {pct(xs, 50) * 1000:8.1f} ms   p99 {pct(xs, 99) * 1000:8.1f} ms"
            f"   max {max(xs) * 1000:8.1f} ms   (n={len(xs)})")
