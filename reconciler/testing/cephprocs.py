"""The processes and files under the dev cluster (testing/devcluster.py):
its ceph.conf rendered, the Ceph tools run with a deadline, the daemons
spawned and stopped, free ports, the daemons' log tails, mon commands, and
its state tree removed without ever entering a mount.

Imported by testing/devcluster.py only.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the bindings come from Debian packages; import them lazily
    import rados

STOP_TIMEOUT = 10.0  # per daemon, before SIGKILL; memstore OSDs exit in ~0.1 s
LOG_TAIL_LINES = 20


class DevClusterError(RuntimeError):
    """Start failed (the message carries the daemons' log tails), or stop left mounts."""


def render_conf(root: Path, fsid: str, mon_addrv: str, addr: str, keyring: Path,
                memstore_bytes: int) -> str:
    # Daemon logs and data go to sections only daemons read, so clients that
    # share this conf (rbd, rbd-fuse, librados in tests) log nowhere by default.
    net = "127.0.0.0/8" if addr.startswith("127.") else f"{addr}/32"
    return f"""\
[global]
fsid = {fsid}
mon host = {mon_addrv}
# Every daemon address on loopback (or the test namespace's one address):
# `public addr` alone leaves the OSD's cluster-side (back and heartbeat)
# ports on 0.0.0.0.
public addr = {addr}
cluster addr = {addr}
public network = {net}
cluster network = {net}
auth cluster required = cephx
auth service required = cephx
auth client required = cephx
run dir = {root}/run
crash dir = {root}/crash
osd pool default size = 1
osd pool default min size = 1
osd pool default pg autoscale mode = off
mon allow pool size one = true
mon allow pool delete = true
osd crush chooseleaf type = 0
mon data avail warn = 1
mon warn on pool no redundancy = false
mon warn on insecure global id reclaim allowed = false
osd objectstore = memstore
memstore device bytes = {memstore_bytes}

[client]
keyring = {keyring}

[mon]
mon data = {root}/mon/$cluster-$id
log file = {root}/log/$name.log
mon cluster log file = {root}/log/cluster.log
# Commits every paxos proposal at once: pool init and snapshots get ~20x faster.
paxos propose interval = 0.01

[osd]
osd data = {root}/osd/$cluster-$id
keyring = {root}/osd/$cluster-$id/keyring
log file = {root}/log/$name.log
"""


def run_tool(argv: Sequence[str | Path], deadline: float) -> None:
    # Each tool finishes in milliseconds; the start deadline only bounds a wedged one.
    args = [str(a) for a in argv]
    try:
        r = subprocess.run(args, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                           timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired as e:
        raise DevClusterError(f"{args[0]} did not finish before the start deadline") from e
    if r.returncode != 0:
        raise DevClusterError(f"{' '.join(args)} exited {r.returncode}: {r.stderr.strip()}")


def spawn(argv: list[str], out: Path, daemon: bool = True) -> subprocess.Popen[bytes]:
    # Our own session: a terminal's Ctrl-C reaches only us, and we stop the
    # daemons in order. setpriv --pdeathsig kills them if we die without
    # stopping them (PID 1 here reaps nothing, so orphans would linger).
    prefix = ["setpriv", "--pdeathsig", "KILL", "--"] if shutil.which("setpriv") else []
    with out.open("ab") as f:
        return subprocess.Popen([*prefix, *argv], stdin=subprocess.DEVNULL, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=daemon)


def terminate(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_TIMEOUT)
            return
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait()  # reap, always: nobody else will


def mon_cmd(handle: rados.Rados, cmd: dict[str, object], inbuf: str = "") -> bytes:
    rc, out, err = handle.mon_command(json.dumps({**cmd, "format": "json"}), inbuf.encode())
    if rc != 0:
        raise DevClusterError(f"mon command {cmd['prefix']!r} failed ({rc}): {err}")
    return out


def secs(t: float) -> str:
    return str(max(1, int(t)))  # whole seconds, and 0 would mean "no timeout"


def read_key(keyring: Path) -> str:
    for line in keyring.read_text().splitlines():
        k, sep, v = line.partition("=")
        if sep and k.strip() == "key":
            return v.strip()
    raise DevClusterError(f"no key in {keyring}")


def free_port(addr: str = "127.0.0.1", avoid: int = 0) -> int:
    # Below 32768 (the kernel's ephemeral range starts there) and outside the
    # OSD's default 6800-7300 range; bind-tested, so only a race can lose it.
    for _ in range(200):
        port = random.randrange(10000, 32768)
        if port == avoid:
            continue
        with socket.socket() as s:
            try:
                s.bind((addr, port))
            except OSError:
                continue
            return port
    raise DevClusterError("no free port found for the mon")


def port_open(port: int, addr: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((addr, port)) == 0


def log_tails(root: Path) -> str:
    parts = []
    for log in sorted((root / "log").glob("*")):
        with contextlib.suppress(OSError):
            lines = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
            if lines:
                parts.append(f"--- {log.name} (tail) ---\n" + "\n".join(lines))
    return "\n".join(parts)


def mount_points() -> set[str]:
    points = set()
    mountinfo = Path("/proc/self/mountinfo").read_bytes().decode("utf-8", "surrogateescape")
    for line in mountinfo.splitlines():
        fields = line.split()
        if len(fields) > 4:  # field 5 is the mount point, with \040-style escapes
            points.add(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[4]))
    return points


def remove_tree(root: Path, keep_root: bool) -> list[str]:
    """Remove root (or only its contents) without entering mount points; return those left."""
    top = os.path.normpath(root)
    points = mount_points()
    blockers = sorted(m for m in points if m.startswith(f"{top}/"))
    if top in points and not keep_root:
        return [top]  # someone mounted over our dir: nothing below it is ours
    if not os.path.lexists(top):
        return blockers
    if not blockers:
        if keep_root:
            _clear(top, set())
        else:
            shutil.rmtree(top)
        return []
    _clear(top, set(blockers))
    return blockers


def _clear(directory: str, mounts: set[str]) -> None:
    # Delete everything in directory except the mount points and the dirs leading to them.
    # Mount points are recognised by path before any syscall touches them.
    with os.scandir(directory) as it:
        entries = list(it)
    for e in entries:
        if e.path in mounts:
            continue
        if any(m.startswith(f"{e.path}/") for m in mounts):
            _clear(e.path, mounts)
        elif e.is_dir(follow_symlinks=False):
            shutil.rmtree(e.path)
        else:
            os.unlink(e.path)
