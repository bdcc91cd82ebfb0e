"""Controller state in Ceph (csi.statePool): two controller processes on one
cluster, sharing one owner name as replicas do, race the same CreateVolume
names; each image is created once, and either replica serves what the other
made (its file rebuilt from the record)."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable

import grpc
import pytest
import rados
from conftest import NodeUnderTest
from csi_fixture import CsiNode, mount_cap
from test_csi import T, error

from reconciler.csi import csi_pb2 as pb
from reconciler.csi import ids
from reconciler.csi.records import OBJECT, PREFIX

pytestmark = pytest.mark.ceph
Code = grpc.StatusCode
MiB = 1 << 20
RETRY_FOR_S = 150.0


def records(node: NodeUnderTest) -> dict[str, dict]:
    """The records that stand: a finished delete's marker (state deleted)
    reads as absent, as the controller reads it."""
    return {k: v for k, v in all_records(node).items() if v.get("state") != "deleted"}


def all_records(node: NodeUnderTest) -> dict[str, dict]:
    with node.cluster.client() as cl, cl.open_ioctx(node.cluster.pool) as io, \
            rados.ReadOpCtx() as op:
        it, _ = io.get_omap_vals(op, "", PREFIX, 10000)
        try:
            io.operate_read_op(op, OBJECT)
        except rados.ObjectNotFound:
            return {}
        return {k[len(PREFIX):]: json.loads(v) for k, v in it}


def drop_records(node: NodeUnderTest) -> None:
    with node.cluster.client() as cl, cl.open_ioctx(node.cluster.pool) as io, \
            contextlib.suppress(rados.ObjectNotFound):
        io.remove_object(OBJECT)


def create_until_done(c: CsiNode, name: str, **mutable: str) -> pb.Volume:
    """A CO's CreateVolume: retried while the answer is ABORTED (the other
    replica holds the name), up to a deadline."""
    end = time.monotonic() + RETRY_FOR_S
    req = pb.CreateVolumeRequest(name=name, capacity_range=pb.CapacityRange(
        required_bytes=16 * MiB), volume_capabilities=[mount_cap()],
        parameters={"pool": c.node.cluster.pool}, mutable_parameters=mutable)
    while True:
        try:
            return c.controller.CreateVolume(req, timeout=T).volume
        except grpc.RpcError as exc:
            if exc.code() != Code.ABORTED or time.monotonic() > end:
                raise
        time.sleep(0.05)  # a CO's backoff between retries, not a synchronisation


def created_by(c: CsiNode, image: str) -> bool:
    return any("create image" in line and image in line
               for line in c.daemon.log.read_text().splitlines())


def test_two_controllers_race_the_same_names(start_csi: Callable[..., CsiNode],
                                             replica_b: Callable[..., CsiNode],
                                             node: NodeUnderTest) -> None:
    drop_records(node)
    state = f"  statePool: {node.cluster.pool}\n"
    a, b = start_csi(state), replica_b(state)
    names = [f"pvc-race-{i}" for i in range(6)]
    for n in names:
        node.images.add(ids.image_for_request(n))
    answers: dict[tuple[str, str], pb.Volume | BaseException] = {}
    gate = threading.Barrier(2 * len(names))

    def race(c: CsiNode, who: str, n: str) -> None:
        gate.wait()
        try:
            answers[(who, n)] = create_until_done(c, n)
        except BaseException as exc:  # reported below, with every other answer
            answers[(who, n)] = exc

    threads = [threading.Thread(target=race, args=(c, who, n))
               for n in names for c, who in ((a, "a"), (b, "b"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(RETRY_FOR_S + 30)
    assert all(isinstance(v, pb.Volume) for v in answers.values()), answers
    for n in names:
        assert answers[("a", n)] == answers[("b", n)], n  # one volume, one answer

    # Each image made by exactly one engine; one record per name, created.
    made = {}
    for n in names:
        image = ids.image_for_request(n)
        by = [who for c, who in ((a, "a"), (b, "b")) if created_by(c, image)]
        assert len(by) == 1, (n, by)
        made[n] = by[0]
    recs = records(node)
    assert {r["doc"]["metadata"]["labels"]["csi.rbd-reconciler/request-name"]
            for r in recs.values()} == set(names)
    assert {r["state"] for r in recs.values()} == {"created"}
    assert all("stage" not in r["doc"]["spec"] for r in recs.values())
    # Converged and recorded, the files are let go: one left behind would be
    # converged again after the other replica deleted its volume, and bring
    # the image back.
    assert a.files() == {} and b.files() == {}

    # Either replica serves what the other made: expand, list, delete.
    for n in names:
        other = b if made[n] == "a" else a
        vol = answers[("a", n)]
        assert isinstance(vol, pb.Volume)
        other.controller.ControllerExpandVolume(pb.ControllerExpandVolumeRequest(
            volume_id=vol.volume_id, capacity_range=pb.CapacityRange(
                required_bytes=32 * MiB)), timeout=T)
    assert a.files() == {} and b.files() == {}
    for c in (a, b):
        listed = c.controller.ListVolumes(pb.ListVolumesRequest(), timeout=T).entries
        sizes = {e.volume.volume_id: e.volume.capacity_bytes for e in listed}
        # Grown through the other replica: the record, not a stale file, answers.
        assert {sizes.get(v.volume_id) for v in answers.values()  # type: ignore[union-attr]
                } == {32 * MiB}, sizes
    for n in names:
        vol = answers[("b", n)]
        assert isinstance(vol, pb.Volume)
        assert node.image_exists(ids.image_for_request(n))
        creator = a if made[n] == "a" else b
        # Delete through the creator, after the other one grew it.
        creator.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=vol.volume_id),
                                        timeout=T)
        assert not node.image_exists(ids.image_for_request(n))
    assert records(node) == {}
    assert a.files() == {} and b.files() == {}  # nothing left for an engine to bring back
    assert a.stop() == 0 and b.stop() == 0
    drop_records(node)


def set_record(node: NodeUnderTest, name: str, **change: object) -> None:
    with node.cluster.client() as cl, cl.open_ioctx(node.cluster.pool) as io:
        rec = records(node)[name]
        rec.update(change)
        with rados.WriteOpCtx() as op:
            io.set_omap(op, (PREFIX + name,), (json.dumps(rec).encode(),))
            io.operate_write_op(op, OBJECT)


def test_claims_unfinished_foreign_and_stale(start_csi: Callable[..., CsiNode],
                                             node: NodeUnderTest) -> None:
    drop_records(node)
    # timeoutSeconds 5: a claim seen unchanged for 2 x 5 + 60 s is stale.
    c = start_csi(f"  statePool: {node.cluster.pool}\n  timeoutSeconds: 5\n")
    me = f"test-node@{socket.gethostname()}:{node.state}"
    vol = create_until_done(c, "pvc-claims")
    name = ids.volume_name(*ids.parse_volume_id(vol.volume_id))  # type: ignore[misc]
    node.images.add(name)
    assert records(node)[name]["state"] == "created" and records(node)[name]["by"] == me

    # Cut off between converging and recording: the retry finishes the record.
    set_record(node, name, state="creating")
    assert create_until_done(c, "pvc-claims") == vol
    assert records(node)[name]["state"] == "created"

    # Another replica's fresh claim on a name this one has no file for: ABORTED,
    # nothing written; once stale (that replica died), taken over and made.
    other = ids.image_for_request("pvc-claimed-elsewhere")
    node.images.add(other)
    with node.cluster.client() as cl, cl.open_ioctx(node.cluster.pool) as io, \
            rados.WriteOpCtx() as op:
        doc = {"apiVersion": "rbd-reconciler/v1", "kind": "Volume",
               "metadata": {"name": other}, "spec": {"image": {}}}
        rec = {"doc": doc, "state": "creating", "by": "test-node@elsewhere:/x", "at": time.time()}
        io.set_omap(op, (PREFIX + other,), (json.dumps(rec).encode(),))
        io.operate_write_op(op, OBJECT)
    req = pb.CreateVolumeRequest(name="pvc-claimed-elsewhere", volume_capabilities=[mount_cap()],
                                 capacity_range=pb.CapacityRange(required_bytes=16 * MiB),
                                 parameters={"pool": node.cluster.pool})
    code_, why = error(lambda: c.controller.CreateVolume(req, timeout=T))
    assert code_ == Code.ABORTED and "elsewhere" in why, why
    assert not (c.csi_dir / f"{other}.yaml").exists() and not node.image_exists(other)
    # The writer's clock is never compared: a claim dated long ago (a
    # replica whose clock is behind) is as live as any until this replica
    # has seen it unchanged for the stale time on its own clock.
    seen = time.monotonic()
    set_record(node, other, at=time.time() - 10_000)
    code_, why = error(lambda: c.controller.CreateVolume(req, timeout=T))
    assert code_ == Code.ABORTED and "elsewhere" in why, why
    taken = create_until_done(c, "pvc-claimed-elsewhere")
    assert time.monotonic() - seen >= 70, "taken over before the stale time"
    assert records(node)[other]["by"] == me and records(node)[other]["state"] == "created"
    for v in (vol, taken):
        c.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=v.volume_id), timeout=T)
    assert records(node) == {}
    assert c.stop() == 0
    drop_records(node)
