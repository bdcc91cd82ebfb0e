"""Helpers of the partition tests (tests/kernel/test_partition.py), in the VM
of scripts/kernel-tests.sh: cutting the guest off from Ceph, writers whose
every acknowledged write is checked afterwards, the daemon with its
sd_notify socket, and the host agent (tests/kernel/hostagent.py).

The cut: the guest's only interface carries only Ceph's traffic (the cluster
is the namespace's 10.99.0.1, reached through QEMU's user networking), so
dropping everything on it, both ways, is a partition from Ceph and nothing
else. It is made inside the guest: on the host side neither of the obvious
ways cuts anything (measured on this host: the kernel has no netem, prio or
u32 qdisc, and `ip link set d0 down` leaves 10.99.0.1 local: traffic to a
local address goes over lo). Egress: netem loss 100%; ingress: a matchall
drop. Packets vanish; nothing is refused or reset.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import mmap
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
IFACE = "eth0"
BLOCK = 64 << 10
BLOCKS = 128  # 8 MiB per file, allocated and synced before any write is counted


def _tc(*args: str) -> None:
    subprocess.run(["tc", *args], check=True, capture_output=True, timeout=30)


@contextlib.contextmanager
def cut_off() -> Iterator[float]:
    """Drop every packet in and out of the guest's interface; heal on exit,
    whatever happens. Yields the monotonic time of the cut."""
    subprocess.run(["modprobe", "-a", "sch_netem", "cls_matchall", "act_gact"], check=True,
                   timeout=60)
    _tc("qdisc", "add", "dev", IFACE, "root", "netem", "loss", "100%")
    try:
        _tc("qdisc", "add", "dev", IFACE, "handle", "ffff:", "ingress")
        _tc("filter", "add", "dev", IFACE, "parent", "ffff:", "matchall", "action", "drop")
        yield time.monotonic()
    finally:
        for args in (("root",), ("ingress",)):
            subprocess.run(["tc", "qdisc", "del", "dev", IFACE, *args], check=False,
                           capture_output=True, timeout=30)


def wait_for(cond: Callable[[], object], what: str, timeout: float,
             step: float = 0.5) -> object:
    """Poll ``cond`` until it is true, with a deadline (never a bare sleep)."""
    end = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(step)


# -- writers ----------------------------------------------------------------------------
@dataclass
class Writer:
    """O_DIRECT writes of 64 KiB blocks, each followed by fdatasync, into a
    file allocated and synced first (so no write needs a metadata change):
    each acknowledged write's content is kept, and ``verify`` reads every
    block back with O_DIRECT."""

    path: Path
    acked: dict[int, bytes] = field(default_factory=dict)  # block -> sha256 of its content
    count: int = 0
    error: str | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Writer:
        with open(self.path, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, BLOCK * BLOCKS)
            f.write(b"\0" * BLOCK * BLOCKS)
            f.flush()
            os.fsync(f.fileno())
        self._thread = threading.Thread(target=self._run, name=f"writer-{self.path.parent.name}",
                                        daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        buf = mmap.mmap(-1, BLOCK)
        fd = os.open(self.path, os.O_WRONLY | os.O_DIRECT)
        try:
            i = 0
            while not self._stop.is_set():
                data = hashlib.sha256(f"{self.path}:{i}".encode()).digest() * (BLOCK // 32)
                buf.seek(0)
                buf.write(data)
                os.pwrite(fd, buf, (i % BLOCKS) * BLOCK)
                # Acknowledged means durable: rbd-nbd's librbd acknowledges
                # writes from its writeback cache (measured: they go on
                # completing while cut off, until a flush), krbd only from Ceph.
                os.fdatasync(fd)
                self.acked[i % BLOCKS] = hashlib.sha256(data).digest()
                self.count = i = i + 1
                self._stop.wait(0.5)
        except OSError as exc:
            self.error = f"{exc} after {self.count} writes"
        finally:
            os.close(fd)
            buf.close()

    def stop(self, timeout: float = 120) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            assert not self._thread.is_alive(), f"{self.path}: the writer is still stuck"

    def verify(self) -> int:
        """Every acknowledged write reads back as written; the number checked."""
        buf = mmap.mmap(-1, BLOCK)
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
        try:
            for block, want in sorted(self.acked.items()):
                os.preadv(fd, [buf], block * BLOCK)
                got = hashlib.sha256(buf[:BLOCK]).digest()
                assert got == want, f"{self.path}: block {block} is not what was acknowledged"
        finally:
            os.close(fd)
            buf.close()
        return len(self.acked)


# -- the daemon -------------------------------------------------------------------------
class Daemon:
    """`rbd-reconciler run` with a notify socket, as under systemd with
    WatchdogSec: every WATCHDOG=1 is timed as it arrives."""

    def __init__(self, config: Path, log: Path, watchdog_s: float) -> None:
        self.config, self.log = config, log
        self.sock_path = log.with_suffix(".notify")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(self.sock_path))
        self.sock.settimeout(0.5)
        self.pings: list[float] = []
        self._stop = threading.Event()
        self._reader = threading.Thread(target=self._read, name="notify", daemon=True)
        self._reader.start()
        env = {**os.environ, "NOTIFY_SOCKET": str(self.sock_path),
               "WATCHDOG_USEC": str(int(watchdog_s * 1e6))}
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                ["setpriv", "--pdeathsig", "KILL", sys.executable, "-m", "reconciler",
                 "--config", str(config), "run", "--log-format", "plain"],
                env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                msg = self.sock.recv(4096).decode(errors="replace")
            except TimeoutError:
                continue
            except OSError:
                return
            if msg.startswith("WATCHDOG=1"):
                self.pings.append(time.monotonic())

    def status(self, state: Path, name: str) -> dict:
        try:
            return json.loads((state / "status" / f"{name}.json").read_text())
        except (OSError, ValueError):
            return {}

    def longest_silence(self, since: float, until: float) -> float:
        """The longest time between two watchdog pings in [since, until]."""
        times = [since, *(t for t in self.pings if since <= t <= until), until]
        return max(b - a for a, b in itertools.pairwise(times))

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=90)
        finally:
            self._stop.set()
            self.sock.close()
            with contextlib.suppress(OSError):
                self.sock_path.unlink()


# -- the host agent ---------------------------------------------------------------------
def on_the_host(req: dict[str, object], timeout: float = 180) -> tuple[int, str]:
    """Have tests/kernel/hostagent.py do ``req`` on Ceph (the guest may be cut off)."""
    agent = Path(os.environ["KERNEL_TESTS_AGENT"])
    n = f"{os.getpid()}-{time.monotonic_ns()}"
    tmp = agent / f"tmp-{n}"
    tmp.write_text(json.dumps(req))
    tmp.rename(agent / f"req-{n}.json")
    resp = agent / f"resp-{n}.json"
    wait_for(resp.exists, f"the host agent's answer to {req}", timeout)
    doc = json.loads(resp.read_text())
    resp.unlink()
    return int(doc["rc"]), str(doc["out"])


def cli(config: Path, *args: str, timeout: float = 300) -> tuple[int, str, float]:
    """The CLI as an operator runs it: its own process; (rc, output, seconds).
    Its output goes to a file, not a pipe: a child it left stuck in the
    kernel (a sync, an umount) keeps what it inherited open, and a pipe would
    hold the wait until that child ends."""
    t0 = time.monotonic()
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen([sys.executable, "-m", "reconciler", "--config", str(config),
                                 *args], stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        took = time.monotonic() - t0
        out.seek(0)
        return rc, out.read().decode(errors="replace"), took


def debugfs() -> None:
    """blk-mq's debugfs, where systemd mounts it (the VM has no systemd)."""
    if not os.path.ismount("/sys/kernel/debug"):
        subprocess.run(["mount", "-t", "debugfs", "debugfs", "/sys/kernel/debug"], check=True,
                       timeout=30)


def driver_busy(device: str) -> str:
    """What blk-mq's debugfs lists for ``device`` (recorded for the report)."""
    name = os.path.basename(os.path.realpath(device))
    return "".join(p.read_text() for p in
                   sorted(Path(f"/sys/kernel/debug/block/{name}").glob("hctx*/busy")))


def mounts_under(root: Path) -> dict[str, tuple[int, str]]:
    """Mount point -> (mount id, device) of every mount under ``root``."""
    out = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        f = line.split()
        if f[4].startswith(str(root)):
            out[f[4]] = (int(f[0]), f[2])
    return out
