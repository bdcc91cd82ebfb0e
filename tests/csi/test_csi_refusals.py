"""A refused CSI call changes nothing, over the real socket on the real
cluster: request values are quoted briefly."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest
from csi_fixture import CsiNode, mount_cap
from test_csi import T, error

from reconciler.csi import csi_pb2 as pb
from reconciler.csi import csi_pb2_grpc

pytestmark = pytest.mark.ceph
Code = grpc.StatusCode
MiB = 1 << 20


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
