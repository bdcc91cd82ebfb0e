"""Issue 26, item 6: a fenced node's shutdown ends.

Node A publishes a volume through rbd-fuse with an application writing;
node B takes it over (A's client is blocklisted, its writes fail); A is
then shut down the documented way, the shutdown unit's own command. A's
rbd-fuse helper no longer answers: the FUSE umount (or the filesystem's
above it, flushing) hangs in the kernel and, SIGKILLed at its deadline,
stays in D state. Before the fix, when a thread of the release had read
the loop device it was stuck the same way, and the command printed `not
released: ...` and then never exited (not even SIGKILL ends a process with
a thread in D state; 4 runs of 5 on main); otherwise it exited leaving the
volume held and the wedged helper, ours, running. Now the FUSE connection
that does not answer is aborted (fusectl), our helper killed, and the
release ends within its deadline, having said what it did, with nothing of
ours left behind.

The same with a helper that is merely stopped (SIGSTOP: alive and silent),
where the unmount of the filesystem above it is what waits.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest
from conftest import NodeUnderTest
from test_claim import Node, blocklisted, map_only, mon, second_node, watchers
from test_daemon import wait_for
from test_lifecycle import fs_spec
from test_shutdown import NOTHING, ROOT, held_by_us, shutdown_command

from reconciler.drivers.fusemapper import reap_fuse_children
from reconciler.drivers.reaper import reap_zombies
from reconciler.facts.parsers import parse_mountinfo

pytestmark = pytest.mark.ceph

STEP_TIMEOUT, DEADLINE = 5, 40  # short: a wedged loop device holds every `sync` on the host
ENDS_WITHIN = 180.0  # generous: "it ends", not how fast


def rbd_fuse_serving(root: Path) -> list[int]:
    out = []
    for d in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            args = (d / "cmdline").read_bytes().split(b"\0")
            if args[0].endswith(b"rbd-fuse") and any(a.startswith(os.fsencode(root))
                                                     for a in args[1:]):
                out.append(int(d.name))
    return out


def end_fuse_connections(root: Path) -> None:
    """The test's own way out, whatever the code under test did: abort every
    FUSE connection under ``root`` (fusectl on a private mount point) and
    kill the helpers, so that nothing waits on them any more."""
    fuse = [m for m in parse_mountinfo(Path("/proc/self/mountinfo").read_text())
            if m.mount_point.startswith(str(root)) and m.fs_type.startswith("fuse")]
    if fuse:
        with tempfile.TemporaryDirectory(prefix="fusectl-") as ctl:
            subprocess.run(["mount", "-t", "fusectl", "fusectl", ctl], check=True, timeout=30)
            try:
                for m in fuse:
                    with contextlib.suppress(OSError):
                        (Path(ctl) / str(m.minor) / "abort").write_text("1")
            finally:
                subprocess.run(["umount", ctl], check=True, timeout=30)
    for pid in rbd_fuse_serving(root):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def start_writer(app: Path, log: Path) -> subprocess.Popen[bytes]:
    """The application: writes and syncs in a loop, noting each failure."""
    return subprocess.Popen(
        ["bash", "-c", f"while :; do dd if=/dev/urandom of={app}/data bs=64k count=16 "
                       f"conv=fsync 2>/dev/null && echo ok >>{log} || echo failed >>{log}; "
                       "done"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def shut_down(node: NodeUnderTest, tmp: Path) -> tuple[int, str, str]:
    """The unit's ExecStop, with short deadlines; its output in files (a
    `sync` left stuck by the command under test must not hold our pipe)."""
    out, err = tmp / "release.out", tmp / "release.err"
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen([*shutdown_command(node), "--step-timeout", str(STEP_TIMEOUT),
                                 "--deadline", str(DEADLINE)], stdout=o, stderr=e, cwd=ROOT)
    try:
        rc = proc.wait(timeout=ENDS_WITHIN)
    except subprocess.TimeoutExpired:
        end_fuse_connections(node.root)  # lets it go (and the host's `sync`s)
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=60)
        raise AssertionError(f"release --all did not end within {ENDS_WITHIN:g} s "
                             f"(--deadline {DEADLINE}):\n{out.read_text()}{err.read_text()}"
                             ) from None
    finally:
        reap_zombies()
        reap_fuse_children()
    return rc, out.read_text(), err.read_text()


def publish_with_writer(node: NodeUnderTest, image: str, tmp: Path
                        ) -> tuple[subprocess.Popen[bytes], Path]:
    app = node.srv / "app"
    node.write(image, fs_spec(node.cluster.pool, "64Mi", "ext4", [(app, False)]))
    assert node.apply()["rc"] == 0
    log = tmp / "writes.log"
    writer = start_writer(app, log)
    wait_for(lambda: log.exists() and "ok" in log.read_text(), "the application to write")
    return writer, log


def stop_writer(writer: subprocess.Popen[bytes]) -> None:
    writer.kill()  # applications stop before the shutdown unit runs
    with contextlib.suppress(subprocess.TimeoutExpired):
        writer.wait(timeout=5)  # one stuck in D state is reaped by the session later


def assert_ended_and_clean(node: NodeUnderTest, rc: int, out: str, err: str) -> None:
    assert rc == 1, out + err  # not a clean release: it had to force
    assert "does not answer" in out + err and "aborted FUSE connection" in out + err, out + err
    assert "0 thing(s) still held" in out, out + err
    assert held_by_us(node) == NOTHING, out + err


@pytest.mark.ceph
def test_a_fenced_nodes_shutdown_ends(node: NodeUnderTest, tmp_path: Path) -> None:
    image = node.name("fenced")
    b = second_node(node, tmp_path)
    (b.root / "desired" / f"{image}.yaml").write_text(map_only(node.cluster.pool, image))
    old: list[str] = []
    writer = None
    try:
        writer, log = publish_with_writer(node, image, tmp_path)
        old = watchers(node, image)
        assert b.cli("takeover", image, "--yes-i-am-sure")[0] == 0
        assert old[0] in blocklisted(node)
        wait_for(lambda: "failed" in log.read_text(), "A's writes to fail (fenced)")
        stop_writer(writer)
        rc, out, err = shut_down(node, tmp_path)
        assert_ended_and_clean(node, rc, out, err)
    finally:
        if writer is not None:
            stop_writer(writer)
        end_fuse_connections(node.root)
        reap_zombies()
        reap_fuse_children()
        assert Node("node-b", b.config, b.root).cli("release")[0] == 0
        for addr in old:
            mon(node, {"prefix": "osd blocklist", "blocklistop": "rm", "addr": addr})


@pytest.mark.ceph
def test_a_stopped_helpers_shutdown_ends(node: NodeUnderTest, tmp_path: Path) -> None:
    image = node.name("stopped")
    writer = None
    try:
        writer, _ = publish_with_writer(node, image, tmp_path)
        helpers = rbd_fuse_serving(node.root)
        assert helpers
        for pid in helpers:
            os.kill(pid, signal.SIGSTOP)  # alive and silent: its mount answers nothing
        stop_writer(writer)
        rc, out, err = shut_down(node, tmp_path)
        assert_ended_and_clean(node, rc, out, err)
    finally:
        if writer is not None:
            stop_writer(writer)
        end_fuse_connections(node.root)
        reap_zombies()
        reap_fuse_children()
