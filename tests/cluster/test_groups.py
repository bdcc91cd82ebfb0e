"""Group snapshots on the real cluster: one crash-consistent moment of two
volumes, their filesystems frozen around it (and thawed on every path),
restores from the members, idempotence, and removal."""

from __future__ import annotations

import contextlib
import hashlib
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import rbd
from conftest import NodeUnderTest
from test_snapshots import published, rows, steps, write_doc, writes_within

pytestmark = pytest.mark.ceph


def group_doc(node: NodeUnderTest, name: str, volumes: list[str], state: str = "present"
              ) -> Path:
    return write_doc(node, "SnapshotGroup", name,
                     f"  state: {state}\n  pool: {node.cluster.pool}\n"
                     f"  volumes: [{', '.join(volumes)}]\n")


def groups_in_pool(node: NodeUnderTest) -> list[str]:
    with node.cluster.client() as c, c.open_ioctx(node.cluster.pool) as io:
        return list(rbd.RBD().group_list(io))


def group_snaps(node: NodeUnderTest, group: str) -> list[str]:
    with node.cluster.client() as c, c.open_ioctx(node.cluster.pool) as io, \
            rbd.Group(io, group) as g:
        return [s["name"] for s in g.list_snaps()]


def digest(root: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.iterdir()) if p.is_file()}


@pytest.fixture
def groups(node: NodeUnderTest) -> Iterator[list[str]]:
    """Groups a test makes: removed (snapshots, members) before the node's teardown."""
    made: list[str] = []
    yield made
    with node.cluster.client() as c, c.open_ioctx(node.cluster.pool) as io:
        for name in made:
            with contextlib.suppress(rbd.ObjectNotFound, rbd.ImageNotFound):
                rbd.RBD().group_remove(io, name)
            with contextlib.suppress(Exception):
                io.remove_object(f"rbd-reconciler.group.{name}")


def two_volumes(node: NodeUnderTest) -> tuple[str, str]:
    a, b = node.name("ga"), node.name("gb")
    published(node, a, node.srv / a)
    published(node, b, node.srv / b)
    assert node.apply()["rc"] == 0
    for v in (a, b):
        (node.srv / v / "data").write_bytes(v.encode() * 50000)
    return a, b


def test_group_snapshot_restore_and_remove(node: NodeUnderTest, groups: list[str]) -> None:
    a, b = two_volumes(node)
    g = node.name("grp")
    groups.append(g)
    group_doc(node, g, [a, b])
    rc, plan = node.plan()
    assert rc == 2
    assert steps(plan, g) == ["create group", "add to group", "add to group", "group snapshot"]
    [snap_step] = [s for v in plan["volumes"] if v["name"] == g for s in v["steps"]
                   if s["action"] == "group snapshot"]
    assert str(node.srv / a) in snap_step["to"] and str(node.srv / b) in snap_step["to"]
    at_snapshot = {v: digest(node.srv / v) for v in (a, b)}
    assert node.apply()["rc"] == 0
    assert group_snaps(node, g) == [g]
    for v in (a, b):  # thawed: a write completes
        assert writes_within(node.srv / v / "data", "after the snapshot")
    assert (node.state / "freezes.json").read_text().strip() in ("", "{}")

    # Taken once: the next pass changes nothing.
    rc, plan = node.plan()
    assert rc == 0, plan
    assert node.apply()["rc"] == 0
    assert group_snaps(node, g) == [g]
    st = rows(node)[g]
    assert st["kind"] == "SnapshotGroup" and st["phase"] == "CREATED", st
    assert sorted(st["members"]) == sorted(f"{node.cluster.pool}/{v}" for v in (a, b))
    rc, text = node.cli("status")
    assert f"group snapshot {node.cluster.pool}/{g}@{g}" in text, text
    rc, text = node.cli("explain", g)
    assert rc == 0 and "owner test-node" in text and f"{node.cluster.pool}/{a}" in text, text

    # Restore each member to a new volume: the data as it was at the snapshot.
    restored = {}
    for v in (a, b):
        r = node.name(f"r{v[1]}")
        restored[v] = r
        published(node, r, node.srv / r, source=f"groupSnapshot: {{pool: {node.cluster.pool}, "
                                               f"group: {g}, image: {v}}}")
    rc, plan = node.plan()
    # (format is probed at apply time: the copy already carries ext4)
    assert rc == 2 and steps(plan, restored[a])[:2] == ["copy from group snapshot", "map"]
    assert node.apply()["rc"] == 0
    for v, r in restored.items():
        assert digest(node.srv / r) == at_snapshot[v], v
        assert digest(node.srv / v) != at_snapshot[v]
    assert node.plan()[0] == 0

    # Membership is fixed once the snapshot is taken: a change is refused, not applied.
    group_doc(node, g, [a])
    doc = node.apply()
    assert doc["rc"] == 1 and "refusing to change the members" in str(doc)
    assert group_snaps(node, g) == [g]

    # absent: the group snapshot, the members, the group go.
    group_doc(node, g, [a, b], state="absent")
    rc, plan = node.plan()
    assert steps(plan, g) == ["delete group snapshot", "remove from group",
                              "remove from group", "delete group"]
    assert node.apply()["rc"] == 0
    assert g not in groups_in_pool(node)
    assert node.plan()[0] == 0


def test_group_snapshot_failure_thaws_every_filesystem(
        node: NodeUnderTest, groups: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from reconciler.drivers import groups as rbdgroups

    a, b = two_volumes(node)
    g = node.name("gfail")
    groups.append(g)
    group_doc(node, g, [a, b])
    frozen_seen = []

    def boom(*_a: object, **_k: object) -> str:
        # Both filesystems are frozen right now: writes would hang.
        frozen_seen.extend(not writes_within(node.srv / v / "probe", "x", 0.5) for v in (a, b))
        raise rbdgroups.CephError("injected group snapshot failure")

    monkeypatch.setattr(rbdgroups, "create_group_snapshot", boom)
    doc = node.apply()
    monkeypatch.undo()
    assert doc["rc"] == 1 and "injected" in str(doc)
    assert frozen_seen == [True, True]
    for v in (a, b):
        assert writes_within(node.srv / v / "after", "y")
    assert node.apply()["rc"] == 0  # taken now
    assert group_snaps(node, g) == [g]


def test_foreign_group_is_left_alone(node: NodeUnderTest, groups: list[str]) -> None:
    a = node.name("fa")
    published(node, a, node.srv / a)
    assert node.apply()["rc"] == 0
    g = node.name("byhand")
    groups.append(g)
    with node.cluster.client() as c, c.open_ioctx(node.cluster.pool) as io:
        rbd.RBD().group_create(io, g)
    group_doc(node, g, [a])
    doc = node.apply()
    assert doc["rc"] == 1 and "not created by this node" in str(doc)
    group_doc(node, g, [a], state="absent")
    doc = node.apply()
    assert doc["rc"] == 1 and "not created by this node" in str(doc)
    assert g in groups_in_pool(node)


KILLER = """
import os, signal, sys
from reconciler.cli import main as cli
from reconciler.drivers import groups

def die():
    os.kill(os.getpid(), signal.SIGKILL)

if sys.argv[2] == "snapshot":  # after the group snapshot, inside the freezes
    real = groups.create_group_snapshot
    def create_group_snapshot(*a, **k):
        real(*a, **k)
        die()
    groups.create_group_snapshot = create_group_snapshot
else:  # after the copy's data, before its records and rename
    real_open = groups.open_image
    def open_image(ioctx, name, *a, **k):
        if name.endswith(groups.PARTIAL_SUFFIX):
            die()
        return real_open(ioctx, name, *a, **k)
    groups.open_image = open_image
sys.exit(cli.main(["--config", sys.argv[1], "apply"]))
"""


def killed_apply(node: NodeUnderTest, where: str) -> None:
    proc = subprocess.run([sys.executable, "-c", KILLER, str(node.config), where], timeout=120,
                          capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr


def test_sigkill_inside_the_freeze_and_the_copy_converges(node: NodeUnderTest,
                                                          groups: list[str]) -> None:
    a, b = two_volumes(node)
    g = node.name("gkill")
    groups.append(g)
    group_doc(node, g, [a, b])
    at_snapshot = digest(node.srv / a)
    try:
        killed_apply(node, "snapshot")  # both filesystems left frozen, recorded
        _, plan = node.plan()
        assert steps(plan, g).count("thaw") == 2, plan
        assert node.apply()["rc"] == 0
        for v in (a, b):
            assert writes_within(node.srv / v / "later", "x")
        assert group_snaps(node, g) == [g]  # taken once, not again
    finally:
        for v in (a, b):
            subprocess.run(["fsfreeze", "-u", str(node.srv / v)], capture_output=True)

    r = node.name("rkill")
    published(node, r, node.srv / r, source=f"groupSnapshot: {{pool: {node.cluster.pool}, "
                                            f"group: {g}, image: {a}}}")
    killed_apply(node, "copy")  # a partial copy is left, never under the volume's name
    assert node.image_exists(r + ".rbdr-partial") and not node.image_exists(r)
    node.images.add(r + ".rbdr-partial")
    assert node.apply()["rc"] == 0  # removed, copied again
    assert not node.image_exists(r + ".rbdr-partial")
    assert digest(node.srv / r) == at_snapshot
    assert node.plan()[0] == 0


def test_group_and_restore_in_one_apply(node: NodeUnderTest, groups: list[str]) -> None:
    """The restore waits for the group snapshot of the same files; apply follows up."""
    a, b = two_volumes(node)
    g, r = node.name("gone"), node.name("rone")
    groups.append(g)
    group_doc(node, g, [a, b])
    published(node, r, node.srv / r, source=f"groupSnapshot: {{pool: {node.cluster.pool}, "
                                            f"group: {g}, image: {b}}}")
    at_snapshot = digest(node.srv / b)
    rc, plan = node.plan()
    assert rc == 2 and "waits for its source group snapshot" in str(
        [v["waiting"] for v in plan["volumes"] if v["name"] == r])
    assert node.apply()["rc"] == 0
    assert digest(node.srv / r) == at_snapshot
    assert node.plan()[0] == 0
