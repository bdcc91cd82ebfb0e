"""Observe forks no probe for a published volume (the staging mount proves
its filesystem), still probes an unmounted mapped device (each read of a
device by a child: drivers/fs.read_head), does not read it again while
nothing is written to it, and probes again a device changed by hand."""

from __future__ import annotations

import subprocess

import pytest
from conftest import NodeUnderTest

from reconciler.engine import plan_pass
from reconciler.observe.node import Node
from reconciler.spec.config import load_config

pytestmark = pytest.mark.ceph

PROBES = {"blkid", "dumpe2fs", "xfs_info", "xfs_db", "dd"}


def spec(node: NodeUnderTest, stage: bool, target: str = "app", fs: str = "ext4",
         size: str = "64Mi") -> str:
    body = f"  image: {{pool: {node.cluster.pool}, size: {size}}}\n  map: {{mapper: fuse}}\n"
    if stage:
        body += f"  stage: {{fsType: {fs}}}\n  publish:\n    - path: {node.srv / target}\n"
    return body


def probes(n: Node) -> list[list[str]]:
    """The probes run, blkid as itself (it runs under a shell that reads
    ahead for it, drivers/fs.readahead_then), and each read of a device."""
    out = []
    for a in n.runner.history:
        if a[0] == "sh" and "blkid" in a:
            a = a[a.index("blkid"):]
        if a[0] in PROBES:
            out.append(a)
    return out


@pytest.mark.parametrize(("fs", "size"), [("ext4", "64Mi"), ("xfs", "320Mi")])
def test_noop_plan_of_a_published_volume_forks_no_probe(node: NodeUnderTest, fs: str,
                                                        size: str) -> None:
    pub, mapped = node.name("pub"), node.name("mapped")
    node.write(pub, spec(node, True, fs=fs, size=size))
    node.write(mapped, spec(node, False))
    assert node.apply()["rc"] == 0
    config = load_config(node.config)
    n = Node.from_config(config)
    p = plan_pass([node.desired], config, n)
    assert all(not vp.steps and not vp.refusal for vp in p.plans), p.plans
    dev_pub = next(m.device for m in p.observed.mappings if m.image == pub)
    dev_mapped = next(m.device for m in p.observed.mappings if m.image == mapped)
    # The published one: no probe, yet its filesystem and size are known. Its
    # superblock is read in this process when the page cache holds it, else
    # by dd, which leaves it there (the mount keeps the device open): at
    # most once, and never again on the next pass.
    reads = [a for a in n.runner.history if any(dev_pub in w for w in a)]
    assert [a[0] for a in reads] in ([], ["dd"]), reads
    d = p.observed.devices[dev_pub]
    assert d.fs_type == fs and d.signature == fs and d.fs_uuid
    assert d.fs_size is not None and 0 <= d.size - d.fs_size < 1 << 20
    # The unmounted one is probed (its start read by dd, then blkid), once;
    # the next pass uses the cache: nothing was written to it since, so it
    # is not even read.
    assert [a for a in probes(n) if any(dev_mapped in w for w in a)] == [
        ["dd", f"if={dev_mapped}", "iflag=direct", "bs=65536", "count=1", "status=none"],
        ["blkid", "-p", "-o", "export", "--", dev_mapped]]
    n.runner.history.clear()
    p = plan_pass([node.desired], config, n)
    assert probes(n) == [] and p.observed.devices[dev_mapped].signature is None
    assert p.observed.devices[dev_pub].fs_size == d.fs_size

    # A filesystem made by hand on the mapped device: probed again, and seen.
    subprocess.run(["mkfs.ext4", "-q", "-F", dev_mapped], check=True)
    p = plan_pass([node.desired], config, n)
    assert [a[0] for a in probes(n)] == ["dd", "blkid"]
    assert p.observed.devices[dev_mapped].fs_type == "ext4"
    assert p.observed.devices[dev_mapped].fs_size == 64 << 20


def test_header_read_matches_librbd(node: NodeUnderTest) -> None:
    import dataclasses

    import rbd

    from reconciler.drivers import rbdbase, rbdheader
    from reconciler.observe.ceph import observe_images

    a, b = node.name("hdr-a"), node.name("hdr-b")
    node.images.update({a, b})
    with node.cluster.client() as c, c.open_ioctx(node.cluster.pool) as io:
        rbd.RBD().create(io, a, 5 << 30, old_format=False,
                         features=rbdbase.feature_bits(["layering", "exclusive-lock", "object-map",
                                                     "fast-diff", "deep-flatten"]))
        rbd.RBD().create(io, b, 12 << 20, old_format=False, features=rbdbase.feature_bits(
            ["layering"]))
        with rbd.Image(io, a) as img:
            img.metadata_set("rbd-reconciler.owner", "n1")
            img.metadata_set("other", "ü" * 300)
            img.resize(6 << 30)
        ids = rbdheader.image_ids(c, node.cluster.pool, [a, b, "no-such-image"])
        assert set(ids) == {a, b}
        for name in (a, b):
            slow = rbdbase.image_state(c, node.cluster.pool, name)
            fast = rbdheader.header_state(c, node.cluster.pool, name, ids[name])
            assert slow is not None and fast == dataclasses.replace(slow, watchers=())
        assert rbdheader.header_state(c, node.cluster.pool, a, "0000dead") is None
    # Through observe: the same images, with and without their watchers.
    cfg = load_config(node.config).ceph
    keys = {(node.cluster.pool, a), (node.cluster.pool, b)}
    full = observe_images(cfg, keys, 5)
    fast_view = observe_images(cfg, keys, 5, watchers_for=set())
    assert fast_view.images == {k: dataclasses.replace(v, watchers=())
                                for k, v in full.images.items()}


def test_ceph_session_kept_across_passes_and_replaced_after_no_answer(
        node: NodeUnderTest, dead_pool: str) -> None:
    from reconciler.observe.ceph import Session, observe_images

    cfg = load_config(node.config).ceph
    session = Session()
    keys = {(node.cluster.pool, "nothing-here")}
    assert node.cluster.pool in observe_images(cfg, keys, 5, set(), session).listed
    first = session.take(cfg)
    assert first is not None
    first.drop()
    observe_images(cfg, keys, 5, set(), session)
    again = session.take(cfg)
    assert again is first  # one connection, not one per pass
    again.drop()
    # A pool that does not answer: this connection is never used again.
    view = observe_images(cfg, keys | {(dead_pool, "x")}, 1, set(), session)
    assert dead_pool in view.errors and node.cluster.pool in view.listed
    assert session.take(cfg) is None
    assert node.cluster.pool in observe_images(cfg, keys, 5, set(), session).listed
    fresh = session.take(cfg)
    assert fresh is not None and fresh is not first
    fresh.drop()
    session.discard()


def image_only(node: NodeUnderTest, name: str, source: str = "") -> None:
    src = f"    source: {{{source}}}\n" if source else ""
    node.write(name, f"  image:\n    pool: {node.cluster.pool}\n    size: 16Mi\n{src}")


def test_image_only_volume_is_read_from_its_header(node: NodeUnderTest,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """No map, nothing mapped here: the planner needs no watchers, so no librbd open."""
    from reconciler.drivers import rbdbase

    names = [node.name(f"only{i}") for i in range(3)]
    for name in names:
        image_only(node, name)
    assert node.apply()["rc"] == 0
    opened: list[str] = []
    real = rbdbase.image_state

    def counting(cluster: object, pool: str, name: str) -> object:
        opened.append(name)
        return real(cluster, pool, name)  # type: ignore[arg-type]

    monkeypatch.setattr(rbdbase, "image_state", counting)
    config = load_config(node.config)
    p = plan_pass([node.desired], config, Node.from_config(config))
    assert all(not vp.steps and not vp.refusal for vp in p.plans), p.plans
    assert opened == []
    for name in names:
        img = p.observed.images[(node.cluster.pool, name)]
        assert img.size == 16 << 20 and img.meta.get("rbd-reconciler.owner") == "test-node"


def test_clone_of_an_image_snapshot_sees_the_snapshot(node: NodeUnderTest) -> None:
    """The source image is read in full: its snapshots are not in the header read."""
    import rbd

    base, copy = node.name("base"), node.name("copy")
    node.images.update({base, copy})
    with node.cluster.client() as c, c.open_ioctx(node.cluster.pool) as io:
        rbd.RBD().create(io, base, 16 << 20, old_format=False, features=1)
        with rbd.Image(io, base) as img:
            img.create_snap("gold")
            img.protect_snap("gold")
    image_only(node, copy, f"image: {{pool: {node.cluster.pool}, name: {base}, "
                           "snapshot: gold}")
    doc = node.apply()
    assert doc["rc"] == 0, doc
    assert node.image_exists(copy)


def test_a_stuck_header_read_makes_only_its_image_unknown(
        node: NodeUnderTest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool's headers are read in one call; one that does not answer (its PG
    down) is unknown, the others are seen, and while that call is still stuck
    the next pass reads the pool's images one call each."""
    import threading

    import rbd

    from reconciler.drivers import rbdbase, rbdheader
    from reconciler.observe import ceph as observe_ceph

    names = [node.name(f"stuck{i}") for i in range(4)]
    node.images.update(names)
    with node.cluster.client() as c, c.open_ioctx(node.cluster.pool) as io:
        for name in names:
            rbd.RBD().create(io, name, 16 << 20, old_format=False,
                             features=rbdbase.feature_bits(["layering"]))
    gate = threading.Event()
    real = rbdheader.header_states
    batches: list[int] = []

    def one_stuck(cluster: object, pool: str, ids: dict[str, str],
                  deliver: object) -> None:
        def withhold(name: str, answer: object) -> None:
            if name != names[0]:
                deliver(name, answer)  # type: ignore[operator]

        batches.append(len(ids))
        real(cluster, pool, ids, withhold)  # type: ignore[arg-type]
        gate.wait()  # as if its read never came back
        deliver(names[0], None)  # type: ignore[operator]

    monkeypatch.setattr(rbdheader, "header_states", one_stuck)
    cfg = load_config(node.config).ceph
    keys = {(node.cluster.pool, n) for n in names}
    try:
        view = observe_ceph.observe_images(cfg, keys, 1, watchers_for=set())
        assert set(view.image_errors) == {(node.cluster.pool, names[0])}
        assert "no answer within 1 s" in view.image_errors[(node.cluster.pool, names[0])]
        assert set(view.images) == keys - {(node.cluster.pool, names[0])}
        assert node.cluster.pool in view.listed and not view.errors
        # The batch is still stuck: this pass reads each image in its own call.
        again = observe_ceph.observe_images(cfg, keys, 5, watchers_for=set())
        assert set(again.images) == keys and not again.image_errors
        assert batches == [4]
    finally:
        gate.set()


def test_observe_reads_node_wide_facts_once_and_writes_nothing(
        node: NodeUnderTest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The mount table, the loop table and the helper table are read once a
    pass, whatever the number of volumes; observing leaves every file as it was."""
    import os
    from pathlib import Path

    from reconciler.drivers import fusemapper
    from reconciler.observe.node import observe
    from reconciler.spec.desired import load_desired

    for i in range(3):
        node.write(node.name(f"m{i}"), spec(node, stage=False))
        image_only(node, node.name(f"i{i}"))
    assert node.apply()["rc"] == 0

    def tree() -> dict[str, tuple[int, int, int]]:
        """Every file of ours, not what a FUSE mount in the state dir serves
        (rbd-fuse's times are the image's, not a write of ours)."""
        out = {}
        for d in (node.state, node.desired):
            for dirpath, dirs, files in os.walk(d):
                dirs[:] = [x for x in dirs if not os.path.ismount(os.path.join(dirpath, x))]
                for f in [dirpath, *(os.path.join(dirpath, f) for f in files)]:
                    st = os.lstat(f)
                    out[f] = (st.st_ino, st.st_size, st.st_mtime_ns)
        return out

    config = load_config(node.config)
    n = Node.from_config(config)
    volumes = load_desired(config).volumes
    observe(n, volumes)  # the helpers' pids are on record from here on
    before = tree()
    reads: list[str] = []
    scans: list[int] = []
    real_read, real_bytes, real_loops = Path.read_text, Path.read_bytes, fusemapper.loop_devices

    def read_text(self: Path, *args: object, **kwargs: object) -> str:
        reads.append(str(self))
        return real_read(self, *args, **kwargs)  # type: ignore[arg-type]

    def read_bytes(self: Path) -> bytes:  # mountinfo is read as bytes (issue 26.4)
        reads.append(str(self))
        return real_bytes(self)

    def loops(*args: object) -> object:
        scans.append(1)
        return real_loops(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "read_text", read_text)
    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    monkeypatch.setattr(fusemapper, "loop_devices", loops)
    monkeypatch.setattr(n.fuse, "scan_helpers", lambda *a: scans.append(2))
    observed = observe(n, volumes)
    assert len([m for m in observed.mappings if m.problem is None]) == 3
    assert reads.count("/proc/self/mountinfo") == 1, reads
    assert scans == [1]  # the loop table once; no /proc scan: every helper on record
    # krbd's list is read from sysfs; rbd-nbd's is asked only of a connected device.
    assert [a for a in n.runner.history if a[:3] == ["rbd", "device", "list"]] == []
    assert tree() == before
