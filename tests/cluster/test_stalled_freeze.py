"""A freeze of a filesystem whose storage does not answer never holds the
process that asked for it (issue 41, item 6).

FIFREEZE writes back every dirty page first: on a device whose storage is
stalled it sleeps in the kernel (D state) and cannot be interrupted, so in a
thread of the daemon it would keep the daemon from exiting. The freeze and
the thaw run in a child (fsfreeze on the descriptor we opened and checked).
Here a fuse-loop volume with dirty pages whose rbd-fuse is stopped (SIGSTOP,
as on a cut from Ceph): the freeze fails by its deadline with no thread of
ours in D state; its child, stuck, may still freeze the filesystem once the
storage answers, so its record stays (naming the child) and nothing thaws
it early; once the child is gone, the thaw of what a dead owner left
(`thaw_recorded`, run before every pass) thaws it and a writer goes on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import NodeUnderTest
from test_daemon import wait_for
from test_events import _fuse_pid
from test_freeze import Writer
from test_snapshots import published, tear_down
from test_stalled_probe import waiting_threads

from reconciler.drivers import freeze
from reconciler.drivers.reaper import reap_zombies

pytestmark = pytest.mark.ceph

HOLD_S = 2.0


@pytest.fixture
def stalled(node: NodeUnderTest) -> Iterator[tuple[Path, int]]:
    """A published ext4 fuse-loop volume with dirty pages, its helper stopped."""
    name = node.name("sfz")
    target = node.root / "srv" / name
    published(node, name, target)
    doc = node.apply()
    assert doc["rc"] == 0, doc
    helper = _fuse_pid(node, name)
    # Dirty pages the freeze must write back (no fsync: they wait in memory).
    subprocess.run(["dd", "if=/dev/urandom", f"of={target}/dirty", "bs=1M", "count=8",
                    "status=none"], check=True, timeout=60)
    os.kill(helper, signal.SIGSTOP)
    try:
        yield target, helper
    finally:
        os.kill(helper, signal.SIGCONT)
        wait_for(lambda: not [r for r in freeze.recorded(node.state) if r.owner_alive()],
                 "the stuck freeze's child to end once the helper goes on", 120)
        freeze.thaw_recorded(node.state)
        subprocess.run(["fsfreeze", "-u", str(target)], capture_output=True, timeout=60)
        tear_down(node, name)


def test_a_freeze_of_a_stalled_filesystem_ends_by_its_deadline(node: NodeUnderTest,
                                                               stalled: tuple[Path, int]
                                                               ) -> None:
    target, helper = stalled
    began = time.monotonic()
    with pytest.raises(freeze.TimedOut) as caught, \
            freeze.frozen(str(target), node.state, None, HOLD_S):
        pytest.fail("the body ran: the freeze did not wait for its write-back")
    took = time.monotonic() - began
    assert took < HOLD_S + freeze.KILL_WAIT_S + 3, took
    assert waiting_threads() == [], "a thread of ours waits on the stalled filesystem"
    # The child is stuck in the kernel: its freeze may still land, so the
    # record stays, names it, and counts as held (nothing thaws it yet).
    assert isinstance(caught.value, freeze.StillRunning), caught.value
    [rec] = freeze.recorded(node.state)
    assert rec.child is not None and rec.child[0] == caught.value.pid, rec
    assert rec.owner_alive() and freeze.left_frozen(node.state) == []
    assert not any("thawed" in line for line in freeze.thaw_recorded(node.state, wait=1))
    assert freeze.recorded(node.state) == [rec]

    # The storage answers: the child's freeze lands (or not), the child ends,
    # and the record is then a dead owner's: thawed, and a writer goes on.
    os.kill(helper, signal.SIGCONT)

    def child_gone() -> bool:
        reap_zombies()
        return not os.path.exists(f"/proc/{rec.child[0]}")  # type: ignore[index]

    wait_for(child_gone, "the freeze's child to end once the helper goes on", 120)
    wait_for(lambda: freeze.left_frozen(node.state) != [],
             "the record to be a dead owner's", 10)
    said = freeze.thaw_recorded(node.state)
    assert len(said) == 1 and ("thawed" in said[0] or "was not frozen" in said[0]), said
    assert freeze.recorded(node.state) == []
    writer = Writer(target / "after")
    assert writer.done_within(60), "a write after the thaw did not complete"
