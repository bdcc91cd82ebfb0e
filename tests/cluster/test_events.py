"""Drift repaired on an event, not at the resync: the resync here is an hour,
so only the daemon's event sources (daemon/events.py) can explain a repair."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from conftest import NodeUnderTest
from test_daemon import Daemon, set_resync, spec, wait_for
from test_daemon import start as start  # the fixture

from reconciler.apply import claims
from reconciler.facts.parsers import parse_mountinfo

pytestmark = pytest.mark.ceph
EVENT_DEADLINE = 30.0  # far below the resync (3600 s); generous for a loaded machine


def _image_only(node: NodeUnderTest, size: str = "64Mi") -> str:
    return f"  image: {{pool: {node.cluster.pool}, size: {size}}}\n  map: {{mapper: fuse}}\n"


def _rbd(node: NodeUnderTest) -> list[str]:
    return ["rbd", "-c", str(node.cluster.conf), "--id", node.cluster.user,
            "--keyring", str(node.cluster.keyring)]


def _settled(d: Daemon, name: str, after: str = "") -> None:
    """The pass after the chain has confirmed it (only that pass writes where
    the volume is): a drift before it would be repaired by that pass. With
    ``after`` (an earlier status's ``updated``), a confirmation written since:
    the one from before the drift says nothing of the repair's chain, which
    may still be at work on the mount."""
    def confirmed() -> bool:
        s = d.status(name)
        return bool(s.get("staging") or s.get("device")) and s.get("updated", "") > after

    wait_for(confirmed, "the confirming pass")


def _mounted(point: str) -> int:
    """How many mounts are stacked at ``point`` now."""
    text = Path("/proc/self/mountinfo").read_text()
    return sum(1 for m in parse_mountinfo(text) if m.mount_point == point)


def _fuse_pid(node: NodeUnderTest, name: str) -> int:
    """The rbd-fuse helper serving this volume's image."""
    mnt = str(node.state / "fuse" / f"{node.cluster.pool}@{name}")
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if args and args[0].endswith(b"rbd-fuse") and mnt.encode() in args:
            return int(pid)
    raise AssertionError(f"no rbd-fuse helper for {mnt}")


def test_publish_and_staging_unmounted_by_hand(node: NodeUnderTest,
                                               start: Callable[..., Daemon]) -> None:
    set_resync(node, 3600)
    name = node.name("ev")
    node.write(name, spec(node))
    d = start()
    d.wait_phase(name, "Published")
    _settled(d, name)
    target = str(node.srv / "app")
    assert _mounted(target) == 1
    before = d.status(name)["updated"]
    subprocess.run(["umount", target], check=True)
    assert _mounted(target) == 0
    wait_for(lambda: target in node.mounts(), "the publish target to be mounted again",
             EVENT_DEADLINE)

    staging = str(node.state / "staging" / name)
    _settled(d, name, after=before)
    assert staging in node.mounts()
    subprocess.run(["umount", target], check=True)  # the bind first: staging is then free
    subprocess.run(["umount", staging], check=True)
    assert _mounted(target) == 0 and _mounted(staging) == 0
    wait_for(lambda: staging in node.mounts() and target in node.mounts(),
             "staging and publish mounted again", EVENT_DEADLINE)
    assert d.stop() == 0


def test_dead_fuse_helper_is_seen_at_once(node: NodeUnderTest,
                                          start: Callable[..., Daemon]) -> None:
    set_resync(node, 3600)
    name = node.name("evh")
    node.write(name, _image_only(node))
    d = start()
    d.wait_phase(name, "Mapped")
    before = wait_for(lambda: d.status(name).get("device") and d.status(name),
                      "the confirm pass's status")
    pid = _fuse_pid(node, name)
    holder = subprocess.run([*_rbd(node), "image-meta", "get", f"{node.cluster.pool}/{name}",
                             "rbd-reconciler.holder"], capture_output=True, text=True).stdout
    clients = json.loads(holder)["clients"]
    assert clients
    os.kill(pid, signal.SIGKILL)
    # A dead helper with nothing mounted is unmapped and mapped again (README).
    # The re-map itself waits for Ceph to drop the dead client's watch (30 s).
    wait_for(lambda: f"unmap {node.cluster.pool}/{name}" in d.log.read_text(),
             "the dead mapping to be unmapped",
             EVENT_DEADLINE)
    wait_for(lambda: (s := d.status(name)).get("device") and s.get("phase") == "Mapped"
             and s["updated"] != before["updated"] and _alive_helper(node, name, pid),  # type: ignore[index]
             "the volume mapped again", 90)
    # The dead helper's client, which our claim names, was fenced before the
    # re-map (for 30 days, as a takeover fences): librbd would otherwise wait
    # out its watch (30 s) and then fence it itself, for an hour.
    with node.cluster.client() as cluster:
        until = claims.blocklist(cluster)
    soon = (datetime.now(UTC) + timedelta(days=2)).isoformat()
    assert all(c in until and until[c] > soon for c in clients), (clients, until)
    assert d.stop() == 0


def _alive_helper(node: NodeUnderTest, name: str, old: int) -> bool:
    try:
        return _fuse_pid(node, name) != old
    except AssertionError:
        return False


def test_image_resized_elsewhere(node: NodeUnderTest, start: Callable[..., Daemon]) -> None:
    set_resync(node, 3600)
    node.config.write_text(node.config.read_text() + "events:\n  imagePollSeconds: 0.5\n")
    name = node.name("evr")
    rbd = ["rbd", "-c", str(node.cluster.conf), "--id", node.cluster.user,
           "--keyring", str(node.cluster.keyring)]
    subprocess.run([*rbd, "create", "--size", "64M", f"{node.cluster.pool}/{name}"],
                   check=True, capture_output=True)
    # No size in the spec: the image is adopted, and grown only by others.
    node.write(name, spec(node).replace(", size: 64Mi", ""))
    d = start()
    d.wait_phase(name, "Published")
    device = wait_for(lambda: d.status(name).get("device"), "the confirm pass's status")
    subprocess.run([*rbd, "resize", "--size", "96M", f"{node.cluster.pool}/{name}"],
                   check=True, capture_output=True)

    def grown() -> bool:
        out = subprocess.run(["blockdev", "--getsize64", str(device)],
                             capture_output=True, text=True).stdout
        return out.strip() == str(96 * 2**20)
    # The loop device over the rbd-fuse file sees the new size only when told.
    wait_for(grown, "the device to show the resized image", EVENT_DEADLINE)
    assert d.stop() == 0


def test_a_storm_of_mount_events_costs_few_passes(node: NodeUnderTest,
                                                  start: Callable[..., Daemon]) -> None:
    set_resync(node, 3600)
    name = node.name("evs")
    node.write(name, spec(node))
    d = start()
    d.wait_phase(name, "Published")
    d.wait_passes(1)  # the confirm pass after the chain
    before = d.passes()
    target = str(node.srv / "app")
    # 200 mounts stacked on the publish target and taken off again.
    script = (f"for i in $(seq 200); do mount -t tmpfs -o size=1m storm {target}; done; "
              f"for i in $(seq 200); do umount {target}; done")
    subprocess.run(["bash", "-c", script], check=True)
    wait_for(lambda: d.passes() > before, "a pass after the storm", EVENT_DEADLINE)
    assert target in node.mounts()
    # Every pass is logged: the storm's 400 changes were coalesced.
    wait_for(lambda: json.loads(json.dumps(d.status(name))).get("phase") == "Published",
             "the volume to stay Published", EVENT_DEADLINE)
    assert d.passes() - before < 40, d.passes() - before
    assert d.stop() == 0
