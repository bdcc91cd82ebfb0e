"""No read of a volume's device waits in our own process (issue 41, item 6).

A read of a device whose storage does not answer sleeps in the kernel
(D state) and cannot be interrupted: in a thread of the daemon it keeps the
daemon from exiting until Ceph answers. The probes (the O_DIRECT read of the
device's start, blkid with its readahead, a superblock not in memory) run in
children, killed or abandoned at their deadline. Here a fuse-loop device
whose rbd-fuse helper is stopped (SIGSTOP: its reads wait, as on a cut from
Ceph): each probe ends by its deadline, says the device is unreadable
(never blank), and no thread of this process is left waiting on the device.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import NodeUnderTest
from test_daemon import wait_for
from test_events import _fuse_pid

from reconciler.drivers.fs import DeviceUnreadable, Filesystems, read_superblock
from reconciler.drivers.fusemapper import loop_devices
from reconciler.drivers.reaper import reap_zombies
from reconciler.drivers.run import CommandError, Runner

pytestmark = pytest.mark.ceph

DEADLINE_S = 3.0


def waiting_threads() -> list[str]:
    """Threads of this process in uninterruptible sleep (D)."""
    out = []
    for task in Path("/proc/self/task").iterdir():
        try:
            state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state == "D":
            out.append(task.name)
    return out


@pytest.fixture
def stopped_device(node: NodeUnderTest) -> Iterator[str]:
    """A mapped fuse-loop volume (nothing mounted) whose helper is stopped."""
    name = node.name("stl")
    node.write(name, f"  image: {{pool: {node.cluster.pool}, size: 64Mi}}\n"
                     "  map: {mapper: fuse}\n")
    doc = node.apply()
    assert doc["rc"] == 0, doc
    image = f"{node.state}/fuse/{node.cluster.pool}@{name}/{name}"
    device = next(lo.name for lo in loop_devices() if lo.back_file == image)
    helper = _fuse_pid(node, name)
    # Nothing of the device in memory: every read below must ask the helper.
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
    os.kill(helper, signal.SIGSTOP)
    try:
        yield device
    finally:
        os.kill(helper, signal.SIGCONT)


@pytest.mark.parametrize("probe", ["read_head", "blkid", "superblock"])
def test_a_probe_of_a_stalled_device_ends_and_holds_no_thread(stopped_device: str,
                                                              probe: str) -> None:
    fs = Filesystems(Runner(timeout=DEADLINE_S))
    calls: dict[str, Callable[[], object]] = {
        "read_head": lambda: fs.probe(stopped_device),
        "blkid": lambda: fs.probe_read(stopped_device),
        "superblock": lambda: read_superblock(stopped_device, "xfs", fs.runner)}
    began = time.monotonic()
    with pytest.raises((DeviceUnreadable, CommandError, OSError)) as caught:
        calls[probe]()
    took = time.monotonic() - began
    assert "timed out" in str(caught.value), caught.value
    # Its deadline, and the bounded wait after the kill (drivers/run.KILL_WAIT_S).
    assert took < DEADLINE_S + 15, took
    assert waiting_threads() == [], "a thread of ours waits on the stalled device"


def test_the_children_end_once_the_device_answers(node: NodeUnderTest,
                                                  stopped_device: str) -> None:
    """What was abandoned is not leaked: once the helper goes on, the killed
    children exit and are reaped (the daemon, a subreaper, reaps orphans as
    here)."""
    fs = Filesystems(Runner(timeout=DEADLINE_S))
    with pytest.raises(DeviceUnreadable):
        fs.probe(stopped_device)
    pid = _fuse_pid(node, node.name("stl"))
    os.kill(pid, signal.SIGCONT)

    def ours() -> list[str]:
        reap_zombies()  # orphans of a killed shell come back to us (a subreaper)
        found = []
        for d in Path("/proc").glob("[0-9]*"):
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
                if fields[1] == str(os.getpid()):
                    found.append(f"{(d / 'comm').read_text().strip()} {d.name} {fields[0]}")
            except (OSError, IndexError):
                continue
        return [c for c in found if c.startswith("dd")]

    try:
        wait_for(lambda: not ours(), "the abandoned dd to exit and be reaped", 60)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: left {ours()}") from None
