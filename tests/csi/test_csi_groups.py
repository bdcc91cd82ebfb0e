"""The CSI GroupController over the real socket, with its error codes; a
volume restored from a group snapshot member, with a checksum."""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable

import grpc
import pytest
import rbd
from csi_fixture import CsiNode
from test_csi import T, code, delete, error, publish_req, stage_req, unpublish, unstage
from test_csi_snapshots import from_source, snap_source

from reconciler.csi import csi_pb2 as pb
from reconciler.csi import csi_pb2_grpc, ids

pytestmark = pytest.mark.ceph
Code = grpc.StatusCode
MiB = 1 << 20


def test_group_snapshot_rpcs_and_restore(start_csi: Callable[..., CsiNode]) -> None:
    c = start_csi()
    grp = csi_pb2_grpc.GroupControllerStub(c.channel)
    kinds = {cap.service.type for cap in c.identity.GetPluginCapabilities(
        pb.GetPluginCapabilitiesRequest(), timeout=T).capabilities if cap.HasField("service")}
    assert pb.PluginCapability.Service.GROUP_CONTROLLER_SERVICE in kinds
    caps = grp.GroupControllerGetCapabilities(pb.GroupControllerGetCapabilitiesRequest(),
                                              timeout=T).capabilities
    assert [x.rpc.type for x in caps] == [
        pb.GroupControllerServiceCapability.RPC.CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT]

    a, b = c.create("pvc-ga", size=32 * MiB), c.create("pvc-gb", size=32 * MiB)
    staging, target = c.kubelet_paths("pv-ga")
    c.nodes.NodeStageVolume(stage_req(a, staging), timeout=T)
    c.nodes.NodePublishVolume(publish_req(a, staging, target), timeout=T)
    old = os.urandom(1 << 20)
    (target / "blob").write_bytes(old)
    os.sync()

    def create(name: str, *vols: pb.Volume) -> pb.VolumeGroupSnapshot:
        return grp.CreateVolumeGroupSnapshot(pb.CreateVolumeGroupSnapshotRequest(
            name=name, source_volume_ids=[v.volume_id for v in vols]), timeout=T).group_snapshot

    # Arguments missing or unknown.
    assert code(lambda: grp.CreateVolumeGroupSnapshot(pb.CreateVolumeGroupSnapshotRequest(
        source_volume_ids=[a.volume_id]), timeout=T)) == Code.INVALID_ARGUMENT
    assert code(lambda: grp.CreateVolumeGroupSnapshot(pb.CreateVolumeGroupSnapshotRequest(
        name="g"), timeout=T)) == Code.INVALID_ARGUMENT
    gone = ids.volume_id(c.node.cluster.pool, ids.image_for_request("never-created"))
    assert code(lambda: grp.CreateVolumeGroupSnapshot(pb.CreateVolumeGroupSnapshotRequest(
        name="g", source_volume_ids=[a.volume_id, gone]), timeout=T)) == Code.NOT_FOUND
    assert code(lambda: grp.GetVolumeGroupSnapshot(pb.GetVolumeGroupSnapshotRequest(),
                                                   timeout=T)) == Code.INVALID_ARGUMENT
    for gid in ("not-ours", ids.group_id(c.node.cluster.pool, ids.group_for_request("no"))):
        assert code(lambda g=gid: grp.GetVolumeGroupSnapshot(pb.GetVolumeGroupSnapshotRequest(
            group_snapshot_id=g), timeout=T)) == Code.NOT_FOUND, gid
    assert code(lambda: grp.DeleteVolumeGroupSnapshot(pb.DeleteVolumeGroupSnapshotRequest(),
                                                      timeout=T)) == Code.INVALID_ARGUMENT
    grp.DeleteVolumeGroupSnapshot(pb.DeleteVolumeGroupSnapshotRequest(
        group_snapshot_id="not-ours"), timeout=T)

    # Twice: the same answer; the same name with other sources: ALREADY_EXISTS.
    first = create("nightly", a, b)
    assert create("nightly", b, a) == first
    assert ids.parse_group_id(first.group_snapshot_id) is not None and first.ready_to_use
    assert sorted(s.source_volume_id for s in first.snapshots) == sorted(
        [a.volume_id, b.volume_id])
    for s in first.snapshots:
        assert s.group_snapshot_id == first.group_snapshot_id and s.ready_to_use
        assert s.size_bytes == 32 * MiB and s.creation_time.seconds > 0
    code_, why = error(lambda: create("nightly", a))
    assert code_ == Code.ALREADY_EXISTS, why
    got = grp.GetVolumeGroupSnapshot(pb.GetVolumeGroupSnapshotRequest(
        group_snapshot_id=first.group_snapshot_id), timeout=T).group_snapshot
    assert got == first
    [sa] = [s for s in first.snapshots if s.source_volume_id == a.volume_id]
    assert c.controller.GetSnapshot(pb.GetSnapshotRequest(snapshot_id=sa.snapshot_id),
                                    timeout=T).snapshot == sa
    # A member is never deleted alone (the spec: INVALID_ARGUMENT); a member
    # volume is not deleted while its group snapshot stands.
    code_, why = error(lambda: c.controller.DeleteSnapshot(pb.DeleteSnapshotRequest(
        snapshot_id=sa.snapshot_id), timeout=T))
    assert code_ == Code.INVALID_ARGUMENT and "group snapshot" in why, why
    code_, why = error(lambda: delete(c, b))
    assert code_ == Code.FAILED_PRECONDITION and "has snapshots" in why, why

    (target / "blob").write_bytes(b"new" * 1000)
    os.sync()
    restored = from_source(c, "pvc-from-member", snap_source(sa.snapshot_id))
    assert restored.content_source.snapshot.snapshot_id == sa.snapshot_id
    assert restored.capacity_bytes == 32 * MiB
    st, tg = c.kubelet_paths("pv-restored")
    c.nodes.NodeStageVolume(stage_req(restored, st), timeout=T)
    c.nodes.NodePublishVolume(publish_req(restored, st, tg), timeout=T)
    assert hashlib.sha256((tg / "blob").read_bytes()).hexdigest() == \
        hashlib.sha256(old).hexdigest()
    unpublish(c, restored, tg)
    unstage(c, restored, st)
    delete(c, restored)

    # Delete: snapshot_ids that do not match are refused; then twice, OK.
    assert code(lambda: grp.DeleteVolumeGroupSnapshot(pb.DeleteVolumeGroupSnapshotRequest(
        group_snapshot_id=first.group_snapshot_id, snapshot_ids=[sa.snapshot_id]),
        timeout=T)) == Code.INVALID_ARGUMENT
    for _ in range(2):
        grp.DeleteVolumeGroupSnapshot(pb.DeleteVolumeGroupSnapshotRequest(
            group_snapshot_id=first.group_snapshot_id,
            snapshot_ids=[s.snapshot_id for s in first.snapshots]), timeout=T)
    assert code(lambda: grp.GetVolumeGroupSnapshot(pb.GetVolumeGroupSnapshotRequest(
        group_snapshot_id=first.group_snapshot_id), timeout=T)) == Code.NOT_FOUND
    with c.node.cluster.client() as cl, cl.open_ioctx(c.node.cluster.pool) as io:
        groups = list(rbd.RBD().group_list(io))
        _pool, name = ids.parse_group_id(first.group_snapshot_id)  # type: ignore[misc]
        with contextlib.suppress(rbd.ObjectNotFound):
            if name in groups:  # leave the pool clean for the node's teardown
                rbd.RBD().group_remove(io, name)
    assert name not in groups
    unpublish(c, a, target)
    unstage(c, a, staging)
    for v in (a, b):
        delete(c, v)
    assert not c.files()
    assert c.stop() == 0
