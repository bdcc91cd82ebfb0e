"""The disposable Ceph cluster works and leaves nothing behind."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from reconciler.testing.devcluster import DevCluster, DevClusterError, start_cluster

pytestmark = pytest.mark.ceph

MiB = 1 << 20


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _mounts_under(root: Path) -> list[str]:
    # Field 5 of mountinfo is the mount point (octal-escaped; our paths need none).
    points = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    return [p for p in points if p == str(root) or p.startswith(f"{root}/")]


def test_image_lifecycle_through_librbd(ceph_cluster: DevCluster) -> None:
    import rbd

    name = f"devcluster-{uuid.uuid4().hex[:8]}"
    payload = b"rbd-reconciler" * 100
    with ceph_cluster.client() as r, r.open_ioctx(ceph_cluster.pool) as ioctx:
        api = rbd.RBD()
        api.create(ioctx, name, 8 * MiB)
        try:
            assert name in api.list(ioctx)
            with rbd.Image(ioctx, name) as img:
                img.resize(16 * MiB)
                assert img.size() == 16 * MiB
                assert img.write(payload, 4 * MiB) == len(payload)
                assert img.read(4 * MiB, len(payload)) == payload
        finally:
            api.remove(ioctx, name)
        assert name not in api.list(ioctx)


def test_client_env_works_for_the_rbd_cli(ceph_cluster: DevCluster) -> None:
    name = f"devcluster-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, **ceph_cluster.client_env()}

    def rbd_cli(*args: str) -> str:
        return subprocess.run(["timeout", "-k", "5", "30", "rbd", *args], env=env, check=True,
                              capture_output=True, text=True).stdout

    rbd_cli("create", "--size", "4M", f"{ceph_cluster.pool}/{name}")
    assert name in rbd_cli("ls", ceph_cluster.pool).split()
    rbd_cli("rm", "--no-progress", f"{ceph_cluster.pool}/{name}")


def test_own_cluster_stops_without_leftovers() -> None:
    t0 = time.monotonic()
    cluster = start_cluster(pool="leftovers")
    startup = time.monotonic() - t0
    pids = dict(cluster.pids)
    root = cluster.root
    try:
        assert set(pids) == {"mon.a", "osd.0"}
        assert all(_alive(pid) for pid in pids.values())
        with cluster.client() as r:
            assert r.pool_exists("leftovers")
            assert r.get_fsid()
    finally:
        cluster.stop()
    cluster.stop()  # idempotent

    for pid in pids.values():
        assert not _alive(pid)
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # already reaped by stop(), no zombie
    assert not root.exists()
    assert _mounts_under(root) == []
    print(f"dev cluster startup: {startup:.2f}s")


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_stop_never_enters_mounts_under_root() -> None:
    # Left-over mounts (a forgotten rbd-fuse or staging mount) must not be
    # walked into — a dead rbd-fuse hangs any stat, and their content is not ours.
    cluster = start_cluster()
    pids = list(cluster.pids.values())
    mnt = cluster.root / "state" / "stage"
    mnt.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "devcluster-test", str(mnt)], check=True)
    try:
        (mnt / "precious").write_text("data")
        with pytest.raises(DevClusterError, match="still holds mounts"):
            cluster.stop()
        assert not any(_alive(pid) for pid in pids)
        assert (mnt / "precious").read_text() == "data"
        assert sorted(p.name for p in cluster.root.iterdir()) == ["state"]
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
    cluster.stop()
    assert not cluster.root.exists()


def _procs_mentioning(root: Path) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(root).encode() in (proc / "cmdline").read_bytes():
                pids.append(int(proc.name))
        except OSError:
            continue  # exited meanwhile
    return pids


def test_failed_start_cleans_up_and_reports_logs(tmp_path: Path) -> None:
    root = tmp_path / "cluster"
    # A 1-byte memstore boots but is full at once, so `rbd pool init` cannot
    # write: the start must time out, kill the mon and OSD it started, remove
    # the dir it created and quote the daemons' logs.
    with pytest.raises(DevClusterError) as ei:
        start_cluster(root=root, memstore_bytes=1, timeout=3)
    msg = str(ei.value)
    assert "could not start dev cluster" in msg
    assert "--- mon.a.log (tail) ---" in msg
    assert "--- osd.0.log (tail) ---" in msg
    assert _procs_mentioning(root) == []
    assert not root.exists()
    assert _mounts_under(root) == []


def test_start_refuses_non_empty_dir(tmp_path: Path) -> None:
    (tmp_path / "precious").write_text("data")
    with pytest.raises(DevClusterError, match="not empty"):
        start_cluster(root=tmp_path)
    assert (tmp_path / "precious").read_text() == "data"


def test_cli_run_sets_env_and_returns_exit_code(tmp_path: Path) -> None:
    root = tmp_path / "demo"
    script = (
        "import os, sys\n"
        "e = os.environ\n"
        "assert os.path.exists(e['RBD_RECONCILER_CEPH_CONF']), e['RBD_RECONCILER_CEPH_CONF']\n"
        "assert e['RBD_RECONCILER_CEPH_CONF'] == e['CEPH_CONF']\n"
        "assert os.path.exists(e['RBD_RECONCILER_CEPH_KEYRING'])\n"
        "assert e['RBD_RECONCILER_CEPH_USER'] == 'admin'\n"
        "assert e['RBD_RECONCILER_POOL'] == 'rbd'\n"
        "sys.exit(7)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "reconciler.testing.devcluster", "run", "--dir", str(root), "--",
         sys.executable, "-c", script],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 7, proc.stderr
    assert not root.exists()  # we created it, so stop() removed it


def _listeners(pids: set[int]) -> list[tuple[str, str]]:
    """(local address, process) of every TCP/UDP socket the given pids listen on."""
    out = subprocess.run(["ss", "-Htulnp"], capture_output=True, text=True, check=True,
                         timeout=30).stdout
    found = []
    for line in out.splitlines():
        fields = line.split()
        procs = fields[-1] if fields[-1].startswith("users:") else ""
        owners = {int(p) for p in re.findall(r"pid=(\d+)", procs)}
        if owners & pids:
            found.append((fields[4], procs))
    return found


def test_every_daemon_listens_on_loopback_only(ceph_cluster: DevCluster) -> None:
    """A test or demo cluster never listens on a real interface (mon, OSD
    public, cluster/back and heartbeat addresses)."""
    listening = _listeners(set(ceph_cluster.pids.values()))
    assert len(listening) >= 4, f"expected the mon and OSD listeners, found {listening}"
    loopback = ("127.", "[::1]", "[::ffff:127.")
    elsewhere = [addr for addr, _ in listening if not addr.startswith(loopback)]
    assert not elsewhere, f"cluster daemons listen beyond loopback: {elsewhere}"
