"""The CSI snapshot RPCs over the real socket, each twice, with their error codes;
CreateVolume from a snapshot and from a volume, with checksums."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable

import grpc
import pytest
from csi_fixture import CsiNode, mount_cap
from test_csi import T, code, delete, error, publish_req, stage_req, unpublish, unstage

from reconciler.csi import csi_pb2 as pb
from reconciler.csi import ids

pytestmark = pytest.mark.ceph
Code = grpc.StatusCode
Rpc = pb.ControllerServiceCapability.RPC
MiB = 1 << 20


def snap(c: CsiNode, name: str, vol: pb.Volume) -> pb.Snapshot:
    return c.controller.CreateSnapshot(pb.CreateSnapshotRequest(
        name=name, source_volume_id=vol.volume_id,
        secrets={"userKey": "not-a-real-secret-4711"}), timeout=T).snapshot


def delete_snap(c: CsiNode, sid: str) -> None:
    c.controller.DeleteSnapshot(pb.DeleteSnapshotRequest(snapshot_id=sid), timeout=T)


def listed(c: CsiNode, **kw: object) -> pb.ListSnapshotsResponse:
    return c.controller.ListSnapshots(pb.ListSnapshotsRequest(**kw), timeout=T)  # type: ignore[arg-type]


def from_source(c: CsiNode, name: str, source: pb.VolumeContentSource,
                size: int | None = None) -> pb.Volume:
    req = pb.CreateVolumeRequest(name=name, volume_capabilities=[mount_cap()],
                                 parameters={"pool": c.node.cluster.pool},
                                 volume_content_source=source)
    if size is not None:
        req.capacity_range.required_bytes = size
    vol = c.controller.CreateVolume(req, timeout=T).volume
    c.node.images.add(vol.volume_id.rsplit(":", 1)[1])
    return vol


def snap_source(sid: str) -> pb.VolumeContentSource:
    return pb.VolumeContentSource(snapshot=pb.VolumeContentSource.SnapshotSource(snapshot_id=sid))


def test_snapshot_rpcs_and_error_codes(start_csi: Callable[..., CsiNode]) -> None:
    c = start_csi()
    caps = {cap.rpc.type for cap in c.controller.ControllerGetCapabilities(
        pb.ControllerGetCapabilitiesRequest(), timeout=T).capabilities}
    assert {Rpc.CREATE_DELETE_SNAPSHOT, Rpc.LIST_SNAPSHOTS, Rpc.CLONE_VOLUME,
            Rpc.GET_SNAPSHOT} <= caps

    vol = c.create("pvc-snap-src", size=16 * MiB)
    other = c.create("pvc-snap-other", size=16 * MiB)
    ctl = c.controller
    # Arguments missing or unknown.
    assert code(lambda: ctl.CreateSnapshot(pb.CreateSnapshotRequest(
        source_volume_id=vol.volume_id), timeout=T)) == Code.INVALID_ARGUMENT
    assert code(lambda: ctl.CreateSnapshot(pb.CreateSnapshotRequest(
        name="s"), timeout=T)) == Code.INVALID_ARGUMENT
    gone = ids.volume_id(c.node.cluster.pool, ids.image_for_request("never-created"))
    assert code(lambda: ctl.CreateSnapshot(pb.CreateSnapshotRequest(
        name="s", source_volume_id=gone), timeout=T)) == Code.NOT_FOUND
    assert code(lambda: ctl.DeleteSnapshot(pb.DeleteSnapshotRequest(), timeout=T)) == \
        Code.INVALID_ARGUMENT
    assert code(lambda: ctl.ListSnapshots(pb.ListSnapshotsRequest(max_entries=-1),
                                          timeout=T)) == Code.INVALID_ARGUMENT
    assert code(lambda: listed(c, starting_token="bogus")) == Code.ABORTED

    # Each twice: the second call is the same answer.
    first = [snap(c, f"snap-{i}", vol) for i in range(3)]
    again = [snap(c, f"snap-{i}", vol) for i in range(3)]
    assert [s.snapshot_id for s in first] == [s.snapshot_id for s in again]
    for s in first:
        assert s.ready_to_use and s.size_bytes == 16 * MiB
        assert s.source_volume_id == vol.volume_id and s.creation_time.seconds > 0
        assert ids.parse_snapshot_id(s.snapshot_id) is not None
    code_, why = error(lambda: snap(c, "snap-0", other))
    assert code_ == Code.ALREADY_EXISTS, why
    mine = snap(c, "snap-other", other)

    # GetSnapshot: by id, what CreateSnapshot answered; no id, or one that
    # never was (ours in form or not), is an error.
    got = ctl.GetSnapshot(pb.GetSnapshotRequest(snapshot_id=first[1].snapshot_id),
                          timeout=T).snapshot
    assert got == first[1], (got, first[1])
    assert code(lambda: ctl.GetSnapshot(pb.GetSnapshotRequest(), timeout=T)) == \
        Code.INVALID_ARGUMENT
    for sid in ("none-exist-id", ids.snapshot_id(c.node.cluster.pool, "x",
                                                 ids.snapshot_for_request("no"))):
        assert code(lambda s=sid: ctl.GetSnapshot(pb.GetSnapshotRequest(snapshot_id=s),
                                                  timeout=T)) == Code.NOT_FOUND, sid

    # Listing: all, by id, by source, paged.
    every = {e.snapshot.snapshot_id for e in listed(c).entries}
    assert every == {s.snapshot_id for s in [*first, mine]}
    by_id = listed(c, snapshot_id=first[1].snapshot_id).entries
    assert [e.snapshot.snapshot_id for e in by_id] == [first[1].snapshot_id]
    assert not listed(c, snapshot_id="rbdr1s:nope").entries
    assert not listed(c, snapshot_id=ids.snapshot_id(c.node.cluster.pool, "x",
                                                     ids.snapshot_for_request("no"))).entries
    by_src = {e.snapshot.snapshot_id for e in listed(c, source_volume_id=other.volume_id).entries}
    assert by_src == {mine.snapshot_id}
    pages, token = [], ""
    while True:
        page = listed(c, max_entries=2, starting_token=token)
        assert len(page.entries) <= 2
        pages += [e.snapshot.snapshot_id for e in page.entries]
        token = page.next_token
        if not token:
            break
    assert sorted(pages) == sorted(every) and len(pages) == len(every)

    # A volume with snapshots is not deleted (they would go with its image).
    code_, why = error(lambda: delete(c, vol))
    assert code_ == Code.FAILED_PRECONDITION and "has snapshots" in why, why
    # Delete, twice each; an id we never handed out is fine too.
    for s in [*first, mine]:
        delete_snap(c, s.snapshot_id)
        delete_snap(c, s.snapshot_id)
    delete_snap(c, "not-ours")
    assert not listed(c).entries
    # Restoring from a snapshot that is gone: NOT_FOUND.
    assert code(lambda: from_source(c, "pvc-from-gone", snap_source(first[0].snapshot_id))) == \
        Code.NOT_FOUND
    for v in (vol, other):
        delete(c, v)
    assert not c.files()
    assert c.stop() == 0


def test_restore_and_clone_through_csi(start_csi: Callable[..., CsiNode]) -> None:
    c = start_csi()
    vol = c.create("pvc-golden", size=64 * MiB, fsType="ext4")
    staging, target = c.kubelet_paths("pv-golden")
    c.nodes.NodeStageVolume(stage_req(vol, staging), timeout=T)
    c.nodes.NodePublishVolume(publish_req(vol, staging, target), timeout=T)
    old = os.urandom(1 << 20)
    (target / "blob").write_bytes(old)
    os.sync()
    s = snap(c, "golden-1", vol)  # frozen around it: the blob is in it
    (target / "blob").write_bytes(b"new" * 1000)
    os.sync()

    restored = from_source(c, "pvc-restored", snap_source(s.snapshot_id), size=128 * MiB)
    assert restored.content_source.snapshot.snapshot_id == s.snapshot_id
    again = from_source(c, "pvc-restored", snap_source(s.snapshot_id), size=128 * MiB)
    assert again.volume_id == restored.volume_id
    assert code(lambda: from_source(c, "pvc-small", snap_source(s.snapshot_id),
                                    size=32 * MiB)) == Code.OUT_OF_RANGE
    cloned = from_source(c, "pvc-cloned", pb.VolumeContentSource(
        volume=pb.VolumeContentSource.VolumeSource(volume_id=vol.volume_id)))
    assert cloned.content_source.volume.volume_id == vol.volume_id

    # A clone depends on the snapshot: deleting it is refused, naming the clone,
    # before anything is touched (its file is not even rewritten).
    snap_file = c.csi_dir / f"{ids.parse_snapshot_id(s.snapshot_id)[2]}.yaml"  # type: ignore[index]
    before = (snap_file.stat().st_ino, snap_file.stat().st_mtime_ns, snap_file.read_bytes())
    code_, why = error(lambda: delete_snap(c, s.snapshot_id))
    assert code_ == Code.FAILED_PRECONDITION and "clones depend on it" in why, why
    assert (snap_file.stat().st_ino, snap_file.stat().st_mtime_ns,
            snap_file.read_bytes()) == before

    for name, v, want in (("pv-restored", restored, hashlib.sha256(old).hexdigest()),
                          ("pv-cloned", cloned, hashlib.sha256(b"new" * 1000).hexdigest())):
        st, tg = c.kubelet_paths(name)
        c.nodes.NodeStageVolume(stage_req(v, st), timeout=T)
        c.nodes.NodePublishVolume(publish_req(v, st, tg), timeout=T)
        assert hashlib.sha256((tg / "blob").read_bytes()).hexdigest() == want
        unpublish(c, v, tg)
        unstage(c, v, st)
        delete(c, v)
    delete_snap(c, s.snapshot_id)  # its clone is gone now
    unpublish(c, vol, target)
    unstage(c, vol, staging)
    delete(c, vol)
    assert not c.files()
    assert c.stop() == 0
