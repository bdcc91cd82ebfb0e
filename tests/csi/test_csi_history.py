"""A Jepsen-style history test of the CSI controller state (csi.statePool).

Two (RBD_HISTORY_REPLICAS=3: three) controller daemons on one cluster, one
nodeName, one state pool. Client threads send random CSI calls on a few names
to random replicas with random gRPC deadlines (many short enough to cut calls
off), while a replica is now and then SIGKILLed and restarted on an empty
state dir. Every call is recorded; then the CO finishes what it would retry,
the replicas settle, Ceph is read, and tests/csi/csi_history.py's pure
checker relates the history to the truth.

    RBD_HISTORY_SECONDS=150  how long calls are issued (default 150)
    RBD_HISTORY_SEED=N       the seed (printed; a failure prints it again and
                             writes the history, JSON lines, under tmp_path)
    RBD_HISTORY_REPLICAS=2   2 or 3 controller daemons

A seed replays the same choices per thread; the interleaving is the machine's.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import rados
import rbd
from conftest import NodeUnderTest
from csi_fixture import CsiNode, connect, mount_cap
from csi_history import (
    FINAL,
    GROUP,
    MODIFY,
    SNAPSHOT,
    VOLUME,
    Op,
    Sample,
    Truth,
    Violation,
    VolumeTruth,
    check,
    dump,
    load,
)
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message
from test_daemon import Daemon

from reconciler.csi import csi_pb2 as pb
from reconciler.csi import csi_pb2_grpc, ids

MiB = 1 << 20
# The controller's records: one RADOS object's omap, a key per object name.
RECORDS_OBJECT, RECORDS_PREFIX = "rbd-reconciler.csi", "v1."
SECONDS = float(os.environ.get("RBD_HISTORY_SECONDS", "150"))
REPLICAS = int(os.environ.get("RBD_HISTORY_REPLICAS", "2"))
THREADS = 4
SHORT = (0.2, 0.8)  # a cut-off call's deadline, seconds (the adapter keeps 0.25 s)
LONG = (4.0, 20.0)
SHORT_SHARE = 0.35
KILL_EVERY = (25.0, 45.0)  # seconds between SIGKILLs of a random replica
# csi.timeoutSeconds: a claim of a killed replica is stale after 2 x this + 60 s.
CSI_TIMEOUT_S = 10
RESYNC_S = 10  # resyncSeconds: every file is converged again this often
SAMPLE_S = 0.5  # Ceph is read this often while calls run
DRAIN_S = 150.0  # the CO's retries after the run, at most
QUIET_S = 2 * RESYNC_S + 5  # Ceph unchanged this long: settled
SETTLE_S = 150.0
WEIGHTS = {"CreateVolume": 16, "DeleteVolume": 10, "ControllerExpandVolume": 20,
           "ControllerModifyVolume": 22, "CreateSnapshot": 8, "DeleteSnapshot": 9,
           "CreateVolumeGroupSnapshot": 5, "DeleteVolumeGroupSnapshot": 6}


# == the checker on hand-made histories (no cluster) ==================================
def _op(i: int, method: str, name: str, t0: float, t1: float, outcome: str = "OK",
        **kw: Any) -> Op:
    return Op(i, "t", "a", method, name, t0, t1, outcome, **kw)


def _truth(volumes: dict[str, VolumeTruth] | None = None, snapshots: set[str] | None = None,
           records: dict[str, str] | None = None) -> Truth:
    vols = volumes or {}
    objects = {f"img-{n}": (VOLUME, n) for n in ("v", "w")}
    objects["snap-s"] = (SNAPSHOT, "s")
    return Truth(vols, snapshots or set(), {}, objects,
                 records if records is not None else {f"img-{n}": "created" for n in vols})


def test_checker_finds_each_violation(tmp_path: Path) -> None:
    create = _op(1, "CreateVolume", "v", 0, 1, capacity=16 * MiB)
    # 1: deleted OK, nothing created since, but there it is.
    hist = [create, _op(2, "DeleteVolume", "v", 2, 3)]
    back = _truth({"v": VolumeTruth(16 * MiB, {})})
    v1 = check(hist, back)
    assert [x.invariant for x in v1] == [1], v1
    # ... unless a create ran at the same time or later (even one cut off).
    racing = [*hist, _op(3, "CreateVolume", "v", 2.5, 4, "DEADLINE_EXCEEDED")]
    assert check(racing, back) == []
    # A cut-off create before the delete does not excuse it: it was over.
    early = [_op(0, "CreateVolume", "v", 0, 0.5, "DEADLINE_EXCEEDED"), *hist]
    assert [x.invariant for x in check(early, back)] == [1]

    # 2: an acknowledged size shrank; an acknowledged volume vanished.
    grow = _op(2, "ControllerExpandVolume", "v", 2, 3, capacity=20 * MiB)
    v2 = check([create, grow], _truth({"v": VolumeTruth(16 * MiB, {})}))
    assert [x.invariant for x in v2] == [2] and "20971520" in v2[0].message, v2
    assert [x.invariant for x in check([create], _truth(records={}))] == [2]
    # A delete cut off before the expand was invoked does not excuse its loss either.
    cut = _op(3, "DeleteVolume", "v", 1.2, 1.5, "DEADLINE_EXCEEDED")
    assert [x.invariant for x in check([create, cut, grow], _truth(records={}))] == [2]
    # A delete refused before it wrote anything (ABORTED) is no excuse for a loss.
    refused = _op(4, "DeleteVolume", "v", 4, 5, "ABORTED")
    assert [x.invariant for x in check([create, grow, refused], _truth(records={}))] == [2]
    # One cut off after it may have deleted it: not judged.
    late = _op(4, "DeleteVolume", "v", 4, 5, "DEADLINE_EXCEEDED")
    assert check([create, grow, late], _truth(records={})) == []

    # 3: the last modify of a key alone, and its value lost.
    mod = _op(2, MODIFY, "v", 2, 3, params={"qosIopsLimit": "500"})
    lost = _truth({"v": VolumeTruth(16 * MiB, {"conf_rbd_qos_iops_limit": "100"})})
    assert [x.invariant for x in check([create, mod], lost)] == [3]
    assert check([create, mod], _truth({"v": VolumeTruth(16 * MiB, {
        "conf_rbd_qos_iops_limit": "500"})})) == []
    lift = _op(3, MODIFY, "v", 4, 5, params={"qosIopsLimit": "0",
                                             "qosWriteBpsLimit": "8Mi"})
    assert check([create, mod, lift], _truth({"v": VolumeTruth(16 * MiB, {
        "conf_rbd_qos_write_bps_limit": str(8 * MiB)})})) == []
    # Two modifies of one key at once: either value may stand, nothing is checked.
    other = _op(4, MODIFY, "v", 2.5, 3.5, "DEADLINE_EXCEEDED", params={"qosIopsLimit": "7"})
    assert check([create, mod, other], lost) == []
    # An expand beside it does not touch QoS: the value must hold.
    beside = _op(5, "ControllerExpandVolume", "v", 2.1, 2.9, capacity=18 * MiB)
    v3 = check([create, mod, beside], _truth({"v": VolumeTruth(18 * MiB, {})}))
    assert [x.invariant for x in v3] == [3] and "#5" in v3[0].message, v3

    # 4: settled objects and their records.
    norec = check([create], _truth({"v": VolumeTruth(16 * MiB, {})}, records={}))
    assert [x.invariant for x in norec] == [4], norec
    ghost = check([create, _op(2, "DeleteVolume", "v", 2, 3)],
                  _truth(records={"img-v": "created"}))
    assert [x.invariant for x in ghost] == [4], ghost
    # Unsettled (the last call was cut off): not judged.
    unsettled = [create, _op(2, "DeleteVolume", "v", 2, 3, "UNAVAILABLE")]
    assert check(unsettled, _truth(records={"img-v": "created"})) == []

    # Samples taken while calls ran: an expand racing an OK delete brought the
    # image back for a while (a later create made it legitimately again).
    racer = _op(3, "ControllerExpandVolume", "v", 1.9, 3.5, capacity=18 * MiB)
    later = _op(4, "CreateVolume", "v", 6, 7, capacity=16 * MiB)
    seen = _truth({"v": VolumeTruth(18 * MiB, {})})
    during = [Sample(4, 4.1, seen), Sample(4.5, 4.6, seen)]
    final = _truth({"v": VolumeTruth(16 * MiB, {})})
    vs = check([*hist, racer, later], final, during)
    assert [x.invariant for x in vs] == [1] and "2 samples" in vs[0].message, vs
    assert "#3" in vs[0].message and "at 4.00..4.10" in vs[0].message, vs
    # A create begun before the sample ended excuses it; so does none being seen.
    assert check([*hist, racer, _op(4, "CreateVolume", "v", 4.05, 7)], final, during) == []
    assert check([*hist, racer, later], final, [Sample(4, 4.1, _truth(records={}))]) == []

    # The history on disk and back.
    path = tmp_path / "h.jsonl"
    dump([*hist, racer, later], path, {"truth": final.to_json()}, during)
    header, ops, samples = load(path)
    assert check(ops, Truth.from_json(header["truth"]), samples) == vs

    # Snapshots: a deleted one back is invariant 1 too.
    snaps = [_op(1, "CreateSnapshot", "s", 0, 1), _op(2, "DeleteSnapshot", "s", 2, 3)]
    vs = check(snaps, _truth(snapshots={"s"}, records={"snap-s": "created"}))
    assert [(x.invariant, x.kind) for x in vs] == [(1, SNAPSHOT)], vs


# == the run against real daemons ======================================================
@dataclass
class Replica:
    """One controller daemon; each restart gets a fresh, empty state dir (an
    emptyDir in a new pod), the same socket, desired dir and nodeName."""

    label: str
    root: Path
    base: NodeUnderTest
    extra_config: str
    incarnation: int = 0
    csi: CsiNode | None = None
    group: csi_pb2_grpc.GroupControllerStub | None = None
    daemons: list[Daemon] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def socket(self) -> Path:
        return self.root / "csi" / "csi.sock"

    def start(self) -> None:
        self.incarnation += 1
        dirs = [self.root / "desired", self.root / f"state-{self.incarnation}", self.root / "srv"]
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
        text = self.base.config.read_text()
        for old, new in zip((self.base.desired, self.base.state, self.base.srv), dirs,
                            strict=True):
            text = text.replace(str(old), str(new))
        config = self.root / f"config-{self.incarnation}.yaml"
        config.write_text(text + self.extra_config)
        node = NodeUnderTest(self.root, self.base.cluster, config, *dirs, self.base.tag)
        d = Daemon(node, args=("--csi-endpoint", f"unix://{self.socket}"))
        self.daemons.append(d)
        c = connect(node, d, self.socket)
        with self.lock:
            self.csi, self.group = c, csi_pb2_grpc.GroupControllerStub(c.channel)

    def stubs(self) -> tuple[csi_pb2_grpc.ControllerStub, csi_pb2_grpc.GroupControllerStub,
                             int] | None:
        with self.lock:
            if self.csi is None or self.group is None:
                return None
            return self.csi.controller, self.group, self.incarnation

    def kill(self) -> None:
        with self.lock:
            c, self.csi, self.group = self.csi, None, None
        if c is not None:
            c.daemon.stop(signal.SIGKILL)  # by its pid; the channel is closed below
            c.channel.close()

    def stop(self) -> None:
        with self.lock:
            c, self.csi, self.group = self.csi, None, None
        if c is not None:
            c.channel.close()
        for d in self.daemons:
            if d.notify.fileno() != -1:
                d.stop()

    def alive(self) -> bool:
        with self.lock:
            return self.csi is not None and self.csi.daemon.proc.poll() is None


@dataclass
class Names:
    """The few names the calls use. As a CO has it, a snapshot name has one
    source volume and a group snapshot name one set of them."""

    volumes: list[str]
    snapshots: dict[str, str]  # snapshot name -> its source volume's name
    groups: dict[str, list[str]]  # group snapshot name -> its source volumes' names

    def objects(self) -> dict[str, tuple[str, str]]:
        out = {ids.image_for_request(v): (VOLUME, v) for v in self.volumes}
        out.update({ids.snapshot_for_request(s): (SNAPSHOT, s) for s in self.snapshots})
        out.update({ids.group_for_request(g): (GROUP, g) for g in self.groups})
        return out


class Run:
    """The clients, the chaos, and the history they write."""

    def __init__(self, seed: int, replicas: list[Replica], names: Names, pool: str) -> None:
        self.seed, self.replicas, self.names, self.pool = seed, replicas, names, pool
        self.t0 = time.monotonic()
        self.wall0 = time.time()
        self.history: list[Op] = []
        self.requests: dict[int, tuple[str, Message]] = {}  # op id -> (method, request)
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        # What a CO learned from OK answers: ids, and the sizes it was told.
        self.vol_ids: dict[str, str] = {}
        self.snap_ids: dict[str, str] = {}
        self.group_ids: dict[str, str] = {}
        self.sizes: dict[str, int] = {}
        self.samples: list[Sample] = []

    def now(self) -> float:
        return time.monotonic() - self.t0

    def _add(self, op: Op) -> None:
        with self.lock:
            op.id = len(self.history)
            self.history.append(op)

    def event(self, what: str, replica: str, message: str = "") -> None:
        t = self.now()
        self._add(Op(0, "chaos", replica, what, "", t, t, "OK", message))

    # -- one call ----------------------------------------------------------------
    def call(self, thread: str, replica: Replica, method: str, name: str, req: Message,
             timeout: float) -> Op | None:
        stubs = replica.stubs()
        if stubs is None:
            return None  # down: the CO's connection is gone, it picks another
        controller, group, incarnation = stubs
        stub = group if "Group" in method else controller
        invoke = self.now()
        outcome, message, resp = "OK", "", None
        try:
            resp = getattr(stub, method)(req, timeout=timeout)
        except grpc.RpcError as exc:
            outcome, message = exc.code().name, exc.details() or ""
        except ValueError as exc:  # the channel was closed under us (killed replica)
            outcome, message = "CANCELLED", f"client: {exc}"
        op = Op(0, thread, f"{replica.label}{incarnation}", method, name, invoke, self.now(),
                outcome, message, round(timeout, 3),
                request=MessageToDict(req, preserving_proto_field_name=True))
        if method == MODIFY:
            op.params = dict(req.mutable_parameters)  # type: ignore[attr-defined]
        if resp is not None:
            op.response = MessageToDict(resp, preserving_proto_field_name=True)
            self._learn(op, resp)
        self._add(op)
        with self.lock:
            self.requests[op.id] = (method, req)
        return op

    def _learn(self, op: Op, resp: Any) -> None:
        with self.lock:
            if op.method == "CreateVolume":
                op.capacity = resp.volume.capacity_bytes
                self.vol_ids[op.name] = resp.volume.volume_id
                self.sizes[op.name] = max(self.sizes.get(op.name, 0), op.capacity)
            elif op.method == "ControllerExpandVolume":
                op.capacity = resp.capacity_bytes
                self.sizes[op.name] = max(self.sizes.get(op.name, 0), op.capacity)
            elif op.method == "DeleteVolume":
                self.sizes.pop(op.name, None)
            elif op.method == "CreateSnapshot":
                self.snap_ids[op.name] = resp.snapshot.snapshot_id
            elif op.method == "CreateVolumeGroupSnapshot":
                self.group_ids[op.name] = resp.group_snapshot.group_snapshot_id

    # -- random calls --------------------------------------------------------------
    def choose(self, rng: random.Random) -> tuple[str, str, Message]:
        method = rng.choices(list(WEIGHTS), weights=list(WEIGHTS.values()))[0]
        vol = rng.choice(self.names.volumes)
        with self.lock:
            vids, sids, gids = dict(self.vol_ids), dict(self.snap_ids), dict(self.group_ids)
            size = self.sizes.get(vol, 16 * MiB)
        if method in ("DeleteSnapshot", "CreateSnapshot"):
            snap = rng.choice(sorted(self.names.snapshots))
            if method == "DeleteSnapshot" and snap in sids:
                return method, snap, pb.DeleteSnapshotRequest(snapshot_id=sids[snap])
            if self.names.snapshots[snap] in vids:
                return "CreateSnapshot", snap, pb.CreateSnapshotRequest(
                    name=snap, source_volume_id=vids[self.names.snapshots[snap]])
        if method in ("DeleteVolumeGroupSnapshot", "CreateVolumeGroupSnapshot"):
            grp = rng.choice(sorted(self.names.groups))
            if method == "DeleteVolumeGroupSnapshot" and grp in gids:
                return method, grp, pb.DeleteVolumeGroupSnapshotRequest(
                    group_snapshot_id=gids[grp])
            if all(v in vids for v in self.names.groups[grp]):
                return "CreateVolumeGroupSnapshot", grp, pb.CreateVolumeGroupSnapshotRequest(
                    name=grp, source_volume_ids=[vids[v] for v in self.names.groups[grp]])
        if method == "DeleteVolume" and vol in vids:
            return method, vol, pb.DeleteVolumeRequest(volume_id=vids[vol])
        if method == "ControllerExpandVolume" and vol in vids:
            grow = size + rng.randint(1, 4) * MiB
            return method, vol, pb.ControllerExpandVolumeRequest(
                volume_id=vids[vol], capacity_range=pb.CapacityRange(required_bytes=grow))
        if method == MODIFY and vol in vids:
            params = {}
            for key in rng.choice((["qosIopsLimit"], ["qosWriteBpsLimit"],
                                   ["qosIopsLimit", "qosWriteBpsLimit"])):
                lift = rng.random() < 0.2
                if key == "qosIopsLimit":
                    params[key] = "0" if lift else str(rng.randint(100, 5000))
                else:
                    params[key] = "0" if lift else f"{rng.randint(1, 100)}Mi"
            return method, vol, pb.ControllerModifyVolumeRequest(volume_id=vids[vol],
                                                                 mutable_parameters=params)
        return "CreateVolume", vol, pb.CreateVolumeRequest(
            name=vol, capacity_range=pb.CapacityRange(required_bytes=16 * MiB),
            volume_capabilities=[mount_cap()], parameters={"pool": self.pool})

    def client(self, n: int, until: float) -> None:
        rng = random.Random(f"{self.seed}/client{n}")
        while not self.stop.is_set() and self.now() < until:
            method, name, req = self.choose(rng)
            timeout = rng.uniform(*SHORT) if rng.random() < SHORT_SHARE else rng.uniform(*LONG)
            start = rng.randrange(len(self.replicas))
            for i in range(len(self.replicas)):
                op = self.call(f"c{n}", self.replicas[(start + i) % len(self.replicas)],
                               method, name, req, timeout)
                if op is not None:
                    break
            if op is None or not op.ok:
                self.stop.wait(rng.uniform(0.05, 0.5))  # a CO's backoff before the next call

    def guarded(self, body: Callable[..., None], *args: object) -> None:
        """A thread's body: its exception stops the run and is raised after it."""
        try:
            body(*args)
        except BaseException as exc:
            self.errors.append(exc)
            self.stop.set()

    def chaos(self, until: float) -> None:
        rng = random.Random(f"{self.seed}/chaos")
        at = rng.uniform(*KILL_EVERY)
        # A timer to the next kill (stopped early if the run is).
        while at < until and not self.stop.wait(max(0.0, at - self.now())):
            at = self.now() + rng.uniform(*KILL_EVERY)
            r = rng.choice(self.replicas)
            self.event("Kill", r.label, "SIGKILL")
            r.kill()
            r.start()
            self.event("Restart", f"{r.label}{r.incarnation}", "empty state dir")

    def sample(self, io: rados.Ioctx) -> None:
        """Ceph as it is now, for the checker (a read that raced a removal
        and failed is dropped: the next one comes)."""
        start = self.now()
        try:
            truth = read_truth(io, self.names)
        except (rbd.Error, rados.Error):
            return
        self.samples.append(Sample(start, self.now(), truth))

    def sampler(self, io: rados.Ioctx, done: threading.Event) -> None:
        while not done.wait(SAMPLE_S):  # a sampling interval, not a synchronisation
            self.sample(io)

    # -- after the run: the CO retries what it has no final answer for ------------
    def drain(self) -> None:
        with self.lock:
            history = list(self.history)
        last: dict[tuple[str, str], Op] = {}
        for op in sorted(history, key=lambda o: o.invoke):
            if op.kind is not None:
                last[(op.kind, op.name)] = op
        pending = [op for op in last.values() if not op.ok and op.outcome not in FINAL]
        end = self.now() + DRAIN_S

        def retry(op: Op) -> None:
            rng = random.Random(f"{self.seed}/drain{op.id}")
            method, req = self.requests[op.id]
            while self.now() < end:
                got = self.call("drain", rng.choice(self.replicas), method, op.name, req, 30.0)
                if got is not None and (got.ok or got.outcome in FINAL):
                    return
                self.stop.wait(rng.uniform(0.5, 2.0))  # the CO's backoff between retries

        threads = [threading.Thread(target=retry, args=(op,), name=f"drain-{op.id}")
                   for op in pending]
        for t in threads:
            t.start()
        for t in threads:
            t.join(DRAIN_S + 60)


# == the truth in Ceph ==================================================================
def read_truth(io: rados.Ioctx, names: Names) -> Truth:
    objects = names.objects()
    images = set(rbd.RBD().list(io))
    volumes: dict[str, VolumeTruth] = {}
    snaps: set[str] = set()
    for v in names.volumes:
        image = ids.image_for_request(v)
        if image not in images:
            continue
        with contextlib.suppress(rbd.ImageNotFound), rbd.Image(io, image, read_only=True) as img:
            meta = {k: val for k, val in img.metadata_list() if k.startswith("conf_rbd_qos_")}
            volumes[v] = VolumeTruth(img.size(), meta)
            have = {s["name"] for s in img.list_snaps()}
            snaps.update(s for s, src in names.snapshots.items()
                         if src == v and ids.snapshot_for_request(s) in have)
    groups: dict[str, bool] = {}
    existing = set(rbd.RBD().group_list(io))
    for g in names.groups:
        gname = ids.group_for_request(g)
        if gname in existing:
            with rbd.Group(io, gname) as grp:
                groups[g] = any(s["name"] == gname and s["state"] ==
                                rbd.RBD_GROUP_SNAP_STATE_COMPLETE for s in grp.list_snaps())
    records: dict[str, str] = {}
    with rados.ReadOpCtx() as op:
        it, _ = io.get_omap_vals(op, "", RECORDS_PREFIX, 10000)
        with contextlib.suppress(rados.ObjectNotFound):
            io.operate_read_op(op, RECORDS_OBJECT)
            for key, raw in it:
                obj = key[len(RECORDS_PREFIX):]
                if obj in objects:
                    try:
                        records[obj] = str(json.loads(raw).get("state"))
                    except ValueError:
                        records[obj] = "unreadable"
    return Truth(volumes, snaps, groups, objects, records)


def settle(run: Run, io: rados.Ioctx, names: Names,
           replicas: list[Replica]) -> tuple[Truth, str]:
    """Ceph unchanged for QUIET_S (longer than two resyncs: a left-behind file
    acts within one), at most SETTLE_S; each read is a sample too. Returns the
    final truth and a note."""
    last: dict[str, Any] | None = None
    since = time.monotonic()
    end = since + SETTLE_S
    while time.monotonic() - since < QUIET_S and time.monotonic() < end:
        run.sample(io)
        now = run.samples[-1].truth.to_json() if run.samples else None
        if now != last:
            last, since = now, time.monotonic()
        time.sleep(1.0)  # the poll interval of a condition with a deadline
    notes = [] if time.monotonic() - since >= QUIET_S else \
        [f"Ceph was still changing after {SETTLE_S:.0f} s (never settled)"]
    dead = [r.label for r in replicas if not r.alive()]
    if dead:
        notes.append(f"daemons not running at the end: {dead}")
    return read_truth(io, names), "; ".join(notes)


def cleanup(io: rados.Ioctx, names: Names) -> None:
    """Groups (with their snapshots and membership), snapshots, images, the
    adapter's group records, the records object: everything the run made."""
    groups = {ids.group_for_request(g) for g in names.groups}
    for g in groups & set(rbd.RBD().group_list(io)):
        with contextlib.suppress(rbd.ObjectNotFound):
            rbd.RBD().group_remove(io, g)
    for obj in list(io.list_objects()):
        if any(g in obj.key for g in groups):
            with contextlib.suppress(rados.ObjectNotFound):
                io.remove_object(obj.key)
    for v in names.volumes:
        image = ids.image_for_request(v)
        with contextlib.suppress(rbd.ImageNotFound):
            with rbd.Image(io, image) as img:
                for s in list(img.list_snaps()):
                    if s.get("namespace", rbd.RBD_SNAP_NAMESPACE_TYPE_USER) == \
                            rbd.RBD_SNAP_NAMESPACE_TYPE_GROUP:
                        # A group snapshot whose group outlived the removal
                        # above (made meanwhile): removed through its group.
                        info = img.snap_get_group_namespace(s["id"])
                        try:
                            with rbd.Group(io, info["name"]) as g:
                                g.remove_snap(info["snap_name"])
                        except rbd.Error:
                            with contextlib.suppress(rbd.Error):
                                img.remove_snap_by_id(s["id"])
                        continue
                    if s.get("namespace", rbd.RBD_SNAP_NAMESPACE_TYPE_USER) != \
                            rbd.RBD_SNAP_NAMESPACE_TYPE_USER:
                        continue
                    if img.is_protected_snap(s["name"]):
                        img.unprotect_snap(s["name"])
                    img.remove_snap(s["name"])
            try:
                rbd.RBD().remove(io, image)
            except rbd.ImageHasSnapshots:
                snaps = [dict(s) for s in rbd.Image(io, image).list_snaps()]
                print(f"cleanup: {image} kept, its snapshots cannot be removed: {snaps}")
    with contextlib.suppress(rados.ObjectNotFound):
        io.remove_object(RECORDS_OBJECT)


def run_clients(run: Run, threads: list[threading.Thread], until: float) -> None:
    """The clients in their threads; the chaos here: a daemon started from a
    thread would be killed when that thread ends (setpriv --pdeathsig is per
    thread)."""
    for t in threads:
        t.start()
    run.guarded(run.chaos, until)
    for t in threads:
        t.join(until + 300)
    assert not any(t.is_alive() for t in threads), "a client thread did not finish"
    if run.errors:
        raise run.errors[0]


@pytest.fixture
def pool_io(node: NodeUnderTest) -> Iterator[rados.Ioctx]:
    with node.cluster.client() as cl, cl.open_ioctx(node.cluster.pool) as io:
        yield io


@pytest.mark.ceph
def test_csi_history(node: NodeUnderTest, pool_io: rados.Ioctx, tmp_path: Path) -> None:
    seed = int(os.environ.get("RBD_HISTORY_SEED") or random.SystemRandom().randrange(1 << 32))
    print(f"\nRBD_HISTORY_SEED={seed} RBD_HISTORY_SECONDS={SECONDS:g} "
          f"RBD_HISTORY_REPLICAS={REPLICAS}")
    vols = [node.name(f"hv{i}") for i in range(3)]
    names = Names(vols, {node.name("hs0"): vols[0], node.name("hs1"): vols[1]},
                  {node.name("hg0"): vols[1:]})
    node.images.update(ids.image_for_request(v) for v in names.volumes)  # a backstop
    pool = node.cluster.pool
    extra = (f"resyncSeconds: {RESYNC_S}\ncsi:\n  driverName: rbd.test.local\n"
             f"  statePool: {pool}\n  timeoutSeconds: {CSI_TIMEOUT_S}\n")
    replicas = [Replica(label, tmp_path / f"replica-{label}", node, extra)
                for label in "abc"[:REPLICAS]]
    cleanup(pool_io, names)
    run = Run(seed, replicas, names, pool)
    out = tmp_path / "history.jsonl"
    violations: list[Violation] = []
    note = ""
    try:
        for r in replicas:
            r.start()
        run.t0 = time.monotonic()
        until = SECONDS
        threads = [threading.Thread(target=run.guarded, args=(run.client, n, until),
                                    name=f"client-{n}") for n in range(THREADS)]
        sampling = threading.Event()
        with node.cluster.client() as cl, cl.open_ioctx(pool) as sample_io:
            sampler = threading.Thread(target=run.sampler, args=(sample_io, sampling),
                                       name="sampler")
            sampler.start()
            try:
                run_clients(run, threads, until)
                issued = len(run.history)
                run.drain()
            finally:
                sampling.set()
                sampler.join(60)
        truth, note = settle(run, pool_io, names, replicas)
        violations = check(run.history, truth, run.samples)
        header = {"seed": seed, "seconds": SECONDS, "replicas": REPLICAS, "names":
                  asdict(names), "wall_start": run.wall0,
                  "truth": truth.to_json(), "note": note,
                  "logs": [str(d.log) for r in replicas for d in r.daemons]}
        dump(run.history, out, header, run.samples)
        counts: dict[str, int] = {}
        for op in run.history:
            counts[f"{op.method} {op.outcome}"] = counts.get(f"{op.method} {op.outcome}", 0) + 1
        print(f"{issued} calls in {SECONDS:g} s, {len(run.history) - issued} CO retries after,"
              f" {len(run.samples)} samples of Ceph; history: {out}")
        for k in sorted(counts):
            print(f"  {counts[k]:4d}  {k}")
        print(f"truth: {json.dumps(truth.to_json(), sort_keys=True)}")
        if note:
            print(f"note: {note}")
    except BaseException:
        run.stop.set()
        dump(run.history, out, {"seed": seed, "error": "the run itself failed"}, run.samples)
        print(f"the run failed: seed {seed}, history so far: {out}")
        raise
    finally:
        run.stop.set()
        for r in replicas:
            r.stop()
        cleanup(pool_io, names)
    if violations:
        per = {i: sum(1 for v in violations if v.invariant == i) for i in (1, 2, 3, 4)}
        pytest.fail(f"{len(violations)} violation(s) (per invariant: {per}); seed {seed}, "
                    f"replay with RBD_HISTORY_SEED={seed}; history {out}\n"
                    + "\n".join(map(str, violations)), pytrace=False)

