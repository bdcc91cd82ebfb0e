"""The CSI adapter over a real gRPC unix socket, on the real cluster."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from csi_fixture import CsiNode, mount_cap

from reconciler.csi import csi_pb2 as pb

pytestmark = pytest.mark.ceph


def test_smoke(start_csi: Callable[..., CsiNode]) -> None:
    c = start_csi()
    info = c.identity.GetPluginInfo(pb.GetPluginInfoRequest(), timeout=10)
    assert info.name == "rbd.test.local"
    vol = c.create("pvc-Smoke")
    staging, target = c.kubelet_paths("pv1")
    c.nodes.NodeStageVolume(pb.NodeStageVolumeRequest(
        volume_id=vol.volume_id, staging_target_path=str(staging),
        volume_capability=mount_cap()), timeout=90)
    c.nodes.NodePublishVolume(pb.NodePublishVolumeRequest(
        volume_id=vol.volume_id, staging_target_path=str(staging), target_path=str(target),
        volume_capability=mount_cap()), timeout=90)
    (target / "x").write_text("hello")
    c.nodes.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(
        volume_id=vol.volume_id, target_path=str(target)), timeout=90)
    c.nodes.NodeUnstageVolume(pb.NodeUnstageVolumeRequest(
        volume_id=vol.volume_id, staging_target_path=str(staging)), timeout=90)
    c.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=vol.volume_id), timeout=90)
    assert not c.files()
    assert c.stop() == 0
