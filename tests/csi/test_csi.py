"""The CSI adapter over a real gRPC unix socket, on the real cluster: every
RPC, the error-code table, kubelet's sequences, concurrency, refusals and a
daemon killed mid-way."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import stat
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import rbd
from conftest import NodeUnderTest
from csi_fixture import CsiNode, block_cap, mount_cap
from test_daemon import wait_for

from reconciler.csi import csi_pb2 as pb
from reconciler.csi import ids

pytestmark = pytest.mark.ceph
Mode = pb.VolumeCapability.AccessMode
Code = grpc.StatusCode
MiB = 1 << 20
T = 90  # gRPC deadline of each call


def code(call: Callable[[], object]) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return]
    return Code.OK


def error(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code(), exc.details()  # type: ignore[return-value]
    return Code.OK, ""


def stage_req(vol: pb.Volume, staging: Path, cap: pb.VolumeCapability | None = None
              ) -> pb.NodeStageVolumeRequest:
    return pb.NodeStageVolumeRequest(volume_id=vol.volume_id, staging_target_path=str(staging),
                                     volume_capability=cap or mount_cap(),
                                     volume_context=vol.volume_context,
                                     secrets={"userKey": "not-a-real-secret-4711"})


def publish_req(vol: pb.Volume, staging: Path, target: Path, read_only: bool = False,
                cap: pb.VolumeCapability | None = None) -> pb.NodePublishVolumeRequest:
    return pb.NodePublishVolumeRequest(volume_id=vol.volume_id, staging_target_path=str(staging),
                                       target_path=str(target), readonly=read_only,
                                       volume_capability=cap or mount_cap())


def unpublish(c: CsiNode, vol: pb.Volume, target: Path) -> None:
    c.nodes.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(
        volume_id=vol.volume_id, target_path=str(target)), timeout=T)


def unstage(c: CsiNode, vol: pb.Volume, staging: Path) -> None:
    c.nodes.NodeUnstageVolume(pb.NodeUnstageVolumeRequest(
        volume_id=vol.volume_id, staging_target_path=str(staging)), timeout=T)


def delete(c: CsiNode, vol: pb.Volume) -> None:
    c.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=vol.volume_id), timeout=T)


def unknown_id(c: CsiNode) -> str:
    return ids.volume_id(c.node.cluster.pool, ids.image_for_request("never-created"))


def assert_empty_dir(path: Path) -> None:
    """After unstage: kubelet's staging dir stays (kubelet made it), empty."""
    assert path.is_dir() and not any(path.iterdir()), list(path.iterdir())


def sha(path: Path, size: int | None = None) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read(size) if size else f.read()).hexdigest()


# --- Identity and the node's and controller's descriptions -------------------------------

def test_identity_capabilities_and_socket(start_csi: Callable[..., CsiNode]) -> None:
    c = start_csi()
    assert stat.S_IMODE(c.socket.stat().st_mode) == 0o600
    info = c.identity.GetPluginInfo(pb.GetPluginInfoRequest(), timeout=T)
    assert info.name == "rbd.test.local" and info.vendor_version
    caps = c.identity.GetPluginCapabilities(pb.GetPluginCapabilitiesRequest(), timeout=T)
    kinds = {cap.WhichOneof("type") for cap in caps.capabilities}
    assert kinds == {"service", "volume_expansion"}
    wait_for(lambda: c.identity.Probe(pb.ProbeRequest(), timeout=T).ready.value, "Probe ready")

    ctrl = c.controller.ControllerGetCapabilities(pb.ControllerGetCapabilitiesRequest(),
                                                  timeout=T)
    rpc = pb.ControllerServiceCapability.RPC
    assert {x.rpc.type for x in ctrl.capabilities} == {
        rpc.CREATE_DELETE_VOLUME, rpc.EXPAND_VOLUME, rpc.LIST_VOLUMES, rpc.GET_CAPACITY,
        rpc.CREATE_DELETE_SNAPSHOT, rpc.LIST_SNAPSHOTS, rpc.CLONE_VOLUME, rpc.GET_SNAPSHOT,
        rpc.SINGLE_NODE_MULTI_WRITER, rpc.MODIFY_VOLUME}
    node = c.nodes.NodeGetCapabilities(pb.NodeGetCapabilitiesRequest(), timeout=T)
    nrpc = pb.NodeServiceCapability.RPC
    assert {x.rpc.type for x in node.capabilities} == {
        nrpc.STAGE_UNSTAGE_VOLUME, nrpc.GET_VOLUME_STATS, nrpc.EXPAND_VOLUME,
        nrpc.VOLUME_CONDITION, nrpc.SINGLE_NODE_MULTI_WRITER}
    assert c.nodes.NodeGetInfo(pb.NodeGetInfoRequest(), timeout=T).node_id == "test-node"
    # A newer CO's fields we do not know (here field 111) are carried, not rejected.
    raw = c.channel.unary_unary("/csi.v1.Identity/GetPluginInfo",
                                response_deserializer=pb.GetPluginInfoResponse.FromString)
    assert raw(b"\xf8\x06\x01", timeout=T).name == "rbd.test.local"

    # Ceph's usage figures come from ceph-mgr, which the test cluster does not
    # run: the answer is 0 here, and a pool that does not exist is an error.
    cap = c.controller.GetCapacity(pb.GetCapacityRequest(
        parameters={"pool": c.node.cluster.pool}), timeout=T)
    assert cap.available_capacity >= 0
    assert c.controller.GetCapacity(pb.GetCapacityRequest(), timeout=T).available_capacity >= 0
    assert code(lambda: c.controller.GetCapacity(pb.GetCapacityRequest(
        parameters={"pool": "no-such-pool"}), timeout=T)) == Code.INVALID_ARGUMENT
    assert c.stop() == 0
    assert not c.socket.exists()  # removed on SIGTERM


# --- the error-code table ---------------------------------------------------------------

def test_error_codes(start_csi: Callable[..., CsiNode]) -> None:
    c = start_csi()
    ctl, node, pool = c.controller, c.nodes, c.node.cluster.pool
    caps = [mount_cap()]
    staging, target = c.kubelet_paths("errors")
    cv = pb.CreateVolumeRequest
    table: list[tuple[str, Callable[[], object], grpc.StatusCode]] = [
        ("create: no name", lambda: ctl.CreateVolume(cv(volume_capabilities=caps,
                                                         parameters={"pool": pool}), timeout=T),
         Code.INVALID_ARGUMENT),
        ("create: no capabilities", lambda: ctl.CreateVolume(cv(name="x", parameters={
            "pool": pool}), timeout=T), Code.INVALID_ARGUMENT),
        ("create: no access mode", lambda: ctl.CreateVolume(cv(name="x", parameters={
            "pool": pool}, volume_capabilities=[pb.VolumeCapability(
                mount=pb.VolumeCapability.MountVolume())]), timeout=T), Code.INVALID_ARGUMENT),
        ("create: multi-node writer", lambda: ctl.CreateVolume(cv(
            name="x", parameters={"pool": pool},
            volume_capabilities=[mount_cap(Mode.MULTI_NODE_MULTI_WRITER)]), timeout=T),
         Code.INVALID_ARGUMENT),
        ("create: unknown parameter", lambda: ctl.CreateVolume(cv(
            name="x", volume_capabilities=caps, parameters={"pool": pool, "colour": "red"}),
            timeout=T), Code.INVALID_ARGUMENT),
        ("create: no pool", lambda: ctl.CreateVolume(cv(name="x", volume_capabilities=caps),
                                                      timeout=T), Code.INVALID_ARGUMENT),
        ("create: unsupported fs", lambda: ctl.CreateVolume(cv(
            name="x", volume_capabilities=[mount_cap(fs_type="btrfs")],
            parameters={"pool": pool}), timeout=T), Code.INVALID_ARGUMENT),
        ("create: limit below 1 MiB", lambda: ctl.CreateVolume(cv(
            name="x", volume_capabilities=caps, parameters={"pool": pool},
            capacity_range=pb.CapacityRange(limit_bytes=1000)), timeout=T), Code.OUT_OF_RANGE),
        ("create: limit not a MiB multiple", lambda: ctl.CreateVolume(cv(
            name="x", volume_capabilities=caps, parameters={"pool": pool},
            capacity_range=pb.CapacityRange(required_bytes=MiB + 1, limit_bytes=MiB + 2)),
            timeout=T), Code.OUT_OF_RANGE),
        ("create: from an unknown snapshot", lambda: ctl.CreateVolume(cv(
            name="x", volume_capabilities=caps, parameters={"pool": pool},
            volume_content_source=pb.VolumeContentSource(
                snapshot=pb.VolumeContentSource.SnapshotSource(snapshot_id="s"))), timeout=T),
         Code.NOT_FOUND),
        ("create: from an unknown volume", lambda: ctl.CreateVolume(cv(
            name="x", volume_capabilities=caps, parameters={"pool": pool},
            volume_content_source=pb.VolumeContentSource(
                volume=pb.VolumeContentSource.VolumeSource(volume_id="v"))), timeout=T),
         Code.NOT_FOUND),
        ("delete: no id", lambda: ctl.DeleteVolume(pb.DeleteVolumeRequest(), timeout=T),
         Code.INVALID_ARGUMENT),
        ("delete: malformed id", lambda: ctl.DeleteVolume(pb.DeleteVolumeRequest(
            volume_id="no-such-volume"), timeout=T), Code.OK),
        ("delete: unknown id", lambda: ctl.DeleteVolume(pb.DeleteVolumeRequest(
            volume_id=unknown_id(c)), timeout=T), Code.OK),
        ("validate: no id", lambda: ctl.ValidateVolumeCapabilities(
            pb.ValidateVolumeCapabilitiesRequest(volume_capabilities=caps), timeout=T),
         Code.INVALID_ARGUMENT),
        ("validate: unknown id", lambda: ctl.ValidateVolumeCapabilities(
            pb.ValidateVolumeCapabilitiesRequest(volume_id=unknown_id(c),
                                                 volume_capabilities=caps), timeout=T),
         Code.NOT_FOUND),
        ("list: bad token", lambda: ctl.ListVolumes(pb.ListVolumesRequest(
            starting_token="invalid-token"), timeout=T), Code.ABORTED),
        ("list: negative max", lambda: ctl.ListVolumes(pb.ListVolumesRequest(
            max_entries=-1), timeout=T), Code.INVALID_ARGUMENT),
        ("expand: no id", lambda: ctl.ControllerExpandVolume(pb.ControllerExpandVolumeRequest(
            capacity_range=pb.CapacityRange(required_bytes=MiB)), timeout=T),
         Code.INVALID_ARGUMENT),
        ("expand: no range", lambda: ctl.ControllerExpandVolume(
            pb.ControllerExpandVolumeRequest(volume_id=unknown_id(c)), timeout=T),
         Code.INVALID_ARGUMENT),
        ("expand: unknown id", lambda: ctl.ControllerExpandVolume(
            pb.ControllerExpandVolumeRequest(volume_id=unknown_id(c), capacity_range=(
                pb.CapacityRange(required_bytes=MiB))), timeout=T), Code.NOT_FOUND),
        ("stage: no id", lambda: node.NodeStageVolume(pb.NodeStageVolumeRequest(
            staging_target_path=str(staging), volume_capability=mount_cap()), timeout=T),
         Code.INVALID_ARGUMENT),
        ("stage: no path", lambda: node.NodeStageVolume(pb.NodeStageVolumeRequest(
            volume_id=unknown_id(c), volume_capability=mount_cap()), timeout=T),
         Code.INVALID_ARGUMENT),
        ("stage: no capability", lambda: node.NodeStageVolume(pb.NodeStageVolumeRequest(
            volume_id=unknown_id(c), staging_target_path=str(staging)), timeout=T),
         Code.INVALID_ARGUMENT),
        ("stage: relative path", lambda: node.NodeStageVolume(pb.NodeStageVolumeRequest(
            volume_id=unknown_id(c), staging_target_path="some/path",
            volume_capability=mount_cap()), timeout=T), Code.INVALID_ARGUMENT),
        ("stage: unknown id", lambda: node.NodeStageVolume(pb.NodeStageVolumeRequest(
            volume_id=unknown_id(c), staging_target_path=str(staging),
            volume_capability=mount_cap()), timeout=T), Code.NOT_FOUND),
        ("stage: malformed id", lambda: node.NodeStageVolume(pb.NodeStageVolumeRequest(
            volume_id="fake-vol-id", staging_target_path=str(staging),
            volume_capability=mount_cap()), timeout=T), Code.NOT_FOUND),
        ("unstage: no id", lambda: node.NodeUnstageVolume(pb.NodeUnstageVolumeRequest(
            staging_target_path=str(staging)), timeout=T), Code.INVALID_ARGUMENT),
        ("unstage: no path", lambda: node.NodeUnstageVolume(pb.NodeUnstageVolumeRequest(
            volume_id=unknown_id(c)), timeout=T), Code.INVALID_ARGUMENT),
        ("unstage: unknown id", lambda: node.NodeUnstageVolume(pb.NodeUnstageVolumeRequest(
            volume_id=unknown_id(c), staging_target_path=str(staging)), timeout=T), Code.OK),
        ("publish: no id", lambda: node.NodePublishVolume(pb.NodePublishVolumeRequest(
            target_path=str(target), staging_target_path=str(staging),
            volume_capability=mount_cap()), timeout=T), Code.INVALID_ARGUMENT),
        ("publish: no target", lambda: node.NodePublishVolume(pb.NodePublishVolumeRequest(
            volume_id=unknown_id(c), staging_target_path=str(staging),
            volume_capability=mount_cap()), timeout=T), Code.INVALID_ARGUMENT),
        ("publish: no capability", lambda: node.NodePublishVolume(pb.NodePublishVolumeRequest(
            volume_id=unknown_id(c), target_path=str(target),
            staging_target_path=str(staging)), timeout=T), Code.INVALID_ARGUMENT),
        ("publish: unknown id", lambda: node.NodePublishVolume(pb.NodePublishVolumeRequest(
            volume_id=unknown_id(c), target_path=str(target), staging_target_path=str(staging),
            volume_capability=mount_cap()), timeout=T), Code.NOT_FOUND),
        ("unpublish: no id", lambda: node.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(
            target_path=str(target)), timeout=T), Code.INVALID_ARGUMENT),
        ("unpublish: no target", lambda: node.NodeUnpublishVolume(
            pb.NodeUnpublishVolumeRequest(volume_id=unknown_id(c)), timeout=T),
         Code.INVALID_ARGUMENT),
        ("unpublish: unknown id", lambda: node.NodeUnpublishVolume(
            pb.NodeUnpublishVolumeRequest(volume_id=unknown_id(c), target_path=str(target)),
            timeout=T), Code.OK),
        ("stats: no id", lambda: node.NodeGetVolumeStats(pb.NodeGetVolumeStatsRequest(
            volume_path="some/path"), timeout=T), Code.INVALID_ARGUMENT),
        ("stats: no path", lambda: node.NodeGetVolumeStats(pb.NodeGetVolumeStatsRequest(
            volume_id=unknown_id(c)), timeout=T), Code.INVALID_ARGUMENT),
        ("stats: unknown id", lambda: node.NodeGetVolumeStats(pb.NodeGetVolumeStatsRequest(
            volume_id=unknown_id(c), volume_path="some/path"), timeout=T), Code.NOT_FOUND),
        ("node expand: no id", lambda: node.NodeExpandVolume(pb.NodeExpandVolumeRequest(
            volume_path=str(target)), timeout=T), Code.INVALID_ARGUMENT),
        ("node expand: unknown id", lambda: node.NodeExpandVolume(pb.NodeExpandVolumeRequest(
            volume_id=unknown_id(c), volume_path="some/path"), timeout=T), Code.NOT_FOUND),
    ]
    got = {what: code(call) for what, call, _ in table}
    assert got == {what: want for what, _, want in table}

    # With a real volume: capacities, idempotency by name, and more codes.
    exact = c.controller.CreateVolume(cv(
        name="Exact-64Mi", volume_capabilities=caps, parameters={"pool": pool},
        capacity_range=pb.CapacityRange(required_bytes=64 * MiB, limit_bytes=64 * MiB)),
        timeout=T).volume
    c.node.images.add(exact.volume_id.rsplit(":", 1)[1])
    assert exact.capacity_bytes == 67108864
    again = c.create("Exact-64Mi")
    assert again.volume_id == exact.volume_id and again.capacity_bytes == 67108864
    assert code(lambda: c.create("Exact-64Mi", size=128 * MiB)) == Code.ALREADY_EXISTS
    odd = c.create("Odd-Size", size=5 * MiB + 1)
    assert odd.capacity_bytes == 6 * MiB
    longest = c.create("L" + "aBc" * 42 + "z")  # 128 characters, mixed case
    assert len(longest.volume_id.encode()) <= 128
    default = c.controller.CreateVolume(cv(name="No-Size", volume_capabilities=caps,
                                           parameters={"pool": pool}), timeout=T).volume
    c.node.images.add(default.volume_id.rsplit(":", 1)[1])
    assert default.capacity_bytes == 1 << 30

    ok = c.controller.ValidateVolumeCapabilities(pb.ValidateVolumeCapabilitiesRequest(
        volume_id=exact.volume_id, volume_capabilities=caps), timeout=T)
    assert list(ok.confirmed.volume_capabilities) == caps
    no = c.controller.ValidateVolumeCapabilities(pb.ValidateVolumeCapabilitiesRequest(
        volume_id=exact.volume_id, volume_capabilities=[mount_cap(Mode.MULTI_NODE_MULTI_WRITER)]),
        timeout=T)
    assert not no.HasField("confirmed") and "not supported" in no.message
    assert code(lambda: ctl.ValidateVolumeCapabilities(pb.ValidateVolumeCapabilitiesRequest(
        volume_id=exact.volume_id), timeout=T)) == Code.INVALID_ARGUMENT
    assert code(lambda: node.NodeGetVolumeStats(pb.NodeGetVolumeStatsRequest(
        volume_id=exact.volume_id, volume_path="some/path"), timeout=T)) == Code.NOT_FOUND
    assert code(lambda: node.NodeExpandVolume(pb.NodeExpandVolumeRequest(
        volume_id=exact.volume_id), timeout=T)) == Code.INVALID_ARGUMENT
    # Not staged yet: publish is refused with a reason, not a guess.
    assert code(lambda: node.NodePublishVolume(publish_req(exact, staging, target),
                                               timeout=T)) == Code.FAILED_PRECONDITION
    # Outside allowedRoots.
    what, msg = error(lambda: node.NodeStageVolume(stage_req(exact, c.node.root / "outside"),
                                                   timeout=T))
    assert what == Code.INVALID_ARGUMENT and "allowed root" in msg

    # ListVolumes: real pagination over what CreateVolume made.
    page = c.controller.ListVolumes(pb.ListVolumesRequest(max_entries=2), timeout=T)
    assert len(page.entries) == 2 and page.next_token
    rest = c.controller.ListVolumes(pb.ListVolumesRequest(starting_token=page.next_token),
                                    timeout=T)
    listed = {e.volume.volume_id for e in [*page.entries, *rest.entries]}
    assert listed == {exact.volume_id, odd.volume_id, longest.volume_id, default.volume_id}
    assert not rest.next_token

    # Expand: exact answer; a filesystem volume needs the node too.
    grown = c.controller.ControllerExpandVolume(pb.ControllerExpandVolumeRequest(
        volume_id=exact.volume_id, capacity_range=pb.CapacityRange(required_bytes=96 * MiB)),
        timeout=T)
    assert grown.capacity_bytes == 96 * MiB and grown.node_expansion_required
    for vol in (exact, odd, longest, default):
        delete(c, vol)
        delete(c, vol)  # idempotent
        assert not c.node.image_exists(vol.volume_id.rsplit(":", 1)[1])
    assert not c.controller.ListVolumes(pb.ListVolumesRequest(), timeout=T).entries
    assert not c.files()
    # Secrets are accepted, never written or logged.
    for p in [*c.node.state.rglob("*"), c.daemon.log]:
        if p.is_file():
            assert b"not-a-real-secret-4711" not in p.read_bytes(), p
    assert c.stop() == 0


# --- kubelet's sequences -------------------------------------------------------------------

def test_kubelet_sequence_filesystem(start_csi: Callable[..., CsiNode]) -> None:
    c = start_csi()
    vol = c.create("pvc-Filesystem-1", size=64 * MiB, fsType="ext4")
    staging, target = c.kubelet_paths("pv-fs")
    ro_target = target.parent / "mount-ro"
    for _ in range(2):  # a CO retries: the second call changes nothing
        c.nodes.NodeStageVolume(stage_req(vol, staging), timeout=T)
    assert str(staging) in c.node.mounts()
    for _ in range(2):
        c.nodes.NodePublishVolume(publish_req(vol, staging, target), timeout=T)
    c.nodes.NodePublishVolume(publish_req(vol, staging, ro_target, read_only=True), timeout=T)
    assert code(lambda: c.nodes.NodePublishVolume(
        publish_req(vol, staging, ro_target, read_only=False), timeout=T)) == \
        Code.ALREADY_EXISTS

    # The CO's name for it is recorded on the image.
    with c.node.cluster.client() as cl, cl.open_ioctx(c.node.cluster.pool) as io, \
            rbd.Image(io, vol.volume_id.rsplit(":", 1)[1], read_only=True) as img:
        assert dict(img.metadata_list())["rbd-reconciler.csi-name"] == "pvc-Filesystem-1"
    # One engine, one view: the CLI shows the CSI volume like any other.
    name = ids.volume_name(*ids.parse_volume_id(vol.volume_id))  # type: ignore[misc]
    rc, out = c.node.cli("status")
    assert rc == 0 and name in out, out

    data = os.urandom(1 << 20)
    (target / "blob").write_bytes(data)
    os.sync()
    assert sha(ro_target / "blob") == hashlib.sha256(data).hexdigest()
    with pytest.raises(OSError):
        (ro_target / "nope").write_text("x")

    stats = c.nodes.NodeGetVolumeStats(pb.NodeGetVolumeStatsRequest(
        volume_id=vol.volume_id, volume_path=str(target)), timeout=T)
    units = {u.unit: u for u in stats.usage}
    assert units[pb.VolumeUsage.BYTES].used >= 1 << 20
    assert 0 < units[pb.VolumeUsage.BYTES].total <= 64 * MiB
    assert units[pb.VolumeUsage.INODES].total > 0
    assert not stats.volume_condition.abnormal

    # The mount gone behind our back: stats say so; the CO's retry of the
    # publish repairs it (a pass on the unchanged file re-binds).
    subprocess.run(["umount", str(target)], check=True)
    stats = c.nodes.NodeGetVolumeStats(pb.NodeGetVolumeStatsRequest(
        volume_id=vol.volume_id, volume_path=str(target)), timeout=T)
    assert stats.volume_condition.abnormal and "nothing is mounted" in \
        stats.volume_condition.message
    c.nodes.NodePublishVolume(publish_req(vol, staging, target), timeout=T)
    assert (target / "blob").read_bytes() == data

    for t in (target, ro_target):
        unpublish(c, vol, t)
        unpublish(c, vol, t)
        assert not t.exists()  # we created it; unpublish removes it
    for _ in range(2):
        unstage(c, vol, staging)
    assert str(staging) not in c.node.mounts()
    assert_empty_dir(staging)
    delete(c, vol)
    assert not c.node.image_exists(vol.volume_id.rsplit(":", 1)[1])
    assert not c.files()
    # The adapter's own removal is deliberate: the mass-removal guard stays quiet.
    assert "vanished in one pass" not in c.daemon.log.read_text()
    assert c.stop() == 0


def test_kubelet_sequence_block(start_csi: Callable[..., CsiNode]) -> None:
    c = start_csi()
    vol = c.create("pvc-Block-1", size=32 * MiB, cap=block_cap())
    staging, target = c.kubelet_paths("pv-block")
    target = target.parent / "dev-file"  # kubelet's block target: a file we create
    ro_target = target.parent / "dev-file-ro"
    for _ in range(2):
        c.nodes.NodeStageVolume(stage_req(vol, staging, block_cap()), timeout=T)
    for _ in range(2):
        c.nodes.NodePublishVolume(publish_req(vol, staging, target, cap=block_cap()),
                                  timeout=T)
    c.nodes.NodePublishVolume(publish_req(vol, staging, ro_target, read_only=True,
                                          cap=block_cap()), timeout=T)
    assert stat.S_ISBLK(target.stat().st_mode)
    data = os.urandom(4 * MiB)
    fd = os.open(target, os.O_WRONLY)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    subprocess.run(["blockdev", "--flushbufs", str(ro_target)], check=False)
    assert sha(ro_target, len(data)) == hashlib.sha256(data).hexdigest()
    # (A read-only bind of a device node does not stop writes through it: the
    # ro mount flag covers files and directories only. Not asserted here.)

    stats = c.nodes.NodeGetVolumeStats(pb.NodeGetVolumeStatsRequest(
        volume_id=vol.volume_id, volume_path=str(target)), timeout=T)
    assert stats.usage[0].total == 32 * MiB and not stats.volume_condition.abnormal

    for t in (target, ro_target):
        unpublish(c, vol, t)
        unpublish(c, vol, t)
        assert not t.exists()
    unstage(c, vol, staging)
    unstage(c, vol, staging)
    assert_empty_dir(staging)
    delete(c, vol)
    assert not c.files()
    assert c.stop() == 0


# --- concurrency, refusals, timeouts, restarts -------------------------------------------

def test_concurrent_calls_on_one_volume(start_csi: Callable[..., CsiNode]) -> None:
    c = start_csi()
    vol = c.create("pvc-Busy", size=320 * MiB, fsType="xfs")
    staging, _ = c.kubelet_paths("pv-busy")
    results: list[grpc.StatusCode] = []
    first = threading.Thread(target=lambda: results.append(code(
        lambda: c.nodes.NodeStageVolume(stage_req(vol, staging), timeout=T))))
    first.start()
    name = ids.volume_name(*ids.parse_volume_id(vol.volume_id))  # type: ignore[misc]
    wait_for(lambda: "stage" in c.files().get(name, {}).get("spec", {}), "the first call's edit")
    second, msg = error(lambda: c.nodes.NodeStageVolume(stage_req(vol, staging), timeout=T))
    # Another volume is not held up meanwhile.
    other = c.create("pvc-Not-Busy")
    first.join()
    assert results == [Code.OK]
    assert second == Code.ABORTED and "in progress" in msg
    unstage(c, vol, staging)
    delete(c, vol)
    delete(c, other)
    assert c.stop() == 0


def test_foreign_signature_is_a_failed_precondition(start_csi: Callable[..., CsiNode],
                                                    tmp_path: Path) -> None:
    c = start_csi()
    vol = c.create("pvc-Foreign", size=16 * MiB)
    swap = tmp_path / "swap.img"
    with open(swap, "wb") as f:
        f.truncate(MiB)
    subprocess.run(["mkswap", str(swap)], check=True, capture_output=True)
    image = vol.volume_id.rsplit(":", 1)[1]
    with c.node.cluster.client() as cl, cl.open_ioctx(c.node.cluster.pool) as io, \
            rbd.Image(io, image) as img:
        img.write(swap.read_bytes()[:8192], 0)
    staging, _ = c.kubelet_paths("pv-foreign")
    what, msg = error(lambda: c.nodes.NodeStageVolume(stage_req(vol, staging), timeout=T))
    assert what == Code.FAILED_PRECONDITION, msg
    assert "swap" in msg and "refus" in msg
    assert str(staging) not in c.node.mounts()
    unstage(c, vol, staging)
    delete(c, vol)
    assert c.stop() == 0


def test_deadline_exceeded_keeps_the_work_going(start_csi: Callable[..., CsiNode]) -> None:
    c = start_csi(config="  timeoutSeconds: 0.2\n")
    staging, _ = c.kubelet_paths("pv-slow")
    what, msg = error(lambda: c.create("pvc-Slow", size=320 * MiB, fsType="xfs"))
    assert what in (Code.OK, Code.DEADLINE_EXCEEDED), msg  # 200 ms may just do for a create
    # Each retry answers as soon as the engine has the result: in time or not.
    vol = wait_for(lambda: _try_create(c), "the retried CreateVolume")
    what, msg = error(lambda: c.nodes.NodeStageVolume(stage_req(vol, staging), timeout=T))
    # 200 ms cannot map, format and mount 320 MiB of xfs; but a waiting
    # thread that gets the CPU back late (a loaded machine) finds the work
    # done and answers OK, which is right too.
    assert what == Code.OK or (what == Code.DEADLINE_EXCEEDED and "its file stays" in msg), msg
    wait_for(lambda: str(staging) in c.node.mounts(), "the stage to finish anyway")
    wait_for(lambda: code(lambda: c.nodes.NodeStageVolume(stage_req(vol, staging), timeout=T))
             == Code.OK, "the retry to succeed")
    wait_for(lambda: code(lambda: unstage(c, vol, staging)) == Code.OK, "unstage")
    wait_for(lambda: str(staging) not in c.node.mounts(), "the unstage to finish")
    wait_for(lambda: code(lambda: delete(c, vol)) == Code.OK, "delete")
    assert c.stop() == 0


def _try_create(c: CsiNode) -> pb.Volume | None:
    with contextlib.suppress(grpc.RpcError):
        return c.create("pvc-Slow", size=320 * MiB, fsType="xfs")
    return None


def test_daemon_killed_between_stage_and_publish(start_csi: Callable[..., CsiNode]) -> None:
    c = start_csi()
    vol = c.create("pvc-Restart", size=64 * MiB)
    staging, target = c.kubelet_paths("pv-restart")
    c.nodes.NodeStageVolume(stage_req(vol, staging), timeout=T)
    c.stop(signal.SIGKILL)
    assert c.socket.exists()  # stale: the next daemon replaces it
    c2 = start_csi()
    c2.nodes.NodeStageVolume(stage_req(vol, staging), timeout=T)  # the CO's retry
    c2.nodes.NodePublishVolume(publish_req(vol, staging, target), timeout=T)
    (target / "after-restart").write_text("data")
    mounts = c2.node.mounts()
    assert len([m for m in mounts if "/fuse/" in m]) == 1, mounts  # one rbd-fuse, not two
    unpublish(c2, vol, target)
    unstage(c2, vol, staging)
    delete(c2, vol)
    assert not c2.files()
    assert c2.stop() == 0


def test_operator_file_wins_a_collision(start_csi: Callable[..., CsiNode]) -> None:
    c = start_csi()
    image = ids.image_for_request("pvc-Taken")
    c.node.write("operator-owned", f"  image: {{pool: {c.node.cluster.pool}, name: {image}, "
                                   "size: 16Mi}\n")
    what, msg = error(lambda: c.create("pvc-Taken"))
    assert what == Code.ALREADY_EXISTS and "operator" in msg
    assert not c.files()
    assert c.stop() == 0


def test_expand_a_published_xfs_volume_online(start_csi: Callable[..., CsiNode]) -> None:
    c = start_csi()
    vol = c.create("pvc-Grow", size=320 * MiB, fsType="xfs")
    staging, target = c.kubelet_paths("pv-grow")
    c.nodes.NodeStageVolume(stage_req(vol, staging), timeout=T)
    c.nodes.NodePublishVolume(publish_req(vol, staging, target), timeout=T)
    before = os.statvfs(target)
    grown = c.controller.ControllerExpandVolume(pb.ControllerExpandVolumeRequest(
        volume_id=vol.volume_id, capacity_range=pb.CapacityRange(required_bytes=480 * MiB)),
        timeout=T)
    assert grown.capacity_bytes == 480 * MiB and grown.node_expansion_required
    out = c.nodes.NodeExpandVolume(pb.NodeExpandVolumeRequest(
        volume_id=vol.volume_id, volume_path=str(target),
        capacity_range=pb.CapacityRange(required_bytes=480 * MiB)), timeout=T)
    assert out.capacity_bytes == 480 * MiB
    after = os.statvfs(target)
    assert after.f_blocks * after.f_frsize > before.f_blocks * before.f_frsize + 100 * MiB
    unpublish(c, vol, target)
    unstage(c, vol, staging)
    delete(c, vol)
    assert c.stop() == 0


def test_delete_of_an_image_open_elsewhere_is_refused(start_csi: Callable[..., CsiNode]) -> None:
    c = start_csi()
    vol = c.create("pvc-In-Use", size=16 * MiB)
    image = vol.volume_id.rsplit(":", 1)[1]
    with c.node.cluster.client() as cl, cl.open_ioctx(c.node.cluster.pool) as io, \
            rbd.Image(io, image):  # another client holds it open (a watcher)
        before = _file_identity(c, vol)
        what, msg = error(lambda: delete(c, vol))
        assert what == Code.FAILED_PRECONDITION and "open by" in msg, msg
        assert c.node.image_exists(image)
        name = ids.volume_name(*ids.parse_volume_id(vol.volume_id))  # type: ignore[misc]
        assert c.files()[name]["spec"]["state"] == "present"  # kept as it was
        assert _file_identity(c, vol) == before  # not even rewritten
    delete(c, vol)  # the CO's retry, once it is free
    assert not c.node.image_exists(image)
    assert c.stop() == 0


def test_refuses_a_world_writable_csi_dir(start_csi: Callable[..., CsiNode]) -> None:
    c = start_csi()
    assert c.stop() == 0
    c.csi_dir.chmod(0o777)  # anyone could drop a volume file in: not converged
    try:
        d2 = start_csi_daemon_expecting_failure(c)
        assert "writable by group or others" in d2
    finally:
        c.csi_dir.chmod(0o700)


def start_csi_daemon_expecting_failure(c: CsiNode) -> str:
    from test_daemon import Daemon

    d = Daemon(c.node, args=("--csi-endpoint", f"unix://{c.socket}"))
    try:
        assert d.proc.wait(timeout=60) == 1
        return d.log.read_text()
    finally:
        d.stop()


@pytest.mark.parametrize("access", ["mount", "block"])
def test_conformance_style_round(start_csi: Callable[..., CsiNode], access: str) -> None:
    """The external suite's shape: it mkdirs a staging and a target dir for each
    test (failing if they exist), publishes at <target>/target, cleans up with
    unpublish, unstage and delete, then rmdirs both dirs (failing if not empty)."""
    c = start_csi()
    cap = block_cap() if access == "block" else mount_cap()
    staging, target_dir = c.node.srv / "csi-staging", c.node.srv / "csi-mount"
    for round_ in range(2):
        staging.mkdir()
        target_dir.mkdir()
        vol = c.create(f"sanity-node-full-{access}-{round_}", cap=cap)
        assert c.controller.ControllerExpandVolume(pb.ControllerExpandVolumeRequest(
            volume_id=vol.volume_id, capacity_range=pb.CapacityRange(required_bytes=96 * MiB)),
            timeout=T).capacity_bytes == 96 * MiB
        target = target_dir / "target"
        for _ in range(2):
            c.nodes.NodeStageVolume(stage_req(vol, staging, cap), timeout=T)
        for _ in range(2):
            c.nodes.NodePublishVolume(publish_req(vol, staging, target, cap=cap), timeout=T)
        stats = c.nodes.NodeGetVolumeStats(pb.NodeGetVolumeStatsRequest(
            volume_id=vol.volume_id, volume_path=str(target)), timeout=T)
        assert stats.usage
        c.nodes.NodeExpandVolume(pb.NodeExpandVolumeRequest(
            volume_id=vol.volume_id, volume_path=str(target),
            capacity_range=pb.CapacityRange(required_bytes=96 * MiB)), timeout=T)
        unpublish(c, vol, target)
        assert not target.exists()
        unstage(c, vol, staging)
        delete(c, vol)
        target_dir.rmdir()
        staging.rmdir()
    assert c.stop() == 0


def test_a_pool_that_does_not_answer_is_unavailable(
        node: NodeUnderTest, start_csi: Callable[..., CsiNode], dead_pool: str) -> None:
    """Unknown is not absent (and not a timeout): the CO hears UNAVAILABLE and retries."""
    from test_daemon import set_observe_timeout

    set_observe_timeout(node, 1)
    c = start_csi()
    what, msg = error(lambda: c.create("pvc-Dead", pool=dead_pool))
    assert what == Code.UNAVAILABLE and "cannot observe" in msg, (what, msg)
    assert c.stop() == 0
    for f in c.csi_dir.glob("*.yaml"):  # its pool goes with the fixture
        f.unlink()


# --- a controller call never tears down node-side state --------------------------------

def _file_identity(c: CsiNode, vol: pb.Volume) -> tuple[int, int, bytes]:
    """The volume file's inode, mtime and bytes: any edit (even one put back) shows."""
    name = ids.volume_name(*ids.parse_volume_id(vol.volume_id))  # type: ignore[misc]
    path = c.csi_dir / f"{name}.yaml"
    st = path.stat()
    return st.st_ino, st.st_mtime_ns, path.read_bytes()


def test_delete_of_a_staged_and_published_volume_is_refused(
        start_csi: Callable[..., CsiNode]) -> None:
    c = start_csi()
    vol = c.create("pvc-Still-Mounted", size=64 * MiB)
    image = vol.volume_id.rsplit(":", 1)[1]
    staging, target = c.kubelet_paths("pv-still-mounted")
    c.nodes.NodeStageVolume(stage_req(vol, staging), timeout=T)
    c.nodes.NodePublishVolume(publish_req(vol, staging, target), timeout=T)
    data = os.urandom(1 << 20)
    (target / "blob").write_bytes(data)
    os.sync()
    before = _file_identity(c, vol)

    what, msg = error(lambda: delete(c, vol))
    assert what == Code.FAILED_PRECONDITION and "published at" in msg and str(target) in msg, msg
    # Nothing changed: the file (not even rewritten), both mounts, the data, the image.
    assert _file_identity(c, vol) == before
    mounts = c.node.mounts()
    assert str(staging) in mounts and str(target) in mounts
    assert (target / "blob").read_bytes() == data
    assert c.node.image_exists(image)

    unpublish(c, vol, target)
    before = _file_identity(c, vol)
    what, msg = error(lambda: delete(c, vol))  # still staged: still refused
    assert what == Code.FAILED_PRECONDITION and f"staged at {staging}" in msg, msg
    assert _file_identity(c, vol) == before and str(staging) in c.node.mounts()
    assert c.node.image_exists(image)

    # A delete racing a stage: one operation per volume, so either it waits
    # its turn (ABORTED) or it sees the stage; never does it undo it.
    unstage(c, vol, staging)
    staging2, _ = c.kubelet_paths("pv-still-mounted-2")
    results: list[grpc.StatusCode] = []
    name = ids.volume_name(*ids.parse_volume_id(vol.volume_id))  # type: ignore[misc]
    stager = threading.Thread(target=lambda: results.append(code(
        lambda: c.nodes.NodeStageVolume(stage_req(vol, staging2), timeout=T))))
    stager.start()
    wait_for(lambda: "stage" in c.files().get(name, {}).get("spec", {}), "the stage's edit")
    raced = code(lambda: delete(c, vol))
    stager.join()
    assert results == [Code.OK]
    assert raced in (Code.ABORTED, Code.FAILED_PRECONDITION), raced
    assert str(staging2) in c.node.mounts() and c.node.image_exists(image)

    unstage(c, vol, staging2)
    delete(c, vol)  # the CO's retry once the node let go
    assert not c.node.image_exists(image)
    assert not c.files()
    assert c.stop() == 0


# --- CreateVolume's answers --------------------------------------------------------------

def test_create_answers_already_exists_and_out_of_range(
        start_csi: Callable[..., CsiNode]) -> None:
    c = start_csi()
    pool = c.node.cluster.pool
    vol = c.create("pvc-Answers", size=320 * MiB)
    assert c.create("pvc-Answers", size=320 * MiB).volume_id == vol.volume_id  # idempotent
    before = c.files()
    for what, call in (
            ("block instead of mount", lambda: c.create("pvc-Answers", size=320 * MiB,
                                                        cap=block_cap())),
            ("another fsType", lambda: c.create("pvc-Answers", size=320 * MiB, fsType="xfs")),
            ("another mapper", lambda: c.create("pvc-Answers", size=320 * MiB, mapper="krbd")),
            ("other features", lambda: c.create("pvc-Answers", size=320 * MiB,
                                                imageFeatures="layering")),
            ("larger", lambda: c.create("pvc-Answers", size=480 * MiB))):
        got, msg = error(call)
        assert got == Code.ALREADY_EXISTS and "already exists" in msg, (what, got, msg)
    assert c.files() == before

    huge = (1 << 63) - 1
    cv = pb.CreateVolumeRequest
    for params in ({"pool": pool}, {"pool": pool, "imageFeatures": "layering"}):
        for required in (huge, (1 << 63) - MiB + 1):
            got, msg = error(lambda p=params, r=required: c.controller.CreateVolume(cv(
                name="pvc-Huge", volume_capabilities=[mount_cap()], parameters=p,
                capacity_range=pb.CapacityRange(required_bytes=r)), timeout=T))
            assert got == Code.OUT_OF_RANGE and "more than a volume" in msg, (params, got, msg)
    # With object-map (the default) the object map's limit is the largest.
    got, msg = error(lambda: c.controller.CreateVolume(cv(
        name="pvc-Huge", volume_capabilities=[mount_cap()], parameters={"pool": pool},
        capacity_range=pb.CapacityRange(required_bytes=256_000_000 * 4 * MiB + 1)), timeout=T))
    assert got == Code.OUT_OF_RANGE and "object map" in msg, msg
    assert code(lambda: c.controller.CreateVolume(cv(
        name="pvc-Huge", volume_capabilities=[mount_cap()], parameters={"pool": pool},
        capacity_range=pb.CapacityRange(required_bytes=2 * MiB, limit_bytes=MiB)),
        timeout=T)) == Code.INVALID_ARGUMENT
    # Nothing was created for any of them, and no traceback in the log.
    assert c.files() == before
    assert not c.node.image_exists(ids.image_for_request("pvc-Huge"))
    assert "Traceback" not in c.daemon.log.read_text()

    # Expansion is held to the same limits, and the volume stays as it was.
    small = c.create("pvc-Small-Layering", size=320 * MiB, imageFeatures="layering")
    for v in (vol, small):
        got, msg = error(lambda v=v: c.controller.ControllerExpandVolume(
            pb.ControllerExpandVolumeRequest(volume_id=v.volume_id, capacity_range=(
                pb.CapacityRange(required_bytes=huge))), timeout=T))
        assert got == Code.OUT_OF_RANGE, (got, msg)
        with c.node.cluster.client() as cl, cl.open_ioctx(pool) as io, \
                rbd.Image(io, v.volume_id.rsplit(":", 1)[1], read_only=True) as img:
            assert img.size() == 320 * MiB
    # Already larger than the limit: never shrunk, and not an OK either.
    got, msg = error(lambda: c.controller.ControllerExpandVolume(
        pb.ControllerExpandVolumeRequest(volume_id=vol.volume_id, capacity_range=(
            pb.CapacityRange(required_bytes=16 * MiB, limit_bytes=32 * MiB))), timeout=T))
    assert got == Code.OUT_OF_RANGE and "never shrink" in msg, (got, msg)
    assert "Traceback" not in c.daemon.log.read_text()
    for v in (vol, small):
        delete(c, v)
    assert not c.files()
    assert c.stop() == 0


def test_single_node_writer_modes(start_csi: Callable[..., CsiNode]) -> None:
    """SINGLE_NODE_MULTI_WRITER: several publishes on this node, all writable;
    SINGLE_NODE_SINGLE_WRITER: a second target path is refused (csi-sanity's
    "already mounted at a different target path")."""
    c = start_csi()
    node_caps = {k.rpc.type for k in c.nodes.NodeGetCapabilities(
        pb.NodeGetCapabilitiesRequest(), timeout=T).capabilities}
    ctl_caps = {k.rpc.type for k in c.controller.ControllerGetCapabilities(
        pb.ControllerGetCapabilitiesRequest(), timeout=T).capabilities}
    assert pb.NodeServiceCapability.RPC.SINGLE_NODE_MULTI_WRITER in node_caps
    assert pb.ControllerServiceCapability.RPC.SINGLE_NODE_MULTI_WRITER in ctl_caps
    single, multi = mount_cap(Mode.SINGLE_NODE_SINGLE_WRITER), mount_cap(
        Mode.SINGLE_NODE_MULTI_WRITER)
    vol = c.create("pvc-snmw", size=16 * MiB, cap=multi)
    staging, first = c.kubelet_paths("pv-snmw")
    second, third = first.parent / "second", first.parent / "third"
    c.nodes.NodeStageVolume(stage_req(vol, staging, multi), timeout=T)
    c.nodes.NodePublishVolume(publish_req(vol, staging, first, cap=single), timeout=T)
    code_, why = error(lambda: c.nodes.NodePublishVolume(
        publish_req(vol, staging, second, cap=single), timeout=T))
    assert code_ == Code.FAILED_PRECONDITION and "SINGLE_NODE_SINGLE_WRITER" in why, why
    assert not second.exists()
    # The same target again is the idempotent retry, not a second writer.
    c.nodes.NodePublishVolume(publish_req(vol, staging, first, cap=single), timeout=T)
    for t in (second, third):
        c.nodes.NodePublishVolume(publish_req(vol, staging, t, cap=multi), timeout=T)
    (second / "a").write_text("from second")
    assert (third / "a").read_text() == "from second"  # one filesystem, three writers
    for t in (first, second, third):
        unpublish(c, vol, t)
    unstage(c, vol, staging)
    delete(c, vol)
    assert c.stop() == 0
