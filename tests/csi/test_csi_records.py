"""The controller records as a transaction (csi.statePool), on the real
cluster with two controller processes: a deleted volume never comes back,
an acknowledged change is never lost, a leftover file never acts, a broken
record concerns its own name only and is never read as absent."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable

import grpc
import pytest
import rados
import rbd
from conftest import NodeUnderTest
from csi_fixture import CsiNode, block_cap
from test_csi import T, error
from test_csi_controller_state import create_until_done, drop_records, records

from reconciler.csi import csi_pb2 as pb
from reconciler.csi import csi_pb2_grpc, ids
from reconciler.csi.records import OBJECT, PREFIX

pytestmark = pytest.mark.ceph
Code = grpc.StatusCode
MiB = 1 << 20
RETRY_FOR_S = 120.0
QUIET_S = 4.0  # how long a deleted image is watched for coming back


def state(node: NodeUnderTest) -> str:
    return f"  statePool: {node.cluster.pool}\n"


def until_ok(call: Callable[[], object]) -> object:
    """A CO's retries: ABORTED (another replica holds the record) and
    DEADLINE_EXCEEDED are asked again, up to a deadline."""
    end = time.monotonic() + RETRY_FOR_S
    while True:
        try:
            return call()
        except grpc.RpcError as exc:
            if exc.code() not in (Code.ABORTED, Code.DEADLINE_EXCEEDED) or \
                    time.monotonic() > end:
                raise
        time.sleep(0.05)  # the CO's backoff, not a synchronisation


def expand(c: CsiNode, vid: str, size: int, timeout: float = T) -> object:
    return c.controller.ControllerExpandVolume(pb.ControllerExpandVolumeRequest(
        volume_id=vid, capacity_range=pb.CapacityRange(required_bytes=size)), timeout=timeout)


def delete(c: CsiNode, vid: str) -> object:
    return c.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=vid), timeout=T)


def modify(c: CsiNode, vid: str, timeout: float = T, **params: str) -> object:
    return c.controller.ControllerModifyVolume(pb.ControllerModifyVolumeRequest(
        volume_id=vid, mutable_parameters=params), timeout=timeout)


def image_meta(node: NodeUnderTest, image: str) -> dict[str, str]:
    with node.cluster.client() as cl, cl.open_ioctx(node.cluster.pool) as io, \
            rbd.Image(io, image, read_only=True) as img:
        return dict(img.metadata_list())


def image_size(node: NodeUnderTest, image: str) -> int:
    with node.cluster.client() as cl, cl.open_ioctx(node.cluster.pool) as io, \
            rbd.Image(io, image, read_only=True) as img:
        return int(img.size())


def stays_gone(node: NodeUnderTest, image: str) -> bool:
    """Watch a deleted image for QUIET_S: False as soon as it is back."""
    end = time.monotonic() + QUIET_S
    while time.monotonic() < end:
        if node.image_exists(image):
            return False
        time.sleep(0.05)
    return True


def wait_for(what: str, cond: Callable[[], bool], limit: float = 60.0) -> None:
    end = time.monotonic() + limit
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"gave up after {limit} s waiting for {what}")
        time.sleep(0.05)


def raw_record(node: NodeUnderTest, name: str, value: bytes) -> None:
    with node.cluster.client() as cl, cl.open_ioctx(node.cluster.pool) as io, \
            rados.WriteOpCtx() as op:
        io.set_omap(op, (PREFIX + name,), (value,))
        io.operate_write_op(op, OBJECT)


def both(a: Callable[[], object], b: Callable[[], object]) -> list[object]:
    """Two calls released at once; each answer, or the exception it raised."""
    out: list[object] = [None, None]
    gate = threading.Barrier(2)

    def run(i: int, fn: Callable[[], object]) -> None:
        gate.wait()
        try:
            out[i] = fn()
        except BaseException as exc:  # compared by the caller
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate((a, b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(RETRY_FOR_S + 30)
    return out


def made(c: CsiNode, node: NodeUnderTest, request: str) -> tuple[pb.Volume, str, str]:
    """CreateVolume as a CO sends it (retried while ABORTED): the volume, its
    image (removed by the fixture if a test fails) and its file's name."""
    vol = create_until_done(c, request)
    image = vol.volume_id.rsplit(":", 1)[1]
    node.images.add(image)
    return vol, image, ids.volume_name(*ids.parse_volume_id(vol.volume_id))


def test_delete_racing_expand_never_brings_the_image_back(
        start_csi: Callable[..., CsiNode], replica_b: Callable[..., CsiNode],
        node: NodeUnderTest) -> None:
    drop_records(node)
    a, b = start_csi(state(node)), replica_b(state(node))
    for trial in range(4):
        vol, image, _ = made(a, node, f"pvc-race-del-{trial}")
        got = both(lambda v=vol: expand(a, v.volume_id, 48 * MiB),
                   lambda v=vol: until_ok(lambda: delete(b, v.volume_id)))
        # The expand may answer OK (before the delete), NOT_FOUND (after it)
        # or ABORTED; the delete must finish.
        assert not isinstance(got[1], BaseException), got
        if isinstance(got[0], grpc.RpcError):
            assert got[0].code() in (Code.NOT_FOUND, Code.ABORTED, Code.FAILED_PRECONDITION), \
                got[0]
        assert stays_gone(node, image), f"trial {trial}: the deleted image came back ({got})"
        assert ids.volume_name(*ids.parse_volume_id(vol.volume_id)) not in records(node)
        for c in (a, b):
            listed = c.controller.ListVolumes(pb.ListVolumesRequest(), timeout=T).entries
            assert vol.volume_id not in {e.volume.volume_id for e in listed}
    wait_for("no CSI file left on either replica", lambda: a.files() == {} == b.files())
    assert a.stop() == 0 and b.stop() == 0
    drop_records(node)


def test_expand_and_modify_at_once_lose_nothing(
        start_csi: Callable[..., CsiNode], replica_b: Callable[..., CsiNode],
        node: NodeUnderTest) -> None:
    drop_records(node)
    a, b = start_csi(state(node)), replica_b(state(node))
    for trial in range(3):
        vol, image, name = made(a, node, f"pvc-lost-update-{trial}")
        size = (32 + trial) * MiB
        got = both(lambda v=vol, s=size: until_ok(lambda: expand(a, v.volume_id, s)),
                   lambda v=vol: until_ok(lambda: modify(b, v.volume_id,
                                                         qosIopsLimit="100")))
        assert not any(isinstance(g, BaseException) for g in got), got
        rec = records(node)[name]
        assert rec["doc"]["spec"]["image"]["size"] == size, rec
        assert rec["doc"]["spec"].get("qos") == {"iops": 100}, rec
        assert image_size(node, image) == size
        assert image_meta(node, image).get("conf_rbd_qos_iops_limit") == "100"
        # The next change keeps both acknowledged ones.
        until_ok(lambda v=vol: modify(a, v.volume_id, qosWriteBpsLimit="1Mi"))
        meta = image_meta(node, image)
        assert meta.get("conf_rbd_qos_iops_limit") == "100", meta
        assert meta.get("conf_rbd_qos_write_bps_limit") == str(MiB), meta
        until_ok(lambda v=vol: delete(b, v.volume_id))
    assert a.stop() == 0 and b.stop() == 0
    drop_records(node)


def test_a_leftover_file_never_acts(start_csi: Callable[..., CsiNode],
                                    replica_b: Callable[..., CsiNode],
                                    node: NodeUnderTest) -> None:
    """A's expand is cut off (its file stays), A is killed; the CO's retry
    and then the delete go to B. A restarted on the same state dir must not
    create the image again from its file; nor may a live A whose file was
    left by a DEADLINE_EXCEEDED."""
    drop_records(node)
    a, b = start_csi(state(node)), replica_b(state(node))
    vol, image, name = made(a, node, "pvc-leftover")

    # Cut off at once (the server keeps 0.25 s of the caller's deadline):
    # the file is written, the call answers DEADLINE_EXCEEDED, the file stays.
    code_, _ = error(lambda: expand(a, vol.volume_id, 64 * MiB, timeout=0.2))
    assert code_ == Code.DEADLINE_EXCEEDED
    # Under load the server may run the call after the client gave up on it.
    wait_for("A's cut-off expand to leave its file", lambda: name in a.files())
    a.stop(signal.SIGKILL)
    # B waits while A's lease stands (ABORTED); A restarted on its state dir
    # lets its predecessor's lease go; its file of that revision never acts.
    a = start_csi()
    until_ok(lambda: expand(b, vol.volume_id, 64 * MiB))
    until_ok(lambda: delete(b, vol.volume_id))
    assert not node.image_exists(image) and name not in records(node)
    a.daemon.proc.send_signal(signal.SIGHUP)  # a pass over every file
    assert stays_gone(node, image), "a restarted replica re-created a deleted image"
    wait_for("A's leftover file to be dropped", lambda: name not in a.files())

    # A live replica: A's call is cut off by its deadline, its file stays
    # (its engine grows the image), and then B grows and deletes it.
    vol, image, name = made(b, node, "pvc-leftover-live")
    code_, _ = error(lambda: expand(a, vol.volume_id, 64 * MiB, timeout=0.2))
    assert code_ == Code.DEADLINE_EXCEEDED
    until_ok(lambda: expand(b, vol.volume_id, 96 * MiB))
    until_ok(lambda: delete(b, vol.volume_id))
    a.daemon.proc.send_signal(signal.SIGHUP)  # a pass over every file
    assert stays_gone(node, image), "a replica's leftover file re-created a deleted image"
    wait_for("A's leftover file to be dropped", lambda: name not in a.files())
    assert a.stop() == 0 and b.stop() == 0
    drop_records(node)


def test_the_next_call_builds_on_a_cut_off_one(start_csi: Callable[..., CsiNode],
                                               node: NodeUnderTest) -> None:
    """A's call is cut off (its file goes on converging under its lease), and
    the CO's next call goes to A again. That call builds on the cut-off one,
    not on the record's document from before it. Found by the history test:
    a QoS removal answered OK was made untrue 0.2 s later, when the cut-off
    call's limit converged; and an expand cut off before a modify was lost."""
    drop_records(node)
    a = start_csi(state(node))
    vol, image, name = made(a, node, "pvc-after-cut-off")

    def settled() -> bool:  # the last call recorded, no lease left
        rec = records(node).get(name)
        return rec is not None and rec["state"] == "created" and "op" not in rec

    # Cut off at once (the server keeps 0.25 s of the caller's deadline).
    code_, _ = error(lambda: modify(a, vol.volume_id, timeout=0.2, qosIopsLimit="1200"))
    assert code_ == Code.DEADLINE_EXCEEDED
    wait_for("A's cut-off modify to leave its file", lambda: name in a.files())
    until_ok(lambda: modify(a, vol.volume_id, qosIopsLimit="0"))
    assert "conf_rbd_qos_iops_limit" not in image_meta(node, image)
    wait_for("the record to be let go", settled)
    assert "iops" not in (records(node)[name]["doc"]["spec"].get("qos") or {})
    assert "conf_rbd_qos_iops_limit" not in image_meta(node, image), "the removal did not hold"

    code_, _ = error(lambda: expand(a, vol.volume_id, 64 * MiB, timeout=0.2))
    assert code_ == Code.DEADLINE_EXCEEDED
    wait_for("A's cut-off expand to leave its file", lambda: name in a.files())
    until_ok(lambda: modify(a, vol.volume_id, qosWriteBpsLimit="1Mi"))
    wait_for("the record to be let go", settled)
    rec = records(node)[name]
    assert rec["doc"]["spec"]["image"]["size"] == 64 * MiB, rec
    assert rec["doc"]["spec"]["qos"] == {"writeBps": MiB}, rec
    assert image_size(node, image) == 64 * MiB
    assert image_meta(node, image).get("conf_rbd_qos_write_bps_limit") == str(MiB)

    # A CreateVolume retry meanwhile answers with the volume and leaves the
    # cut-off call to finish (it let the file go, and the expand went unrecorded).
    # (With the mutable parameters in force: others are ALREADY_EXISTS.)
    code_, _ = error(lambda: expand(a, vol.volume_id, 96 * MiB, timeout=0.2))
    assert code_ == Code.DEADLINE_EXCEEDED
    wait_for("A's cut-off expand to leave its file", lambda: name in a.files())
    again = create_until_done(a, "pvc-after-cut-off", qosWriteBpsLimit="1Mi")
    assert again.volume_id == vol.volume_id
    # What it answers is done: never the size the cut-off call has not reached.
    assert again.capacity_bytes <= image_size(node, image), again
    wait_for("the record to be let go", settled)
    assert records(node)[name]["doc"]["spec"]["image"]["size"] == 96 * MiB
    assert image_size(node, image) == 96 * MiB
    until_ok(lambda: delete(a, vol.volume_id))
    assert a.stop() == 0
    drop_records(node)


def test_an_ok_is_true_of_ceph_when_nothing_new_is_asked(start_csi: Callable[..., CsiNode],
                                                         node: NodeUnderTest) -> None:
    """A modify that asks for what the record already says still converges it
    before answering OK. Found by the history test: a failed modify left a
    limit half-set in Ceph (librbd refused the second key, EBUSY, and the
    first stayed), and the next modify, which removed that limit, answered OK
    from the record alone, with the limit still in Ceph."""
    drop_records(node)
    a = start_csi(state(node))
    vol, image, name = made(a, node, "pvc-ok-is-true")
    until_ok(lambda: modify(a, vol.volume_id, qosWriteBpsLimit="1Mi"))
    # What a half-failed call leaves (or someone by hand): a limit the
    # record does not have, and another one gone.
    with node.cluster.client() as cl, cl.open_ioctx(node.cluster.pool) as io, \
            rbd.Image(io, image) as img:
        img.metadata_set("conf_rbd_qos_iops_limit", "1146")
        img.metadata_remove("conf_rbd_qos_write_bps_limit")
    until_ok(lambda: modify(a, vol.volume_id, qosIopsLimit="0"))
    meta = image_meta(node, image)
    assert "conf_rbd_qos_iops_limit" not in meta, meta
    assert meta.get("conf_rbd_qos_write_bps_limit") == str(MiB), meta
    rec = records(node)[name]
    assert rec["doc"]["spec"]["qos"] == {"writeBps": MiB} and "op" not in rec, rec
    until_ok(lambda: delete(a, vol.volume_id))
    assert a.stop() == 0
    drop_records(node)


def test_qos_beyond_librbd_changes_nothing(start_csi: Callable[..., CsiNode],
                                           node: NodeUnderTest) -> None:
    drop_records(node)
    c = start_csi(state(node))
    vol = c.create("pvc-qos-range", size=8 << 30)  # thin: nothing is written
    image = vol.volume_id.rsplit(":", 1)[1]
    for params in ({"qosIopsLimit": "100", "qosBpsLimit": str(1 << 63)},
                   {"qosIopsLimit": "100", "qosBpsLimit": "18446744073709551615"},
                   # 2^62 per GiB of an 8 GiB image: 2^65 once scaled.
                   {"qosIopsLimit": "100", "qosBpsPerGiB": str(1 << 62)},
                   {"qosIopsLimit": "１００"}, {"qosIopsLimit": "1_000"},
                   {"qosIopsLimit": " 100"}, {"qosWriteBpsLimit": "1Mi\n"}):
        code_, why = error(lambda p=params: modify(c, vol.volume_id, **p))
        assert code_ == Code.INVALID_ARGUMENT, (params, code_, why)
        assert not any(k.startswith("conf_rbd_qos") for k in image_meta(node, image)), params
        assert c.files() == {}, params
    modify(c, vol.volume_id, qosIopsLimit="100")
    assert image_meta(node, image)["conf_rbd_qos_iops_limit"] == "100"
    delete(c, vol.volume_id)
    assert c.stop() == 0
    drop_records(node)


def test_a_broken_record_is_an_error_for_its_name_only(
        start_csi: Callable[..., CsiNode], node: NodeUnderTest) -> None:
    drop_records(node)
    c = start_csi(state(node))
    vol = create_until_done(c, "pvc-broken-record")
    other = create_until_done(c, "pvc-beside-it")
    image = vol.volume_id.rsplit(":", 1)[1]
    node.images.update({image, other.volume_id.rsplit(":", 1)[1]})
    name = ids.volume_name(*ids.parse_volume_id(vol.volume_id))
    good = json.dumps(records(node)[name]).encode()

    raw_record(node, name, b"{not json")
    for call in (lambda: delete(c, vol.volume_id),
                 lambda: expand(c, vol.volume_id, 64 * MiB),
                 lambda: modify(c, vol.volume_id, qosIopsLimit="10"),
                 lambda: create_until_done(c, "pvc-broken-record")):
        code_, why = error(call)
        assert code_ == Code.FAILED_PRECONDITION, (code_, why)
        assert f"{PREFIX}{name}" in why and "rmomapkey" in why, why
    assert node.image_exists(image)  # never read as absent: not orphaned

    # A record under a snapshot's key with no spec: every other call goes on.
    snap = ids.snapshot_for_request("snap-without-spec")
    raw_record(node, snap, json.dumps({"doc": {"kind": "Snapshot", "metadata": {}},
                                       "state": "created", "by": "x", "at": 1}).encode())
    # A key that is not UTF-8 (issue 26.4; never one of ours): the listing
    # reads past it (the rados binding raised for the whole object before).
    with node.cluster.client() as cl, cl.open_ioctx(node.cluster.pool) as io, \
            rados.WriteOpCtx() as op:
        io.set_omap(op, (PREFIX.encode() + b"\xff\xfe",), (b"{}",))
        io.operate_write_op(op, OBJECT)
    c.controller.ListSnapshots(pb.ListSnapshotsRequest(), timeout=T)
    listed = c.controller.ListVolumes(pb.ListVolumesRequest(), timeout=T).entries
    assert other.volume_id in {e.volume.volume_id for e in listed}
    delete(c, other.volume_id)
    assert not node.image_exists(other.volume_id.rsplit(":", 1)[1])

    raw_record(node, name, good)  # repaired by hand: the volume is served again
    delete(c, vol.volume_id)
    assert not node.image_exists(image)
    assert c.stop() == 0
    drop_records(node)


def remove_record(node: NodeUnderTest, name: str) -> None:
    """What the repair text of an unreadable record says to do."""
    with node.cluster.client() as cl, cl.open_ioctx(node.cluster.pool) as io, \
            rados.WriteOpCtx() as op:
        io.remove_omap_keys(op, (PREFIX + name,))
        io.operate_write_op(op, OBJECT)


def test_the_repair_text_leads_to_a_state_the_next_call_handles(
        start_csi: Callable[..., CsiNode], node: NodeUnderTest) -> None:
    """An unreadable record's repair text says to remove it: the next call on
    the name rebuilds it from what Ceph holds (a volume's QoS and labels kept
    through an expand; a snapshot deleted, not orphaned)."""
    drop_records(node)
    c = start_csi(state(node))
    req = pb.CreateVolumeRequest(
        name="pvc-repaired", capacity_range=pb.CapacityRange(required_bytes=16 * MiB),
        volume_capabilities=[block_cap()], parameters={"pool": node.cluster.pool},
        mutable_parameters={"qosIopsLimit": "300"})
    vol = c.controller.CreateVolume(req, timeout=T).volume
    image = vol.volume_id.rsplit(":", 1)[1]
    node.images.add(image)
    name = ids.volume_name(*ids.parse_volume_id(vol.volume_id))
    snap = c.controller.CreateSnapshot(pb.CreateSnapshotRequest(
        name="snap-repaired", source_volume_id=vol.volume_id), timeout=T).snapshot
    snap_name = ids.parse_snapshot_id(snap.snapshot_id)[2]  # type: ignore[index]

    raw_record(node, name, b"{not json")
    code_, why = error(lambda: expand(c, vol.volume_id, 32 * MiB))
    assert code_ == Code.FAILED_PRECONDITION and "rebuilds the record" in why, why
    remove_record(node, name)
    got = c.controller.ControllerExpandVolume(pb.ControllerExpandVolumeRequest(
        volume_id=vol.volume_id, capacity_range=pb.CapacityRange(required_bytes=32 * MiB)),
        timeout=T)
    assert got.capacity_bytes == 32 * MiB and not got.node_expansion_required  # block, kept
    assert image_size(node, image) == 32 * MiB
    assert image_meta(node, image)["conf_rbd_qos_iops_limit"] == "300"  # kept, not lifted
    rec = records(node)[name]
    assert rec["state"] == "created" and rec["doc"]["spec"]["qos"] == {"iops": 300}, rec

    remove_record(node, snap_name)  # a snapshot's record, removed by hand
    c.controller.DeleteSnapshot(pb.DeleteSnapshotRequest(snapshot_id=snap.snapshot_id),
                                timeout=T)
    with node.cluster.client() as cl, cl.open_ioctx(node.cluster.pool) as io, \
            rbd.Image(io, image, read_only=True) as img:
        assert snap_name not in {s["name"] for s in img.list_snaps()}, "the snapshot was orphaned"

    remove_record(node, name)
    delete(c, vol.volume_id)
    assert not node.image_exists(image), "DeleteVolume answered OK and left the image"
    assert name not in records(node)
    assert c.stop() == 0
    drop_records(node)


def test_overlapping_group_snapshots_refused_before_anything(
        start_csi: Callable[..., CsiNode], node: NodeUnderTest) -> None:
    drop_records(node)
    c = start_csi(state(node))
    grp = csi_pb2_grpc.GroupControllerStub(c.channel)
    v1, v2, v3 = (c.create(f"pvc-overlap-{i}", size=16 * MiB) for i in (1, 2, 3))

    def create(name: str, *vols: pb.Volume) -> pb.VolumeGroupSnapshot:
        return grp.CreateVolumeGroupSnapshot(pb.CreateVolumeGroupSnapshotRequest(
            name=name, source_volume_ids=[v.volume_id for v in vols]), timeout=T).group_snapshot

    gx = create("gx", v1, v2)
    with node.cluster.client() as cl, cl.open_ioctx(node.cluster.pool) as io:
        before = sorted(rbd.RBD().group_list(io))
    for members in ((v1, v3), (v3, v1), (v2,)):
        code_, why = error(lambda m=members: create("gy", *m))
        assert code_ == Code.FAILED_PRECONDITION, (code_, why)
        assert "one group at most" in why and "nothing was changed" in why, why
        with node.cluster.client() as cl, cl.open_ioctx(node.cluster.pool) as io:
            assert sorted(rbd.RBD().group_list(io)) == before  # nothing made
        assert c.files() == {}
    delete(c, v3.volume_id)  # never added to a group: deleted at once
    grp.DeleteVolumeGroupSnapshot(pb.DeleteVolumeGroupSnapshotRequest(
        group_snapshot_id=gx.group_snapshot_id), timeout=T)
    for v in (v1, v2):
        delete(c, v.volume_id)
    assert c.stop() == 0
    drop_records(node)


def test_mutable_parameters_take_the_documented_syntax_only() -> None:
    from reconciler.csi import mutable
    from reconciler.csi.errors import CsiError

    assert mutable.parse({"qosIopsLimit": "100", "qosBpsLimit": "1Mi",
                          "qosReadBpsLimit": "0"}) == {"iops": 100, "bps": MiB,
                                                       "readBps": None}
    for value in ("１００", "1_000", " 100", "100 ", "+100", "1e3", "100\n", "0x10", " 0",
                  str(10**12 + 1)):
        with pytest.raises(CsiError):
            mutable.parse({"qosIopsLimit": value})
    for value in ("1_000Mi", "１Mi", "1Mi\n", str(1 << 63), "9223372036854775808"):
        with pytest.raises(CsiError):
            mutable.parse({"qosBpsLimit": value})
    assert mutable.parse({"qosBpsLimit": str((1 << 63) - 1)}) == {"bps": (1 << 63) - 1}



def test_a_node_stages_by_what_the_record_says(start_csi: Callable[..., CsiNode],
                                               replica_b: Callable[..., CsiNode],
                                               node: NodeUnderTest) -> None:
    """The file is let go once the create is recorded; a stage by id alone
    takes the fs type from the record (not ext4 by default), and an expand
    on the other replica while it is published keeps the node's part."""
    from test_csi import publish_req, stage_req, unpublish, unstage

    drop_records(node)
    a, b = start_csi(state(node)), replica_b(state(node))
    vol = b.create("pvc-by-record", size=320 * MiB, fsType="xfs")
    node.images.add(vol.volume_id.rsplit(":", 1)[1])
    assert a.files() == {} == b.files()
    staging, target = a.kubelet_paths("pv-by-record")
    a.nodes.NodeStageVolume(stage_req(vol, staging), timeout=T)
    a.nodes.NodePublishVolume(publish_req(vol, staging, target), timeout=T)
    assert node.mounts()[str(staging)].fs_type == "xfs"  # type: ignore[attr-defined]
    until_ok(lambda: expand(a, vol.volume_id, 384 * MiB))
    [doc] = a.files().values()
    assert "size" not in doc["spec"]["image"] and "record-rev" not in str(doc)
    assert doc["spec"]["publish"][0]["path"] == str(target)
    (target / "kept").write_text("data")
    unpublish(a, vol, target)
    unstage(a, vol, staging)
    delete(b, vol.volume_id)
    assert a.files() == {} == b.files()
    assert a.stop() == 0 and b.stop() == 0
    drop_records(node)
