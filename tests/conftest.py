"""Shared pytest fixtures."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from reconciler.cli import main as cli
from reconciler.drivers.fusemapper import fuse_pids, loop_devices, reap_fuse_children
from reconciler.drivers.reaper import become_subreaper, reap_zombies
from reconciler.facts.parsers import parse_mountinfo
from reconciler.testing.devcluster import DevCluster, start_cluster

if TYPE_CHECKING:
    from gitserver import GitServer
    from gitserver_https import HttpsGitServer
    from source_signing import Signing, SshKey

# --- real Ceph cluster (reconciler.testing.devcluster) ---------------------------------
# One disposable 1-mon + 1-memstore-OSD cluster per test session. Startup takes
# about a second, but its data lives in OSD RAM (3 GiB cap), so tests share it:
# use unique image names and remove what you create. Mark such tests
# `@pytest.mark.ceph`. Every test that needs the cluster (marked, or using
# the `ceph_cluster` fixture, directly or through `node`) is also marked
# `cluster`: `pytest -m "not cluster"` runs the rest in seconds.


IN_VM = os.environ.get("RUN_IN_VM") == "1"  # inside scripts/kernel-tests.sh's VM


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Tests marked `kernel` need krbd, rbd-nbd or dm-crypt: they run in the VM
    # that scripts/kernel-tests.sh boots (a stock Debian kernel), not here.
    skip = pytest.mark.skip(reason="needs the real kernel paths (krbd, rbd-nbd, dm-crypt): "
                                   "run scripts/kernel-tests.sh")
    for item in items:
        if item.get_closest_marker("ceph") or "ceph_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.cluster)
        if item.get_closest_marker("kernel") and not IN_VM:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ceph_cluster() -> Iterator[DevCluster]:
    if IN_VM and os.environ.get("RBD_RECONCILER_CEPH_CONF"):
        # The VM uses the cluster scripts/kernel-tests.sh runs on the host
        # (its data survives the VM: a reboot is a second boot).
        yield DevCluster.attach(Path(os.environ["RBD_RECONCILER_CEPH_CONF"]),
                                Path(os.environ["RBD_RECONCILER_CEPH_KEYRING"]),
                                os.environ.get("RBD_RECONCILER_CEPH_USER", "admin"),
                                os.environ.get("RBD_RECONCILER_POOL", "rbd"))
        return
    if shutil.which("ceph-mon") is None or shutil.which("ceph-osd") is None:
        # Not a skip: a suite that silently drops its Ceph tests is not green.
        pytest.fail("ceph-mon/ceph-osd not installed (scripts/setup.sh installs them)")
    cluster = start_cluster()
    try:
        yield cluster
    finally:
        cluster.stop()


# --- a node under test: config, desired dir, state dir, allowed root ----------
# Everything lives under the test's tmp_path; teardown releases what the test
# left published, deletes the images it made, and asserts nothing leaked.





@dataclass
class NodeUnderTest:
    root: Path
    cluster: DevCluster
    config: Path
    desired: Path
    state: Path
    srv: Path
    tag: str
    images: set[str] = field(default_factory=set)

    def name(self, base: str) -> str:
        return f"{base}-{self.tag}"

    def write(self, name: str, body: str, filename: str | None = None) -> Path:
        """Write a volume file; ``body`` is the YAML under ``spec:`` (indented 2)."""
        text = (f"apiVersion: rbd-reconciler/v1\nkind: Volume\nmetadata:\n  name: {name}\n"
                f"spec:\n{body}")
        path = self.desired / (filename or f"{name}.yaml")
        path.write_text(text)
        for line in body.splitlines():
            if line.strip().startswith("name:"):
                self.images.add(line.split(":", 1)[1].strip())
        self.images.add(name)
        return path

    def cli(self, *args: str) -> tuple[int, str]:
        """Run the CLI in-process (rbd-fuse stays our child and is reaped)."""
        import io
        import sys

        out = io.StringIO()
        old = sys.stdout
        sys.stdout = out
        try:
            rc = cli.main(["--config", str(self.config), *args])
        finally:
            sys.stdout = old
        return rc, out.getvalue()

    def cli_json(self, *args: str) -> tuple[int, dict]:
        rc, out = self.cli(*args, "-o", "json")
        return rc, json.loads(out)

    def apply(self) -> dict:
        rc, doc = self.cli_json("apply")
        doc["rc"] = rc
        return doc

    def plan(self) -> tuple[int, dict]:
        return self.cli_json("plan")

    def mounts(self) -> dict[str, object]:
        return {m.mount_point: m for m in parse_mountinfo(Path("/proc/self/mountinfo").read_bytes())
                if m.mount_point.startswith(str(self.root))}

    def image_exists(self, name: str) -> bool:
        import rbd  # Ceph's binding only where a test needs the cluster

        with self.cluster.client() as c, c.open_ioctx(self.cluster.pool) as io:
            return name in rbd.RBD().list(io)


def _loops_under(root: Path, tag: str) -> list[str]:
    """Loop devices of this test: backed by a file under its root, or, once
    the FUSE mount behind it is gone (sysfs then shows "/IMAGE"), by one of
    its images (named NAME-TAG)."""
    return [lo.name for lo in loop_devices()
            if lo.back_file and (lo.back_file.startswith(str(root))
                                 or lo.back_file.endswith(f"-{tag}"))]


@pytest.fixture(scope="session", autouse=True)
def _subreaper() -> Iterator[None]:
    """rbd-fuse helpers orphaned by CLI/daemon processes come back to the test
    session; at its end none may still run (each test released its volumes)."""
    become_subreaper()
    yield
    reap_zombies()
    reap_fuse_children()
    me = str(os.getpid())
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            text = stat.read_text()
            rest = text[text.rindex(")") + 2:].split()
            if "(rbd-fuse)" in text and rest[1] == me and rest[0] != "Z":
                alive.append(stat.parent.name)
    assert not alive, f"rbd-fuse processes left running: {alive}"


def new_node(root: Path, ceph_cluster: DevCluster, extra: str = "") -> NodeUnderTest:
    """A node's directories and config under ``root`` (``extra``: more of
    the config's top-level YAML)."""
    tag = uuid.uuid4().hex[:6]
    desired, state, srv = root / "desired", root / "state", root / "srv"
    for d in (desired, state, srv):
        d.mkdir()
    config = root / "config.yaml"
    config.write_text(
        f"desiredDir: {desired}\nstateDir: {state}\nnodeName: test-node\n"
        f"ceph:\n  conf: {ceph_cluster.conf}\n  user: {ceph_cluster.user}\n"
        f"  keyring: {ceph_cluster.keyring}\n"
        f"allowedRoots: [{srv}]\nmapper: fuse\n"
        # Its own (under stateDir: a second node's config, made by replacing
        # the state path, gets its own too): tests run several daemons at once.
        f"controlSocket: {state}/control.sock\n{extra}")
    return NodeUnderTest(root, ceph_cluster, config, desired, state, srv, tag)


@pytest.fixture
def node(tmp_path: Path, ceph_cluster: DevCluster) -> Iterator[NodeUnderTest]:
    n = new_node(tmp_path, ceph_cluster)
    desired = n.desired
    yield n
    # Teardown: give everything back, then prove nothing leaked. Leftovers are
    # removed forcibly either way: a FUSE mount outliving the session cluster
    # would hang every later losetup/umount on this machine.
    try:
        if any(desired.iterdir()):
            n.cli("release")
        with ceph_cluster.client() as c, c.open_ioctx(ceph_cluster.pool) as io:
            # Clones before their parents: a few rounds settle any order.
            for _ in range(4):
                for name in sorted(n.images):
                    _remove_with_snapshots(io, name)
    finally:
        reap_zombies()
        leaked_mounts = sorted(n.mounts())
        leaked_loops = _loops_under(tmp_path, n.tag)
        _force_cleanup(leaked_mounts, leaked_loops)
    assert not leaked_mounts, f"mounts leaked: {leaked_mounts}"
    assert not leaked_loops, f"loop devices leaked: {leaked_loops}"


def _remove_with_snapshots(io: object, name: str) -> None:
    import rbd

    with contextlib.suppress(rbd.ImageNotFound, rbd.ImageBusy, rbd.ImageHasSnapshots):
        with rbd.Image(io, name) as img:
            for snap in list(img.list_snaps()):
                if img.is_protected_snap(snap["name"]):
                    img.unprotect_snap(snap["name"])
                img.remove_snap(snap["name"])
        rbd.RBD().remove(io, name)


def _force_cleanup(mounts: list[str], loops: list[str]) -> None:
    import subprocess

    for mp in reversed(mounts):  # children before parents
        subprocess.run(["umount", "-l", mp], check=False, timeout=30)
    for lo in loops:
        _thaw_detached(lo)
        subprocess.run(["losetup", "-d", lo], check=False, timeout=30)
    for mnt, pid in fuse_pids().items():
        if mnt.startswith(tuple(mounts)) or not Path(mnt).exists():
            with contextlib.suppress(OSError):
                os.kill(pid, 9)
    reap_fuse_children()


def _thaw_detached(loop: str) -> None:
    """A filesystem unmounted while frozen lives on in the kernel, frozen,
    holding its loop device with no mount point anywhere: mount it again (the
    kernel hands back that superblock), thaw it there, unmount it."""
    import subprocess
    import tempfile

    dev = Path(loop).name
    if not any(Path(f"/sys/fs/{fs}/{dev}").exists() for fs in ("ext4", "xfs")):
        return
    if any(m.source == loop for m in parse_mountinfo(Path("/proc/self/mountinfo").read_bytes())):
        return  # mounted: the lazy unmount above lets it go
    with tempfile.TemporaryDirectory(prefix="thaw-") as mnt:
        if subprocess.run(["mount", "--", loop, mnt], check=False, timeout=30).returncode:
            return
        subprocess.run(["fsfreeze", "-u", "--", mnt], check=False, timeout=30)
        subprocess.run(["umount", "--", mnt], check=False, timeout=30)


@pytest.fixture
def start_csi(node: NodeUnderTest) -> Iterator[object]:
    """Start the daemon with --csi-endpoint; returns a CsiNode (tests/csi/csi_fixture.py)."""
    from csi_fixture import start_csi_fixture

    yield from start_csi_fixture(node)


@pytest.fixture
def replica_b(node: NodeUnderTest, tmp_path: Path) -> Iterator[object]:
    """A second CSI daemon on the same cluster: its own state, desired dir and
    socket, the same nodeName (controller replicas share one owner name).
    Calling it again restarts it on the same state dir."""
    from csi_fixture import start_csi_fixture

    root = tmp_path / "replica-b"
    dirs = [root / d for d in ("desired", "state", "srv")]
    for d in dirs:
        d.mkdir(parents=True)
    config = root / "config.yaml"
    text = node.config.read_text()
    for old, new in zip((node.desired, node.state, node.srv), dirs, strict=True):
        text = text.replace(str(old), str(new))
    config.write_text(text)
    yield from start_csi_fixture(NodeUnderTest(root, node.cluster, config, *dirs, node.tag))


@pytest.fixture
def dead_pool(ceph_cluster: DevCluster) -> Iterator[str]:
    """A real pool whose CRUSH rule maps to no OSD: every op on it waits."""
    tag = uuid.uuid4().hex[:6]
    root, rule, pool = f"empty-{tag}", f"dead-{tag}", f"dead-{tag}"

    def mon(cmd: dict[str, object]) -> None:
        with ceph_cluster.client(timeout=30) as c:
            rc, _, err = c.mon_command(json.dumps(cmd), b"", timeout=30)
            assert rc == 0, f"{cmd['prefix']}: {err}"

    mon({"prefix": "osd crush add-bucket", "name": root, "type": "root"})
    mon({"prefix": "osd crush rule create-replicated", "name": rule, "root": root,
         "type": "osd"})
    mon({"prefix": "osd pool create", "pool": pool, "pg_num": 8, "pgp_num": 8,
         "pool_type": "replicated", "rule": rule})
    try:
        yield pool
    finally:
        mon({"prefix": "osd pool rm", "pool": pool, "pool2": pool,
             "yes_i_really_really_mean_it": True})
        mon({"prefix": "osd crush rule rm", "name": rule})
        mon({"prefix": "osd crush remove", "name": root})


@pytest.fixture
def git_server() -> Iterator[GitServer]:
    """A real sshd on 127.0.0.1 serving a bare repository (tests/gitserver.py):
    ``.url``, ``.deploy_key``, ``.known_hosts``, ``.repo``, ``.file_url``,
    ``.push(workdir)``, ``.stop()``/``.start()``/``.down()``."""
    from gitserver import serve

    with serve() as server:
        yield server


@pytest.fixture
def git_https_server(tmp_path: Path) -> Iterator[HttpsGitServer]:
    """git http-backend over TLS on 127.0.0.1 behind Basic authentication
    (tests/gitserver_https.py): ``.url``, ``.ca`` (not trusted by default),
    ``.token_file``, ``.username``, ``.requests``, ``.push(workdir)``, ``.holding()``."""
    from gitserver_https import serve_https

    with serve_https(tmp_path) as server:
        yield server


@pytest.fixture
def signer(tmp_path: Path) -> Iterator[Signing]:
    """The signer's side of the GitOps source (tests/source_signing.py):
    keys and a work repository; its gpg-agent stopped at the end."""
    from source_signing import Signing

    with Signing(tmp_path / "signer") as s:
        yield s


@pytest.fixture
def alice(signer: Signing) -> SshKey:
    """One ssh signing key of ``signer``'s."""
    return signer.ssh_key("alice")
