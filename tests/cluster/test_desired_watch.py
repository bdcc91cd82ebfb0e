"""Issue 26: what wakes the daemon for its desired files, with the real daemon.

- Item 7: ``desiredDir`` named through a symlink above it
  (``gitops/current/volumes``, ``current -> releases/r1``), swapped to
  ``releases/r2`` the way a deploy does it (a new link renamed over the old
  one). The swap happens in ``gitops/``, which the daemon did not watch (it
  watched the resolved directory and ``desiredDir``'s parent, which inotify
  resolves to the old release): nothing happened until the resync.
- The kernel's event queue overflowing (a burst of editor droppings while
  the daemon does not read): the file watcher dropped the overflow event
  without a word, and the last change, lost with it, waited for the resync.
  Here through the real kernel: the daemon is stopped (SIGSTOP) while more
  events than ``fs.inotify.max_queued_events`` are made, then the change.

The resync is an hour in both: only an event can make the daemon act.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import NodeUnderTest
from test_daemon import Daemon, set_resync, start, wait_for  # noqa: F401 - the fixture

pytestmark = pytest.mark.ceph

EVENT_DEADLINE = 30.0  # generous for a loaded machine, far under the hour of the resync


def image_only(node: NodeUnderTest, name: str) -> str:
    node.images.add(name)
    return (f"apiVersion: rbd-reconciler/v1\nkind: Volume\nmetadata:\n  name: {name}\n"
            f"spec:\n  image: {{pool: {node.cluster.pool}, size: 16Mi}}\n")


def settle(d: Daemon) -> None:
    """Wait for the pass that follows the first chain: after it, nothing is
    due, so a pass that comes later was woken by an event."""
    wait_for(lambda: d.passes() >= 2, "the daemon to settle")


def stopped(pid: int) -> bool:
    """Every thread of ``pid`` is stopped (SIGSTOP has taken effect)."""
    states = [(t / "stat").read_text().rsplit(")", 1)[1].split()[0]
              for t in Path(f"/proc/{pid}/task").iterdir()]
    return all(s in ("T", "t") for s in states)


def test_a_link_swapped_above_the_desired_directory_is_seen(
        node: NodeUnderTest, start: Callable[..., Daemon]) -> None:  # noqa: F811
    gitops = node.root / "gitops"
    first, second = node.name("rel1"), node.name("rel2")
    for release, name in (("r1", first), ("r2", second)):
        volumes = gitops / "releases" / release / "volumes"
        volumes.mkdir(parents=True)
        (volumes / f"{name}.yaml").write_text(image_only(node, name))
    (gitops / "current").symlink_to("releases/r1")
    node.config.write_text(node.config.read_text().replace(
        f"desiredDir: {node.desired}", f"desiredDir: {gitops / 'current' / 'volumes'}"))
    set_resync(node, 3600)
    d = start()
    d.wait_phase(first, "Created")
    settle(d)
    new = gitops / "current.new"
    new.symlink_to("releases/r2")
    os.replace(new, gitops / "current")  # atomic, as git-sync and deploy tools do it
    d.wait_phase(second, "Created", timeout=EVENT_DEADLINE)
    assert d.stop() == 0


def test_lost_file_events_make_the_daemon_look_at_every_volume(
        node: NodeUnderTest, start: Callable[..., Daemon]) -> None:  # noqa: F811
    set_resync(node, 3600)
    first, lost = node.name("ovf1"), node.name("ovf2")
    (node.desired / f"{first}.yaml").write_text(image_only(node, first))
    # An editor's droppings: ignored names, whose events alone wake nobody.
    storm = [node.desired / ".a.yaml.swp", node.desired / ".b.yaml.swp"]
    for f in storm:
        f.write_text("")
    d = start()
    d.wait_phase(first, "Created")
    settle(d)
    queued = int(Path("/proc/sys/fs/inotify/max_queued_events").read_text())
    d.proc.send_signal(signal.SIGSTOP)  # it reads nothing: the kernel's queue fills up
    try:
        wait_for(lambda: stopped(d.proc.pid), "the daemon to stop")
        for i in range(queued + 64):  # alternating names: the kernel merges no two
            os.utime(storm[i % 2])
        (node.desired / f"{lost}.yaml").write_text(image_only(node, lost))  # events lost
    finally:
        d.proc.send_signal(signal.SIGCONT)
    d.wait_phase(lost, "Created", timeout=EVENT_DEADLINE)
    assert "inotify queue overflowed" in d.log.read_text()
    assert d.stop() == 0
