"""ControllerModifyVolume and mutable parameters (VolumeAttributesClass) over
the real socket: QoS limits read back from Ceph, changed while in use."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import rbd
from csi_fixture import CsiNode, mount_cap
from test_csi import T, code, delete, error, publish_req, stage_req, unpublish, unstage

from reconciler.csi import csi_pb2 as pb
from reconciler.csi import ids

pytestmark = pytest.mark.ceph
Code = grpc.StatusCode
MiB = 1 << 20


def qos_keys(c: CsiNode, vol: pb.Volume) -> dict[str, str]:
    with c.node.cluster.client() as cl, cl.open_ioctx(c.node.cluster.pool) as io, \
            rbd.Image(io, vol.volume_id.rsplit(":", 1)[1], read_only=True) as img:
        return {k.removeprefix("conf_rbd_qos_"): v for k, v in img.metadata_list()
                if k.startswith("conf_rbd_qos_")}


def modify(c: CsiNode, vid: str, **params: str) -> pb.ControllerModifyVolumeResponse:
    return c.controller.ControllerModifyVolume(pb.ControllerModifyVolumeRequest(
        volume_id=vid, mutable_parameters=params), timeout=T)


def test_modify_volume_qos(start_csi: Callable[..., CsiNode]) -> None:
    c = start_csi()
    caps = {k.rpc.type for k in c.controller.ControllerGetCapabilities(
        pb.ControllerGetCapabilitiesRequest(), timeout=T).capabilities}
    assert pb.ControllerServiceCapability.RPC.MODIFY_VOLUME in caps

    # The conformance suite's error codes.
    assert code(lambda: modify(c, "")) == Code.INVALID_ARGUMENT
    assert code(lambda: modify(c, "non-existing-volume-id")) == Code.NOT_FOUND
    bad = pb.CreateVolumeRequest(name="pvc-bad-vac", volume_capabilities=[mount_cap()],
                                 parameters={"pool": c.node.cluster.pool},
                                 mutable_parameters={"XXX_FakeKey": "XXX_FakeValue"})
    assert code(lambda: c.controller.CreateVolume(bad, timeout=T)) == Code.INVALID_ARGUMENT
    assert not c.files()  # refused before anything was written

    req = pb.CreateVolumeRequest(
        name="pvc-vac", capacity_range=pb.CapacityRange(required_bytes=64 * MiB),
        volume_capabilities=[mount_cap()], parameters={"pool": c.node.cluster.pool},
        mutable_parameters={"qosReadIopsLimit": "2000", "qosWriteBpsLimit": "100Mi"})
    vol = c.controller.CreateVolume(req, timeout=T).volume
    c.node.images.add(vol.volume_id.rsplit(":", 1)[1])
    assert qos_keys(c, vol) == {"read_iops_limit": "2000", "write_bps_limit": str(100 * MiB)}

    for params in ({"XXX_FakeKey": "XXX_FakeValue"}, {"qosReadIopsLimit": "fast"},
                   {"qosReadIopsLimit": "-5"}, {"qosMaxIops": "10"}):
        code_, why = error(lambda p=params: modify(c, vol.volume_id, **p))
        assert code_ == Code.INVALID_ARGUMENT, (params, why)
    assert qos_keys(c, vol) == {"read_iops_limit": "2000", "write_bps_limit": str(100 * MiB)}

    # Staged and published: modified in place, the mount stays.
    staging, target = c.kubelet_paths("pv-vac")
    c.nodes.NodeStageVolume(stage_req(vol, staging), timeout=T)
    c.nodes.NodePublishVolume(publish_req(vol, staging, target), timeout=T)
    (target / "kept").write_text("still here")
    modify(c, vol.volume_id)  # nothing named: nothing changes
    for _ in range(2):  # a retry is the same answer
        modify(c, vol.volume_id, qosReadIopsLimit="0", qosIopsPerGiB="4000",
               qosMaxIops="300")
    # 64 MiB at 4000/GiB is 250 (under the cap); 0 lifted the read limit;
    # the write limit, not named, is as it was.
    assert qos_keys(c, vol) == {"iops_limit": "250", "write_bps_limit": str(100 * MiB)}
    assert (target / "kept").read_text() == "still here"
    assert str(target) in c.node.mounts()

    # ValidateVolumeCapabilities confirms mutable parameters it takes.
    ok = c.controller.ValidateVolumeCapabilities(pb.ValidateVolumeCapabilitiesRequest(
        volume_id=vol.volume_id, volume_capabilities=[mount_cap()],
        mutable_parameters={"qosWriteIopsLimit": "10"}), timeout=T)
    assert dict(ok.confirmed.mutable_parameters) == {"qosWriteIopsLimit": "10"}
    no = c.controller.ValidateVolumeCapabilities(pb.ValidateVolumeCapabilitiesRequest(
        volume_id=vol.volume_id, volume_capabilities=[mount_cap()],
        mutable_parameters={"XXX_FakeKey": "1"}), timeout=T)
    assert not no.HasField("confirmed") and "XXX_FakeKey" in no.message

    unpublish(c, vol, target)
    unstage(c, vol, staging)
    delete(c, vol)
    assert c.stop() == 0


def test_publish_gives_the_pod_cgroup_the_limits_never_blocking(
        start_csi: Callable[..., CsiNode]) -> None:
    """NodePublish finds the pod's cgroup from kubelet's target path and puts
    it on the publish entry (io.max mirrors the image's limits for krbd's
    sake). This host's cgroup v2 has no io controller: the limit is reported
    not set and the pod gets its volume all the same. (The kernel tests set
    io.max on a krbd device for real.)"""
    unified = Path("/sys/fs/cgroup/unified")
    if not (unified / "cgroup.controllers").exists():
        pytest.skip("no cgroup v2 hierarchy at /sys/fs/cgroup/unified")
    c = start_csi()
    uid = str(uuid.uuid4())
    kube = unified / f"kubepods-{c.node.tag}.slice"
    pod = kube / f"kubepods-{c.node.tag}-pod{uid.replace('-', '_')}.slice"
    pod.mkdir(parents=True)
    try:
        req = pb.CreateVolumeRequest(
            name="pvc-pod-qos", capacity_range=pb.CapacityRange(required_bytes=32 * MiB),
            volume_capabilities=[mount_cap()], parameters={"pool": c.node.cluster.pool},
            mutable_parameters={"qosWriteBpsLimit": "8Mi"})
        vol = c.controller.CreateVolume(req, timeout=T).volume
        c.node.images.add(vol.volume_id.rsplit(":", 1)[1])
        staging, _ = c.kubelet_paths("pv-pod-qos")
        target = (c.node.srv / "kubelet" / "pods" / uid / "volumes" / "kubernetes.io~csi"
                  / "pv-pod-qos" / "mount")
        target.parent.mkdir(parents=True)
        c.nodes.NodeStageVolume(stage_req(vol, staging), timeout=T)
        c.nodes.NodePublishVolume(publish_req(vol, staging, target), timeout=T)
        [doc] = c.files().values()
        assert doc["spec"]["publish"] == [{"path": str(target), "readOnly": False,
                                           "ioCgroup": str(pod)}]
        assert str(target) in c.node.mounts()
        name = ids.volume_name(*ids.parse_volume_id(vol.volume_id))  # type: ignore[misc]
        notes = " ".join(c.daemon.status(name).get("notes", []))
        assert f"QoS not set for {pod}" in notes and "no io.max" in notes, notes
        unpublish(c, vol, target)
        unstage(c, vol, staging)
        delete(c, vol)
        assert c.stop() == 0
    finally:
        pod.rmdir()
        kube.rmdir()
