"""CSI secrets never reach a log line, a file or a message (safety rule 6).

Every call whose request carries ``secrets`` is made over the real socket
with a unique marker as a secret's key and value, successful calls and
refused ones alike; then the marker is looked for in the daemon's whole log
(run with -v: every command it ran is logged too), every file under the
node's directories (state dir with its status files, records, CSI volume
files and helper logs; desired dir; config), every answer and error message
the client got, the CLI's status and explain output, and the metadata of
every image the calls made.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import rbd
from csi_fixture import CsiNode, mount_cap
from test_csi import T, publish_req, stage_req

from reconciler.csi import csi_pb2 as pb
from reconciler.csi import csi_pb2_grpc, ids

pytestmark = pytest.mark.ceph
MiB = 1 << 20
BIG = 16 * MiB  # larger files are volume data (published mounts are skipped anyway)


def files_holding(root: Path, marker: bytes) -> list[str]:
    """Every regular file under ``root`` whose bytes hold ``marker``; a
    mount point's contents (a volume's data, an rbd-fuse image) are not ours."""
    found = []
    for top, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if not os.path.ismount(os.path.join(top, d))]
        for n in names:
            path = os.path.join(top, n)
            try:
                if not os.path.isfile(path) or os.path.islink(path) or \
                        os.path.getsize(path) > BIG:
                    continue
                with open(path, "rb") as f:
                    if marker in f.read():
                        found.append(path)
            except OSError:
                continue
    return found


def test_secrets_reach_no_log_file_or_message(start_csi: Callable[..., CsiNode]) -> None:
    marker = f"s3cr3t-{uuid.uuid4().hex}"
    secrets = {"userKey": marker, f"key-{marker}": marker}
    c = start_csi(args=("-v",))
    grp = csi_pb2_grpc.GroupControllerStub(c.channel)
    pool = c.node.cluster.pool
    said: list[str] = []  # every answer and every error message

    def call(rpc: Callable[..., Any], req: Any, ok: bool | None = True) -> Any:
        """``ok``: it must succeed (True), be refused (False), or either (None)."""
        assert req.secrets, req  # the point: each of these carries them
        try:
            resp = rpc(req, timeout=T)
        except grpc.RpcError as exc:
            said.append(f"{exc.code()}: {exc.details()}")
            assert ok is not True, (type(req).__name__, exc.code(), exc.details())
            return None
        said.append(str(resp))
        assert ok is not False, (type(req).__name__, "answered OK, not a refusal")
        return resp

    vol = call(c.controller.CreateVolume, pb.CreateVolumeRequest(
        name="pvc-secrets", capacity_range=pb.CapacityRange(required_bytes=64 * MiB),
        volume_capabilities=[mount_cap(fs_type="ext4")], parameters={"pool": pool},
        secrets=secrets)).volume
    c.node.images.add(vol.volume_id.rsplit(":", 1)[1])
    call(c.controller.ValidateVolumeCapabilities, pb.ValidateVolumeCapabilitiesRequest(
        volume_id=vol.volume_id, volume_capabilities=[mount_cap()], secrets=secrets))
    staging, target = c.kubelet_paths("pv-secrets")
    stage = stage_req(vol, staging)
    stage.secrets.clear()
    stage.secrets.update(secrets)
    call(c.nodes.NodeStageVolume, stage)
    publish = publish_req(vol, staging, target)
    publish.secrets.update(secrets)
    call(c.nodes.NodePublishVolume, publish)
    call(c.controller.ControllerExpandVolume, pb.ControllerExpandVolumeRequest(
        volume_id=vol.volume_id, capacity_range=pb.CapacityRange(required_bytes=96 * MiB),
        volume_capability=mount_cap(), secrets=secrets))
    call(c.nodes.NodeExpandVolume, pb.NodeExpandVolumeRequest(
        volume_id=vol.volume_id, volume_path=str(target), staging_target_path=str(staging),
        capacity_range=pb.CapacityRange(required_bytes=96 * MiB),
        volume_capability=mount_cap(), secrets=secrets), ok=None)  # ext4 may grow offline
    call(c.controller.ControllerModifyVolume, pb.ControllerModifyVolumeRequest(
        volume_id=vol.volume_id, mutable_parameters={"qosReadIopsLimit": "2000"},
        secrets=secrets))

    snap = call(c.controller.CreateSnapshot, pb.CreateSnapshotRequest(
        source_volume_id=vol.volume_id, name="snap-secrets", secrets=secrets)).snapshot
    call(c.controller.GetSnapshot, pb.GetSnapshotRequest(snapshot_id=snap.snapshot_id,
                                                         secrets=secrets))
    call(c.controller.ListSnapshots, pb.ListSnapshotsRequest(
        source_volume_id=vol.volume_id, secrets=secrets))
    call(c.controller.DeleteSnapshot, pb.DeleteSnapshotRequest(snapshot_id=snap.snapshot_id,
                                                               secrets=secrets))
    group = call(grp.CreateVolumeGroupSnapshot, pb.CreateVolumeGroupSnapshotRequest(
        name="group-secrets", source_volume_ids=[vol.volume_id],
        secrets=secrets)).group_snapshot
    call(grp.GetVolumeGroupSnapshot, pb.GetVolumeGroupSnapshotRequest(
        group_snapshot_id=group.group_snapshot_id, secrets=secrets))
    call(grp.DeleteVolumeGroupSnapshot, pb.DeleteVolumeGroupSnapshotRequest(
        group_snapshot_id=group.group_snapshot_id,
        snapshot_ids=[s.snapshot_id for s in group.snapshots], secrets=secrets))

    # Refused calls carrying secrets: their messages and log lines too.
    call(c.controller.CreateVolume, pb.CreateVolumeRequest(
        name="pvc-secrets-bad", volume_capabilities=[mount_cap(fs_type="btrfs")],
        parameters={"pool": pool}, secrets=secrets), ok=False)
    call(c.controller.CreateVolume, pb.CreateVolumeRequest(
        name="pvc-secrets", volume_capabilities=[mount_cap()],
        capacity_range=pb.CapacityRange(required_bytes=128 * MiB),
        parameters={"pool": pool}, secrets=secrets), ok=False)  # ALREADY_EXISTS
    call(c.controller.ControllerModifyVolume, pb.ControllerModifyVolumeRequest(
        volume_id=vol.volume_id, mutable_parameters={"qosReadIopsLimit": "fast"},
        secrets=secrets), ok=False)
    call(c.controller.CreateSnapshot, pb.CreateSnapshotRequest(
        source_volume_id="not-ours", name="snap-secrets-bad", secrets=secrets), ok=False)
    bad_stage = stage_req(vol, Path("relative/staging"))
    bad_stage.secrets.update(secrets)
    call(c.nodes.NodeStageVolume, bad_stage, ok=False)

    name = ids.volume_name(*ids.parse_volume_id(vol.volume_id))  # type: ignore[misc]
    for args in (("status",), ("status", "-o", "json"), ("explain", name)):
        said.append(c.node.cli(*args)[1])
    published = c.node.state / "status" / f"{name}.json"
    assert published.exists(), list((c.node.state / "status").iterdir())
    leaks = files_holding(c.node.root, marker.encode())  # while staged and published

    c.nodes.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(
        volume_id=vol.volume_id, target_path=str(target)), timeout=T)
    c.nodes.NodeUnstageVolume(pb.NodeUnstageVolumeRequest(
        volume_id=vol.volume_id, staging_target_path=str(staging)), timeout=T)
    with c.node.cluster.client() as cl, cl.open_ioctx(pool) as io:
        for image in rbd.RBD().list(io):
            try:  # the pool is shared: another test may delete an image between list and open
                with rbd.Image(io, image, read_only=True) as img:
                    said += [f"{image} {k}={v}" for k, v in img.metadata_list()]
            except rbd.ImageNotFound:
                continue
    call(c.controller.DeleteVolume, pb.DeleteVolumeRequest(volume_id=vol.volume_id,
                                                           secrets=secrets))
    assert c.stop() == 0
    log = c.daemon.log.read_text()
    assert "run: mount" in log  # -v: the commands are in it
    leaks += files_holding(c.node.root, marker.encode())  # and the log, after the stop
    assert not leaks, sorted(set(leaks))
    assert not [s for s in said if marker in s], [s for s in said if marker in s]
    assert marker not in log
