"""A disposable, real, single-node Ceph cluster for tests and demos.

One ceph-mon and one memstore ceph-osd on 127.0.0.1 with cephx auth, all state
under one temporary directory. Another address (``--addr``, for a VM to reach:
scripts/kernel-tests.sh) is refused unless this process runs in the private
network namespace that script made (RBD_RECONCILER_TEST_NETNS names its
inode): a test cluster never listens on a real interface. No ceph-mgr: the
RBD data path does not need it (but `ceph pg ...`, `ceph osd df` and `rbd
perf` hang without one — never call them). Data lives in the OSD's RAM, so
the cluster is throw-away by design.

    with start_cluster() as cluster:
        subprocess.run(["rbd", "ls"], env={**os.environ, **cluster.client_env()})

CLI (used by the README demo):

    python -m reconciler.testing.devcluster run [--dir DIR] [--pool rbd] -- CMD ARGS...

Imported by the tests, the benchmarks and the demo (its CLI), never by the
product (the layers contract keeps testing/ beside cli/). Its processes and
files are testing/cephprocs.py; ``DevClusterError`` is defined there and
named in ``__all__`` here, the public entry.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from reconciler.drivers.reaper import become_subreaper, reap_zombies
from reconciler.testing.cephprocs import (
    DevClusterError,
    free_port,
    log_tails,
    mon_cmd,
    port_open,
    read_key,
    remove_tree,
    render_conf,
    run_tool,
    secs,
    spawn,
    terminate,
)

if TYPE_CHECKING:  # the bindings come from Debian packages; import them lazily
    import rados

__all__ = ["DevCluster", "DevClusterError", "main", "start_cluster"]

MON_ID = "a"
OSD_ID = 0


@dataclass
class DevCluster:
    root: Path
    conf: Path
    keyring: Path
    user: str
    pool: str
    mon_addr: str
    _procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict, repr=False)
    # False when the caller handed us an existing (empty) directory: then we
    # empty it on stop instead of deleting it.
    _owns_root: bool = field(default=True, repr=False)
    _stopped: bool = field(default=False, repr=False)
    _external: bool = field(default=False, repr=False)  # attach(): not ours to stop

    @classmethod
    def attach(cls, conf: Path, keyring: Path, user: str = "admin",
               pool: str = "rbd") -> DevCluster:
        """A cluster someone else started (the kernel tests' VM uses the one
        scripts/kernel-tests.sh runs on the host): stop() leaves it alone."""
        return cls(root=conf.parent, conf=conf, keyring=keyring, user=user, pool=pool,
                   mon_addr="", _owns_root=False, _external=True)

    @property
    def pids(self) -> dict[str, int]:
        """Daemon name -> pid, e.g. {"mon.a": 123, "osd.0": 124}."""
        return {name: p.pid for name, p in self._procs.items()}

    def client_env(self) -> dict[str, str]:
        """Environment for client subprocesses (rbd, rbd-fuse, ceph): no -c/--id needed."""
        return {
            "CEPH_CONF": str(self.conf),
            "CEPH_ARGS": f"--id {self.user} --keyring {self.keyring}",
        }

    def connect(self, timeout: float = 30, osd_op_timeout: float | None = None) -> rados.Rados:
        """A connected librados handle; the caller must shutdown() it (or use client()).

        `timeout` bounds connecting and mon commands: a dead cluster should fail
        a test, not hang it. `osd_op_timeout` bounds data I/O (a full memstore
        blocks writes forever); unset, I/O waits as long as it takes.
        """
        import rados

        conf = {"keyring": str(self.keyring)}
        conf["client_mount_timeout"] = conf["rados_mon_op_timeout"] = secs(timeout)
        if osd_op_timeout is not None:
            conf["rados_osd_op_timeout"] = secs(osd_op_timeout)
        handle = rados.Rados(conffile=str(self.conf), rados_id=self.user, conf=conf)
        try:
            handle.connect()
        except BaseException:
            handle.shutdown()
            raise
        return handle

    @contextlib.contextmanager
    def client(
        self, timeout: float = 30, osd_op_timeout: float | None = None
    ) -> Iterator[rados.Rados]:
        """`with cluster.client() as r:` — connect() that shuts down on exit."""
        handle = self.connect(timeout, osd_op_timeout)
        try:
            yield handle
        finally:
            handle.shutdown()

    def stop(self) -> None:
        """Stop the OSD, then the mon (by pid), and remove the state. Idempotent.

        Mount points under root are never entered (a stat on an rbd-fuse mount
        whose cluster is gone hangs, and a filesystem mounted there is not ours
        to delete): they are left in place and reported with DevClusterError;
        call stop() again after unmounting them.
        """
        if self._stopped or self._external:
            return
        # OSD first: a mon-less OSD would otherwise wait for its mon until killed.
        for name in sorted(self._procs, key=lambda n: not n.startswith("osd")):
            terminate(self._procs[name])
        left = remove_tree(self.root, keep_root=not self._owns_root)
        if left:
            raise DevClusterError(
                f"dev cluster stopped, but {self.root} still holds mounts, left untouched "
                f"(unmount them, then call stop() again): {', '.join(left)}"
            )
        self._stopped = True

    def __enter__(self) -> DevCluster:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def in_test_netns() -> bool:
    """Whether this process runs in the private namespace of the kernel tests."""
    want = os.environ.get("RBD_RECONCILER_TEST_NETNS")
    try:
        return bool(want) and str(os.stat("/proc/self/ns/net").st_ino) == want
    except OSError:
        return False


def start_cluster(
    root: Path | None = None,
    pool: str = "rbd",
    memstore_bytes: int = 3 << 30,
    timeout: float = 60,
    addr: str = "127.0.0.1",
) -> DevCluster:
    """Bootstrap and start a 1-mon + 1-OSD cluster with an rbd-initialised `pool`.

    `addr`: where every daemon listens. Not loopback only inside the kernel
    tests' private network namespace (else DevClusterError). The mon then
    also speaks msgr v1: the kernel client's default (ms_mode=legacy).

    `root` must be absent or empty (it is emptied again on stop); by default a
    fresh temporary directory is used and deleted on stop. On any failure the
    started daemons are killed, the state removed, and DevClusterError raised
    with the tails of the mon and OSD logs.
    """
    if not addr.startswith("127.") and not in_test_netns():
        raise DevClusterError(
            f"refusing to listen on {addr} outside the kernel tests' private network "
            "namespace (it could be a real interface); use 127.0.0.1, or "
            "scripts/kernel-tests.sh")
    missing = [t for t in ("ceph-mon", "ceph-osd", "ceph-authtool", "monmaptool")
               if shutil.which(t) is None]
    if missing:
        raise DevClusterError(f"missing Ceph tools: {', '.join(missing)}")
    deadline = time.monotonic() + timeout
    if root is None:
        root, owns_root = Path(tempfile.mkdtemp(prefix="rbd-reconciler-ceph-")), True
    else:
        root = root.absolute()
        owns_root = not root.exists()
        if not owns_root and any(root.iterdir()):
            raise DevClusterError(f"{root} is not empty; refusing to put a cluster there")
        root.mkdir(parents=True, exist_ok=True)

    port = free_port(addr)
    cluster = DevCluster(
        root=root,
        conf=root / "ceph.conf",
        keyring=root / "ceph.client.admin.keyring",
        user="admin",
        pool=pool,
        mon_addr=f"{addr}:{port}",
        _owns_root=owns_root,
    )
    try:
        _bootstrap(cluster, memstore_bytes, deadline)
    except BaseException as e:  # also KeyboardInterrupt/SystemExit: never leak daemons
        logs = log_tails(root)
        cluster.stop()
        if isinstance(e, Exception):
            raise DevClusterError(f"could not start dev cluster in {root}: {e}\n{logs}") from e
        raise
    return cluster


# --- bootstrap ---------------------------------------------------------------


def _bootstrap(c: DevCluster, memstore_bytes: int, deadline: float) -> None:
    root = c.root
    fsid, osd_uuid = str(uuid.uuid4()), str(uuid.uuid4())
    mon_data, osd_data = root / "mon" / f"ceph-{MON_ID}", root / "osd" / f"ceph-{OSD_ID}"
    for d in (mon_data, osd_data, root / "run", root / "log", root / "crash"):
        d.mkdir(parents=True)
    addr = c.mon_addr.rsplit(":", 1)[0]
    # The kernel client speaks msgr v1 unless told otherwise (ms_mode): a mon
    # for a VM advertises both.
    v2 = int(c.mon_addr.rsplit(":", 1)[1])
    v1 = None if addr.startswith("127.") else free_port(addr, avoid=v2)
    addrv = f"[v2:{c.mon_addr}" + (f",v1:{addr}:{v1}]" if v1 else "]")
    c.conf.write_text(render_conf(root, fsid, addrv, addr, c.keyring, memstore_bytes))
    conf = ["-c", str(c.conf)]

    mon_keyring, osd_keyring = root / "mon.keyring", osd_data / "keyring"
    run_tool(["ceph-authtool", "--create-keyring", mon_keyring, "--gen-key", "-n", "mon.",
              "--cap", "mon", "allow *"], deadline)
    run_tool(["ceph-authtool", "--create-keyring", c.keyring, "--gen-key", "-n", "client.admin",
              "--cap", "mon", "allow *", "--cap", "osd", "allow *",
              "--cap", "mds", "allow *", "--cap", "mgr", "allow *"], deadline)
    run_tool(["ceph-authtool", mon_keyring, "--import-keyring", c.keyring], deadline)
    run_tool(["ceph-authtool", "--create-keyring", osd_keyring, "--gen-key", "-n", f"osd.{OSD_ID}"],
             deadline)
    osd_key = read_key(osd_keyring)

    # The OSD's mkfs needs no mon (fsid comes from the conf): run it alongside the mon's.
    osd_mkfs = spawn(["ceph-osd", *conf, "--no-mon-config", "-i", str(OSD_ID), "--mkfs",
                      "--osd-uuid", osd_uuid], root / "log" / "osd-mkfs.out", daemon=False)
    try:
        run_tool(["monmaptool", "--create", "--fsid", fsid, "--addv", MON_ID, addrv,
                  root / "monmap"], deadline)
        run_tool(["ceph-mon", *conf, "--mkfs", "-i", MON_ID, "--monmap", root / "monmap",
                  "--keyring", mon_keyring], deadline)
        c._procs[f"mon.{MON_ID}"] = spawn(["ceph-mon", *conf, "-f", "-i", MON_ID],
                                          root / "log" / f"mon.{MON_ID}.out")
        rc = osd_mkfs.wait(timeout=max(0.1, deadline - time.monotonic()))
        if rc != 0:
            raise DevClusterError(f"ceph-osd --mkfs exited {rc}")
    finally:
        terminate(osd_mkfs)

    port = int(c.mon_addr.rsplit(":", 1)[1])
    _wait_for(lambda: port_open(port, addr), c, deadline, "mon to listen")
    left = deadline - time.monotonic()
    handle = c.connect(timeout=left, osd_op_timeout=left)
    try:
        mon_cmd(handle, {"prefix": "osd new", "uuid": osd_uuid, "id": OSD_ID},
                json.dumps({"cephx_secret": osd_key}))
        c._procs[f"osd.{OSD_ID}"] = spawn(["ceph-osd", *conf, "-f", "-i", str(OSD_ID)],
                                          root / "log" / f"osd.{OSD_ID}.out")
        _wait_for(lambda: _osd_up(handle), c, deadline, "osd.0 to be up")
        # Without a mgr, MGR_DOWN appears after 120 s; sticky so it holds before it fires.
        mon_cmd(handle, {"prefix": "health mute", "code": "MGR_DOWN", "sticky": True})
        mon_cmd(handle, {"prefix": "osd pool create", "pool": c.pool, "pg_num": 8,
                         "pgp_num": 8})
        import rbd

        with handle.open_ioctx(c.pool) as ioctx:
            rbd.RBD().pool_init(ioctx, False)  # == `rbd pool init`; waits for active PGs
    finally:
        handle.shutdown()

def _osd_up(handle: rados.Rados) -> bool:
    dump = json.loads(mon_cmd(handle, {"prefix": "osd dump"}))
    return any(o["osd"] == OSD_ID and o["up"] == 1 for o in dump["osds"])


def _wait_for(cond: Callable[[], bool], c: DevCluster, deadline: float, what: str) -> None:
    while not cond():
        for name, p in c._procs.items():
            if p.poll() is not None:
                raise DevClusterError(f"{name} exited {p.returncode} while waiting for {what}")
        if time.monotonic() > deadline:
            raise DevClusterError(f"timed out waiting for {what}")
        time.sleep(0.02)

# --- CLI -----------------------------------------------------------------------


def _run(args: argparse.Namespace) -> int:
    cmd: list[str] = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        print("devcluster run: missing command after --", file=sys.stderr)
        return 2
    child: subprocess.Popen[bytes] | None = None

    def on_signal(signum: int, _frame: object) -> None:
        if child is None:
            raise SystemExit(128 + signum)  # unwinds start_cluster, which cleans up
        # A terminal's Ctrl-C already reached the command (same foreground process
        # group); anything else is forwarded. The cluster stops once it exits.
        if child.poll() is None and not (signum == signal.SIGINT and _tty_foreground()):
            child.send_signal(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    # rbd-fuse outlives the command that mapped; have it reparented here, not to PID 1.
    become_subreaper()
    cluster: DevCluster | None = None
    rc = 1
    try:
        t0 = time.monotonic()
        cluster = start_cluster(root=args.dir, pool=args.pool, timeout=args.timeout,
                                addr=args.addr)
        print(f"devcluster: up in {time.monotonic() - t0:.1f}s at {cluster.root} "
              f"(mon {cluster.mon_addr}, pool {cluster.pool})", file=sys.stderr)
        env = {
            **os.environ,
            **cluster.client_env(),
            "RBD_RECONCILER_CEPH_CONF": str(cluster.conf),
            "RBD_RECONCILER_CEPH_KEYRING": str(cluster.keyring),
            "RBD_RECONCILER_CEPH_USER": cluster.user,
            "RBD_RECONCILER_POOL": cluster.pool,
        }
        try:
            child = subprocess.Popen(cmd, env=env)
        except OSError as e:
            print(f"devcluster run: {cmd[0]}: {e}", file=sys.stderr)
            return 127
        rc = child.wait()
        rc = rc if rc >= 0 else 128 - rc
    except DevClusterError as e:
        print(f"devcluster: {e}", file=sys.stderr)
    finally:
        # Stopping is bounded; a second signal must not leave daemons half-stopped.
        for s in old:
            signal.signal(s, signal.SIG_IGN)
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()
        reap_zombies()
        if cluster is not None:
            try:
                cluster.stop()
            except DevClusterError as e:
                print(f"devcluster: {e}", file=sys.stderr)
                rc = rc or 1
        for s, h in old.items():
            signal.signal(s, h)
    return rc


def _tty_foreground() -> bool:
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError):
        return False


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m reconciler.testing.devcluster",
                                description="Run a command against a disposable Ceph cluster.")
    sub = p.add_subparsers(dest="action", required=True)
    run = sub.add_parser("run", help="start a cluster, run CMD with client env set, stop it")
    run.add_argument("--dir", type=Path, help="state directory (absent or empty; emptied after)")
    run.add_argument("--pool", default="rbd")
    run.add_argument("--timeout", type=float, default=60, help="startup deadline in seconds")
    run.add_argument("--addr", default="127.0.0.1",
                     help="listen here (not loopback: only in scripts/kernel-tests.sh's "
                          "private network namespace)")
    run.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    args = p.parse_args(argv)
    return _run(args)


if __name__ == "__main__":
    sys.exit(main())
