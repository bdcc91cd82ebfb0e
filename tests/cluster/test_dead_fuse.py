"""A killed rbd-fuse under the daemon (issue 41, item 3). A FUSE connection
dies with its process: nothing re-attaches to it. The daemon learns of the
death at once (a pidfd per helper); a fuse-loop volume whose filesystem
nobody uses is unmounted, mapped and mounted again by itself; one in use is
left exactly as it is and reported Degraded (HelperGone) naming its users,
and comes back once they are gone. The resync is an hour: only events explain
what happens here."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import NodeUnderTest
from test_daemon import Daemon, set_resync, spec, wait_for
from test_daemon import start as start  # the fixture
from test_events import _alive_helper, _fuse_pid, _settled

from reconciler.facts.parsers import parse_mountinfo

pytestmark = pytest.mark.ceph
REPORTED_S = 1.0  # the bound: a dead helper is reported within a second
BACK_S = 90.0  # the remap may wait for Ceph to let go of the dead client's watch


def _mount_ids(*points: str) -> dict[str, list[int]]:
    text = Path("/proc/self/mountinfo").read_text()
    return {p: [m.mount_id for m in parse_mountinfo(text) if m.mount_point == p]
            for p in points}


@pytest.fixture
def holders() -> Iterator[Callable[[Path], subprocess.Popen[str]]]:
    """Processes holding a file open; killed by pid at the end whatever happens."""
    procs: list[subprocess.Popen[str]] = []

    def hold(path: Path) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-c", f"f = open({str(path)!r}, 'rb')\n"
             "print('ready', flush=True)\nimport time; time.sleep(600)"],
            text=True, stdout=subprocess.PIPE)
        procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        return proc

    yield hold
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def _published(node: NodeUnderTest, start: Callable[..., Daemon], name: str
               ) -> tuple[Daemon, Path, bytes]:
    set_resync(node, 3600)
    node.write(name, spec(node))
    d = start()
    d.wait_phase(name, "Published")
    _settled(d, name)
    app = node.srv / "app"
    data = os.urandom(1 << 16)
    with open(app / "data", "wb") as f:
        f.write(data)
        # On the image before the helper dies (what is not is lost with it).
        # Not os.sync(): it waits on every device of the machine.
        os.fsync(f.fileno())
    return d, app, data


def _back(node: NodeUnderTest, d: Daemon, name: str, old_pid: int, after: str) -> None:
    wait_for(lambda: (s := d.status(name)).get("phase") == "Published"
             and s.get("updated", "") > after and _alive_helper(node, name, old_pid),
             "the volume published again over a new rbd-fuse", BACK_S)


def test_killed_rbd_fuse_of_an_unused_volume_comes_back_by_itself(
        node: NodeUnderTest, start: Callable[..., Daemon]) -> None:
    name = node.name("dfu")
    d, app, data = _published(node, start, name)
    staging = str(node.state / "staging" / name)
    before = d.status(name)["updated"]
    pid = _fuse_pid(node, name)
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    # Seen at once: the pass it wakes plans the repair (its note says so).
    wait_for(lambda: "nothing uses" in d.log.read_text()
             or f"unpublish {app}" in d.log.read_text(), "the repair to start", 30)
    seen = time.monotonic() - t0
    _back(node, d, name, pid, before)
    assert (app / "data").read_bytes() == data
    ids = _mount_ids(staging, str(app))
    assert all(len(v) == 1 for v in ids.values()), ids  # nothing stacked, nothing left
    assert seen < 30
    assert d.stop() == 0


def test_killed_rbd_fuse_of_a_used_volume_is_reported_and_left_alone(
        node: NodeUnderTest, start: Callable[..., Daemon],
        holders: Callable[[Path], subprocess.Popen[str]]) -> None:
    name = node.name("dfb")
    d, app, data = _published(node, start, name)
    staging = str(node.state / "staging" / name)
    user = holders(app / "data")
    mounts = _mount_ids(staging, str(app))
    before = d.status(name)["updated"]
    pid = _fuse_pid(node, name)
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    s = wait_for(lambda: (s := d.status(name)).get("phase") == "Degraded" and s,
                 "the volume reported Degraded", 30)
    took = time.monotonic() - t0
    assert s["reason"] == "HelperGone", s  # type: ignore[index]
    assert f"pid {user.pid} (python" in s["message"], s  # type: ignore[index]
    assert took < REPORTED_S, f"reported after {took:.2f} s"
    # Left exactly as it is: the same mounts, nothing unmounted, no step run.
    d.wait_passes(1)
    assert _mount_ids(staging, str(app)) == mounts
    assert d.status(name)["phase"] == "Degraded"
    user.kill()
    user.wait()
    # Its user's exit (a pidfd too) lets it be brought back.
    _back(node, d, name, pid, before)
    assert (app / "data").read_bytes() == data
    assert d.stop() == 0
