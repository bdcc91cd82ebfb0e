"""Snapshots and clones on the real cluster: data, depth, refusals, fsfreeze, crashes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import rbd
from conftest import NodeUnderTest
from test_daemon import Daemon, start  # noqa: F401  (start: the daemon fixture)

pytestmark = pytest.mark.ceph

HEADER = "apiVersion: rbd-reconciler/v1\nkind: {kind}\nmetadata:\n  name: {name}\nspec:\n"


def write_doc(node: NodeUnderTest, kind: str, name: str, body: str) -> Path:
    path = node.desired / f"{name}.yaml"
    path.write_text(HEADER.format(kind=kind, name=name) + body)
    if kind == "Volume":
        node.images.add(name)
    return path


def published(node: NodeUnderTest, name: str, target: Path, size: str = "64Mi",
              source: str = "", policy: str = "Delete") -> Path:
    src = f"    source: {{{source}}}\n" if source else ""
    return write_doc(node, "Volume", name,
                     f"  image:\n    pool: {node.cluster.pool}\n    size: {size}\n"
                     f"    reclaimPolicy: {policy}\n{src}"
                     f"  map: {{mapper: fuse}}\n  stage: {{fsType: ext4}}\n"
                     f"  publish:\n    - path: {target}\n")


def snapshot(node: NodeUnderTest, name: str, volume: str, state: str = "present") -> Path:
    return write_doc(node, "Snapshot", name, f"  state: {state}\n  source: {{volume: {volume}}}\n")


def image_only(node: NodeUnderTest, name: str, source: str = "") -> Path:
    src = f"    source: {{{source}}}\n" if source else ""
    return write_doc(node, "Volume", name, f"  image:\n    pool: {node.cluster.pool}\n"
                                           f"    size: 16Mi\n    reclaimPolicy: Delete\n{src}")


def set_config(node: NodeUnderTest, extra: str) -> None:
    text = node.config.read_text().split("clone:")[0]
    node.config.write_text(text + extra)


def rows(node: NodeUnderTest) -> dict[str, dict]:
    _, doc = node.cli_json("status")
    return {v["name"]: v for v in doc["volumes"]}


def steps(plan: dict, name: str) -> list[str]:
    return [s["action"] for v in plan["volumes"] if v["name"] == name for s in v["steps"]]


def snaps_of(node: NodeUnderTest, image: str) -> list[str]:
    with node.cluster.client() as c, c.open_ioctx(node.cluster.pool) as io, \
            rbd.Image(io, image, read_only=True) as img:
        return [s["name"] for s in img.list_snaps()]


def writes_within(path: Path, data: str, seconds: float = 10) -> bool:
    """A write that hangs means the filesystem is still frozen."""
    done = threading.Event()

    def go() -> None:
        with path.open("w") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        done.set()

    threading.Thread(target=go, daemon=True).start()
    return done.wait(seconds)


def tear_down(node: NodeUnderTest, *names: str) -> None:
    """Snapshots first (state: absent), then clones, then sources."""
    for f in node.desired.glob("*.yaml"):
        text = f.read_text()
        text = text.replace("  state: present\n", "").replace("  state: absent\n", "")
        f.write_text(text.replace("spec:\n", "spec:\n  state: absent\n", 1))
    for _ in range(3):
        doc = node.apply()
        if doc["rc"] == 0:
            break
    assert doc["rc"] == 0, doc
    for n in names:
        assert not node.image_exists(n), n


def test_snapshot_then_clone_keeps_the_moment(node: NodeUnderTest) -> None:
    src, snap, copy = node.name("src"), node.name("s1"), node.name("copy")
    published(node, src, node.srv / "src")
    assert node.apply()["rc"] == 0
    (node.srv / "src" / "data").write_text("before")

    snapshot(node, snap, src)
    rc, plan = node.plan()
    assert rc == 2 and steps(plan, snap) == ["snapshot"]
    [step] = [s for v in plan["volumes"] if v["name"] == snap for s in v["steps"]]
    assert "fsfreeze" in step["to"]  # a read-write published filesystem is frozen around it
    rc, text = node.cli("plan")
    assert f"+ snapshot         {node.cluster.pool}/{src}@{snap}" in text
    assert node.apply()["rc"] == 0
    assert not (node.state / "freezes.json").exists() or \
        (node.state / "freezes.json").read_text().strip() == "{}"
    assert writes_within(node.srv / "src" / "data", "after")  # thawed

    # Taken once: a second pass is ok, never a second snapshot.
    rc, _ = node.plan()
    assert rc == 0
    assert snaps_of(node, src) == [snap]

    published(node, copy, node.srv / "copy", size="96Mi", source=f"snapshot: {snap}")
    rc, text = node.cli("plan")
    assert rc == 2 and "+ clone" in text
    assert node.apply()["rc"] == 0
    assert (node.srv / "copy" / "data").read_text() == "before"
    assert (node.srv / "src" / "data").read_text() == "after"
    st = rows(node)
    assert st[copy]["clonedFrom"] == f"{node.cluster.pool}/{src}@{snap}"
    assert st[copy]["size"] == 96 << 20
    assert st[snap]["kind"] == "Snapshot" and st[snap]["phase"] == "CREATED"
    assert st[snap]["children"] == [f"{node.cluster.pool}/{copy}"]
    rc, text = node.cli("explain", snap)
    assert rc == 0 and f"clones:   {node.cluster.pool}/{copy}" in text

    # A snapshot with a clone is not deleted: the refusal names the clone.
    snapshot(node, snap, src, state="absent")
    rc, plan = node.plan()
    assert rc == 1
    [vp] = [v for v in plan["volumes"] if v["name"] == snap]
    assert copy in vp["refusal"] and not vp["steps"]
    assert node.apply()["rc"] == 1
    assert snaps_of(node, src) == [snap]

    # With flattenOnDelete the clone is flattened first, then the snapshot goes.
    set_config(node, "clone:\n  flattenOnDelete: true\n")
    rc, text = node.cli("plan")
    assert "~ flatten" in text and "! delete snapshot" in text, text
    assert node.apply()["rc"] == 0
    assert snaps_of(node, src) == []
    assert (node.srv / "copy" / "data").read_text() == "before"
    assert rows(node)[copy]["clonedFrom"] is None
    tear_down(node, src, copy)


def test_clone_depth_and_volume_clone(node: NodeUnderTest) -> None:
    a, sa, b, sb, c = (node.name(x) for x in ("a", "sa", "b", "sb", "c"))
    set_config(node, "clone:\n  maxDepth: 1\n  flattenOnDelete: true\n")
    image_only(node, a)
    snapshot(node, sa, a)
    image_only(node, b, f"snapshot: {sa}")
    snapshot(node, sb, b)
    image_only(node, c, f"snapshot: {sb}")
    # One apply: each waits for its source and follows in the next pass.
    assert node.apply()["rc"] == 0
    st = rows(node)
    assert st[b]["clonedFrom"] == f"{node.cluster.pool}/{a}@{sa}" and st[b]["cloneDepth"] == 1
    assert st[c]["clonedFrom"] is None, st[c]  # depth 2 > maxDepth 1: flattened
    assert node.plan()[0] == 0

    # A clone of a volume goes through a temporary snapshot, then stands alone.
    d = node.name("d")
    image_only(node, d, f"volume: {a}")
    rc, plan = node.plan()
    assert rc == 2
    assert steps(plan, d) == ["snapshot", "clone", "flatten", "delete snapshot"]
    assert node.apply()["rc"] == 0
    assert rows(node)[d]["clonedFrom"] is None
    assert snaps_of(node, a) == [sa]
    tear_down(node, a, b, c, d)


def test_image_with_foreign_snapshot_is_not_deleted(node: NodeUnderTest) -> None:
    a = node.name("own")
    image_only(node, a)
    assert node.apply()["rc"] == 0
    with node.cluster.client() as cl, cl.open_ioctx(node.cluster.pool) as io, \
            rbd.Image(io, a) as img:
        img.create_snap("by-hand")
    tear = (node.desired / f"{a}.yaml")
    tear.write_text(tear.read_text().replace("spec:\n", "spec:\n  state: absent\n", 1))
    doc = node.apply()
    assert doc["rc"] == 1 and "by-hand" in doc["volumes"][0]["error"]
    assert node.image_exists(a)


def test_snapshot_failure_still_thaws(node: NodeUnderTest, monkeypatch: pytest.MonkeyPatch
                                      ) -> None:
    from reconciler.drivers import ceph, rbdbase

    src, snap = node.name("frz"), node.name("frz-s")
    published(node, src, node.srv / "frz")
    assert node.apply()["rc"] == 0
    snapshot(node, snap, src)

    def boom(*_a: object, **_k: object) -> str:
        # The filesystem is frozen right now: a write would hang.
        assert not writes_within(node.srv / "frz" / "probe", "x", 0.5)
        raise rbdbase.CephError("injected snapshot failure")

    monkeypatch.setattr(ceph, "create_snapshot", boom)
    doc = node.apply()
    assert doc["rc"] == 1 and "injected" in str(doc)
    monkeypatch.undo()
    assert writes_within(node.srv / "frz" / "after", "y")
    assert node.apply()["rc"] == 0
    assert snaps_of(node, src) == [snap]
    tear_down(node, src)


KILLER = """
import os, signal, sys, types
import rbd
from reconciler.cli import main as cli
from reconciler.drivers import ceph

def die():
    os.kill(os.getpid(), signal.SIGKILL)

if sys.argv[2] == "snapshot":  # after the snapshot, inside the freeze
    real = ceph.create_snapshot
    def create_snapshot(*a, **k):
        real(*a, **k)
        die()
    ceph.create_snapshot = create_snapshot
else:  # after the clone, before its owner record
    class RBD(rbd.RBD):
        def clone(self, *a, **k):
            super().clone(*a, **k)
            die()
    shim = types.ModuleType("rbd")
    shim.__dict__.update(rbd.__dict__)
    shim.RBD = RBD
    ceph.rbd = shim
sys.exit(cli.main(["--config", sys.argv[1], "apply"]))
"""


def killed_apply(node: NodeUnderTest, where: str) -> None:
    proc = subprocess.run([sys.executable, "-c", KILLER, str(node.config), where], timeout=120,
                          capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr


def test_sigkill_during_snapshot_and_clone_converges(node: NodeUnderTest) -> None:
    src, snap, copy = node.name("k"), node.name("k-s"), node.name("k-copy")
    published(node, src, node.srv / "k")
    assert node.apply()["rc"] == 0
    (node.srv / "k" / "data").write_text("moment")
    snapshot(node, snap, src)
    try:
        # Killed right after the snapshot, while the filesystem is frozen.
        killed_apply(node, "snapshot")
        rc, plan = node.plan()
        assert "thaw" in steps(plan, snap) or "thaw" in steps(plan, src), plan
        assert node.apply()["rc"] == 0
        assert writes_within(node.srv / "k" / "data2", "later")
        assert snaps_of(node, src) == [snap]  # no duplicate, and not re-taken
    finally:
        subprocess.run(["fsfreeze", "-u", str(node.srv / "k")], capture_output=True)

    # Killed right after the clone, before its owner record.
    image = write_doc(node, "Volume", copy,
                      f"  image:\n    pool: {node.cluster.pool}\n    size: 64Mi\n"
                      f"    reclaimPolicy: Delete\n    source: {{snapshot: {snap}}}\n")
    killed_apply(node, "clone")
    assert node.image_exists(copy)
    assert node.apply()["rc"] == 0
    rc, _ = node.plan()
    assert rc == 0
    st = rows(node)
    assert st[copy]["clonedFrom"] == f"{node.cluster.pool}/{src}@{snap}"
    assert image.exists()
    tear_down(node, src, copy)


def test_daemon_takes_the_snapshot_then_clones(node: NodeUnderTest,
                                               start: Callable[..., Daemon]) -> None:  # noqa: F811
    """Files in, snapshot and clone out: the clone waits (Pending, not Failed)
    for the snapshot and follows as soon as it is taken."""
    import time

    from test_daemon import wait_for

    src, snap, copy = node.name("d"), node.name("d-s"), node.name("d-copy")
    published(node, src, node.srv / "d")
    daemon = start()
    daemon.wait_phase(src, "Published")
    (node.srv / "d" / "data").write_text("then")
    snapshot(node, snap, src)
    published(node, copy, node.srv / "d-copy", source=f"snapshot: {snap}")
    t0 = time.monotonic()
    daemon.wait_phase(snap, "Created")
    daemon.wait_phase(copy, "Published")
    assert time.monotonic() - t0 < 30
    assert (node.srv / "d-copy" / "data").read_text() == "then"
    assert daemon.status(copy).get("lastResult") != "failed"
    wait_for(lambda: daemon.status(snap).get("phase") == "Created", "snapshot status")
    assert daemon.stop() == 0
    tear_down(node, src, copy)


def test_a_snapshot_taken_after_its_record_moved_on_is_removed(node: NodeUnderTest) -> None:
    """A replica paused between the gate's check and the snapshot wakes after
    another replica deleted that snapshot (stop 48's CI, the history checker):
    the gate asked again after the take refuses, and the snapshot goes."""
    from reconciler.apply.runner import apply
    from reconciler.engine import plan_pass
    from reconciler.observe.node import Node
    from reconciler.plan.steps import CreateSnapshot, Step
    from reconciler.spec.config import load_config

    src, snap = node.name("moved"), node.name("moved-s1")
    image_only(node, src)
    assert node.apply()["rc"] == 0
    snapshot(node, snap, src)
    config = load_config(node.config)
    n = Node.from_config(config)
    p = plan_pass([node.desired], config, n)
    asked: list[str] = []

    def gate(name: str, _file: Path, step: Step) -> str | None:
        if not isinstance(step, CreateSnapshot):
            return None
        asked.append(name)
        return None if len(asked) == 1 else "its controller record moved on (test)"

    outs = {o.name: o for o in apply(p.plans, {v.name: v for v in p.loaded.volumes},
                                     p.observed, n, gate=gate)}
    assert asked == [snap, snap]
    assert outs[snap].status == "failed" and outs[snap].refused, outs[snap]
    assert "was removed" in (outs[snap].error or ""), outs[snap]
    assert snaps_of(node, src) == []
    # Nothing asks twice when the gate lets it be: taken, and kept.
    assert node.apply()["rc"] == 0 and snaps_of(node, src) == [snap]
    tear_down(node, src)


def test_an_image_created_after_its_record_moved_on_is_removed(node: NodeUnderTest) -> None:
    """The same for a volume: a create woken after its name was deleted
    removes the image it just made (no one was told of it)."""
    from reconciler.apply.runner import apply
    from reconciler.engine import plan_pass
    from reconciler.observe.node import Node
    from reconciler.plan.steps import CreateImage, Step
    from reconciler.spec.config import load_config

    vol = node.name("moved-vol")
    image_only(node, vol)
    config = load_config(node.config)
    n = Node.from_config(config)
    p = plan_pass([node.desired], config, n)
    asked: list[str] = []

    def gate(name: str, _file: Path, step: Step) -> str | None:
        if isinstance(step, CreateImage):
            asked.append(name)
            return None if len(asked) == 1 else "its controller record moved on (test)"
        return None

    [out] = apply(p.plans, {v.name: v for v in p.loaded.volumes}, p.observed, n, gate=gate)
    assert asked == [vol, vol] and out.refused and "was removed" in (out.error or ""), out
    assert not node.image_exists(vol)
