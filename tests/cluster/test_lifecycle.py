"""The engine on a real Ceph cluster: real rbd-fuse, loop devices, filesystems, mounts."""

from __future__ import annotations

import errno
import hashlib
import os
import subprocess
from pathlib import Path

import pytest
from conftest import NodeUnderTest

pytestmark = pytest.mark.ceph


def fs_spec(pool: str, size: str, fs: str, targets: list[tuple[Path, bool]],
            extra: str = "", policy: str = "Retain") -> str:
    pub = "".join(f"    - path: {p}\n      readOnly: {'true' if ro else 'false'}\n"
                  for p, ro in targets)
    return (f"{extra}  image:\n    pool: {pool}\n    size: {size}\n    reclaimPolicy: {policy}\n"
            f"  map: {{mapper: fuse}}\n  stage:\n    fsType: {fs}\n"
            + (f"  publish:\n{pub}" if targets else ""))


def status_of(node: NodeUnderTest, name: str) -> dict:
    rc, doc = node.cli_json("status")
    assert rc == 0, doc
    return {v["name"]: v for v in doc["volumes"]}[name]


def statuses(doc: dict) -> dict[str, str]:
    return {v["name"]: v["status"] for v in doc["volumes"]}


def fs_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize


def checksum_tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and "lost+found" not in p.parts}


@pytest.mark.parametrize(("fs", "size"), [("ext4", "256Mi"), ("xfs", "320Mi")])
def test_filesystem_volume_round_trip_retain(node: NodeUnderTest, fs: str, size: str) -> None:
    name = node.name(fs)
    rw, ro = node.srv / "app", node.srv / "view"
    f = node.write(name, fs_spec(node.cluster.pool, size, fs, [(rw, False), (ro, True)]))

    rc, plan = node.plan()
    assert rc == 2
    actions = [s["action"] for s in plan["volumes"][0]["steps"]]
    assert actions == ["create image", "map", "format", "stage", "publish", "publish"]

    doc = node.apply()
    assert doc["rc"] == 0 and doc["recap"] == {"ok": 0, "changed": 1, "failed": 0}, doc
    st = status_of(node, name)
    assert st["phase"] == "PUBLISHED" and st["filesystem"] == fs
    assert sorted(st["published"]) == [[str(rw), "rw"], [str(ro), "ro"]]

    # Idempotent: nothing planned, nothing changed.
    assert node.plan()[0] == 0
    assert node.apply()["recap"] == {"ok": 1, "changed": 0, "failed": 0}

    # The binds are the same filesystem; the read-only one refuses writes.
    (rw / "hello").write_text("hi")
    assert (ro / "hello").read_text() == "hi"
    with pytest.raises(OSError) as exc:
        (ro / "nope").write_text("x")
    assert exc.value.errno == errno.EROFS

    # state: absent with Retain releases the node and keeps the image.
    f.write_text(f.read_text().replace("spec:\n", "spec:\n  state: absent\n"))
    doc = node.apply()
    assert doc["rc"] == 0, doc
    vol = doc["volumes"][0]
    assert [s["action"] for s in vol["steps"]] == ["unpublish", "unpublish", "unstage", "unmap"]
    assert any("Retain" in n for n in vol["notes"])
    assert node.image_exists(name)
    assert not node.mounts()
    assert status_of(node, name)["phase"] == "CREATED"
    assert node.plan()[0] == 0


def test_delete_policy_removes_the_image(node: NodeUnderTest) -> None:
    name = node.name("del")
    f = node.write(name, fs_spec(node.cluster.pool, "64Mi", "ext4", [(node.srv / "d", False)],
                                 policy="Delete"))
    assert node.apply()["rc"] == 0
    f.write_text(f.read_text().replace("spec:\n", "spec:\n  state: absent\n"))
    rc, plan = node.plan()
    assert rc == 2
    steps = plan["volumes"][0]["steps"]
    assert steps[-1]["action"] == "delete image" and steps[-1]["destructive"]
    assert node.apply()["rc"] == 0
    assert not node.image_exists(name)
    assert node.plan()[0] == 0


def test_block_mode_exposes_the_device(node: NodeUnderTest) -> None:
    name = node.name("blk")
    target = node.srv / "disk"
    node.write(name, f"  image: {{pool: {node.cluster.pool}, size: 16Mi}}\n"
                     f"  map: {{mapper: fuse}}\n  stage: {{mode: block}}\n"
                     f"  publish:\n    - path: {target}\n")
    assert node.apply()["rc"] == 0
    assert node.plan()[0] == 0
    st = status_of(node, name)
    assert st["phase"] == "PUBLISHED"
    # nosuid, never nodev: a bind of a device node on a nodev mount cannot open.
    for path in (target, Path(st["staging"])):
        opts = node.mounts()[str(path)].options  # type: ignore[attr-defined]
        assert "nosuid" in opts and "nodev" not in opts, (path, opts)
    payload = os.urandom(4096)
    fd = os.open(target, os.O_WRONLY)
    try:
        os.pwrite(fd, payload, 1 << 20)
        os.fsync(fd)
    finally:
        os.close(fd)
    with open(st["device"], "rb") as dev:
        dev.seek(1 << 20)
        assert dev.read(4096) == payload


def test_data_survives_teardown_to_created_and_back(node: NodeUnderTest) -> None:
    name = node.name("data")
    app = node.srv / "app"
    published = fs_spec(node.cluster.pool, "128Mi", "ext4", [(app, False)])
    f = node.write(name, published)
    assert node.apply()["rc"] == 0
    (app / "dir").mkdir()
    for i in range(20):
        (app / "dir" / f"f{i}").write_bytes(os.urandom(4096 * (i + 1)))
    before = checksum_tree(app)
    assert len(before) == 20

    f.write_text(f"apiVersion: rbd-reconciler/v1\nkind: Volume\nmetadata:\n  name: {name}\n"
                 f"spec:\n  image: {{pool: {node.cluster.pool}, size: 128Mi}}\n")
    assert node.apply()["rc"] == 0
    assert status_of(node, name)["phase"] == "CREATED"
    assert not node.mounts()

    node.write(name, published)
    doc = node.apply()
    assert doc["rc"] == 0
    fmt = [s for s in doc["volumes"][0]["steps"] if s["action"] == "format"]
    assert not fmt, "a formatted image must never be planned for mkfs again"
    assert checksum_tree(app) == before


def test_drift_is_planned_back(node: NodeUnderTest) -> None:
    name = node.name("drift")
    app, view = node.srv / "app", node.srv / "view"
    node.write(name, fs_spec(node.cluster.pool, "64Mi", "ext4", [(app, False), (view, True)]))
    assert node.apply()["rc"] == 0
    (app / "keep").write_text("kept")

    # A target unmounted by hand: only that publish is planned.
    subprocess.run(["umount", str(view)], check=True)
    rc, plan = node.plan()
    assert rc == 2
    assert [(s["action"], s["target"]) for s in plan["volumes"][0]["steps"]] == [
        ("publish", str(view))]
    assert node.apply()["rc"] == 0 and node.plan()[0] == 0

    # A target remounted read-write by hand: put back to read-only.
    subprocess.run(["mount", "-o", "remount,bind,rw", str(view)], check=True)
    rc, plan = node.plan()
    assert [s["action"] for s in plan["volumes"][0]["steps"]] == ["remount"]
    assert node.apply()["rc"] == 0
    assert status_of(node, name)["published"] == [[str(app), "rw"], [str(view), "ro"]]

    # The whole mapping torn down by hand (fs, binds, loop, fuse): rebuilt.
    st = status_of(node, name)
    for p in (view, app, st["staging"]):
        subprocess.run(["umount", str(p)], check=True)
    subprocess.run(["losetup", "-d", st["device"]], check=True)
    fuse_mount = node.state / "fuse" / f"{node.cluster.pool}@{name}"
    subprocess.run(["umount", str(fuse_mount)], check=True)
    rc, plan = node.plan()
    assert rc == 2
    assert [s["action"] for s in plan["volumes"][0]["steps"]] == [
        "map", "stage", "publish", "publish"]
    assert node.apply()["rc"] == 0
    assert node.plan()[0] == 0
    assert (app / "keep").read_text() == "kept"


def test_grow_xfs_online(node: NodeUnderTest) -> None:
    name = node.name("growx")
    app = node.srv / "app"
    f = node.write(name, fs_spec(node.cluster.pool, "512Mi", "xfs", [(app, False)]))
    assert node.apply()["rc"] == 0
    small = fs_bytes(app)
    f.write_text(f.read_text().replace("512Mi", "1Gi"))
    rc, plan = node.plan()
    assert [s["action"] for s in plan["volumes"][0]["steps"]] == [
        "resize image", "set image-meta", "refresh device", "grow filesystem"]
    doc = node.apply()
    assert doc["rc"] == 0, doc
    assert fs_bytes(app) > small + 400 * 2**20
    rc, plan = node.plan()
    assert rc == 0, plan["volumes"][0]["steps"]


def test_grow_ext4_offline_at_stage(node: NodeUnderTest) -> None:
    name = node.name("growe")
    app = node.srv / "app"
    f = node.write(name, fs_spec(node.cluster.pool, "512Mi", "ext4", [(app, False)]))
    assert node.apply()["rc"] == 0
    (app / "keep").write_text("kept")
    small = fs_bytes(app)
    f.write_text(f.read_text().replace("512Mi", "1Gi"))
    doc = node.apply()
    assert doc["rc"] == 0, doc
    grow = [s for s in doc["volumes"][0]["steps"] if s["action"] == "grow filesystem"]
    assert len(grow) == 1
    if fs_bytes(app) <= small:
        # Online ext4 grow refused here (no CAP_SYS_RESOURCE): reported, and the
        # plan says so without planning the same failing step again.
        assert "offline" in grow[0]["message"]
        rc, plan = node.plan()
        assert rc == 0 and any("offline" in n for n in plan["volumes"][0]["notes"])
        assert node.cli("release")[0] == 0
        doc = node.apply()
        assert doc["rc"] == 0, doc
        stage = [s for s in doc["volumes"][0]["steps"] if s["action"] == "stage"]
        assert "offline" in stage[0]["message"]
    assert fs_bytes(app) > small + 400 * 2**20
    assert (app / "keep").read_text() == "kept"
    assert node.plan()[0] == 0


def test_refuses_to_format_a_device_with_another_filesystem(node: NodeUnderTest) -> None:
    name = node.name("foreign")
    node.write(name, f"  image: {{pool: {node.cluster.pool}, size: 320Mi}}\n"
                     f"  map: {{mapper: fuse}}\n")
    assert node.apply()["rc"] == 0
    device = status_of(node, name)["device"]
    subprocess.run(["mkfs.xfs", "-q", "-f", device], check=True, capture_output=True)
    mapped_only = set(node.mounts())
    node.write(name, fs_spec(node.cluster.pool, "320Mi", "ext4", [(node.srv / "a", False)]))
    rc, plan = node.plan()
    assert rc == 1
    assert "xfs" in plan["volumes"][0]["refusal"] and not plan["volumes"][0]["steps"]
    doc = node.apply()
    assert doc["rc"] == 1 and statuses(doc) == {name: "failed"}
    assert set(node.mounts()) == mapped_only  # nothing changed: still just mapped
    probe = subprocess.run(["blkid", "-p", "-o", "value", "-s", "TYPE", device],
                           capture_output=True, text=True)
    assert probe.stdout.strip() == "xfs"


def test_refuses_to_shrink(node: NodeUnderTest) -> None:
    name = node.name("shrink")
    f = node.write(name, f"  image: {{pool: {node.cluster.pool}, size: 64Mi}}\n")
    assert node.apply()["rc"] == 0
    f.write_text(f.read_text().replace("64Mi", "32Mi"))
    rc, plan = node.plan()
    assert rc == 1 and "shrinking" in plan["volumes"][0]["refusal"]
    assert node.apply()["rc"] == 1
    assert status_of(node, name)["size"] == 64 * 2**20


def test_refuses_to_delete_an_image_open_elsewhere(node: NodeUnderTest) -> None:
    import rbd

    name = node.name("watched")
    f = node.write(name, f"  image: {{pool: {node.cluster.pool}, size: 16Mi, "
                         f"reclaimPolicy: Delete}}\n")
    assert node.apply()["rc"] == 0
    f.write_text(f.read_text().replace("spec:\n", "spec:\n  state: absent\n"))
    with node.cluster.client() as c, c.open_ioctx(node.cluster.pool) as io, \
            rbd.Image(io, name):  # a read-write open registers a watch: a foreign user
        rc, plan = node.plan()
        assert rc == 1 and "open by 1 other client" in plan["volumes"][0]["refusal"]
        assert node.apply()["rc"] == 1
        assert node.image_exists(name)
    assert node.apply()["rc"] == 0
    assert not node.image_exists(name)


def test_refuses_to_delete_an_image_it_did_not_create(node: NodeUnderTest) -> None:
    import rbd

    name = node.name("adopted")
    with node.cluster.client() as c, c.open_ioctx(node.cluster.pool) as io:
        rbd.RBD().create(io, name, 16 * 2**20)
    node.write(name, f"  state: absent\n  image: {{pool: {node.cluster.pool}, "
                     f"reclaimPolicy: Delete}}\n")
    rc, plan = node.plan()
    assert rc == 1 and "not created by this node" in plan["volumes"][0]["refusal"]
    assert node.image_exists(name)


def test_never_publishes_an_unmounted_staging_path(node: NodeUnderTest) -> None:
    """Safety rule 2 at execution time: the plan said stage was there; it is not."""
    from reconciler.apply.runner import apply
    from reconciler.engine import plan_pass
    from reconciler.observe.node import Node
    from reconciler.spec.config import load_config

    name = node.name("unstaged")
    app = node.srv / "app"
    node.write(name, fs_spec(node.cluster.pool, "64Mi", "ext4", [(app, False)]))
    assert node.apply()["rc"] == 0
    subprocess.run(["umount", str(app)], check=True)
    config = load_config(node.config)
    n = Node.from_config(config)
    p = plan_pass([node.desired], config, n)
    assert [s.action for s in p.plans[0].steps] == ["publish"]
    staging = p.plans[0].steps[0].staging
    subprocess.run(["umount", staging], check=True)  # between plan and apply
    [out] = apply(p.plans, {v.name: v for v in p.loaded.volumes}, p.observed, n)
    assert out.status == "failed" and "not a mount of" in (out.error or "")
    assert not any(str(app) == m for m in node.mounts())
    assert not any(app.iterdir()), "nothing may be written through an unmounted staging dir"
    # The next pass stages again before publishing.
    assert node.apply()["rc"] == 0 and node.plan()[0] == 0


def test_refuses_a_staging_path_with_a_foreign_mount(node: NodeUnderTest) -> None:
    name = node.name("squat")
    staging = node.srv / "stage"
    node.write(name, fs_spec(node.cluster.pool, "64Mi", "ext4", [(node.srv / "app", False)])
               .replace("    fsType: ext4\n", f"    fsType: ext4\n    path: {staging}\n"))
    staging.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(staging)], check=True)
    try:
        rc, plan = node.plan()
        assert rc == 1 and "already has a mount" in plan["volumes"][0]["refusal"]
    finally:
        subprocess.run(["umount", str(staging)], check=True)


def test_frozen_file_is_left_alone(node: NodeUnderTest) -> None:
    name = node.name("frozen")
    app = node.srv / "app"
    f = node.write(name, fs_spec(node.cluster.pool, "64Mi", "ext4", [(app, False)]))
    assert node.apply()["rc"] == 0
    good = f.read_text()
    f.write_text(good.replace("size: 64Mi", "size: 64MB"))
    rc, plan = node.plan()
    assert rc == 1 and "failed to load" in plan["volumes"][0]["refusal"]
    doc = node.apply()
    assert doc["rc"] == 1 and doc["errors"]
    assert str(app) in node.mounts()
    assert node.cli("release")[0] == 1  # frozen means frozen, for release too
    assert str(app) in node.mounts()
    f.write_text(good)
    assert node.plan()[0] == 0


def test_apply_converges_many_volumes_at_once(node: NodeUnderTest) -> None:
    """Chains run side by side (parallel: 4); output stays in volume order."""
    names = [node.name(f"p{i}") for i in range(5)]
    for i, name in enumerate(names):
        node.write(name, fs_spec(node.cluster.pool, "32Mi", "ext4",
                                 [(node.srv / f"app{i}", False)]))
    doc = node.apply()
    assert doc["rc"] == 0 and doc["recap"] == {"ok": 0, "changed": 5, "failed": 0}, doc
    assert [v["name"] for v in doc["volumes"]] == sorted(names)
    for i in range(5):
        (node.srv / f"app{i}" / "x").write_text(str(i))
    assert node.plan()[0] == 0
    assert len(_loops(node)) == 5


def _loops(node: NodeUnderTest) -> list[str]:
    from conftest import _loops_under

    return _loops_under(node.root, node.tag)
