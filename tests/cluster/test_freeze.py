"""fsfreeze around snapshots on the real cluster: a freeze a dead run left is
thawed before any Ceph call (Ceph may be down), a held freeze is bounded by a
watchdog (a monitor that hangs), and one freeze per device at a time."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import NodeUnderTest
from test_daemon import Daemon, start, wait_for  # noqa: F401  (start: the daemon fixture)
from test_shutdown import NOTHING, held_by_us, run_shutdown
from test_snapshots import (
    killed_apply,
    published,
    set_config,
    snaps_of,
    snapshot,
    tear_down,
    writes_within,
)

from reconciler.cli import main as cli

pytestmark = pytest.mark.ceph

WRITER = """
import os, sys
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
os.write(fd, b"x")
os.fsync(fd)
"""


class Writer:
    """A write (and fsync) in a child process: on a frozen filesystem it waits
    until the thaw. Always reaped: the caller thaws first if it must."""

    def __init__(self, path: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)])

    def done_within(self, seconds: float) -> bool:
        try:
            return self.proc.wait(timeout=seconds) == 0
        except subprocess.TimeoutExpired:
            return False


@pytest.fixture
def writers(node: NodeUnderTest) -> Iterator[Callable[[Path], Writer]]:
    made: list[Writer] = []

    def new(path: Path) -> Writer:
        made.append(Writer(path))
        return made[-1]

    yield new
    # Whatever the test left frozen under its root is thawed, so every writer ends.
    for mp in node.mounts():
        subprocess.run(["fsfreeze", "-u", mp], capture_output=True, timeout=30)
    for w in made:
        w.proc.wait(timeout=60)


def run_cli(config: Path, *args: str) -> tuple[int, str]:
    """The CLI in-process with another config; its stdout."""
    import io

    out, old = io.StringIO(), sys.stdout
    sys.stdout = out
    try:
        rc = cli.main(["--config", str(config), *args])
    finally:
        sys.stdout = old
    return rc, out.getvalue()


def records(node: NodeUnderTest) -> dict:
    path = node.state / "freezes.json"
    return json.loads(path.read_text()) if path.exists() else {}


def unreachable_config(node: NodeUnderTest) -> Path:
    """The node's config, its ceph.conf pointing at a port nobody listens on."""
    import socket

    with socket.socket() as s:  # a free port, closed again: connections are refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conf = Path(node.cluster.conf).read_text()
    dead = node.root / "dead-ceph.conf"
    dead.write_text(conf.replace(node.cluster.mon_addr, f"127.0.0.1:{port}"))
    assert f"127.0.0.1:{port}" in dead.read_text()
    config = node.root / "dead-config.yaml"
    config.write_text(node.config.read_text().replace(str(node.cluster.conf), str(dead))
                      + "observeTimeoutSeconds: 2\n")
    return config


def frozen_by_a_dead_run(node: NodeUnderTest, src: str, snap: str,
                         new_writer: Callable[[Path], Writer]) -> Writer:
    """SIGKILL an apply inside its freeze (after the snapshot): the filesystem
    stays frozen. Returns a writer that waits on it."""
    snapshot(node, snap, src)
    killed_apply(node, "snapshot")
    assert records(node), "the dead run left no record of its freeze"
    writer = new_writer(node.srv / src / f"after-{snap}")
    assert not writer.done_within(0.5)  # frozen: the write waits
    return writer


def test_left_frozen_is_thawed_while_ceph_is_unreachable(
        node: NodeUnderTest, writers: Callable[[Path], Writer],
        start: Callable[..., Daemon]) -> None:  # noqa: F811
    src = node.name("ice")
    published(node, src, node.srv / src)
    assert node.apply()["rc"] == 0
    dead = unreachable_config(node)

    # The CLI: apply thaws first, from the record alone; Ceph never answers.
    writer = frozen_by_a_dead_run(node, src, node.name("ice-s1"), writers)
    rc, text = run_cli(dead, "plan")  # reports it, changes nothing
    assert rc == 1 and f"LEFT FROZEN: {node.srv / src}" in text, text
    assert not writer.done_within(0.2)
    rc, text = run_cli(dead, "apply", "-o", "json")
    assert rc == 1  # the volumes are unknown: Ceph does not answer
    [line] = json.loads(text)["thawed"]
    assert line.startswith(f"{node.srv / src}: thawed (left frozen by pid "), line
    assert writer.done_within(30), "apply left the filesystem frozen"
    assert records(node) == {}

    # The daemon: at start-up, before its first (unanswered) Ceph call.
    writer = frozen_by_a_dead_run(node, src, node.name("ice-s2"), writers)
    good = node.config.read_text()
    node.config.write_text(dead.read_text())
    try:
        daemon = start()
        assert writer.done_within(60), "the daemon left the filesystem frozen"
        wait_for(lambda: records(node) == {}, "the record to be forgotten")
        assert daemon.stop() == 0
    finally:
        node.config.write_text(good)

    # Ceph back: both snapshots were taken (inside the freeze), none again.
    assert node.apply()["rc"] == 0
    assert sorted(snaps_of(node, src)) == sorted([node.name("ice-s1"), node.name("ice-s2")])
    tear_down(node, src)


def test_release_all_thaws_a_dead_runs_freeze_first(
        node: NodeUnderTest, writers: Callable[[Path], Writer]) -> None:
    """The shutdown command (`release --all`) after an apply was killed inside
    its freeze: it thaws from the record first, as plain `release` does, then
    releases everything. Unthawed, a writer blocked on the filesystem kept it
    busy (nothing released); without one, the frozen filesystem was unmounted
    and lived on frozen in the kernel, to be mounted again frozen."""
    src = node.name("halt")
    published(node, src, node.srv / src)
    assert node.apply()["rc"] == 0

    writer = frozen_by_a_dead_run(node, src, node.name("halt-s1"), writers)
    proc = run_shutdown(node)
    assert writer.done_within(30), "release --all left the filesystem frozen"
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{node.srv / src}: thawed (left frozen by pid " in proc.stderr, proc.stderr
    assert held_by_us(node) == NOTHING, proc.stdout + proc.stderr
    assert records(node) == {}

    # No writer: the filesystem is thawed before its last unmount, so the boot
    # that follows mounts a filesystem that takes writes.
    assert node.apply()["rc"] == 0
    snapshot(node, node.name("halt-s2"), src)
    killed_apply(node, "snapshot")
    assert records(node)
    proc = run_shutdown(node)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert held_by_us(node) == NOTHING, proc.stdout + proc.stderr
    assert records(node) == {}
    assert node.apply()["rc"] == 0
    assert writes_within(node.srv / src / "after", "x", 30), "mounted again still frozen"
    tear_down(node, src)


HOLDER = """
import sys
from pathlib import Path
from reconciler.drivers import freeze
with freeze.frozen(sys.argv[1], Path(sys.argv[2]), None, 120):
    print("frozen", flush=True)
    sys.stdin.readline()
"""


def test_a_live_owners_freeze_is_left_alone(node: NodeUnderTest,
                                            writers: Callable[[Path], Writer]) -> None:
    """Another live process (the daemon, say) holds a freeze: a CLI run thaws
    nothing from under it; once it ends, its own thaw does."""
    src = node.name("live")
    published(node, src, node.srv / src)
    assert node.apply()["rc"] == 0
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(node.srv / src),
                               str(node.state)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "frozen\n"
        writer = writers(node.srv / src / "w")
        assert cli.main(["--config", str(unreachable_config(node)), "apply"]) == 1
        assert not writer.done_within(0.5), "a live run's freeze was thawed"
        [rec] = records(node).values()
        assert rec["pid"] == holder.pid and rec["dev"]
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        assert holder.wait(timeout=60) == 0
    assert writer.done_within(30)
    assert records(node) == {}
    tear_down(node, src)


def test_a_freeze_is_bounded_when_the_monitor_hangs(
        node: NodeUnderTest, writers: Callable[[Path], Writer],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The monitor allocates snapshot ids: stopped, it makes the snapshot call
    hang inside the freeze. The watchdog thaws at the deadline all the same;
    the snapshot fails, and one that completes later is not kept."""
    from reconciler.drivers import ceph

    src, snap = node.name("mon"), node.name("mon-s")
    set_config(node, "snapshots:\n  freezeTimeoutSeconds: 1\n")
    doc = published(node, src, node.srv / src)
    # Without exclusive-lock: with it, librbd proxies the snapshot to the lock
    # owner (here rbd-fuse), which blocks the image's writes until the monitor
    # answers, thaw or not. Here only the snapshot call waits.
    doc.write_text(doc.read_text().replace("    reclaimPolicy:",
                                           "    features: [layering]\n    reclaimPolicy:"))
    assert node.apply()["rc"] == 0
    snapshot(node, snap, src)
    mon = node.cluster.pids["mon.a"]
    real = ceph.create_snapshot
    in_call = threading.Event()

    def hanging(*a: object, **k: object) -> str:
        os.kill(mon, signal.SIGSTOP)  # inside the freeze: create_snap now waits
        in_call.set()
        return real(*a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(ceph, "create_snapshot", hanging)
    result: dict = {}
    apply = threading.Thread(target=lambda: result.update(node.apply()), daemon=True)
    try:
        apply.start()
        assert in_call.wait(120)
        writer = writers(node.srv / src / "during")
        assert writer.done_within(30), "frozen past the deadline while the snapshot hangs"
        assert apply.is_alive()  # the snapshot call still hangs: it is the watchdog's thaw
        assert records(node) == {}
    finally:
        os.kill(mon, signal.SIGCONT)
    apply.join(120)
    assert not apply.is_alive()
    monkeypatch.undo()
    assert result["rc"] == 1
    [vol] = [v for v in result["volumes"] if v["name"] == snap]
    assert "for more than 1 s: thawed" in vol["error"], vol
    assert "(not under the freeze): removed it" in vol["error"], vol
    assert snaps_of(node, src) == []  # taken after the thaw: not kept
    assert node.apply()["rc"] == 0  # the next pass takes it, under the freeze
    assert snaps_of(node, src) == [snap]
    tear_down(node, src)


def test_two_snapshots_of_one_filesystem_at_once(
        node: NodeUnderTest, writers: Callable[[Path], Writer],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two Snapshot files of one volume in one parallel apply: the second
    waits for the first's freeze (no EBUSY), and neither forgets the other's
    record."""
    from reconciler.apply import runner as apply_mod
    from reconciler.drivers import ceph, freeze

    src, s1, s2 = node.name("two"), node.name("two-a"), node.name("two-b")
    published(node, src, node.srv / src)
    assert node.apply()["rc"] == 0
    snapshot(node, s1, src)
    snapshot(node, s2, src)

    # The first snapshot call holds on until the other chain has tried to
    # freeze too: it waits for the device lock, or (without one) it failed.
    other = threading.Event()
    real_run, real_wait, real_create = (apply_mod._VolumeRun.run,
                                        getattr(freeze, "_wait_for_lock", None),
                                        ceph.create_snapshot)
    seen: list[dict] = []

    def run(self: apply_mod._VolumeRun) -> object:
        try:
            return real_run(self)
        finally:
            if self.plan.name in (s1, s2):
                other.set()

    def wait_for_lock(*a: object) -> None:
        other.set()
        assert real_wait is not None
        real_wait(*a)

    def create(*a: object, **k: object) -> str:
        if not seen:
            seen.append({})
            assert other.wait(120)
            seen[0] = records(node)  # our freeze is still on record
        return real_create(*a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(apply_mod._VolumeRun, "run", run)
    monkeypatch.setattr(freeze, "_wait_for_lock", wait_for_lock, raising=False)
    monkeypatch.setattr(ceph, "create_snapshot", create)
    doc = node.apply()
    monkeypatch.undo()
    assert doc["rc"] == 0, doc
    assert len(seen[0]) == 1, seen  # the waiting chain did not forget the first's record
    assert sorted(snaps_of(node, src)) == sorted([s1, s2])
    assert records(node) == {}
    assert writers(node.srv / src / "after").done_within(30)
    tear_down(node, src)


# -- no cluster needed -------------------------------------------------------------
@pytest.mark.parametrize(("body", "error"), [
    ("snapshots:\n  freezeTimeoutSeconds: 0\n",
     "snapshots.freezeTimeoutSeconds: 0 must be greater than 0"),
    ("snapshots:\n  freezeTimeoutSeconds: 600\n",
     "snapshots.freezeTimeoutSeconds: 600 is greater than the maximum of 60"),
    ("snapshots:\n  freezeTimeout: 3\n", "snapshots.freezeTimeout: unknown field"),
])
def test_freeze_timeout_config(tmp_path: Path, body: str, error: str) -> None:
    from reconciler.spec.config import ConfigError, load_config

    path = tmp_path / "config.yaml"
    path.write_text("nodeName: n\n")
    assert load_config(path).snapshots.freeze_timeout_seconds == 5
    path.write_text("snapshots:\n  freezeTimeoutSeconds: 2.5\n")
    assert load_config(path).snapshots.freeze_timeout_seconds == 2.5
    path.write_text(body)
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert error in str(exc.value)


def test_record_owner_liveness(tmp_path: Path) -> None:
    """A live process's record is its own; a reused pid (another start time),
    a gone pid, or this process's record of a chain that ended are not."""
    from reconciler.drivers import freeze

    parent = os.getppid()
    began = freeze._start_time(parent)
    alive = freeze.Record.parse("a", {"path": "/x", "dev": [7, 1], "pid": parent,
                                      "start": began})
    assert alive.owner_alive() and alive.dev == (7, 1)
    assert not freeze.Record.parse("b", {"path": "/x", "pid": parent,
                                         "start": (began or 0) + 1}).owner_alive()
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert not freeze.Record.parse("c", {"path": "/x", "pid": gone.pid, "start": 1}
                                   ).owner_alive()
    me = {"path": "/x", "pid": os.getpid(), "start": freeze._start_time(os.getpid())}
    assert not freeze.Record.parse("ended-chain", me).owner_alive()
    assert freeze.Record.parse("legacy-path", {"pid": 0}).path == "legacy-path"
