"""Issue 7 regressions on the real cluster: data safety, what is not ours, leaks.

Each test reproduces a defect found by an adversarial run of the landed code
and proves it gone: it failed before the fix.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import rbd
from conftest import NodeUnderTest
from test_lifecycle import checksum_tree, fs_spec, status_of

from reconciler.drivers import fusemapper
from reconciler.drivers.run import CommandError
from reconciler.facts import meta

pytestmark = pytest.mark.ceph


def image_meta(node: NodeUnderTest, name: str) -> dict[str, str]:
    with node.cluster.client() as c, c.open_ioctx(node.cluster.pool) as io, \
            rbd.Image(io, name, read_only=True) as img:
        return dict(img.metadata_list())


def kill_helper(node: NodeUnderTest, name: str) -> None:
    """SIGKILL the volume's rbd-fuse helper and blocklist its client, so its
    watch goes at once (else the dead client's watch lingers ~30 s)."""
    mnt = str(node.state / "fuse" / f"{node.cluster.pool}@{name}")
    proc = fusemapper._fuse_children.pop(mnt)
    with node.cluster.client() as c, c.open_ioctx(node.cluster.pool) as io, \
            rbd.Image(io, name, read_only=True) as img:
        addrs = [w["addr"] for w in img.watchers_list()]
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    env = {**os.environ, **node.cluster.client_env()}
    for addr in addrs:
        subprocess.run(["ceph", "osd", "blocklist", "add", addr], env=env, check=True,
                       timeout=30, capture_output=True)


def fs_volume(node: NodeUnderTest, name: str, targets: list[tuple[Path, bool]],
              size: str = "64Mi", extra: str = "", policy: str = "Retain") -> Path:
    return node.write(name, fs_spec(node.cluster.pool, size, "ext4", targets, extra, policy))


# --- 1 and 3: a dead helper is unknown, reported, never formatted -------------------


def test_dead_helper_is_reported_and_left_alone_while_in_use(node: NodeUnderTest) -> None:
    name = node.name("dead")
    app = node.srv / "app"
    fs_volume(node, name, [(app, False)])
    assert node.apply()["rc"] == 0
    (app / "data").write_bytes(os.urandom(65536))
    os.sync()
    # A user of the filesystem (another process: the CLI runs in this one,
    # and never counts itself): a dead mapping nobody uses is repaired.
    user = subprocess.Popen([sys.executable, "-c", f"f = open({str(app / 'data')!r})\n"
                             "print('ready', flush=True)\nimport time; time.sleep(600)"],
                            text=True, stdout=subprocess.PIPE)
    try:
        assert user.stdout is not None and user.stdout.readline() == "ready\n"
        kill_helper(node, name)

        rc, doc = node.cli_json("status")
        row = {v["name"]: v for v in doc["volumes"]}[name]
        assert rc == 1 and row["phase"] == "DEGRADED" and "helper is gone" in row["problem"]
        assert f"pid {user.pid} (python" in row["problem"]
        rc, plan = node.plan()
        vol = plan["volumes"][0]
        assert not vol["steps"] and f"pid {user.pid}" in vol["problems"]["HelperGone"], vol
        rc, out = node.cli("explain", name)
        assert "PROBLEM" in out and "helper is gone" in out
    finally:
        user.kill()
        user.wait()

    # The operator's way out: release (nothing is formatted), then apply again.
    # ext4 cannot write back what the dead device lost: the file written
    # before the sync survives.
    assert node.cli("release")[0] == 0, node.cli("release")[1]
    assert not node.mounts()
    doc = node.apply()
    assert doc["rc"] == 0, doc
    assert "format" not in [s["action"] for s in doc["volumes"][0]["steps"]]
    assert len((app / "data").read_bytes()) == 65536


def test_dead_helper_of_an_unmounted_mapping_is_remapped_never_formatted(
        node: NodeUnderTest) -> None:
    """The scenario behind item 1: an adopted image with data, a dead helper."""
    name = node.name("adopt")
    app = node.srv / "app"
    fs_volume(node, name, [(app, False)])
    assert node.apply()["rc"] == 0
    (app / "precious").write_bytes(b"x" * 10000)
    before = checksum_tree(app)
    # Mapped only, and adopted: nothing records that we formatted it.
    node.write(name, f"  image: {{pool: {node.cluster.pool}}}\n  map: {{mapper: fuse}}\n")
    assert node.apply()["rc"] == 0
    with node.cluster.client() as c, c.open_ioctx(node.cluster.pool) as io, \
            rbd.Image(io, name) as img:
        for k in (meta.FORMATTED, meta.OWNER):
            img.metadata_remove(k)
    kill_helper(node, name)

    rc, plan = node.plan()
    steps = [(s["action"], s["target"]) for s in plan["volumes"][0]["steps"]]
    assert rc == 2 and [a for a, _ in steps] == ["unmap", "map"], plan
    # Now wanted staged again: the device is probed after the new map.
    node.write(name, fs_spec(node.cluster.pool, "64Mi", "ext4", [(app, False)])
               .replace("    size: 64Mi\n", ""))
    doc = node.apply()
    assert doc["rc"] == 0, doc
    fmt = [s for s in doc["volumes"][0]["steps"] if s["action"] == "format"]
    assert all(s["status"] == "ok" for s in fmt), fmt  # found ext4: not formatted
    assert checksum_tree(app) == before
    assert meta.FORMATTING not in image_meta(node, name)


def test_image_with_data_but_no_signature_is_never_formatted(node: NodeUnderTest) -> None:
    name = node.name("raw")
    payload = os.urandom(8192)
    with node.cluster.client() as c, c.open_ioctx(node.cluster.pool) as io:
        rbd.RBD().create(io, name, 64 * 2**20, old_format=False,
                         features=rbd.RBD_FEATURE_LAYERING)
        with rbd.Image(io, name) as img:
            img.write(payload, 4 * 2**20)  # past every signature blkid looks at
    node.write(name, f"  image: {{pool: {node.cluster.pool}}}\n  map: {{mapper: fuse}}\n"
                     f"  stage: {{fsType: ext4}}\n")
    doc = node.apply()
    vol = doc["volumes"][0]
    assert doc["rc"] == 1 and "has data written to it" in vol["error"], doc
    assert vol["undone"], "the half-done stage is undone"
    with node.cluster.client() as c, c.open_ioctx(node.cluster.pool) as io, \
            rbd.Image(io, name, read_only=True) as img:
        assert img.read(4 * 2**20, 8192) == payload
    assert meta.FORMATTING not in image_meta(node, name)


def test_failed_mkfs_that_wrote_nothing_clears_the_marker(
        node: NodeUnderTest, monkeypatch: pytest.MonkeyPatch) -> None:
    from reconciler.drivers.fs import Filesystems

    def failing_mkfs(self: Filesystems, device: str, *_: object, **__: object) -> None:
        raise CommandError(["mkfs.ext4", device], 1, "mkfs.ext4: Input/output error")

    name = node.name("mkfail")
    fs_volume(node, name, [])
    monkeypatch.setattr(Filesystems, "mkfs", failing_mkfs)
    doc = node.apply()
    assert doc["rc"] == 1 and "Input/output error" in doc["volumes"][0]["error"]
    assert meta.FORMATTING not in image_meta(node, name)
    monkeypatch.undo()
    assert node.apply()["rc"] == 0
    assert image_meta(node, name)[meta.FORMATTED] == "ext4"


# --- 2: device-node binds are found by identity, wherever they are -----------------


def block_spec(node: NodeUnderTest, targets: list[Path], staging: Path | None = None,
               state: str = "present", policy: str = "Retain") -> str:
    pub = "".join(f"    - path: {t}\n" for t in targets)
    stage = f"  stage: {{mode: block{f', path: {staging}' if staging else ''}}}\n"
    return (f"  state: {state}\n  image: {{pool: {node.cluster.pool}, size: 16Mi, "
            f"reclaimPolicy: {policy}}}\n  map: {{mapper: fuse}}\n{stage}"
            + (f"  publish:\n{pub}" if targets else ""))


def test_block_binds_are_torn_down_when_no_longer_named(node: NodeUnderTest) -> None:
    name = node.name("blkb")
    a, b = node.srv / "a.dev", node.srv / "b.dev"
    s1, s2 = node.srv / "stage1.dev", node.srv / "stage2.dev"
    node.write(name, block_spec(node, [a, b], s1))
    assert node.apply()["rc"] == 0
    assert {str(a), str(b), str(s1)} <= set(node.mounts())

    # A publish path dropped from the list, and the custom staging path moved.
    node.write(name, block_spec(node, [a], s2))
    doc = node.apply()
    assert doc["rc"] == 0, doc
    assert str(b) not in node.mounts() and str(s1) not in node.mounts()
    assert {str(a), str(s2)} <= set(node.mounts())
    assert node.plan()[0] == 0

    # absent with the stage and publish sections gone: every bind goes.
    node.write(name, f"  state: absent\n  image: {{pool: {node.cluster.pool}, size: 16Mi, "
                     f"reclaimPolicy: Delete}}\n")
    doc = node.apply()
    assert doc["rc"] == 0, doc
    assert not node.mounts()
    assert not node.image_exists(name)


# --- 4: symlinks are never followed ------------------------------------------------


def test_symlink_in_a_publish_path_is_refused(node: NodeUnderTest) -> None:
    outside = node.root / "outside"
    outside.mkdir()
    (outside / "keep").write_text("not yours")
    (node.srv / "link").symlink_to(outside)
    name = node.name("sym")
    fs_volume(node, name, [(node.srv / "link" / "app", False)])
    rc, plan = node.plan()
    assert rc == 1 and "is a symlink" in plan["volumes"][0]["refusal"]
    assert node.apply()["rc"] == 1
    assert not node.mounts()
    assert sorted(p.name for p in outside.iterdir()) == ["keep"]


def test_symlink_swapped_in_after_plan_is_refused_at_apply(node: NodeUnderTest) -> None:
    """The plan is stale by the time apply acts: apply checks again, through descriptors."""
    from reconciler.apply.runner import apply
    from reconciler.engine import plan_pass
    from reconciler.observe.node import Node
    from reconciler.spec.config import load_config

    outside = node.root / "outside"
    outside.mkdir()
    target = node.srv / "blk.dev"
    name = node.name("swap")
    node.write(name, block_spec(node, [target]))
    config = load_config(node.config)
    n = Node.from_config(config)
    p = plan_pass([node.desired], config, n)
    assert p.plans[0].refusal is None
    (outside / "victim").write_text("an existing file")
    target.symlink_to(outside / "victim")
    [out] = apply(p.plans, {v.name: v for v in p.loaded.volumes}, p.observed, n)
    assert out.status == "failed" and "symlink" in (out.error or ""), out
    assert (outside / "victim").read_text() == "an existing file"
    assert not any(m.startswith(str(outside)) for m in node.mounts())
    target.unlink()
    assert node.apply()["rc"] == 0


def test_directories_we_did_not_create_are_kept(node: NodeUnderTest) -> None:
    name = node.name("keepdir")
    app, made = node.srv / "app", node.srv / "made"
    app.mkdir()
    f = fs_volume(node, name, [(app, False), (made, False)])
    assert node.apply()["rc"] == 0
    f.write_text(f.read_text().replace("spec:\n", "spec:\n  state: absent\n"))
    assert node.apply()["rc"] == 0
    assert app.is_dir(), "an operator's directory is never removed"
    assert not made.exists(), "the mount point we made is removed"


# --- 5: only our own mounts are unmounted ------------------------------------------


def test_foreign_mount_on_top_of_a_publish_path_is_left_alone(node: NodeUnderTest) -> None:
    name = node.name("cover")
    app = node.srv / "app"
    f = fs_volume(node, name, [(app, False)])
    assert node.apply()["rc"] == 0
    subprocess.run(["mount", "-t", "tmpfs", "squatter", str(app)], check=True)
    try:
        (app / "theirs").write_text("tmpfs data")
        f.write_text(f.read_text().replace("spec:\n", "spec:\n  state: absent\n"))
        rc, plan = node.plan()
        assert rc == 1 and "tmpfs squatter" in plan["volumes"][0]["refusal"]
        doc = node.apply()
        assert doc["rc"] == 1
        assert (app / "theirs").read_text() == "tmpfs data"
    finally:
        subprocess.run(["umount", str(app)], check=True)
    assert node.apply()["rc"] == 0
    assert not node.mounts()


# --- 13, 14: refused deletes and interrupted creates -------------------------------


def test_refused_delete_still_tears_down(node: NodeUnderTest) -> None:
    name = node.name("notmine")
    app = node.srv / "app"
    f = fs_volume(node, name, [(app, False)], policy="Delete")
    assert node.apply()["rc"] == 0
    with node.cluster.client() as c, c.open_ioctx(node.cluster.pool) as io, \
            rbd.Image(io, name) as img:
        img.metadata_set(meta.OWNER, "another-node")
    f.write_text(f.read_text().replace("spec:\n", "spec:\n  state: absent\n"))
    doc = node.apply()
    vol = doc["volumes"][0]
    assert doc["rc"] == 1 and "owner: another-node" in vol["error"]
    assert [s["action"] for s in vol["steps"]] == ["unpublish", "unstage", "unmap"]
    assert not node.mounts()
    assert node.image_exists(name)


class ProcessDies(BaseException):
    """Stands for the process being killed: nothing in the CLI catches it
    (Ctrl-C, a KeyboardInterrupt, is answered with exit 130)."""


def test_crash_between_create_and_owner_record_is_recovered(
        node: NodeUnderTest, monkeypatch: pytest.MonkeyPatch) -> None:
    name = node.name("orphan")
    f = node.write(name, f"  image: {{pool: {node.cluster.pool}, size: 16Mi, "
                         f"reclaimPolicy: Delete}}\n")

    from reconciler.drivers import ceph

    def create_then_die(cluster, pool, image, size, *_: object) -> None:  # type: ignore[no-untyped-def]
        with cluster.open_ioctx(pool) as io:
            rbd.RBD().create(io, image, size, old_format=False)
        raise ProcessDies  # before the owner record

    monkeypatch.setattr(ceph, "create_image", create_then_die)
    with pytest.raises(ProcessDies):
        node.apply()
    monkeypatch.undo()
    assert node.image_exists(name) and meta.OWNER not in image_meta(node, name)

    rc, plan = node.plan()
    steps = plan["volumes"][0]["steps"]
    assert rc == 2 and [(s["action"], s["target"].split()[-1]) for s in steps] == [
        ("set image-meta", meta.OWNER), ("set image-meta", meta.SPEC_HASH)]
    assert node.apply()["rc"] == 0
    assert image_meta(node, name)[meta.OWNER] == "test-node"
    assert json.loads((node.state / "intents.json").read_text()) == {}
    f.write_text(f.read_text().replace("spec:\n", "spec:\n  state: absent\n"))
    assert node.apply()["rc"] == 0
    assert not node.image_exists(name)


def test_killed_inside_librbd_create_is_recovered(
        node: NodeUnderTest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Killed after librbd wrote the image's id object but before its
    directory entry: the name is taken, yet no listing shows the image. Our
    own recorded attempt is cleared and the create done again."""
    name = node.name("halfmade")
    node.write(name, f"  image: {{pool: {node.cluster.pool}, size: 16Mi}}\n")

    from reconciler.drivers import ceph

    def die_inside_create(cluster, pool, image, *_: object) -> None:  # type: ignore[no-untyped-def]
        with cluster.open_ioctx(pool) as io:  # what librbd's create writes first
            image_id = b"0badc0ffee"
            io.write_full(f"rbd_id.{image}", struct.pack("<I", len(image_id)) + image_id)
        raise ProcessDies

    monkeypatch.setattr(ceph, "create_image", die_inside_create)
    with pytest.raises(ProcessDies):
        node.apply()
    monkeypatch.undo()
    assert not node.image_exists(name)  # not listed, but the name is taken
    with node.cluster.client() as c, c.open_ioctx(node.cluster.pool) as io, \
            pytest.raises(rbd.ImageExists):
        rbd.RBD().create(io, name, 1 << 20)

    assert node.apply()["rc"] == 0
    assert node.image_exists(name)
    assert image_meta(node, name)[meta.OWNER] == "test-node"


def test_killed_right_after_librbd_listed_the_image_is_recovered(
        node: NodeUnderTest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Killed inside librbd's create right after its directory entry (seen
    in CI: a daemon SIGKILLed at its first step under load): the name is
    listed and taken, with no id object and no header, so the image cannot
    be opened and reads as absent. Our own recorded attempt is cleared and
    the create done again (before: 'already exists' at every retry, for ever)."""
    name = node.name("halflisted")
    node.write(name, f"  image: {{pool: {node.cluster.pool}, size: 16Mi}}\n")

    from reconciler.drivers import ceph

    def die_inside_create(cluster, pool, image, *_: object) -> None:  # type: ignore[no-untyped-def]
        with cluster.open_ioctx(pool) as io:
            image_id = b"0badc0ffee"
            io.execute("rbd_directory", "rbd", "dir_add_image",
                       struct.pack("<I", len(image)) + image.encode()
                       + struct.pack("<I", len(image_id)) + image_id)
        raise ProcessDies

    monkeypatch.setattr(ceph, "create_image", die_inside_create)
    with pytest.raises(ProcessDies):
        node.apply()
    monkeypatch.undo()
    with node.cluster.client() as c, c.open_ioctx(node.cluster.pool) as io:
        assert name in rbd.RBD().list(io)  # listed, but no image behind it
        with pytest.raises(rbd.ImageExists):
            rbd.RBD().create(io, name, 1 << 20)

    assert node.apply()["rc"] == 0
    assert image_meta(node, name)[meta.OWNER] == "test-node"
    assert json.loads((node.state / "intents.json").read_text()) == {}


# --- 18: a mapper change ------------------------------------------------------------


def test_mapper_change_is_refused_while_mounted(node: NodeUnderTest) -> None:
    name = node.name("mapper")
    app = node.srv / "app"
    f = fs_volume(node, name, [(app, False)])
    assert node.apply()["rc"] == 0
    f.write_text(f.read_text().replace("mapper: fuse", "mapper: nbd"))
    rc, plan = node.plan()
    assert rc == 1 and "wants nbd" in plan["volumes"][0]["refusal"]
    # Mapped only: the remap is planned, shown as disruptive.
    f.write_text(f"apiVersion: rbd-reconciler/v1\nkind: Volume\nmetadata:\n  name: {name}\n"
                 f"spec:\n  image: {{pool: {node.cluster.pool}}}\n  map: {{mapper: nbd}}\n")
    rc, plan = node.plan()
    steps = plan["volumes"][0]["steps"]
    assert rc == 2
    steps = [s for s in steps if s["action"] != "set image-meta"]  # the spec hash
    assert [s["action"] for s in steps] == ["unpublish", "unstage", "unmap", "map"]
    assert steps[2]["disruptive"] and steps[3]["to"] == "mapped (nbd)"
    f.write_text(f.read_text().replace("mapper: nbd", "mapper: fuse"))


# --- two nodes on one cluster ---------------------------------------------------------


def test_second_node_refuses_an_image_the_first_has_published(
        node: NodeUnderTest, tmp_path: Path) -> None:
    name = node.name("shared")
    app = node.srv / "app"
    fs_volume(node, name, [(app, False)])
    assert node.apply()["rc"] == 0

    other = tmp_path / "node-b"
    desired, state, srv = other / "desired", other / "state", other / "srv"
    for d in (desired, state, srv):
        d.mkdir(parents=True)
    cfg = node.config.read_text().replace(str(node.desired), str(desired)) \
        .replace(str(node.state), str(state)).replace(str(node.srv), str(srv)) \
        .replace("nodeName: test-node", "nodeName: node-b")
    config_b = other / "config.yaml"
    config_b.write_text(cfg)
    (desired / f"{name}.yaml").write_text(
        f"apiVersion: rbd-reconciler/v1\nkind: Volume\nmetadata:\n  name: {name}\nspec:\n"
        + fs_spec(node.cluster.pool, "64Mi", "ext4", [(srv / "app", False)]))
    from reconciler.cli import main as cli

    rc, out = run_cli(cli, config_b, "plan", "-o", "json")
    refusal = json.loads(out)["volumes"][0]["refusal"]
    assert rc == 1 and "open by 1 other client" in refusal and "test-node" in refusal
    assert run_cli(cli, config_b, "apply")[0] == 1
    rc, out = run_cli(cli, config_b, "explain", name)
    assert "mapped by test-node" in out
    assert not any(m.startswith(str(other)) for m in node.mounts())
    (desired / f"{name}.yaml").unlink()
    assert status_of(node, name)["phase"] == "PUBLISHED"


def run_cli(cli, config: Path, *args: str) -> tuple[int, str]:  # type: ignore[no-untyped-def]
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli.main(["--config", str(config), *args])
    return rc, out.getvalue()


def test_crash_after_the_directory_entry_before_the_header_is_recovered(
        node: NodeUnderTest, monkeypatch: pytest.MonkeyPatch) -> None:
    """librbd lists a new image before it writes its header: killed between
    the two, the name is listed but the image cannot be opened (it holds no
    data). Our recorded attempt is cleared away and made again; the same
    remains without our intent are refused, never removed."""
    name = node.name("headless")
    node.write(name, f"  image: {{pool: {node.cluster.pool}, size: 16Mi, "
                     f"reclaimPolicy: Delete}}\n")

    from reconciler.drivers import ceph, rbdbase

    def create_then_die(cluster, pool, image, size, *_: object) -> None:  # type: ignore[no-untyped-def]
        with cluster.open_ioctx(pool) as io:
            rbd.RBD().create(io, image, size, old_format=False)
            io.remove_object(rbdbase.header_oid(io, image))  # as if killed before the header
        raise ProcessDies

    monkeypatch.setattr(ceph, "create_image", create_then_die)
    with pytest.raises(ProcessDies):
        node.apply()
    monkeypatch.undo()
    _, plan = node.plan()
    assert [s["action"] for s in plan["volumes"][0]["steps"]] == ["create image"]
    doc = node.apply()
    assert doc["rc"] == 0, doc
    assert image_meta(node, name)[meta.OWNER] == "test-node"
    assert json.loads((node.state / "intents.json").read_text()) == {}
