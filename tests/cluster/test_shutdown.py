"""Shutdown and reboot (issue 15, items 3 and 4): `release --all`, the units
that run it at the right moment, and the hardened sandbox they run in.

The cluster tests run the exact command rbd-reconciler-shutdown.service runs
at shutdown, then converge again as the daemon does at boot.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import NodeUnderTest, _loops_under
from test_daemon import Daemon, wait_for
from test_lifecycle import checksum_tree, fs_spec

from reconciler.drivers.fusemapper import _helper_args, reap_fuse_children
from reconciler.drivers.reaper import reap_zombies
from reconciler.drivers.safepath import ensure_dir
from reconciler.facts.observed import ImageState, Mapping, Observed
from reconciler.plan.release import identity_volume, provably_ours

ROOT = Path(__file__).resolve().parents[2]
UNITS = ROOT / "systemd"
DAEMON_UNIT = UNITS / "rbd-reconciler.service"
SHUTDOWN_UNIT = UNITS / "rbd-reconciler-shutdown.service"
INSTALLED = "/usr/bin/rbd-reconciler"
# What the hardening reached (systemd 252's `security --offline`): it may only go down.
# 4.3, then 4.4 with the daemon's CAP_SYSLOG (it reads /dev/kmsg; without it the
# kernel lets CAP_SYS_ADMIN read it through a deprecated path, with a warning).
MAX_EXPOSURE = 4.4
# Each of these gives the service its own mount namespace (systemd's
# exec_needs_mount_namespace): our mounts would not reach the host.
MOUNT_NAMESPACE_OPTIONS = {
    "PrivateTmp", "PrivateDevices", "PrivateMounts", "PrivateNetwork", "PrivateIPC",
    "ProtectSystem", "ProtectHome", "ProtectKernelTunables", "ProtectKernelModules",
    "ProtectKernelLogs", "ProtectControlGroups", "ProtectProc", "ProcSubset",
    "ReadOnlyPaths", "ReadWritePaths", "InaccessiblePaths", "ExecPaths", "NoExecPaths",
    "BindPaths", "BindReadOnlyPaths", "TemporaryFileSystem", "MountFlags", "RootDirectory",
    "RootImage", "MountImages", "ExtensionImages", "ExtensionDirectories", "LogNamespace",
    "NetworkNamespacePath", "IPCNamespacePath",
}


def unit_options(path: Path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^([A-Za-z]+)=(.*)$", line)
        if m:
            out.setdefault(m.group(1), []).append(m.group(2))
    return out


def installed_copy(unit: Path, tmp: Path) -> Path:
    """The unit with ExecStart/ExecStop pointing at this checkout's script
    (verify checks that the binary exists)."""
    exe = shutil.which("rbd-reconciler") or str(ROOT / ".venv" / "bin" / "rbd-reconciler")
    out = tmp / unit.name
    out.write_text(unit.read_text().replace(INSTALLED, exe))
    return out


# --- the units ---------------------------------------------------------------


def test_units_verify(tmp_path: Path) -> None:
    units = [installed_copy(u, tmp_path) for u in (DAEMON_UNIT, SHUTDOWN_UNIT)]
    proc = subprocess.run(["systemd-analyze", "verify", *map(str, units)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "rbd-reconciler" not in proc.stderr, proc.stderr  # no warning about ours


@pytest.mark.parametrize("unit", [DAEMON_UNIT, SHUTDOWN_UNIT], ids=lambda u: u.name)
def test_unit_exposure_and_no_mount_namespace(unit: Path, tmp_path: Path) -> None:
    proc = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--no-pager",
                           str(installed_copy(unit, tmp_path))],
                          capture_output=True, text=True)
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d)", proc.stdout)
    assert m, proc.stdout + proc.stderr
    assert float(m.group(1)) <= MAX_EXPOSURE, proc.stdout
    opts = unit_options(unit)
    assert not MOUNT_NAMESPACE_OPTIONS & set(opts), MOUNT_NAMESPACE_OPTIONS & set(opts)
    caps = set(opts["CapabilityBoundingSet"][0].split())
    # The daemon reads /dev/kmsg (I/O errors, filesystems gone read-only).
    extra = {"CAP_SYSLOG"} if unit == DAEMON_UNIT else set()
    assert caps == {"CAP_SYS_ADMIN", "CAP_DAC_OVERRIDE", "CAP_SYS_RESOURCE"} | extra
    assert opts["NoNewPrivileges"] == ["yes"] and opts["UMask"] == ["0077"]


def test_every_unit_that_runs_us_dumps_no_core() -> None:
    """Our processes hold node keys and unsealed passphrases: no core file of
    them (they also make themselves non-dumpable: tests/unit/cli/test_nodump.py)."""
    units = sorted(UNITS.glob("*.service"))
    assert {DAEMON_UNIT, SHUTDOWN_UNIT} <= set(units)
    for unit in units:
        opts = unit_options(unit)
        if any(INSTALLED in v for k in ("ExecStart", "ExecStop") for v in opts.get(k, [])):
            assert opts.get("LimitCORE") == ["0"], unit.name


def test_shutdown_ordering() -> None:
    """rbdmap's ordering, and the daemon stops before the release runs (stop
    order is the reverse of After=); a plain daemon stop never releases."""
    sd, daemon = unit_options(SHUTDOWN_UNIT), unit_options(DAEMON_UNIT)
    after = " ".join(sd["After"]).split()
    assert "network-online.target" in after and "ceph.target" in after
    # rbdmap's `unmap-all` takes every krbd device: our release goes first.
    assert "rbdmap.service" in after
    assert "remote-fs-pre.target" in " ".join(sd["Before"]).split()
    assert sd["Type"] == ["oneshot"] and sd["RemainAfterExit"] == ["yes"]
    assert "DefaultDependencies" not in sd  # yes: Conflicts=/Before=shutdown.target
    argv = shlex.split(sd["ExecStop"][0])
    assert argv[0] == INSTALLED and argv[1:3] == ["release", "--all"]
    assert "rbd-reconciler-shutdown.service" in " ".join(daemon["After"]).split()
    assert "rbd-reconciler-shutdown.service" in " ".join(daemon["Wants"]).split()
    for binding in ("BindsTo", "PartOf", "Requires", "Requisite"):
        assert "rbd-reconciler-shutdown" not in " ".join(daemon.get(binding, []))
    assert shlex.split(daemon["ExecStart"][0])[0] == INSTALLED
    # The Debian package's path; the pip route installs the units with the
    # path it links the command to.
    install = (ROOT / "docs" / "daemon.md").read_text()  # The daemon, Install (systemd)
    assert "ln -s /opt/rbd-reconciler/bin/rbd-reconciler /usr/local/bin/rbd-reconciler" in install
    assert f"sed 's#{INSTALLED}#/usr/local/bin/rbd-reconciler#'" in install


def test_directories_for_apps_are_0755_whatever_the_umask(tmp_path: Path) -> None:
    """The unit runs with UMask=0077: a publish target's parents made by us
    must still let the apps through."""
    old = os.umask(0o077)
    try:
        assert ensure_dir(str(tmp_path / "srv" / "app" / "data"))
    finally:
        os.umask(old)
    for p in (tmp_path / "srv", tmp_path / "srv" / "app", tmp_path / "srv" / "app" / "data"):
        assert p.stat().st_mode & 0o777 == 0o755, p


def test_kernel_mappings_by_identity_need_our_holder() -> None:
    """A krbd mapping no file names is ours only if its image-meta says this
    node mapped it: rbdmap's, or one we cannot read, is left alone."""
    def observed(meta: dict[str, str] | None) -> Observed:
        images = {} if meta is None else {("p", "i"): ImageState("p", "i", 1, frozenset(), meta)}
        return Observed(images=images, pools_listed=frozenset({"p"}), pool_errors={},
                        mappings=(), devices={}, mounts=(),
                        image_errors={} if meta is not None else {("p", "i"): "timed out"})

    krbd = identity_volume(Mapping("krbd", "p", "i", "/dev/rbd0"))
    fuse = identity_volume(Mapping("fuse", "p", "i", "/dev/loop0", "/x/fuse/p@i"))
    assert provably_ours(krbd, observed({"rbd-reconciler.holder": "me"}), "me") is None
    assert "not ours" in provably_ours(krbd, observed({"rbd-reconciler.holder": "n2"}), "me")
    # The claim as apply writes it (JSON, with the mapping clients).
    claim = '{"node": "me", "clients": ["127.0.0.1:0/42"]}'
    assert provably_ours(krbd, observed({"rbd-reconciler.holder": claim}), "me") is None
    other = '{"node": "n2", "clients": ["127.0.0.1:0/43"]}'
    assert "claimed by n2" in provably_ours(krbd, observed({"rbd-reconciler.holder": other}),
                                            "me")
    assert "not ours" in provably_ours(krbd, observed({}), "me")
    assert "timed out" in provably_ours(krbd, observed(None), "me")
    assert provably_ours(fuse, observed(None), "me") is None  # its mount point says so


# --- on the real cluster -------------------------------------------------------


def shutdown_command(node: NodeUnderTest) -> list[str]:
    """The unit's ExecStop, run from this checkout with the test's config."""
    argv = shlex.split(unit_options(SHUTDOWN_UNIT)["ExecStop"][0])
    assert argv[0] == INSTALLED
    return [sys.executable, "-m", "reconciler", "--config", str(node.config), *argv[1:]]


def run_shutdown(node: NodeUnderTest, *extra: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([*shutdown_command(node), *extra], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)  # the unit's TimeoutStopSec
    reap_zombies()  # the helpers it unmounted were our children
    reap_fuse_children()
    return proc


def fuse_helpers_under(root: Path) -> list[str]:
    return [p.name for p in Path("/proc").glob("[0-9]*")
            if any(a.startswith(str(root)) for a in _helper_args(p))]


def held_by_us(node: NodeUnderTest) -> dict[str, object]:
    return {"mounts": sorted(node.mounts()), "loops": _loops_under(node.root, node.tag),
            "rbd-fuse": fuse_helpers_under(node.root)}


NOTHING = {"mounts": [], "loops": [], "rbd-fuse": []}


def desired_files(node: NodeUnderTest) -> dict[str, str]:
    return {str(p): p.read_text() for d in (node.desired, node.state / "csi.d")
            for p in sorted(d.iterdir())}


def block_spec(pool: str, target: Path) -> str:
    return (f"  image: {{pool: {pool}, size: 16Mi}}\n  map: {{mapper: fuse}}\n"
            f"  stage: {{mode: block}}\n  publish:\n    - path: {target}\n")


def write_block(path: Path, payload: bytes) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, payload, 1 << 20)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_block(path: Path, n: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(1 << 20)
        return f.read(n)


@pytest.mark.ceph
def test_shutdown_releases_everything_and_boot_restores_it(node: NodeUnderTest) -> None:
    pool, srv = node.cluster.pool, node.srv
    fs, blk, csi, kept, frozen = (node.name(n) for n in ("fs", "blk", "csi", "kept", "frozen"))
    node.write(fs, fs_spec(pool, "64Mi", "ext4", [(srv / "app", False), (srv / "view", True)]))
    node.write(blk, block_spec(pool, srv / "disk"))
    node.write(kept, fs_spec(pool, "64Mi", "ext4", [(srv / "kept", False)],
                             extra="  onRemove: keep\n"))
    frozen_file = node.write(frozen, fs_spec(pool, "64Mi", "ext4", [(srv / "frozen", False)]))
    # The CSI adapter's directory (csi.dir): converged and released like the rest.
    csi_dir = node.state / "csi.d"
    csi_dir.mkdir(mode=0o700)
    node.write(csi, fs_spec(pool, "64Mi", "ext4", [(srv / "csi", False)]))
    (node.desired / f"{csi}.yaml").rename(csi_dir / f"{csi}.yaml")
    doc = node.apply()
    assert doc["rc"] == 0, doc

    payload = os.urandom(4096)
    write_block(srv / "disk", payload)
    for d in ("app", "csi", "kept", "frozen"):
        (srv / d / "data").write_bytes(os.urandom(1 << 16))
    sums = {d: checksum_tree(srv / d) for d in ("app", "csi", "kept", "frozen")}
    # Ours by identity only: a file removed with onRemove: keep (no daemon record),
    # and one that no longer loads.
    kept_text = (node.desired / f"{kept}.yaml").read_text()
    (node.desired / f"{kept}.yaml").unlink()
    good = frozen_file.read_text()
    frozen_file.write_text(good.replace("size: 64Mi", "size: 64MB"))
    files = desired_files(node)

    # What the package's prerm asks before a removal: every one of them,
    # and nothing done.
    before = held_by_us(node)
    dry = run_shutdown(node, "--dry-run")
    assert dry.returncode == 2, dry.stdout + dry.stderr
    for n in (fs, blk, csi, kept, frozen):
        assert f"held: {n}:" in dry.stdout or f"held: {pool}/{n}" in dry.stdout, dry.stdout
    assert held_by_us(node) == before and desired_files(node) == files

    proc = run_shutdown(node)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "warning:" not in proc.stderr  # sync finished in time
    assert held_by_us(node) == NOTHING, proc.stdout + proc.stderr
    dry = run_shutdown(node, "--dry-run")
    assert (dry.returncode, dry.stdout.strip()) == (0, "release --all has nothing to take down")
    for n in (kept, frozen):  # no file or record names them: found by identity
        assert f"[{pool}/{n}]" in proc.stdout, proc.stdout
    assert desired_files(node) == files  # desired files untouched
    assert all(node.image_exists(n) for n in (fs, blk, csi, kept, frozen))  # nothing deleted
    # Nothing of ours is mapped: no image still names this node as its holder.
    assert {n: holder(node, n) for n in (fs, blk, csi, kept, frozen)} == dict.fromkeys(
        (fs, blk, csi, kept, frozen))

    # Boot: the daemon converges the files again, with the data as it was.
    doc = node.apply()
    assert doc["rc"] == 1 and doc["errors"]  # the broken file stays frozen
    assert read_block(srv / "disk", 4096) == payload
    assert all(checksum_tree(srv / d) == sums[d] for d in ("app", "csi"))
    assert (srv / "view" / "data").read_bytes() == (srv / "app" / "data").read_bytes()
    frozen_file.write_text(good)
    (node.desired / f"{kept}.yaml").write_text(kept_text)
    doc = node.apply()
    assert doc["rc"] == 0, doc
    assert all(checksum_tree(srv / d) == sums[d] for d in ("kept", "frozen"))


def holder(node: NodeUnderTest, image: str) -> str | None:
    import rbd  # Ceph's binding only where a test needs the cluster

    with node.cluster.client() as c, c.open_ioctx(node.cluster.pool) as io, \
            rbd.Image(io, image, read_only=True) as img:
        return dict(img.metadata_list()).get("rbd-reconciler.holder")


@pytest.mark.ceph
def test_shutdown_waits_for_the_daemon_and_never_races_it(node: NodeUnderTest) -> None:
    """While the daemon runs (holds the state lock) the release does nothing
    and says why; a plain daemon stop keeps every mount; the release that
    follows, as at shutdown, gives everything back."""
    name = node.name("d")
    node.write(name, fs_spec(node.cluster.pool, "64Mi", "ext4", [(node.srv / "app", False)]))
    d = Daemon(node)
    try:
        d.wait_phase(name, "Published")
        proc = run_shutdown(node, "--step-timeout", "1")
        assert proc.returncode == 1 and "in use by another" in proc.stderr, proc.stderr
        assert str(node.srv / "app") in node.mounts()
        # The dry run takes no lock: it answers while the daemon runs (the
        # package's prerm asks then), and changes nothing.
        dry = run_shutdown(node, "--dry-run")
        assert dry.returncode == 2 and f"held: {name}:" in dry.stdout, dry.stdout + dry.stderr
        assert str(node.srv / "app") in node.mounts()
    finally:
        assert d.stop() == 0
    assert str(node.srv / "app") in node.mounts()  # stop (an upgrade) is not shutdown
    wait_for(lambda: fuse_helpers_under(node.root), "the helper to outlive the daemon", 10)
    proc = run_shutdown(node)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert held_by_us(node) == NOTHING


def test_the_deadline_fits_the_unit() -> None:
    """`release --all` ends (and has printed its report) by --deadline, which
    the unit passes, well under the unit's TimeoutStopSec: systemd's SIGKILL
    there would cut the report off."""
    from reconciler.cli.main import build_parser
    from reconciler.engine import release

    sd = unit_options(SHUTDOWN_UNIT)
    argv = shlex.split(sd["ExecStop"][0])
    args = build_parser().parse_args(argv[1:])
    stop = float(sd["TimeoutStopSec"][0].removesuffix("s"))
    assert args.all and args.deadline + 30 <= stop, (args.deadline, stop)
    default = build_parser().parse_args(["release", "--all"]).deadline
    assert default == release.DEFAULT_DEADLINE_S and default + 30 <= stop
    assert f"--deadline {args.deadline:g}" in (ROOT / "docs" / "daemon.md").read_text()


@pytest.mark.ceph
def test_release_all_reports_within_its_deadline(node: NodeUnderTest, tmp_path: Path) -> None:
    """Volumes whose unmount hangs (a stand-in `umount` that never returns,
    as on a dead OSD), one at a time, 4 s each: 12 s and more without an
    overall deadline. With --deadline 6 the command kills what still runs,
    prints every volume it could not release and exits 1, within the
    deadline; nothing of the stand-in is left running."""
    names = [node.name(f"dl{i}") for i in range(3)]
    for n in names:
        node.write(n, fs_spec(node.cluster.pool, "16Mi", "ext4", [(node.srv / n, False)]))
    node.config.write_text(node.config.read_text() + "parallel: 1\n")
    assert node.apply()["rc"] == 0
    stuck = tmp_path / "stuck-bin"
    stuck.mkdir()
    marker = f"stuck-umount-{node.tag}"
    (stuck / "umount").write_text(f"#!/bin/bash\nexec -a {marker} sleep 600\n")
    (stuck / "umount").chmod(0o755)

    began = time.monotonic()
    proc = subprocess.run([*shutdown_command(node), "--step-timeout", "4", "--deadline", "6"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env={**os.environ, "PATH": f"{stuck}:{os.environ['PATH']}"})
    took = time.monotonic() - began
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert took < 6 + 3, f"took {took:.1f} s"  # the deadline, and Python's start and exit
    assert "deadline of 6 s reached while releasing" in proc.stderr, proc.stderr
    for n in names:
        assert f"not released: {n}: unpublish {node.srv / n} not done" in proc.stderr, \
            proc.stderr
    assert "killed" in proc.stdout, proc.stdout  # the one in flight at the deadline
    assert not [p for p in Path("/proc").glob("[0-9]*")
                if marker.encode() in _cmdline(p)], "a stuck umount was left running"
    assert sorted(node.mounts()) == sorted(  # nothing was unmounted
        str(p) for n in names
        for p in (node.srv / n, node.state / "staging" / n, node.state / "fuse" / f"rbd@{n}"))

    # Stuck where no command can be killed (here: in Python, as in the
    # kernel or a Ceph call): the report is printed at the deadline all the
    # same, and the process exits, leaving the stuck thread behind.
    began = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", STUCK_UNMOUNT, *shutdown_command(node)[3:],
                           "--step-timeout", "4", "--deadline", "6", "-o", "json"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    took = time.monotonic() - began
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert took < 6 + 3, f"took {took:.1f} s"
    doc = json.loads(proc.stdout)
    assert doc["deadline"] == "deadline of 6 s reached while releasing", doc
    assert {line.split(":")[0] for line in doc["notReleased"]} == set(names), doc

    proc = run_shutdown(node)  # the real umount: everything goes
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert held_by_us(node) == NOTHING


STUCK_UNMOUNT = """
import sys, threading
from reconciler.cli import main as cli
from reconciler.drivers import fs

def unmount(*a, **k):
    threading.Event().wait()  # never returns, and nothing can kill it

fs.Filesystems.unmount = unmount
sys.exit(cli.main(sys.argv[1:]))
"""


def _cmdline(proc_dir: Path) -> bytes:
    try:
        return (proc_dir / "cmdline").read_bytes()
    except OSError:
        return b""


def test_release_all_takes_no_paths(node: NodeUnderTest) -> None:
    rc, _ = node.cli("release", "--all", str(node.desired))
    assert rc == 1
    with pytest.raises(SystemExit):
        node.cli("release", "--all", "--step-timeout", "0")


# --- the units' sandbox, applied without systemd (tests/cluster/unit_sandbox.py) ---------


def in_unit_sandbox(unit: Path, node: NodeUnderTest, key: str) -> list[str]:
    """The unit's ExecStart= or ExecStop= argv, run from this checkout with the
    test's config, inside the unit's capabilities, seccomp filter, address
    families, NoNewPrivileges and umask."""
    argv = shlex.split(unit_options(unit)[key][0])
    assert argv[0] == INSTALLED
    return ["setpriv", "--pdeathsig", "KILL", sys.executable,
            str(ROOT / "tests" / "cluster" / "unit_sandbox.py"), str(unit), "--",
            sys.executable, "-m", "reconciler", "--config", str(node.config), *argv[1:]]


def status_phase(node: NodeUnderTest, name: str) -> str | None:
    try:
        return json.loads((node.state / "status" / f"{name}.json").read_text()).get("phase")
    except (OSError, ValueError):
        return None


@pytest.mark.ceph
def test_the_units_work_inside_their_sandbox(node: NodeUnderTest) -> None:
    """The daemon (ExecStart) converges, stops with its mounts up, the release
    (ExecStop) gives everything back, and the daemon restores it: each inside
    the sandbox its unit declares. Before the hardening this proves nothing;
    after it, that the daemon needs no capability, call or socket family the
    units take away."""
    name, blk = node.name("sbx"), node.name("sbxb")
    app = node.srv / "deep" / "app"
    node.write(name, fs_spec(node.cluster.pool, "64Mi", "ext4", [(app, False)]))
    node.write(blk, block_spec(node.cluster.pool, node.srv / "disk"))
    log = node.root / "daemon.log"

    def daemon() -> subprocess.Popen[bytes]:
        with open(log, "ab") as out:
            return subprocess.Popen(in_unit_sandbox(DAEMON_UNIT, node, "ExecStart"),
                                    stdout=out, stderr=out, cwd=ROOT)

    def published(proc: subprocess.Popen[bytes], since: int) -> None:
        """Published by this daemon: a pass logged since it started (the status
        files of the last one are still there) and both mounts up."""
        def ok() -> bool:
            assert proc.poll() is None, log.read_text()
            return (" pass " in log.read_text()[since:]
                    and status_phase(node, name) == status_phase(node, blk) == "Published"
                    and {str(app), str(node.srv / "disk")} <= set(node.mounts()))
        wait_for(ok, "both volumes Published under the sandbox")

    def stop(proc: subprocess.Popen[bytes]) -> None:
        proc.terminate()
        assert proc.wait(timeout=120) == 0, log.read_text()[-4000:]
        reap_zombies()

    proc = daemon()
    try:
        published(proc, 0)
    finally:
        stop(proc)
    assert (node.srv / "deep").stat().st_mode & 0o777 == 0o755  # UMask=0077 notwithstanding
    (app / "data").write_bytes(os.urandom(1 << 16))
    payload = os.urandom(4096)
    write_block(node.srv / "disk", payload)
    sums = checksum_tree(app)
    assert str(app) in node.mounts()  # a daemon stop keeps the mounts

    rel = subprocess.run(in_unit_sandbox(SHUTDOWN_UNIT, node, "ExecStop"), capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    reap_zombies()
    reap_fuse_children()
    assert rel.returncode == 0, rel.stdout + rel.stderr
    assert "warning:" not in rel.stderr  # sync ran, inside the filter too
    assert held_by_us(node) == NOTHING, rel.stdout + rel.stderr

    since = len(log.read_text())
    proc = daemon()
    try:
        published(proc, since)
        assert checksum_tree(app) == sums
        assert read_block(node.srv / "disk", 4096) == payload
    finally:
        stop(proc)


@pytest.mark.ceph
def test_release_unmounts_and_unmaps_before_it_touches_ceph(
        node: NodeUnderTest, monkeypatch: pytest.MonkeyPatch) -> None:
    """`release FILE`: the node's side first (nothing of Ceph observed or
    waited for), then one connection drops the holder record."""
    from reconciler.apply import runner
    from reconciler.drivers.run import Runner
    from reconciler.observe import ceph as observe_ceph
    from reconciler.observe import node as observe_node

    name = node.name("rel-order")
    node.write(name, fs_spec(node.cluster.pool, "64Mi", "ext4",
                             [(node.srv / "rel-order", False)]))
    assert node.apply()["rc"] == 0
    assert holder(node, name) is not None

    events: list[str] = []
    real_run, real_cluster, real_release = (Runner.run, observe_ceph.Connecting.cluster,
                                            runner.claims.release)

    def run(self: Runner, argv: list[str], **kw: object) -> object:
        if argv[0] != "dd":  # a read of the device (observe's superblock): no change
            events.append(argv[0] if argv[0] != "losetup" else
                          f"losetup {argv[1].partition('=')[0]}")
        return real_run(self, argv, **kw)  # type: ignore[arg-type]

    def cluster(self: observe_ceph.Connecting) -> object:
        events.append("wait for Ceph")
        return real_cluster(self)

    def release(*args: object) -> bool:
        events.append("drop claim")
        return real_release(*args)  # type: ignore[arg-type]

    def observe_images(*_: object, **__: object) -> None:
        raise AssertionError("a release observed Ceph before its teardown")

    monkeypatch.setattr(Runner, "run", run)
    monkeypatch.setattr(observe_ceph.Connecting, "cluster", cluster)
    monkeypatch.setattr(runner.claims, "release", release)
    monkeypatch.setattr(observe_node, "observe_images", observe_images)
    rc, doc = node.cli_json("release")
    assert rc == 0, doc
    assert [s["action"] for s in doc["volumes"][0]["steps"]] == [
        "unpublish", "unstage", "unmap"]
    assert all(s["message"] == "" for s in doc["volumes"][0]["steps"][2:]), doc
    assert events == ["umount", "umount", "losetup --detach", "umount", "wait for Ceph",
                      "drop claim"], events
    assert holder(node, name) is None
    assert not node.mounts()
    assert not _loops_under(node.root, node.tag)
