"""What the benchmarks share: running commands with a deadline, reading
mounts, loop devices and rbd-fuse processes under a work directory, taking
everything down after a run (or a failure), signals during cleanup, the CLI
under test, P1's shell baseline (P7 runs it too), a process's CPU, and a
volume moved between two nodes with its baseline by hand (P17, P18).
Benchmarks import this module, never each other."""

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
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
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


# -- a process's CPU (P13, P18) -----------------------------------------------------------

def cpu_seconds(pid: int, children: bool = False) -> float:
    """utime+stime of ``pid`` (the setpriv wrapper execs the daemon: same
    pid); ``children``: plus those of its children it has reaped (git,
    ssh-keygen: each counted once it has been waited for)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = sum(int(f) for f in fields[11:15 if children else 13])
    return ticks / os.sysconf("SC_CLK_TCK")


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def create_images(cluster: DevCluster, names: list[str], size: int) -> None:
    """Images made with the rbd binding (one connection), before their files."""
    import rados
    import rbd

    with rados.Rados(conffile=str(cluster.conf), rados_id=cluster.user,
                     conf={"keyring": str(cluster.keyring)}) as c, \
            c.open_ioctx(cluster.pool) as io:
        for n in names:
            rbd.RBD().create(io, n, size)


# -- a volume moved between two nodes (P17, P18) -------------------------------------------

MOVE_POLL_S = 0.001


def logged(rec: dict) -> float:
    """A JSON log record's time, epoch seconds (logged in ms)."""
    return datetime.fromisoformat(rec["time"]).timestamp()


@dataclass
class MoveSeen:
    released: float  # the old node's unmap step ended (its claim dropped with it)
    map_start: float  # the new node's map step began
    published: float  # the new node's status said Published (time.time() when read)
    lines: dict[str, list[dict]]  # "old", "new": every log record read meanwhile


def watch_move(old: DaemonProc, new: DaemonProc, new_state: Path, name: str,
               labels: tuple[str, str], timeout: float) -> MoveSeen:
    """Follow a move of ``name`` in both daemons' logs (from their last
    ``new_lines``) and the new node's status file, in a tight loop, until the
    new node says Published; checks the history (the old node's unmap ended
    before the new node's map began)."""
    released = map_start = published = None
    lines: dict[str, list[dict]] = {"old": [], "new": []}
    deadline = time.monotonic() + timeout
    while published is None or released is None:
        now = time.time()
        for rec in old.new_lines():
            lines["old"].append(rec)
            if rec.get("volume") == name and rec.get("step") == "unmap":
                if rec.get("result") != "changed":
                    raise BenchError(f"{labels[0]}: unmap {rec.get('result')}: {rec}")
                released = logged(rec)
        for rec in new.new_lines():
            lines["new"].append(rec)
            if rec.get("volume") == name and rec.get("step") == "map":
                if rec.get("result") != "changed":
                    raise BenchError(f"{labels[1]}: map {rec.get('result')}: {rec}")
                map_start = logged(rec) - rec["duration_ms"] / 1000
        if published is None and status(new_state, name).get("phase") == "Published":
            published = now
        if time.monotonic() > deadline:
            raise BenchError(f"not moved within {timeout:.0f} s; log of {labels[1]}:\n"
                             f"{new.tail()}")
        old.check_alive()
        new.check_alive()
        time.sleep(MOVE_POLL_S)
    if map_start is None:
        raise BenchError(f"{labels[1]} published without a map step")
    if released > map_start + 0.002:  # both logged in ms
        raise BenchError(f"{labels[1]} began its map at {map_start:.3f}, before {labels[0]}'s "
                         f"unmap ended at {released:.3f}")
    return MoveSeen(released, map_start, published, lines)


# The move by hand. $1 conf, $2 pool, $3 image, $4 the old side's loop device,
# $5 its rbd-fuse mount, $6 its staging, $7 the new side's rbd-fuse mount,
# $8 its staging, $9 the publish target, $10 rbd-fuse's log. Prints when the
# old side is down, then fuse_pid= and dev= of the new side.
RAW_MOVE = """\
set -euo pipefail
conf=$1 pool=$2 img=$3 dev=$4 fmnt=$5 fstg=$6 tmnt=$7 tstg=$8 target=$9 log=${10}
umount "$target"
umount "$fstg"
losetup -d "$dev"
n=0
until umount "$fmnt" 2>/dev/null; do  # the detach completes asynchronously: EBUSY a moment
    n=$((n + 1))
    [ "$n" -lt 500 ] || { umount "$fmnt"; exit 1; }
    sleep 0.01
done
echo "down=$(date +%s.%N)"
mkdir -p "$tmnt" "$tstg"
setsid rbd-fuse -c "$conf" -p "$pool" -r "$img" "$tmnt" -f </dev/null >"$log" 2>&1 &
fuse_pid=$!
echo "fuse_pid=$fuse_pid"
until mountpoint -q "$tmnt"; do
    kill -0 "$fuse_pid" 2>/dev/null || { echo "rbd-fuse exited" >&2; exit 1; }
    sleep 0.01
done
dev=$(losetup --find --show --direct-io=on "$tmnt/$img")
echo "dev=$dev"
mount "$dev" "$tstg"
mount --bind "$tstg" "$target"
"""


@dataclass
class RawTimes:
    down: float
    up: float

    @property
    def total(self) -> float:
        return self.down + self.up


def kv(text: str) -> dict[str, str]:
    return dict(ln.split("=", 1) for ln in text.splitlines() if "=" in ln)


class RawMove:
    """The same move by hand on another image (raw commands, no claim, no
    checks), back and forth between two sides under ``base``: the baseline."""

    def __init__(self, base: Path, cluster: DevCluster, image: str, target: Path) -> None:
        self.base, self.cluster, self.image, self.target = base, cluster, image, target
        self.side = "a"
        self.dev = ""

    def paths(self, side: str) -> tuple[Path, Path]:
        return self.base / side / "fuse", self.base / side / "staging"

    def setup(self) -> None:
        """P1's shell sequence: the image made, mapped, formatted and published on side a."""
        mnt, stg = self.paths("a")
        out = run(["bash", "-c", SHELL_SEQUENCE, "raw", str(self.cluster.conf),
                   self.cluster.pool, self.image, str(mnt), str(stg), str(self.target),
                   str(self.base / "a.log")]).stdout
        self.dev = kv(out)["dev"]

    def trial(self) -> RawTimes:
        old, new = self.side, ("b" if self.side == "a" else "a")
        fmnt, fstg = self.paths(old)
        tmnt, tstg = self.paths(new)
        token = uuid.uuid4().hex
        (self.target / "token").write_text(token)
        helper = fuse_pids_under(fmnt.parent)
        t0 = time.time()
        out = run(["bash", "-c", RAW_MOVE, "raw-move", str(self.cluster.conf),
                   self.cluster.pool, self.image, self.dev, str(fmnt), str(fstg), str(tmnt),
                   str(tstg), str(self.target), str(self.base / f"{new}.log")])
        t1 = time.time()
        values = kv(out.stdout)
        self.dev, self.side = values["dev"], new
        for pid in helper:  # the old side's rbd-fuse exits with its unmount
            wait_exit(pid)
        if (self.target / "token").read_text() != token:
            raise BenchError("raw move: the token did not follow")
        down = float(values["down"])
        return RawTimes(down - t0, t1 - down)
