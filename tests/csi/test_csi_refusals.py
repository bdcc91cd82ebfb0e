"""A refused CSI call changes nothing, over the real socket on the real
cluster: what the engine would refuse is refused before the volume's file is
written; what only the engine can refuse puts the file back; a path nested
in another volume's is refused with the other volume untouched (and a file
that claims one anyway freezes alone); request values are quoted briefly."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import rbd
import yaml
from csi_fixture import CsiNode, mount_cap
from test_csi import T, delete, error, publish_req, stage_req, unpublish, unstage
from test_daemon import wait_for

from reconciler.csi import csi_pb2 as pb
from reconciler.csi import csi_pb2_grpc, ids

pytestmark = pytest.mark.ceph
Code = grpc.StatusCode
MiB = 1 << 20


def name_of(vol: pb.Volume | str) -> str:
    vid = vol if isinstance(vol, str) else vol.volume_id
    return ids.volume_name(*ids.parse_volume_id(vid))  # type: ignore[misc]


def identity(c: CsiNode, vol: pb.Volume | str) -> tuple[int, int, bytes] | None:
    """The volume file's inode, mtime and bytes (None: no file): any write shows."""
    path = c.csi_dir / f"{name_of(vol)}.yaml"
    try:
        st = path.stat()
        return st.st_ino, st.st_mtime_ns, path.read_bytes()
    except FileNotFoundError:
        return None


def raw(c: CsiNode, vol: pb.Volume | str) -> bytes | None:
    found = identity(c, vol)
    return None if found is None else found[2]


@contextlib.contextmanager
def foreign_mount(path: Path) -> Iterator[None]:
    """A tmpfs of somebody else's at ``path``, for the duration."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "someone-elses", str(path)],
                   check=True)
    try:
        yield
    finally:
        subprocess.run(["umount", str(path)], check=True)


def test_a_refused_publish_changes_nothing(start_csi: Callable[..., CsiNode]) -> None:
    """Issue 30.1: each target the engine would refuse is refused before the
    file is written; the publish at A and its unpublish go on working."""
    c = start_csi()
    vol = c.create("pvc-Refused-Publish", size=16 * MiB)
    staging, a = c.kubelet_paths("pv-refused-publish")
    c.nodes.NodeStageVolume(stage_req(vol, staging), timeout=T)
    c.nodes.NodePublishVolume(publish_req(vol, staging, a), timeout=T)
    before = identity(c, vol)
    pods = a.parent
    elsewhere = c.node.srv / "elsewhere"
    elsewhere.mkdir()
    (pods / "link").symlink_to(elsewhere)
    (pods / "a-file").write_text("not a directory")
    with foreign_mount(pods / "foreign"):
        for what, target, want, words in (
                ("a foreign mount", pods / "foreign", Code.FAILED_PRECONDITION,
                 "refusing to stack on it"),
                ("through a symlinked directory", pods / "link" / "mount",
                 Code.FAILED_PRECONDITION, "passes through the symlink"),
                ("a symlink", pods / "link", Code.FAILED_PRECONDITION, "is the symlink"),
                ("a 300-byte component", pods / ("n" * 300), Code.INVALID_ARGUMENT,
                 "a name holds at most 255"),
                ("a path of 5000 bytes", pods.joinpath(*["p" * 99] * 50), Code.INVALID_ARGUMENT,
                 "a path holds at most 4095"),
                ("under a regular file", pods / "a-file" / "mount", Code.FAILED_PRECONDITION,
                 "is not a directory")):
            got, msg = error(lambda t=target: c.nodes.NodePublishVolume(  # type: ignore[misc]
                publish_req(vol, staging, t), timeout=T))
            assert got == want and words in msg, (what, got, msg)
            assert len(msg) < 1024, (what, len(msg))
            assert identity(c, vol) == before, what  # not even rewritten
            # The idempotent retry of A answers OK, not the refusal.
            c.nodes.NodePublishVolume(publish_req(vol, staging, a), timeout=T)
        assert c.node.mounts()[str(pods / "foreign")].fs_type == "tmpfs"  # left alone
    assert not any(elsewhere.iterdir())  # nothing made through the symlink
    assert c.daemon.status(name_of(vol))["phase"] == "Published"
    unpublish(c, vol, a)
    assert not a.exists() and str(a) not in c.node.mounts()
    unstage(c, vol, staging)
    delete(c, vol)
    assert not c.files()
    assert "Traceback" not in c.daemon.log.read_text()
    assert c.stop() == 0


def test_a_stage_the_engine_refuses_puts_the_file_back(start_csi: Callable[..., CsiNode]
                                                       ) -> None:
    """Issue 30.1: a refusal only the engine makes (a foreign mount on the
    staging path: which mount is the volume's own is known once it is mapped)
    leaves the file exactly as it was, or no file when there was none."""
    c = start_csi()
    vol = c.create("pvc-Put-Back", size=16 * MiB)
    pool = c.node.cluster.pool
    by_hand = c.node.name("by-hand")  # an image no CreateVolume made: staged by its id
    with c.node.cluster.client() as cl, cl.open_ioctx(pool) as io:
        rbd.RBD().create(io, by_hand, 16 * MiB)
    c.node.images.add(by_hand)
    by_id = ids.volume_id(pool, by_hand)
    staging, _ = c.kubelet_paths("pv-put-back")
    before = raw(c, vol)
    assert before is not None and identity(c, by_id) is None
    with foreign_mount(staging):
        for vid in (vol.volume_id, by_id):
            req = stage_req(vol, staging)
            req.volume_id = vid
            got, msg = error(lambda r=req: c.nodes.NodeStageVolume(r, timeout=T))
            assert got == Code.FAILED_PRECONDITION and "refusing to stack on it" in msg, msg
        assert raw(c, vol) == before  # put back byte for byte
        assert identity(c, by_id) is None  # there was none: there is none
        assert c.node.mounts()[str(staging)].fs_type == "tmpfs"
    # Nothing of the refused stage stays: the engine, woken, takes back any mapping.
    wait_for(lambda: not [m for m in c.node.mounts() if "/fuse/" in m], "the mappings to go")
    # The CO's retry, once the path is free, stages it.
    c.nodes.NodeStageVolume(stage_req(vol, staging), timeout=T)
    assert str(staging) in c.node.mounts()
    unstage(c, vol, staging)
    delete(c, vol)
    assert not c.files()
    assert c.stop() == 0


def _write_by_hand(path: Path, doc: dict) -> None:
    """What a second call racing the adapter's check could commit: atomically."""
    tmp = path.with_name(f".{path.name}.by-hand.tmp")
    tmp.write_text(yaml.safe_dump(doc, sort_keys=False))
    os.replace(tmp, path)


def test_a_path_nested_in_another_volumes_is_refused_before_it_is_written(
        start_csi: Callable[..., CsiNode]) -> None:
    """Issue 30.2: a stage or publish path inside (or around) another CSI
    volume's path is refused with both files as they were; and a file that
    claims one anyway freezes alone, the volume already there still served."""
    c = start_csi()
    outer = c.create("pvc-Outer", size=16 * MiB)
    inner = c.create("pvc-Inner", size=16 * MiB)
    s1, a = c.kubelet_paths("pv-outer")
    s2, _ = c.kubelet_paths("pv-inner")
    c.nodes.NodeStageVolume(stage_req(outer, s1), timeout=T)
    c.nodes.NodePublishVolume(publish_req(outer, s1, a), timeout=T)
    (a / "sub").mkdir()  # kubelet makes a staging dir wherever it is told

    def unchanged() -> tuple[object, object]:
        return identity(c, outer), identity(c, inner)

    before = unchanged()
    got, msg = error(lambda: c.nodes.NodeStageVolume(stage_req(inner, a / "sub"), timeout=T))
    assert got == Code.INVALID_ARGUMENT and "is inside the publish path" in msg, msg
    assert unchanged() == before
    c.nodes.NodeStageVolume(stage_req(inner, s2), timeout=T)
    before = unchanged()
    for target, want, words in (
            (a / "sub", Code.INVALID_ARGUMENT, "is inside the publish path"),
            (s1 / "deeper", Code.INVALID_ARGUMENT, "is inside the staging path"),
            (a.parent, Code.INVALID_ARGUMENT, "contains the publish path"),
            # Equal to a path in use: its mount is seen first.
            (s1, Code.FAILED_PRECONDITION, "already has a mount of something else")):
        got, msg = error(lambda t=target: c.nodes.NodePublishVolume(  # type: ignore[misc]
            publish_req(inner, s2, t), timeout=T))
        assert got == want and words in msg, (target, got, msg)
        assert name_of(outer) in msg or target == s1, msg
        assert unchanged() == before, target
    assert c.daemon.status(name_of(outer))["phase"] == "Published"
    assert c.daemon.status(name_of(inner))["phase"] == "Staged"

    # Two calls at once on two volumes could still commit a clash (each checks
    # before the other writes): the file that brings it is frozen, alone.
    path = c.csi_dir / f"{name_of(inner)}.yaml"
    doc = yaml.safe_load(path.read_bytes())
    doc["spec"]["publish"] = [{"path": str(a / "sub"), "readOnly": False}]
    _write_by_hand(path, doc)
    # A call on the volume already there waits for a pass that loads both
    # files: it is served, not frozen.
    c.nodes.NodePublishVolume(publish_req(outer, s1, a), timeout=T)
    assert c.daemon.status(name_of(outer))["phase"] == "Published"
    c.daemon.wait_phase(name_of(inner), "Frozen")
    assert not any((a / "sub").iterdir())  # nothing was mounted inside it
    log = c.daemon.log.read_text()
    assert f"{name_of(inner)}.yaml" in log and "is inside publish path" in log
    unpublish(c, inner, a / "sub")  # the CO's call takes the entry out again
    c.daemon.wait_phase(name_of(inner), "Staged")

    unpublish(c, outer, a)
    unstage(c, outer, s1)
    unstage(c, inner, s2)
    for v in (outer, inner):
        delete(c, v)
    assert not c.files()
    assert c.stop() == 0


def test_a_very_long_id_is_quoted_briefly(start_csi: Callable[..., CsiNode]) -> None:
    """Issue 30.4: a 20,000-byte id (or path, name, token) is quoted as an
    excerpt: NOT_FOUND or INVALID_ARGUMENT with a short message, never
    RESOURCE_EXHAUSTED from a message larger than gRPC's headers hold."""
    c = start_csi()
    grp = csi_pb2_grpc.GroupControllerStub(c.channel)
    pool = c.node.cluster.pool
    long_id = f"rbdr1:{pool}:" + "x" * 20_000
    long_snap = f"rbdr1s:{pool}:" + "y" * 20_000
    long_path = "/" + "/".join(["z" * 200] * 100)
    staging, target = c.kubelet_paths("pv-long")
    cap = mount_cap()
    rng = pb.CapacityRange(required_bytes=MiB)
    calls: dict[str, Callable[[], object]] = {
        "NodeStageVolume": lambda: c.nodes.NodeStageVolume(pb.NodeStageVolumeRequest(
            volume_id=long_id, staging_target_path=str(staging), volume_capability=cap),
            timeout=T),
        "NodeStageVolume, long path": lambda: c.nodes.NodeStageVolume(
            pb.NodeStageVolumeRequest(volume_id=long_id, staging_target_path=long_path,
                                      volume_capability=cap), timeout=T),
        "NodePublishVolume": lambda: c.nodes.NodePublishVolume(pb.NodePublishVolumeRequest(
            volume_id=long_id, staging_target_path=str(staging), target_path=str(target),
            volume_capability=cap), timeout=T),
        "NodePublishVolume, long path": lambda: c.nodes.NodePublishVolume(
            pb.NodePublishVolumeRequest(volume_id=long_id, staging_target_path=str(staging),
                                        target_path=long_path, volume_capability=cap),
            timeout=T),
        "NodeGetVolumeStats": lambda: c.nodes.NodeGetVolumeStats(pb.NodeGetVolumeStatsRequest(
            volume_id=long_id, volume_path=str(target)), timeout=T),
        "NodeExpandVolume": lambda: c.nodes.NodeExpandVolume(pb.NodeExpandVolumeRequest(
            volume_id=long_id, volume_path=str(target)), timeout=T),
        "ControllerExpandVolume": lambda: c.controller.ControllerExpandVolume(
            pb.ControllerExpandVolumeRequest(volume_id=long_id, capacity_range=rng), timeout=T),
        "ControllerModifyVolume": lambda: c.controller.ControllerModifyVolume(
            pb.ControllerModifyVolumeRequest(volume_id=long_id), timeout=T),
        "ValidateVolumeCapabilities": lambda: c.controller.ValidateVolumeCapabilities(
            pb.ValidateVolumeCapabilitiesRequest(volume_id=long_id, volume_capabilities=[cap]),
            timeout=T),
        "CreateVolume, long name": lambda: c.controller.CreateVolume(pb.CreateVolumeRequest(
            name="n" * 20_000, volume_capabilities=[cap], parameters={"pool": pool}), timeout=T),
        "CreateVolume, long pool": lambda: c.controller.CreateVolume(pb.CreateVolumeRequest(
            name="pvc-long-pool", volume_capabilities=[cap], parameters={"pool": "p" * 20_000}),
            timeout=T),
        "CreateVolume, long parameter": lambda: c.controller.CreateVolume(
            pb.CreateVolumeRequest(name="pvc-long-key", volume_capabilities=[cap],
                                   parameters={"pool": pool, "k" * 20_000: "v"}), timeout=T),
        "CreateVolume from it": lambda: c.controller.CreateVolume(pb.CreateVolumeRequest(
            name="pvc-from-long", volume_capabilities=[cap], parameters={"pool": pool},
            volume_content_source=pb.VolumeContentSource(
                volume=pb.VolumeContentSource.VolumeSource(volume_id=long_id))), timeout=T),
        "CreateVolume from a long snapshot id": lambda: c.controller.CreateVolume(
            pb.CreateVolumeRequest(name="pvc-from-long-snap", volume_capabilities=[cap],
                                   parameters={"pool": pool},
                                   volume_content_source=pb.VolumeContentSource(
                                       snapshot=pb.VolumeContentSource.SnapshotSource(
                                           snapshot_id=long_snap))), timeout=T),
        "CreateSnapshot": lambda: c.controller.CreateSnapshot(pb.CreateSnapshotRequest(
            name="snap-of-long", source_volume_id=long_id), timeout=T),
        "GetSnapshot": lambda: c.controller.GetSnapshot(pb.GetSnapshotRequest(
            snapshot_id=long_snap), timeout=T),
        "ListVolumes, long token": lambda: c.controller.ListVolumes(pb.ListVolumesRequest(
            starting_token="t" * 20_000), timeout=T),
        "CreateVolumeGroupSnapshot": lambda: grp.CreateVolumeGroupSnapshot(
            pb.CreateVolumeGroupSnapshotRequest(name="grp-of-long", source_volume_ids=[long_id]),
            timeout=T),
        "GetVolumeGroupSnapshot": lambda: grp.GetVolumeGroupSnapshot(
            pb.GetVolumeGroupSnapshotRequest(group_snapshot_id="rbdr1g:" + "g" * 20_000),
            timeout=T),
    }
    answered = {what: error(call) for what, call in calls.items()}
    for what, (got, msg) in answered.items():
        assert got in (Code.NOT_FOUND, Code.INVALID_ARGUMENT, Code.ABORTED), (what, got,
                                                                                msg[:300])
        assert len(msg.encode()) < 1024 and "…" in msg, (what, len(msg), msg[:300])
    assert answered["NodeStageVolume"][0] == Code.NOT_FOUND
    assert answered["NodeGetVolumeStats"][0] == Code.NOT_FOUND
    assert answered["ControllerExpandVolume"][0] == Code.NOT_FOUND
    assert answered["NodePublishVolume, long path"][0] == Code.INVALID_ARGUMENT
    assert not c.files()
    assert "Traceback" not in c.daemon.log.read_text()
    assert c.stop() == 0


def flags_cap(*flags: str) -> pb.VolumeCapability:
    return pb.VolumeCapability(mount=pb.VolumeCapability.MountVolume(fs_type="ext4",
                                                                     mount_flags=list(flags)),
                               access_mode=pb.VolumeCapability.AccessMode(
                                   mode=pb.VolumeCapability.AccessMode.SINGLE_NODE_WRITER))


def test_mount_flags_are_allow_listed(start_csi: Callable[..., CsiNode]) -> None:
    """Issue 25.2: a capability's mount flags meet the allow-list of a file's
    mountOptions: a refused flag is INVALID_ARGUMENT naming it, and changes
    nothing; what is allowed mounts with nosuid,nodev as well."""
    c = start_csi()
    vol = c.create("pvc-Mount-Flags", size=16 * MiB)
    staging, target = c.kubelet_paths("pv-mount-flags")
    before = identity(c, vol)
    for flags, words in ((["errors=panic"], "'errors=panic' is not allowed"),
                         (["noatime,suid"], "'suid' is allowed only at or under"),
                         (["dev"], "mountPrivileges.devRoots"),
                         (["logdev=/dev/vda"], "names another device"),
                         (["noatime", "X-mount.mkdir"], "'X-mount.mkdir'")):
        got, msg = error(lambda f=flags: c.nodes.NodeStageVolume(  # type: ignore[misc]
            stage_req(vol, staging, flags_cap(*f)), timeout=T))
        assert got == Code.INVALID_ARGUMENT and words in msg, (flags, got, msg)
        assert "mount_flags" in msg
        assert identity(c, vol) == before, flags  # not even rewritten
        assert str(staging) not in c.node.mounts()
    c.nodes.NodeStageVolume(stage_req(vol, staging, flags_cap("noatime,noexec")), timeout=T)
    assert {"noatime", "noexec", "nosuid", "nodev"} <= c.node.mounts()[str(staging)].options
    staged = raw(c, vol)
    got, msg = error(lambda: c.nodes.NodePublishVolume(
        publish_req(vol, staging, target, cap=flags_cap("errors=panic")), timeout=T))
    assert got == Code.INVALID_ARGUMENT and "'errors=panic'" in msg, (got, msg)
    assert raw(c, vol) == staged and str(target) not in c.node.mounts()
    c.nodes.NodePublishVolume(publish_req(vol, staging, target,
                                          cap=flags_cap("noatime,noexec")), timeout=T)
    # The bind states the staging mount's per-mount flags again, and its own.
    assert {"noatime", "noexec", "nosuid", "nodev"} <= c.node.mounts()[str(target)].options
    unpublish(c, vol, target)
    unstage(c, vol, staging)
    delete(c, vol)
    assert not c.files()
    assert "Traceback" not in c.daemon.log.read_text()
    assert c.stop() == 0


def test_a_degraded_volume_is_not_answered_ok(start_csi: Callable[..., CsiNode]) -> None:
    """A stage or publish that was made but cannot be used as asked (its
    filesystem read-only, its publish covered by someone else's mount) is
    not OK: FAILED_PRECONDITION naming why, the file kept as it is (no undo
    and redo at each retry), OK again once it is put right. The way down
    (unpublish, unstage) is not held up by it."""
    c = start_csi()
    vol = c.create("pvc-Degraded", size=16 * MiB)
    name = name_of(vol)
    staging, target = c.kubelet_paths("pv-degraded")
    c.nodes.NodeStageVolume(stage_req(vol, staging), timeout=T)
    c.nodes.NodePublishVolume(publish_req(vol, staging, target), timeout=T)

    # Someone mounts over the pod's target: the publish is shadowed.
    with foreign_mount(target):
        c.daemon.wait_phase(name, "Degraded")
        before = identity(c, vol)
        got, details = error(lambda: c.nodes.NodePublishVolume(
            publish_req(vol, staging, target), timeout=T))
        assert got == Code.FAILED_PRECONDITION and "Shadowed" in details, (got, details)
        assert identity(c, vol) == before
    c.daemon.wait_phase(name, "Published")
    c.nodes.NodePublishVolume(publish_req(vol, staging, target), timeout=T)

    # The filesystem turns read-only under a stage that wants it read-write.
    subprocess.run(["mount", "-o", "remount,ro", "--", str(staging)], check=True)
    try:
        c.daemon.wait_phase(name, "Degraded")
        assert c.daemon.status(name)["reason"] == "FilesystemReadOnly"
        before = identity(c, vol)
        got, details = error(lambda: c.nodes.NodeStageVolume(stage_req(vol, staging), timeout=T))
        assert got == Code.FAILED_PRECONDITION and "read-only" in details, (got, details)
        assert identity(c, vol) == before
        # A new publish is made, and said not usable; its file keeps it.
        other = target.parent.parent.parent / "pod-2" / "volumes" / "mount"
        other.parent.mkdir(parents=True)
        got, details = error(lambda: c.nodes.NodePublishVolume(
            publish_req(vol, staging, other), timeout=T))
        assert got == Code.FAILED_PRECONDITION and "read-only" in details, (got, details)
        assert [p["path"] for p in c.files()[name]["spec"]["publish"]] == [str(target), str(other)]
        # The way down is not held up.
        unpublish(c, vol, other)
        assert [p["path"] for p in c.files()[name]["spec"]["publish"]] == [str(target)]
    finally:
        subprocess.run(["mount", "-o", "remount,rw", "--", str(staging)], check=True)
    c.daemon.wait_phase(name, "Published")
    c.nodes.NodeStageVolume(stage_req(vol, staging), timeout=T)
    unpublish(c, vol, target)
    unstage(c, vol, staging)
    delete(c, vol)
