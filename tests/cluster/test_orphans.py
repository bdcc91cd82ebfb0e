"""Nothing unaccounted for (issue 41, item 5), on a real cluster, real loop
devices, a real rbd-fuse and real mounts: a fuse-loop volume whose file is
gone (its rbd-fuse mount under stateDir/fuse, its loop device, its staging
mount under stateDir and its publish bind under the allowed root) and a
tmpfs under stateDir are ours; a loop device over some other file under the
allowed root, a tmpfs there, and an rbd-fuse of our pool serving a mount
outside stateDir are not. ``status`` lists each with its verdict;
``release --orphans`` removes only ours, never one in use, and says why it
left what it left. The krbd, nbd and dm-crypt kinds need kernel modules this
host lacks: tests/unit/plan/test_orphan_verdicts.py has their verdicts as data, and
tests/kernel/test_kernel_orphans.py their run in the VM (scripts/kernel-tests.sh)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import NodeUnderTest
from test_daemon import Daemon, spec, wait_for
from test_daemon import start as start  # the fixture
from test_metrics import free_port, metrics_config, scrape, value, wait_metric

from reconciler.drivers.mappers import ceph_args
from reconciler.facts.parsers import parse_mountinfo
from reconciler.spec.config import load_config

pytestmark = pytest.mark.ceph


def _mounted(point: Path) -> bool:
    text = Path("/proc/self/mountinfo").read_bytes()
    return any(m.mount_point == str(point) for m in parse_mountinfo(text))


def _loops() -> dict[str, str]:
    """Loop device -> its backing file, from sysfs (no losetup: it stats the files)."""
    out = {}
    for f in Path("/sys/block").glob("loop*/loop/backing_file"):
        with contextlib.suppress(OSError):
            out[f"/dev/{f.parent.parent.name}"] = f.read_text().strip()
    return out


class Foreign:
    """What is not ours, made for the test and undone at its end whatever
    happens: mounts unmounted (lazily, last made first), loop devices
    detached, processes killed by pid."""

    def __init__(self) -> None:
        self.mounts: list[Path] = []
        self.loops: list[str] = []
        self.procs: list[subprocess.Popen[bytes]] = []

    def tmpfs(self, point: Path) -> Path:
        point.mkdir(parents=True)
        subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(point)], check=True, timeout=30)
        self.mounts.append(point)
        return point

    def loop(self, backing: Path) -> str:
        with open(backing, "wb") as f:
            f.truncate(8 << 20)
        dev = subprocess.run(["losetup", "--find", "--show", "--", str(backing)], check=True,
                             timeout=30, capture_output=True, text=True).stdout.strip()
        self.loops.append(dev)
        return dev

    def rbd_fuse(self, node: NodeUnderTest, image: str, point: Path) -> int:
        point.mkdir(parents=True)
        config = load_config(node.config)
        proc = subprocess.Popen(["rbd-fuse", *ceph_args(config.ceph),
                                 f"--poolname={node.cluster.pool}", f"--image={image}",
                                 str(point), "-f"], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        self.procs.append(proc)
        self.mounts.append(point)
        wait_for(lambda: _mounted(point) or proc.poll() is not None, "a foreign rbd-fuse mount")
        assert proc.poll() is None, "rbd-fuse exited"
        return proc.pid

    def hold(self, cwd: Path) -> int:
        """A process whose working directory is ``cwd``: it uses that mount."""
        proc = subprocess.Popen(["sleep", "600"], cwd=cwd)
        self.procs.append(proc)
        return proc.pid

    def undo(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait(timeout=30)
        for point in reversed(self.mounts):
            if _mounted(point):
                subprocess.run(["umount", "-l", str(point)], check=False, timeout=30)
        for dev in self.loops:
            subprocess.run(["losetup", f"--detach={dev}"], check=False, timeout=30)


@pytest.fixture
def foreign() -> Iterator[Foreign]:
    f = Foreign()
    try:
        yield f
    finally:
        f.undo()


def _others(o: dict, keep: frozenset[str] = frozenset()) -> bool:
    """A helper process of the whole node that is not ours and not one this
    test made: another test's or another run's rbd-fuse (processes are listed
    node-wide; mounts and loop devices only under this node's roots)."""
    return o["what"].startswith("pid ") and not o["ours"] and o["what"] not in keep


def _by_what(doc: dict, keep: frozenset[str] = frozenset()) -> dict[str, dict]:
    return {o["what"]: o for o in doc["unaccounted"]["orphans"] if not _others(o, keep)}


def test_status_lists_leftovers_and_release_orphans_removes_only_ours(
        node: NodeUnderTest, foreign: Foreign) -> None:
    gone = node.name("gone")
    path = node.write(gone, spec(node, target="app"))
    assert node.apply()["rc"] == 0
    fuse_mount = str(node.state / "fuse" / f"{node.cluster.pool}@{gone}")
    staging = str(node.state / "staging" / gone)
    app = str(node.srv / "app")
    loop = next(dev for dev, back in _loops().items() if back == f"{fuse_mount}/{gone}")
    path.unlink()  # its file is gone: nothing accounts for the volume any more

    # Ours too: a mount under our state dir, used by a process (so it stays).
    held = foreign.tmpfs(node.state / "scratch")
    holder = foreign.hold(held)
    # Not ours: a loop device over another file and a tmpfs under the allowed
    # root; an rbd-fuse of another image serving a mount outside stateDir.
    other_loop = foreign.loop(node.srv / "disk.img")
    elsewhere = foreign.tmpfs(node.srv / "theirs")
    other = node.name("other")
    node.images.add(other)
    import rbd

    with node.cluster.client() as c, c.open_ioctx(node.cluster.pool) as io:
        rbd.RBD().create(io, other, 16 << 20)
    their_pid = foreign.rbd_fuse(node, other, node.root / "their-fuse")

    rc, doc = node.cli_json("status")
    assert doc["unaccounted"]["unknown"] == []
    theirs = frozenset({f"pid {their_pid}"})
    found = _by_what(doc, theirs)
    verdicts = {what: (o["kind"], o["ours"]) for what, o in found.items()}
    assert verdicts == {
        staging: ("mount", True), app: ("mount", True), str(held): ("mount", True),
        loop: ("loop", True), fuse_mount: ("rbd-fuse", True),
        other_loop: ("loop", False), str(elsewhere): ("mount", False),
        f"pid {their_pid}": ("rbd-fuse", False),
    }
    assert "mount under our state dir" in found[str(held)]["why"]
    assert f"one of our leftovers ({loop})" in found[app]["why"]
    assert "our FUSE file" in found[loop]["why"]
    assert "not one of our FUSE files" in found[other_loop]["why"]
    assert "outside our state dir" in found[f"pid {their_pid}"]["why"]
    rc, human = node.cli("status")
    assert "unaccounted for" in human and f"not ours  loop      {other_loop}" in human

    rc, swept = node.cli_json("release", "--orphans")
    assert rc == 1, swept  # something of ours was left: the mount in use
    assert swept["refused"] is None
    assert [o["what"] for o in swept["removed"]] == [staging, app, loop, fuse_mount]
    [left] = swept["left"]
    assert str(held) in left and f"in use by pid {holder} (sleep): working directory" in left
    assert {o["what"] for o in swept["notOurs"] if not _others(o, theirs)} == {
        other_loop, str(elsewhere), f"pid {their_pid}"}
    # Ours are gone; what is not ours is all still there, and so is the one in use.
    assert not any(_mounted(Path(p)) for p in (staging, app, fuse_mount))
    assert loop not in _loops() or _loops()[loop] != f"{fuse_mount}/{gone}"
    assert _mounted(held) and _mounted(elsewhere) and _mounted(node.root / "their-fuse")
    assert _loops().get(other_loop) == str(node.srv / "disk.img")
    os.kill(their_pid, 0)  # still alive

    # Its user gone, the mount in our state dir goes too; nothing of ours left.
    os.kill(holder, signal.SIGKILL)
    foreign.procs[0].wait(timeout=30)
    rc, out = node.cli("release", "--orphans")  # in words this time
    assert rc == 0, out
    assert out.splitlines() == [f"removed: mount {held}: mount under our state dir",
                                "removed: 1; left: 0 of ours, 3 not known to be ours"]
    assert not _mounted(held)
    rc, doc = node.cli_json("status")
    assert {o["what"] for o in doc["unaccounted"]["orphans"]} == {
        other_loop, str(elsewhere), f"pid {their_pid}"}


def test_release_orphans_refuses_while_a_file_does_not_load(
        node: NodeUnderTest, foreign: Foreign) -> None:
    held = foreign.tmpfs(node.state / "scratch")
    (node.desired / "broken.yaml").write_text("apiVersion: rbd-reconciler/v1\nkind: [\n")
    rc, swept = node.cli_json("release", "--orphans")
    assert rc == 1
    assert "does not load" in swept["refused"] and swept["removed"] == []
    assert any(str(held) in line for line in swept["left"])
    assert _mounted(held)
    (node.desired / "broken.yaml").unlink()
    rc, swept = node.cli("release", "--orphans", "extra-path")
    assert rc == 1


def test_the_daemon_counts_them_answers_status_and_keeps_the_sweep_off(
        node: NodeUnderTest, foreign: Foreign, start: Callable[..., Daemon]) -> None:
    """With the daemon running: rbd_reconciler_unaccounted counts ours and the
    others, its status answer lists them, and the sweep refuses (the daemon
    holds the node's lock); stopped, the sweep runs."""
    ours = foreign.tmpfs(node.state / "scratch")
    theirs = foreign.tmpfs(node.srv / "theirs")
    port = free_port()
    metrics_config(node, port)
    d = start()
    wait_metric(lambda: scrape(port), "the leftovers counted", lambda s: value(
        s, "rbd_reconciler_unaccounted", kind="mount", ours="true") == 1 and value(
        s, "rbd_reconciler_unaccounted", kind="mount", ours="false") == 1)
    rc, doc = node.cli_json("status")
    assert doc["answeredBy"] != "this command", doc["answeredBy"]
    assert {(o["what"], o["ours"]) for o in doc["unaccounted"]["orphans"]
            if not _others(o)} == {(str(ours), True), (str(theirs), False)}
    rc, _ = node.cli("release", "--orphans")
    assert rc == 1 and _mounted(ours)
    d.stop()
    rc, swept = node.cli_json("release", "--orphans")
    assert rc == 0 and [o["what"] for o in swept["removed"]] == [str(ours)]
    assert not _mounted(ours) and _mounted(theirs)


def test_a_block_mode_leftover_goes_bind_first_then_its_loop_device(
        node: NodeUnderTest) -> None:
    """A block-mode volume exposes its loop device node by bind mounts (a
    devtmpfs mount whose root is the node's name): those sit on the loop
    device, so they go first, each unmounted only while it is still a bind
    of that device's node."""
    gone = node.name("blk")
    path = node.write(gone, f"  image: {{pool: {node.cluster.pool}, size: 16Mi}}\n"
                            "  map: {mapper: fuse}\n  stage: {mode: block}\n"
                            f"  publish:\n    - path: {node.srv / 'blk.dev'}\n")
    assert node.apply()["rc"] == 0
    fuse_mount = str(node.state / "fuse" / f"{node.cluster.pool}@{gone}")
    loop = next(dev for dev, back in _loops().items() if back == f"{fuse_mount}/{gone}")
    path.unlink()
    rc, doc = node.cli_json("status")
    found = _by_what(doc)
    binds = sorted(w for w, o in found.items() if o["kind"] == "mount")
    assert str(node.srv / "blk.dev") in binds
    assert all(found[w]["ours"] and loop in found[w]["why"] for w in binds)
    rc, swept = node.cli_json("release", "--orphans")
    assert rc == 0, swept
    assert [o["what"] for o in swept["removed"]][-2:] == [loop, fuse_mount]
    assert sorted(o["what"] for o in swept["removed"][:-2]) == binds
    assert not any(_mounted(Path(p)) for p in [*binds, fuse_mount])


def test_a_mount_frozen_for_a_snapshot_is_never_swept(node: NodeUnderTest,
                                                     foreign: Foreign) -> None:
    """Unmounted while frozen, a filesystem would live on frozen in the
    kernel, holding its device: a freeze recorded this boot keeps it."""
    held = foreign.tmpfs(node.state / "scratch")
    (node.state / "freezes.json").write_text(json.dumps({str(held): {"path": str(held)}}))
    rc, swept = node.cli_json("release", "--orphans")
    assert rc == 1 and swept["removed"] == []
    [left] = swept["left"]
    assert str(held) in left and "frozen by a snapshot" in left
    assert _mounted(held)
    (node.state / "freezes.json").unlink()


def test_a_frozen_filesystem_is_never_swept_at_any_of_its_mounts(node: NodeUnderTest,
                                                                foreign: Foreign) -> None:
    """Review: a freeze is recorded at one mount point (the staging path),
    but the filesystem is the superblock, mounted wherever: its other mount
    (a publish bind), left as the last, would be unmounted frozen too. The
    record's device keeps every mount of it."""
    held = foreign.tmpfs(node.state / "scratch")
    bind = node.state / "bind"
    bind.mkdir()
    subprocess.run(["mount", "--bind", str(held), str(bind)], check=True, timeout=30)
    foreign.mounts.append(bind)
    st = os.stat(held)
    (node.state / "freezes.json").write_text(json.dumps({"k": {
        "path": str(node.state / "staging" / "was-here"),
        "dev": [os.major(st.st_dev), os.minor(st.st_dev)]}}))
    rc, swept = node.cli_json("release", "--orphans")
    assert rc == 1 and swept["removed"] == [], swept
    assert all("frozen by a snapshot" in line for line in swept["left"]), swept
    assert _mounted(held) and _mounted(bind)
    (node.state / "freezes.json").unlink()


def _helper_of(fuse_mount: str) -> int:
    for d in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            args = (d / "cmdline").read_bytes().split(b"\0")
            if os.path.basename(args[0]) == b"rbd-fuse" and fuse_mount.encode() in args:
                return int(d.name)
    raise AssertionError(f"no rbd-fuse for {fuse_mount}")


def test_a_stalled_rbd_fuse_never_hangs_status_and_the_sweep_leaves_its_mount(
        node: NodeUnderTest) -> None:
    """Review: the leftover's rbd-fuse stopped (SIGSTOP): ``status`` answers
    at once, and ``release --orphans`` neither hangs nor forces the FUSE
    connection off (it is left, with why)."""
    import threading
    import time

    gone = node.name("stall")
    path = node.write(gone, spec(node, target="app"))
    assert node.apply()["rc"] == 0
    fuse_mount = str(node.state / "fuse" / f"{node.cluster.pool}@{gone}")
    pid = _helper_of(fuse_mount)
    path.unlink()
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        rc, doc = node.cli_json("status")
        assert time.monotonic() - t0 < 10
        assert fuse_mount in _by_what(doc)
        out: list[object] = []
        t = threading.Thread(target=lambda: out.append(node.cli_json(
            "release", "--orphans", "--step-timeout", "5")), daemon=True)
        t0 = time.monotonic()
        t.start()
        t.join(60)
        assert not t.is_alive(), "release --orphans hung on a stalled rbd-fuse"
        [(rc, swept)] = out
        assert rc == 1
        assert fuse_mount not in [o["what"] for o in swept["removed"]], swept
        assert Path(f"/proc/{pid}").exists(), "its helper was killed"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    # It answers again: the umount killed at its deadline ends by itself, and
    # the sweep takes the rest.
    wait_for(lambda: node.cli_json("release", "--orphans")[0] == 0, "the rest swept")
    assert not _mounted(Path(fuse_mount))
