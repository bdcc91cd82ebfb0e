"""A Jepsen-style history test of the CSI controller state (csi.statePool).

Two (RBD_HISTORY_REPLICAS=3: three) controller daemons on one cluster, one
nodeName, one state pool. Client threads send random CSI calls to random
replicas with random gRPC deadlines (many short enough to cut calls off):
creates (of varying capacity, some with QoS mutable_parameters: a name that
stands with other parameters is ALREADY_EXISTS), deletes, expands, modifies,
snapshots and group snapshots, and the questions ListVolumes,
ValidateVolumeCapabilities and GetCapacity. Three volume names carry the
snapshots; two more slots hand out fresh names, and a name is retired now
and then after an OK delete or modify (never called again: what a paused
replica does to it later shows at the end).

The faults model what a cluster does to its replicas, each a real process
(tests/csi/faultsite/sitecustomize.py on its PYTHONPATH):

- kill: SIGKILL every 25-45 s, restarted at once on an empty state dir (a
  new pod) or on its own (the same pod restarted), half and half;
- pause: every 6-14 s a replica is stopped (SIGSTOP), at once or when it
  next reaches a pause point (records.get, records.write, volumes.converge,
  volumes.gate: while it reads, writes or holds a lease), for 0.3-3 s,
  past any client's deadline (21-36 s) or past the stale time
  (2 x csi.timeoutSeconds + 60 + 5-20 s, at a point that holds a lease or
  claim; the first pause of a run is one a third of the time, when it
  fits), then SIGCONT; a pause that would leave no replica running
  is short, a replica resumed or restarted is left alone for ACT_S = 15 s,
  and every pause ends before the last TAIL_S of calls: resumed replicas
  act while calls go on;
- skew: each incarnation's wall clock runs up to RBD_HISTORY_SKEW_S
  (600 s) ahead or behind (a quarter of them exact; monotonic untouched).

Every call and fault is recorded; then the CO's drain finishes every
pending delete (retried until OK; the snapshots that hold a volume's are
deleted first) and retries the rest it has no final answer for, the
replicas settle, Ceph is read, and tests/csi/csi_history.py's pure checker
relates the history to the truth (a claim or tombstone may outlive its
call by the stale time plus one csi.timeoutSeconds). The end prints the
calls issued and the faults injected.

    RBD_HISTORY_SECONDS=150  how long calls are issued (default 150; the
                             last TAIL_S = 15 s without new faults)
    RBD_HISTORY_CALLS=N      instead: faults and calls until N calls were
                             issued, then the TAIL_S tail (a long run:
                             RBD_HISTORY_REPLICAS=3 RBD_HISTORY_THREADS=8
                             RBD_HISTORY_CALLS=10000)
    RBD_HISTORY_SEED=N       the seed (printed; a failure prints it again and
                             writes the history, JSON lines, under tmp_path)
    RBD_HISTORY_REPLICAS=2   2 or 3 controller daemons
    RBD_HISTORY_THREADS=4    client threads
    RBD_HISTORY_FAULTS=kill,pause,skew  the faults injected ("" none)
    RBD_HISTORY_SKEW_S=600   the largest clock offset, seconds

A seed replays the same choices per thread and for the faults; the
interleaving is the machine's.
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
    CAPACITY,
    FINAL,
    GROUP,
    LIST,
    MODIFY,
    SNAPSHOT,
    VALIDATE,
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
from test_daemon import Daemon, wait_for

from reconciler.csi import csi_pb2 as pb
from reconciler.csi import csi_pb2_grpc, ids

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]
FAULTSITE = Path(__file__).resolve().parent / "faultsite"
# The controller's records: one RADOS object's omap, a key per object name.
RECORDS_OBJECT, RECORDS_PREFIX = "rbd-reconciler.csi", "v1."
SECONDS = float(os.environ.get("RBD_HISTORY_SECONDS") or 150)
CALLS = int(os.environ.get("RBD_HISTORY_CALLS") or 0)
REPLICAS = int(os.environ.get("RBD_HISTORY_REPLICAS") or 2)
THREADS = int(os.environ.get("RBD_HISTORY_THREADS") or 4)
FAULTS = frozenset(f for f in os.environ.get("RBD_HISTORY_FAULTS", "kill,pause,skew")
                   .replace(" ", "").split(",") if f)
SKEW_S = float(os.environ.get("RBD_HISTORY_SKEW_S") or 600)
SHORT = (0.2, 0.8)  # a cut-off call's deadline, seconds (the adapter keeps 0.25 s)
LONG = (4.0, 20.0)
SHORT_SHARE = 0.35
TAIL_S = 15.0  # calls go on this long after the last fault (every pause over)
KILL_EVERY = (25.0, 45.0)  # seconds between SIGKILLs of a random replica
OWN_DIR_SHARE = 0.5  # of restarts: on the replica's own state dir (else an empty one)
# csi.timeoutSeconds: a claim of a killed replica is stale after 2 x this + 60 s.
CSI_TIMEOUT_S = 10
STALE_S = 2 * CSI_TIMEOUT_S + 60
PAUSE_EVERY = (6.0, 14.0)  # seconds between pauses (of a replica not paused already)
ACT_S = 15.0  # a replica resumed or restarted is neither paused nor killed this long
# How long a pause lasts: (share, range); the first of a run is past the stale time.
PAUSES = {"short": (0.20, (0.3, 3.0)),
          "past-deadline": (0.65, (LONG[1] + 1, LONG[1] + 16)),
          "past-stale": (0.15, (STALE_S + 5, STALE_S + 20))}
# The first pause of a run is past the stale time this often (when it fits:
# with two replicas it is then most of the run's only long pause).
FIRST_PAST_STALE = 1 / 3
# Where a pause stops the process (faultsite's points), or "" at once (SIGSTOP).
POINTS = {"": 3, "records.get": 4, "records.write": 2, "volumes.converge": 1,
          "volumes.gate": 2}
ARM_S = 15.0  # an armed pause point not reached this long is disarmed
# Of armed record points: the share that stops only a call on a slot's
# current name (likely retired while the replica is stopped).
ONE_NAME_SHARE = 0.6
RESYNC_S = 10  # resyncSeconds: every file is converged again this often
SAMPLE_S = 0.5  # Ceph is read this often while calls run
DRAIN_S = 150.0  # the CO's retries after the run, at most
QUIET_S = 2 * RESYNC_S + 5  # Ceph unchanged this long: settled
SETTLE_S = 150.0
WEIGHTS = {"CreateVolume": 16, "DeleteVolume": 10, "ControllerExpandVolume": 20,
           "ControllerModifyVolume": 22, "CreateSnapshot": 8, "DeleteSnapshot": 9,
           "CreateVolumeGroupSnapshot": 5, "DeleteVolumeGroupSnapshot": 6,
           LIST: 4, VALIDATE: 5, CAPACITY: 2}
SLOTS = 2  # volume names handed out fresh, retired now and then
RETIRE_AFTER = {"DeleteVolume": 0.5, MODIFY: 0.1}  # chance after an OK answer
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


def test_checker_judges_made_qos_leftovers_and_answers(tmp_path: Path) -> None:
    create = _op(1, "CreateVolume", "v", 0, 1, capacity=16 * MiB)
    iops = "conf_rbd_qos_iops_limit"

    # 3: a create that made the volume sets its QoS, and only that.
    made = _op(1, "CreateVolume", "v", 0, 1, capacity=16 * MiB,
               params={"qosIopsLimit": "300"})
    assert check([made], _truth({"v": VolumeTruth(16 * MiB, {iops: "300"})})) == []
    v3 = check([made], _truth({"v": VolumeTruth(16 * MiB, {})}))
    assert [x.invariant for x in v3] == [3] and "made the volume" in v3[0].message, v3
    # One that found it standing (idempotent) changes nothing.
    again = _op(2, "CreateVolume", "v", 2, 3, capacity=16 * MiB,
                params={"qosIopsLimit": "900"})
    assert check([made, again], _truth({"v": VolumeTruth(16 * MiB, {iops: "300"})})) == []
    # Made again after an OK delete: its own QoS (none), not the old image's.
    gone = _op(2, "DeleteVolume", "v", 2, 3)
    remade = _op(3, "CreateVolume", "v", 4, 5, capacity=16 * MiB)
    old = _truth({"v": VolumeTruth(16 * MiB, {iops: "300"})})
    assert [x.invariant for x in check([made, gone, remade], old)] == [3]
    # ... unless another create may have made it since the delete.
    cut = _op(4, "CreateVolume", "v", 3.5, 3.8, "DEADLINE_EXCEEDED",
              params={"qosIopsLimit": "300"})
    assert check([made, gone, cut, remade], old) == []

    # 5: a claim or tombstone left with its object.
    exists = {"v": VolumeTruth(16 * MiB, {})}
    claim = check([create], _truth(exists, records={"img-v": "creating"}))
    assert [x.invariant for x in claim] == [5] and "claim" in claim[0].message, claim
    tomb = check([create, gone], _truth(exists, records={"img-v": "deleting"}))
    assert [x.invariant for x in tomb] == [1, 5], tomb
    # A cut-off delete's tombstone: a delete refused long after it ended,
    # when it was stale, should have taken it over.
    cut_del = _op(2, "DeleteVolume", "v", 2, 3, "DEADLINE_EXCEEDED")
    refused = [_op(3, "DeleteVolume", "v", 4, 4.1, "ABORTED"),
               _op(4, "DeleteVolume", "v", 100, 100.1, "ABORTED")]
    left = _truth(exists, records={"img-v": "deleting"})
    stale = check([create, cut_del, *refused], left, stale_s=80)
    assert [x.invariant for x in stale] == [5] and "#4" in stale[0].message, stale
    assert check([create, cut_del, *refused], left) == []  # no stale time: not judged
    assert check([create, cut_del, refused[0]], left, stale_s=80) == []  # not stale yet
    assert check([create, cut_del, *refused], _truth(records={"img-v": "deleting"}),
                 stale_s=80) == []  # the image is gone: harmless
    cut_create = _op(1, "CreateVolume", "v", 0, 1, "DEADLINE_EXCEEDED")
    late = _op(2, "CreateVolume", "v", 90, 90.1, "ABORTED")
    assert [x.invariant for x in check([cut_create, late], _truth(
        exists, records={"img-v": "creating"}), stale_s=80)] == [5]

    # 6: what a list or a validation says exists, and what it must not miss.
    def listing(i: int, t0: float, names: list[str]) -> Op:
        return _op(i, "ListVolumes", "", t0, t0 + 1, listed=names)

    assert check([create, listing(2, 2, ["v"])], _truth(exists)) == []
    missed = check([create, listing(2, 2, [])], _truth(exists))
    assert [x.invariant for x in missed] == [6] and "did not list" in missed[0].message
    phantom = check([create, gone, listing(3, 4, ["v"])], _truth())
    assert [x.invariant for x in phantom] == [6] and "listed" in phantom[0].message
    # Ceph showed it next to the call: the list was true (invariant 1's case).
    seen = [Sample(4.2, 4.3, _truth(exists))]
    assert [x.invariant for x in check([create, gone, listing(3, 4, ["v"])], _truth(),
                                       seen)] == [1]
    # A create in progress may or may not be listed.
    running = _op(4, "CreateVolume", "v", 3.5, 6, "DEADLINE_EXCEEDED")
    assert check([create, gone, running, listing(3, 4, ["v"])], _truth()) == []
    assert check([create, gone, running, listing(3, 4, [])], _truth()) == []
    # Never created at all.
    assert [x.invariant for x in check([listing(1, 0, ["w"])], _truth())] == [6]
    # A validation is a look at one volume; NOT_FOUND answers are judged too.
    valid = _op(3, VALIDATE, "v", 4, 5)
    assert [x.invariant for x in check([create, gone, valid], _truth())] == [6]
    for method in (VALIDATE, "ControllerExpandVolume", MODIFY):
        nf = _op(2, method, "v", 2, 3, "NOT_FOUND")
        assert [x.invariant for x in check([create, nf], _truth(exists))] == [6], method
        assert check([create, gone, nf], _truth()) == []  # deleted: true
        racing = _op(3, "DeleteVolume", "v", 1.5, 2.5, "DEADLINE_EXCEEDED")
        assert check([create, racing, nf], _truth()) == []  # a delete ran: maybe true

    # 7: GetCapacity against what Ceph reported next to the call.
    cap = _op(1, CAPACITY, "", 2, 3, response={"available_capacity": "100"})
    near = [Sample(1, 1.5, _truth()), Sample(3.5, 4, _truth())]
    for s in near:
        s.truth.available = 100
    assert check([cap], _truth(), near) == []
    near[1].truth.available = 50
    assert check([cap], _truth(), near) == []  # it may have been 50..100
    cap.response = {"available_capacity": "7"}
    assert [x.invariant for x in check([cap], _truth(), near)] == [7]
    assert check([cap], _truth()) == []  # nothing read: not judged

    # The history on disk and back, with the new fields.
    path = tmp_path / "h2.jsonl"
    hist = [create, cut_del, *refused, listing(5, 200, ["v"]), cap]
    dump(hist, path, {"truth": left.to_json(), "stale_s": 80}, near)
    header, ops, samples = load(path)
    assert check(ops, Truth.from_json(header["truth"]), samples, header["stale_s"]) == \
        check(hist, left, near, 80)


# == the run against real daemons ======================================================
def _proc_state(pid: int) -> str:
    """The process's state letter (T: stopped), "" when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return text[text.rindex(")") + 2:].split()[0]


@dataclass
class Replica:
    """One controller daemon. A restart gets either a fresh, empty state dir
    (an emptyDir in a new pod) or the one it had (the same pod restarted);
    always the same socket, desired dir and nodeName. Each incarnation gets
    its own wall clock offset; a pause dir holds its armed pause points."""

    label: str
    root: Path
    base: NodeUnderTest
    extra_config: str
    seed: int
    skew_s: float
    incarnation: int = 0
    state_dirs: int = 0
    offset: float = 0.0
    csi: CsiNode | None = None
    group: csi_pb2_grpc.GroupControllerStub | None = None
    daemons: list[Daemon] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    paused: bool = False

    @property
    def socket(self) -> Path:
        return self.root / "csi" / "csi.sock"

    @property
    def pause_dir(self) -> Path:
        return self.root / "pause"

    def start(self, fresh: bool = True) -> None:
        self.incarnation += 1
        if fresh or not self.state_dirs:
            self.state_dirs += 1
        rng = random.Random(f"{self.seed}/clock/{self.label}/{self.incarnation}")
        self.offset = 0.0 if rng.random() < 0.25 else round(rng.uniform(-1, 1) * self.skew_s, 1)
        dirs = [self.root / "desired", self.root / f"state-{self.state_dirs}", self.root / "srv"]
        for d in (*dirs, self.pause_dir):
            d.mkdir(parents=True, exist_ok=True)
        text = self.base.config.read_text()
        for old, new in zip((self.base.desired, self.base.state, self.base.srv), dirs,
                            strict=True):
            text = text.replace(str(old), str(new))
        config = self.root / f"config-{self.incarnation}.yaml"
        config.write_text(text + self.extra_config)
        node = NodeUnderTest(self.root, self.base.cluster, config, *dirs, self.base.tag)
        path = os.pathsep.join(p for p in (str(FAULTSITE), str(ROOT),
                                           os.environ.get("PYTHONPATH", "")) if p)
        env = {"PYTHONPATH": path, "RBD_TEST_CLOCK_OFFSET_S": str(self.offset),
               "RBD_TEST_PAUSE_DIR": str(self.pause_dir)}
        d = Daemon(node, extra_env=env, args=("--csi-endpoint", f"unix://{self.socket}"))
        self.daemons.append(d)
        c = connect(node, d, self.socket)
        with self.lock:
            self.csi, self.group = c, csi_pb2_grpc.GroupControllerStub(c.channel)
            self.paused = False

    def stubs(self) -> tuple[csi_pb2_grpc.ControllerStub, csi_pb2_grpc.GroupControllerStub,
                             int] | None:
        with self.lock:
            if self.csi is None or self.group is None:
                return None
            return self.csi.controller, self.group, self.incarnation

    @property
    def pid(self) -> int | None:
        with self.lock:
            return self.csi.daemon.proc.pid if self.csi is not None else None

    def stopped(self) -> bool:
        pid = self.pid
        return pid is not None and _proc_state(pid) in ("T", "t")

    def sigstop(self) -> None:
        if (pid := self.pid) is not None:
            os.kill(pid, signal.SIGSTOP)
            self.paused = True

    def arm(self, point: str, name: str = "") -> None:
        """The process stops itself when it next reaches ``point`` (for an
        object whose name contains ``name``)."""
        (self.pause_dir / point).write_text(name)

    def disarm(self, point: str) -> bool:
        """True: the point was never reached (and now never is); False: the
        process took it (it stops itself, if it has not yet)."""
        try:
            (self.pause_dir / point).unlink()
        except FileNotFoundError:
            self.paused = True
            return False
        return True

    def resume(self) -> None:
        if (pid := self.pid) is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self.paused = False

    def kill(self) -> None:
        for armed in self.pause_dir.glob("*"):
            with contextlib.suppress(FileNotFoundError):
                armed.unlink()
        with self.lock:
            c, self.csi, self.group = self.csi, None, None
        if c is not None:
            c.daemon.stop(signal.SIGKILL)  # by its pid (a stopped one too)
            c.channel.close()
        self.paused = False

    def stop(self) -> None:
        if self.paused or self.stopped():
            self.resume()  # a stopped process would not see SIGTERM
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
    """The names the calls use. As a CO has it, a snapshot name has one
    source volume and a group snapshot name one set of them. ``volumes``:
    every volume name used so far (the fixed ones, then each slot's)."""

    fixed: list[str]
    snapshots: dict[str, str]  # snapshot name -> its source volume's name
    groups: dict[str, list[str]]  # group snapshot name -> its source volumes' names
    slots: list[str] = field(default_factory=list)  # the names handed out now
    retired: list[str] = field(default_factory=list)
    volumes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.volumes:
            self.volumes = [*self.fixed, *self.slots]

    def objects(self) -> dict[str, tuple[str, str]]:
        out = {ids.image_for_request(v): (VOLUME, v) for v in self.volumes}
        out.update({ids.snapshot_for_request(s): (SNAPSHOT, s) for s in self.snapshots})
        out.update({ids.group_for_request(g): (GROUP, g) for g in self.groups})
        return out


@dataclass
class Pause:
    """One pause of a replica: armed at a point (stopped when it gets there)
    or stopped at once; it ends ``hold`` seconds after it stopped."""

    replica: Replica
    point: str  # "" : SIGSTOP at once
    kind: str  # a key of PAUSES
    hold: float
    armed_until: float
    stopped_at: float | None = None


class Run:
    """The clients, the faults, and the history they write."""

    def __init__(self, seed: int, replicas: list[Replica], names: Names, pool: str,
                 tag: str, images: set[str]) -> None:
        self.seed, self.replicas, self.names, self.pool = seed, replicas, names, pool
        self.tag, self.images = tag, images
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
        self.issued = 0  # calls of the client threads
        self.generation = 0  # of slot names
        # Calls go on until then (CALLS: set when the faults end).
        self.calls_until = SECONDS if not CALLS else float("inf")
        for slot in range(SLOTS):
            self._new_name(slot)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def _add(self, op: Op) -> None:
        with self.lock:
            op.id = len(self.history)
            self.history.append(op)

    def event(self, what: str, replica: str, message: str = "") -> None:
        t = self.now()
        self._add(Op(0, "chaos", replica, what, "", t, t, "OK", message))

    # -- names -------------------------------------------------------------------
    def _new_name(self, slot: int) -> None:
        """The slot's next name (the caller holds the lock, or no thread runs)."""
        self.generation += 1
        name = f"hr{slot}g{self.generation}-{self.tag}"
        if slot < len(self.names.slots):
            self.names.retired.append(self.names.slots[slot])
            self.names.slots[slot] = name
        else:
            self.names.slots.append(name)
        self.names.volumes.append(name)
        self.images.add(ids.image_for_request(name))  # the node fixture's backstop

    def retire(self, op: Op, rng: random.Random) -> None:
        """After an OK delete or modify, now and then: the name is called no
        more, its slot gets a new one."""
        if not op.ok or rng.random() >= RETIRE_AFTER.get(op.method, 0.0):
            return
        with self.lock:
            if op.name in self.names.slots:
                self._new_name(self.names.slots.index(op.name))

    def names_now(self) -> Names:
        with self.lock:
            return Names(list(self.names.fixed), dict(self.names.snapshots),
                         dict(self.names.groups), list(self.names.slots),
                         list(self.names.retired), list(self.names.volumes))

    # -- one call ----------------------------------------------------------------
    def call(self, thread: str, replica: Replica, method: str, name: str, req: Message,
             timeout: float) -> Op | None:
        stubs = replica.stubs()
        if stubs is None:
            return None  # down: the CO's connection is gone, it picks another
        controller, group, incarnation = stubs
        stub = group if "Group" in method else controller
        if thread != "drain":
            with self.lock:
                self.issued += 1
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
        if method in (MODIFY, "CreateVolume"):
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
            elif op.method == LIST:
                by_image = {ids.image_for_request(v): v for v in self.names.volumes}
                images = [(ids.parse_volume_id(e.volume.volume_id) or ("", ""))[1]
                          for e in resp.entries]
                op.listed = sorted(by_image[i] for i in images if i in by_image)

    # -- random calls --------------------------------------------------------------
    def _qos(self, rng: random.Random) -> dict[str, str]:
        params = {}
        for key in rng.choice((["qosIopsLimit"], ["qosWriteBpsLimit"],
                               ["qosIopsLimit", "qosWriteBpsLimit"])):
            lift = rng.random() < 0.2
            if key == "qosIopsLimit":
                params[key] = "0" if lift else str(rng.randint(100, 5000))
            else:
                params[key] = "0" if lift else f"{rng.randint(1, 100)}Mi"
        return params

    def choose(self, rng: random.Random) -> tuple[str, str, Message]:
        method = rng.choices(list(WEIGHTS), weights=list(WEIGHTS.values()))[0]
        with self.lock:
            vids, sids, gids = dict(self.vol_ids), dict(self.snap_ids), dict(self.group_ids)
            vol = rng.choice([*self.names.fixed, *self.names.slots])
            size = self.sizes.get(vol, 16 * MiB)
        if method == LIST:
            return method, "", pb.ListVolumesRequest()
        if method == CAPACITY:
            return method, "", pb.GetCapacityRequest(volume_capabilities=[mount_cap()],
                                                     parameters={"pool": self.pool})
        if method == VALIDATE:  # by the id the CO was told, or the one it would be
            vid = vids.get(vol) or ids.volume_id(self.pool, ids.image_for_request(vol))
            return method, vol, pb.ValidateVolumeCapabilitiesRequest(
                volume_id=vid, volume_capabilities=[mount_cap()])
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
            return method, vol, pb.ControllerModifyVolumeRequest(
                volume_id=vids[vol], mutable_parameters=self._qos(rng))
        # A create: mostly as before; sometimes another capacity (a name that
        # stands smaller, or larger than a limit, is ALREADY_EXISTS) or QoS.
        need = rng.choice((16, 16, 16, 8, 24, 32)) * MiB
        limit = need + rng.choice((0, 8 * MiB)) if rng.random() < 0.2 else 0
        qos = self._qos(rng) if rng.random() < 0.3 else {}
        return "CreateVolume", vol, pb.CreateVolumeRequest(
            name=vol, capacity_range=pb.CapacityRange(required_bytes=need, limit_bytes=limit),
            volume_capabilities=[mount_cap()], parameters={"pool": self.pool},
            mutable_parameters=qos)

    def client(self, n: int) -> None:
        rng = random.Random(f"{self.seed}/client{n}")
        while not self.stop.is_set() and self.now() < self.calls_until:
            method, name, req = self.choose(rng)
            timeout = rng.uniform(*SHORT) if rng.random() < SHORT_SHARE else rng.uniform(*LONG)
            start = rng.randrange(len(self.replicas))
            for i in range(len(self.replicas)):
                op = self.call(f"c{n}", self.replicas[(start + i) % len(self.replicas)],
                               method, name, req, timeout)
                if op is not None:
                    break
            if op is not None:
                self.retire(op, rng)
            if op is None or not op.ok:
                self.stop.wait(rng.uniform(0.05, 0.5))  # a CO's backoff before the next call

    def guarded(self, body: Callable[..., None], *args: object) -> None:
        """A thread's body: its exception stops the run and is raised after it."""
        try:
            body(*args)
        except BaseException as exc:
            self.errors.append(exc)
            self.stop.set()

    # -- the faults ------------------------------------------------------------------
    def faults_over(self) -> bool:
        if CALLS:
            with self.lock:
                return self.issued >= CALLS
        return self.now() >= SECONDS - TAIL_S

    def chaos(self) -> None:
        """Kills and pauses (and each incarnation's clock) until the faults
        end; then every pause ends, and calls go on for TAIL_S. Run in the
        main thread: a daemon started from a thread would be killed when that
        thread ends (setpriv --pdeathsig is per thread)."""
        rng = random.Random(f"{self.seed}/chaos")
        pauses: dict[str, Pause] = {}
        acted: dict[str, float] = {}  # replica -> when it was last resumed or restarted
        inf = float("inf")
        next_kill = self.now() + rng.uniform(*KILL_EVERY) if "kill" in FAULTS else inf
        next_pause = self.now() + rng.uniform(2.0, 8.0) if "pause" in FAULTS else inf
        first = True
        while not self.stop.is_set() and not self.faults_over():
            now = self.now()
            for label, p in list(pauses.items()):
                if p.stopped_at is None:
                    self._reached(p, now, pauses)
                elif now >= p.stopped_at + p.hold:
                    p.replica.resume()
                    self.event("Resume", f"{label}{p.replica.incarnation}",
                               f"after {now - p.stopped_at:.1f} s ({p.kind})")
                    del pauses[label]
                    acted[label] = now
            # A replica resumed (or restarted) lately is left to act for ACT_S.
            free = [r for r in self.replicas if r.label not in pauses
                    and now - acted.get(r.label, -inf) >= ACT_S]
            if now >= next_kill and free:  # else as soon as one is free
                next_kill = now + rng.uniform(*KILL_EVERY)
                r = rng.choice(free)
                self.restart(r, own=rng.random() < OWN_DIR_SHARE)
                acted[r.label] = self.now()
                free.remove(r)
            if now >= next_pause and free:
                next_pause = now + rng.uniform(*PAUSE_EVERY)
                r = rng.choice(free)
                # Never every replica stopped for long: one keeps answering.
                alone = all(o.label in pauses for o in self.replicas if o is not r)
                p = self._pause(rng, r, now, first and not alone, alone)
                pauses[r.label] = p
                first = first and alone
                free.remove(r)
            due = [max(next_kill, now + 0.5) if not free else next_kill,
                   max(next_pause, now + 0.5) if not free else next_pause,
                   *(p.stopped_at + p.hold for p in pauses.values() if p.stopped_at is not None),
                   *(now + 0.1 for p in pauses.values() if p.stopped_at is None),
                   now + 1.0]  # at least once a second: have the faults ended?
            self.stop.wait(max(0.0, min(due) - self.now()))  # a schedule, not a synchronisation
        for label, p in pauses.items():  # the faults are over: every pause ends
            if p.stopped_at is None and p.replica.disarm(p.point):
                self.event("Disarm", f"{label}{p.replica.incarnation}", f"{p.point} not reached")
                continue
            wait_for(p.replica.stopped, f"replica {label} to stop at {p.point or 'SIGSTOP'}", 30)
            p.replica.resume()
            held = self.now() - (p.stopped_at if p.stopped_at is not None else self.now())
            self.event("Resume", f"{label}{p.replica.incarnation}",
                       f"after {held:.1f} s ({p.kind}, cut short: the faults ended)")
        if CALLS:
            self.calls_until = self.now() + TAIL_S

    def _pause(self, rng: random.Random, r: Replica, now: float, first: bool,
               alone: bool) -> Pause:
        kinds = list(PAUSES)
        kind = rng.choices(kinds, weights=[share for share, _ in PAUSES.values()])[0]
        if first and rng.random() < FIRST_PAST_STALE:
            kind = "past-stale"
        if alone:
            kind = "short"
        hold = rng.uniform(*PAUSES[kind][1])
        # In a run of SECONDS, a pause ends before the faults do (a shorter
        # kind, or none, when it would not).
        end = SECONDS - TAIL_S if not CALLS else float("inf")
        while now + ARM_S + hold > end and kind != "short":
            kind = "past-deadline" if kind == "past-stale" else "short"
            hold = rng.uniform(*PAUSES[kind][1])
        point = rng.choices(list(POINTS), weights=list(POINTS.values()))[0]
        if kind == "past-stale":  # while it holds a lease or a claim
            point = rng.choice(("records.write", "volumes.gate", "volumes.converge"))
        p = Pause(r, point, kind, hold, now + ARM_S)
        if point:
            name = ""
            if point.startswith("records.") and rng.random() < ONE_NAME_SHARE:
                with self.lock:
                    name = rng.choice(self.names.slots)
            r.arm(point, ids.image_for_request(name) if name else "")
            self.event("Arm", f"{r.label}{r.incarnation}", f"{point} for {hold:.1f} s ({kind})"
                       + (f" on {name}" if name else ""))
        else:
            r.sigstop()
            p.stopped_at = now
            self.event("Pause", f"{r.label}{r.incarnation}", f"SIGSTOP for {hold:.1f} s ({kind})")
        return p

    def _reached(self, p: Pause, now: float, pauses: dict[str, Pause]) -> None:
        """An armed pause: stopped at its point yet, or disarmed in time."""
        r = p.replica
        if not r.stopped():
            if now < p.armed_until:
                return
            if r.disarm(p.point):
                self.event("Disarm", f"{r.label}{r.incarnation}", f"{p.point} not reached")
                del pauses[r.label]
                return
            # Taken as it was disarmed: it stops itself in a moment.
            wait_for(r.stopped, f"replica {r.label} to stop at {p.point}", 30)
        p.stopped_at = self.now()
        self.event("Pause", f"{r.label}{r.incarnation}",
                   f"at {p.point} for {p.hold:.1f} s ({p.kind})")

    def restart(self, r: Replica, own: bool) -> None:
        self.event("Kill", f"{r.label}{r.incarnation}", "SIGKILL")
        r.kill()
        r.start(fresh=not own)
        self.event("Restart", f"{r.label}{r.incarnation}",
                   f"{'own' if own else 'empty'} state dir, clock {r.offset:+.1f} s")

    # -- Ceph while calls run ----------------------------------------------------------
    def sample(self, cl: rados.Rados, io: rados.Ioctx) -> None:
        """Ceph as it is now, for the checker (a read that raced a removal
        and failed is dropped: the next one comes)."""
        start = self.now()
        try:
            truth = read_truth(io, self.names_now(), cl)
        except (rbd.Error, rados.Error):
            return
        self.samples.append(Sample(start, self.now(), truth))

    def sampler(self, cl: rados.Rados, io: rados.Ioctx, done: threading.Event) -> None:
        while not done.wait(SAMPLE_S):  # a sampling interval, not a synchronisation
            self.sample(cl, io)

    # -- after the run: the CO finishes its deletes and retries the rest ------------
    def drain(self) -> list[str]:
        """Every pending delete (the last delete of a name not answered OK,
        with no OK create or delete since) is retried until OK: snapshots
        and group snapshots first, with those of a volume whose delete is
        pending (the user deletes them: they would refuse it for ever), then
        volumes. Then every other last call with no final answer is retried
        until it has one. All within DRAIN_S; returns what did not finish."""
        with self.lock:
            history = list(self.history)
        per: dict[tuple[str, str], list[Op]] = {}
        for op in sorted(history, key=lambda o: o.invoke):
            if op.kind is not None:
                per.setdefault((op.kind, op.name), []).append(op)
        pending: dict[tuple[str, str], tuple[str, Message]] = {}
        others: list[tuple[str, str, Message]] = []
        for (kind, name), ops in per.items():
            dels = [o for o in ops if o.method.startswith("Delete")]
            if dels and not dels[-1].ok and not any(
                    o.ok and o.invoke > dels[-1].invoke and o.method.startswith(("Create",
                                                                                 "Delete"))
                    for o in ops):
                pending[(kind, name)] = self.requests[dels[-1].id]
            last = ops[-1]
            if not last.ok and last.outcome not in FINAL and not last.method.startswith("Del"):
                others.append((name, *self.requests[last.id]))
        for kind, vol in list(pending):
            if kind != VOLUME:
                continue
            image = ids.image_for_request(vol)
            for snap in (s for s, v in self.names.snapshots.items() if v == vol):
                sid = self.snap_ids.get(snap) or ids.snapshot_id(
                    self.pool, image, ids.snapshot_for_request(snap))
                pending.setdefault((SNAPSHOT, snap), (
                    "DeleteSnapshot", pb.DeleteSnapshotRequest(snapshot_id=sid)))
            for grp in (g for g, vs in self.names.groups.items() if vol in vs):
                gid = self.group_ids.get(grp) or ids.group_id(
                    self.pool, ids.group_for_request(grp))
                pending.setdefault((GROUP, grp), ("DeleteVolumeGroupSnapshot",
                                                  pb.DeleteVolumeGroupSnapshotRequest(
                                                      group_snapshot_id=gid)))
        end = self.now() + DRAIN_S
        unfinished: list[str] = []

        def retry(name: str, method: str, req: Message, until_ok: bool) -> None:
            rng = random.Random(f"{self.seed}/drain/{method}/{name}")
            got = None
            while self.now() < end:
                got = self.call("drain", rng.choice(self.replicas), method, name, req, 30.0)
                if got is not None and (got.ok or (got.outcome in FINAL and not until_ok)):
                    return
                self.stop.wait(rng.uniform(0.5, 2.0))  # the CO's backoff between retries
            last = got.outcome if got else "not tried: the drain's time was up"
            with self.lock:
                unfinished.append(f"{method} {name}: {last}")

        batches = ([(n, *mr, True) for (k, n), mr in pending.items() if k != VOLUME],
                   [(n, *mr, True) for (k, n), mr in pending.items() if k == VOLUME],
                   [(*nmr, False) for nmr in others])
        for batch in batches:
            threads = [threading.Thread(target=retry, args=args, name=f"drain-{args[0]}")
                       for args in batch]
            for t in threads:
                t.start()
            for t in threads:
                t.join(max(0.0, end - self.now()) + 60)
            assert not any(t.is_alive() for t in threads), "a drain thread did not finish"
        return unfinished


# == the truth in Ceph ==================================================================
def available(cl: rados.Rados, pool: str) -> int | None:
    """The pool's free bytes as `ceph df` reports them (what GetCapacity
    passes on), the cluster's when it lists no pools (a cluster without a
    manager: ours); None when Ceph did not answer."""
    try:
        ret, out, _ = cl.mon_command(json.dumps({"prefix": "df", "format": "json"}), b"",
                                     timeout=10)
    except rados.Error:
        return None
    if ret != 0:
        return None
    df = json.loads(out)
    for p in df.get("pools", []):
        if p.get("name") == pool:
            return int(p["stats"]["max_avail"])
    return int(df.get("stats", {}).get("total_avail_bytes", 0))


def read_truth(io: rados.Ioctx, names: Names, cl: rados.Rados | None = None) -> Truth:
    objects = names.objects()
    images = set(rbd.RBD().list(io))
    volumes: dict[str, VolumeTruth] = {}
    snaps: set[str] = set()
    members: set[str] = set()  # groups with a member snapshot on one of the images
    for v in names.volumes:
        image = ids.image_for_request(v)
        if image not in images:
            continue
        with contextlib.suppress(rbd.ImageNotFound), rbd.Image(io, image, read_only=True) as img:
            meta = {k: val for k, val in img.metadata_list() if k.startswith("conf_rbd_qos_")}
            volumes[v] = VolumeTruth(img.size(), meta)
            listed = list(img.list_snaps())
            have = {s["name"] for s in listed}
            snaps.update(s for s, src in names.snapshots.items()
                         if src == v and ids.snapshot_for_request(s) in have)
            for s in listed:
                if s.get("namespace") == rbd.RBD_SNAP_NAMESPACE_TYPE_GROUP:
                    members.add(img.snap_get_group_namespace(s["id"])["name"])
    groups: dict[str, bool] = {}
    existing = set(rbd.RBD().group_list(io))
    for g in names.groups:
        gname = ids.group_for_request(g)
        if gname in existing:
            with rbd.Group(io, gname) as grp:
                groups[g] = any(s["name"] == gname and s["state"] ==
                                rbd.RBD_GROUP_SNAP_STATE_COMPLETE for s in grp.list_snaps())
        elif gname in members:  # its group is gone, a member snapshot is not
            groups[g] = False
    records: dict[str, str] = {}
    with rados.ReadOpCtx() as op:
        it, _ = io.get_omap_vals(op, "", RECORDS_PREFIX, 100000)
        with contextlib.suppress(rados.ObjectNotFound):
            io.operate_read_op(op, RECORDS_OBJECT)
            for key, raw in it:
                obj = key[len(RECORDS_PREFIX):]
                if obj in objects:
                    try:
                        records[obj] = str(json.loads(raw).get("state"))
                    except ValueError:
                        records[obj] = "unreadable"
    free = available(cl, io.get_pool_name()) if cl is not None else None
    return Truth(volumes, snaps, groups, objects, records, free)


def settle(run: Run, cl: rados.Rados, io: rados.Ioctx,
           replicas: list[Replica]) -> tuple[Truth, str]:
    """Ceph unchanged for QUIET_S (longer than two resyncs: a left-behind file
    acts within one), at most SETTLE_S; each read is a sample too. Returns the
    final truth and a note."""
    last: dict[str, Any] | None = None
    since = time.monotonic()
    end = since + SETTLE_S
    while time.monotonic() - since < QUIET_S and time.monotonic() < end:
        run.sample(cl, io)
        now = run.samples[-1].truth.to_json() if run.samples else None
        if now != last:
            last, since = now, time.monotonic()
        time.sleep(1.0)  # the poll interval of a condition with a deadline
    notes = [] if time.monotonic() - since >= QUIET_S else \
        [f"Ceph was still changing after {SETTLE_S:.0f} s (never settled)"]
    dead = [r.label for r in replicas if not r.alive()]
    if dead:
        notes.append(f"daemons not running at the end: {dead}")
    return read_truth(io, run.names_now(), cl), "; ".join(notes)
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


def run_clients(run: Run, threads: list[threading.Thread]) -> None:
    """The clients in their threads; the faults here, in the main thread."""
    for t in threads:
        t.start()
    run.guarded(run.chaos)
    for t in threads:
        t.join(TAIL_S + LONG[1] + 300)
    assert not any(t.is_alive() for t in threads), "a client thread did not finish"
    if run.errors:
        raise run.errors[0]


def summary(history: list[Op], issued: int) -> list[str]:
    """Calls issued and retried, answers per method, faults injected."""
    calls = [op for op in history if op.thread != "chaos"]
    events = [op for op in history if op.thread == "chaos"]
    answers: dict[str, int] = {}
    for op in calls:
        answers[f"{op.method} {op.outcome}"] = answers.get(f"{op.method} {op.outcome}", 0) + 1
    pauses: dict[str, int] = {}
    for op in events:
        if op.method == "Pause":
            kind = op.message.rsplit("(", 1)[-1].rstrip(")")
            point = op.message.split()[1] if op.message.startswith("at ") else "once"
            pauses[f"{kind} at {point}"] = pauses.get(f"{kind} at {point}", 0) + 1
    kills = sum(op.method == "Kill" for op in events)
    own = sum(op.method == "Restart" and op.message.startswith("own") for op in events)
    unreached = sum(op.method == "Disarm" for op in events)
    offsets = [op.message.rsplit("clock ", 1)[-1] for op in events
               if op.method in ("Start", "Restart")]
    lines = [f"calls issued: {issued}, CO retries after: {len(calls) - issued}"]
    lines += [f"  {answers[k]:5d}  {k}" for k in sorted(answers)]
    lines.append(f"faults injected: {kills + sum(pauses.values())}: kills {kills} (restarted on "
                 f"their own state dir {own}, on an empty one {kills - own}), pauses "
                 f"{sum(pauses.values())} ({unreached} more armed, never reached); "
                 f"clocks: {', '.join(offsets)}")
    lines += [f"  {pauses[k]:5d}  pause {k}" for k in sorted(pauses)]
    return lines


@pytest.fixture
def pool_io(node: NodeUnderTest) -> Iterator[rados.Ioctx]:
    with node.cluster.client() as cl, cl.open_ioctx(node.cluster.pool) as io:
        yield io


@pytest.mark.ceph
def test_csi_history(node: NodeUnderTest, pool_io: rados.Ioctx, tmp_path: Path) -> None:
    seed = int(os.environ.get("RBD_HISTORY_SEED") or random.SystemRandom().randrange(1 << 32))
    length = f"RBD_HISTORY_CALLS={CALLS}" if CALLS else f"RBD_HISTORY_SECONDS={SECONDS:g}"
    print(f"\nRBD_HISTORY_SEED={seed} {length} RBD_HISTORY_REPLICAS={REPLICAS} "
          f"RBD_HISTORY_THREADS={THREADS} RBD_HISTORY_FAULTS={','.join(sorted(FAULTS))} "
          f"RBD_HISTORY_SKEW_S={SKEW_S:g}")
    vols = [node.name(f"hv{i}") for i in range(3)]
    names = Names(vols, {node.name("hs0"): vols[0], node.name("hs1"): vols[1]},
                  {node.name("hg0"): vols[1:]})
    node.images.update(ids.image_for_request(v) for v in names.volumes)  # a backstop
    pool = node.cluster.pool
    extra = (f"resyncSeconds: {RESYNC_S}\ncsi:\n  driverName: rbd.test.local\n"
             f"  statePool: {pool}\n  timeoutSeconds: {CSI_TIMEOUT_S}\n")
    skew = SKEW_S if "skew" in FAULTS else 0.0
    replicas = [Replica(label, tmp_path / f"replica-{label}", node, extra, seed, skew)
                for label in "abc"[:REPLICAS]]
    cleanup(pool_io, names)
    run = Run(seed, replicas, names, pool, node.tag, node.images)
    out = tmp_path / "history.jsonl"
    violations: list[Violation] = []
    note = ""
    began = time.monotonic()
    try:
        for r in replicas:
            r.start()
        run.t0 = time.monotonic()
        for r in replicas:
            run.event("Start", f"{r.label}{r.incarnation}", f"clock {r.offset:+.1f} s")
        threads = [threading.Thread(target=run.guarded, args=(run.client, n),
                                    name=f"client-{n}") for n in range(THREADS)]
        sampling = threading.Event()
        with node.cluster.client() as cl, cl.open_ioctx(pool) as sample_io:
            sampler = threading.Thread(target=run.sampler, args=(cl, sample_io, sampling),
                                       name="sampler")
            sampler.start()
            try:
                run_clients(run, threads)
                issued, calls_s = run.issued, run.now()
                unfinished = run.drain()
                drain_s = run.now() - calls_s
            finally:
                sampling.set()
                sampler.join(60)
            truth, note = settle(run, cl, pool_io, replicas)
            if unfinished:
                note = "; ".join(([note] if note else []) + [
                    f"the drain did not finish {len(unfinished)} call(s) in {DRAIN_S:.0f} s: "
                    + ", ".join(unfinished)])
        checking = time.monotonic()
        violations = check(run.history, truth, run.samples, stale_s=STALE_S + CSI_TIMEOUT_S)
        check_s = time.monotonic() - checking
        header = {"seed": seed, "seconds": SECONDS, "calls": CALLS, "replicas": REPLICAS,
                  "threads": THREADS, "faults": sorted(FAULTS), "skew_s": skew,
                  "stale_s": STALE_S + CSI_TIMEOUT_S, "names": asdict(run.names_now()),
                  "wall_start": run.wall0, "truth": truth.to_json(), "note": note,
                  "logs": [str(d.log) for r in replicas for d in r.daemons]}
        dump(run.history, out, header, run.samples)
        print("\n".join(summary(run.history, issued)))
        print(f"calls {calls_s:.0f} s, drain {drain_s:.0f} s, settled after "
              f"{run.now() - calls_s - drain_s:.0f} s, checked in {check_s:.1f} s; "
              f"{len(run.samples)} samples of Ceph; {len(run.names.volumes)} volume names; "
              f"history: {out}")
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
        cleanup(pool_io, run.names_now())
    print(f"the whole run: {time.monotonic() - began:.0f} s")
    if violations:
        per = {i: sum(1 for v in violations if v.invariant == i) for i in range(1, 8)}
        pytest.fail(f"{len(violations)} violation(s) (per invariant: {per}); seed {seed}, "
                    f"replay with RBD_HISTORY_SEED={seed}; history {out}\n"
                    + "\n".join(map(str, violations)), pytrace=False)
