"""A Jepsen-style history of CSI controller calls and a pure checker for it.

The history is what clients saw: each call's invoke and complete time, the
replica it went to, the request and the answer (OK with the answer's fields,
or a gRPC code and message). The truth is what Ceph holds: images with their
size and QoS image-meta, snapshots, group snapshots, and the controller's
records; read once the replicas settled (the final truth) and, as samples,
while the calls ran. ``check`` relates history and truth; it knows nothing of
the adapter's internals, only the CSI API and librbd's own keys.

Semantics. A call answered OK took effect between its invoke and its
complete. A call answered with a definite refusal (``DEFINITE``: nothing was
written) took no effect. Any other answer (DEADLINE_EXCEEDED, UNAVAILABLE
when a replica was killed, INTERNAL, FAILED_PRECONDITION, ...) is
indeterminate: it may have taken effect, but only while the client waited: a
call that is over, whatever its answer, never acts after a later call began
(the controller's stated design: a file left by a cut-off call never acts on
its own later). So a call "ran after" a moment t when it may have taken
effect and had not completed by t.

The invariants, each per object (a volume, snapshot or group snapshot name),
at the end and at each sample (a sample taken between s0 and s1 judges the
calls completed before s0, and excuses any call begun before s1):

1. An OK delete is never undone: after the last OK delete D (by invoke), if
   no create ran after D was invoked, the object is gone. (An expand or a
   modify racing D does not excuse it: neither may create.)
2. An acknowledged create or size holds: for each OK create or expand A
   with no delete running after A was invoked, the object exists and (a
   volume) is at least A's acknowledged capacity.
3. An acknowledged QoS value holds: for each QoS key, the last OK modify M
   that set it (by complete) determines it when no other modify of that key
   and no delete ran after M was invoked; the image-meta then holds M's
   value (or no key: "0" lifts the limit). An expand beside M must keep it.
4. Records match Ceph (at the end only): for each settled object (its last
   call answered OK and no other call overlapped it), an existing object has
   a record and a record in state ``created`` has its object.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MiB = 1 << 20

# Refusals given before anything is written (ABORTED: another call holds the
# name, retry); the rest may have acted. FAILED_PRECONDITION is not among
# them: it is also the engine's refusal of a file already written (a step
# refused, others perhaps done), and the API does not tell the two apart.
DEFINITE = frozenset({"ABORTED", "INVALID_ARGUMENT", "NOT_FOUND", "ALREADY_EXISTS",
                      "OUT_OF_RANGE"})
# What a CO does not retry: the answer is final (ABORTED is retried).
FINAL = (DEFINITE - {"ABORTED"}) | {"FAILED_PRECONDITION"}

VOLUME, SNAPSHOT, GROUP = "volume", "snapshot", "group"
CREATE = {"CreateVolume": VOLUME, "CreateSnapshot": SNAPSHOT,
          "CreateVolumeGroupSnapshot": GROUP}
DELETE = {"DeleteVolume": VOLUME, "DeleteSnapshot": SNAPSHOT,
          "DeleteVolumeGroupSnapshot": GROUP}
EXPAND, MODIFY = "ControllerExpandVolume", "ControllerModifyVolume"
KIND = {**CREATE, **DELETE, EXPAND: VOLUME, MODIFY: VOLUME}

# CSI mutable parameter -> librbd's per-image config key (image-meta), and
# whether its value is a size ("100Mi") in bytes.
QOS_META = {"qosIopsLimit": ("conf_rbd_qos_iops_limit", False),
            "qosWriteBpsLimit": ("conf_rbd_qos_write_bps_limit", True)}
_UNITS = {"Ki": 1 << 10, "Mi": MiB, "Gi": 1 << 30}


@dataclass
class Op:
    """One call as the client saw it (or an event: Kill, Restart, with no name)."""

    id: int
    thread: str
    replica: str
    method: str
    name: str  # the request name of the object: volume, snapshot or group
    invoke: float  # seconds since the run began (monotonic)
    complete: float
    outcome: str  # "OK" or the gRPC code's name
    message: str = ""
    timeout: float = 0.0
    capacity: int = 0  # an OK create / expand: the acknowledged capacity_bytes
    params: dict[str, str] = field(default_factory=dict)  # a modify's mutable_parameters
    request: dict[str, Any] = field(default_factory=dict)
    response: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.outcome == "OK"

    @property
    def effective(self) -> bool:
        """It did, or may have, taken effect."""
        return self.outcome not in DEFINITE

    @property
    def kind(self) -> str | None:
        return KIND.get(self.method)


@dataclass
class VolumeTruth:
    size: int
    meta: dict[str, str]  # the image's conf_rbd_qos_* image-meta


@dataclass
class Truth:
    """Ceph after the run, for the run's own names."""

    volumes: dict[str, VolumeTruth]  # request name -> the image, if it exists
    snapshots: set[str]  # request names whose RBD snapshot exists (on any of the images)
    groups: dict[str, bool]  # request name -> the RBD group exists: its snapshot is complete
    # Object (image / snapshot / group) name -> (kind, request name), for every name used.
    objects: dict[str, tuple[str, str]]
    records: dict[str, str]  # object name -> the record's state, for records of our names

    def exists(self, kind: str, name: str) -> bool:
        if kind == VOLUME:
            return name in self.volumes
        if kind == SNAPSHOT:
            return name in self.snapshots
        return name in self.groups

    def to_json(self) -> dict[str, Any]:
        return {"volumes": {n: asdict(v) for n, v in self.volumes.items()},
                "snapshots": sorted(self.snapshots), "groups": self.groups,
                "objects": {o: list(kn) for o, kn in self.objects.items()},
                "records": self.records}

    @staticmethod
    def from_json(data: dict[str, Any]) -> Truth:
        return Truth({n: VolumeTruth(**v) for n, v in data["volumes"].items()},
                     set(data["snapshots"]), dict(data["groups"]),
                     {o: (k, n) for o, (k, n) in data["objects"].items()},
                     dict(data["records"]))


@dataclass(frozen=True)
class Violation:
    invariant: int
    kind: str
    name: str
    message: str
    ops: tuple[int, ...] = ()

    def __str__(self) -> str:
        ops = f" (ops {', '.join(map(str, self.ops))})" if self.ops else ""
        return f"invariant {self.invariant}: {self.kind} {self.name}: {self.message}{ops}"


def meta_value(param: str, value: str) -> str | None:
    """The image-meta value a mutable parameter sets; None: the key is removed."""
    if value.strip() == "0":
        return None
    _, is_size = QOS_META[param]
    if not is_size:
        return str(int(value))
    for suffix, factor in _UNITS.items():
        if value.endswith(suffix):
            return str(int(value[:-len(suffix)]) * factor)
    return str(int(value))


@dataclass
class Sample:
    """The truth read while calls ran: each thing in it was so at some moment
    between ``start`` and ``end`` (run seconds)."""

    start: float
    end: float
    truth: Truth


def _by_object(history: Iterable[Op]) -> dict[tuple[str, str], list[Op]]:
    out: dict[tuple[str, str], list[Op]] = {}
    for op in history:
        if op.kind is not None:
            out.setdefault((op.kind, op.name), []).append(op)
    for ops in out.values():
        ops.sort(key=lambda o: o.invoke)
    return out


def _fmt(op: Op) -> str:
    return (f"#{op.id} {op.method} on {op.replica} [{op.invoke:.2f}..{op.complete:.2f}] "
            f"{op.outcome}")


def _after(op: Op, t: float, until: float) -> bool:
    """``op`` may have acted after ``t`` and before ``until``: it did or may have
    taken effect, it was still running at ``t``, and it began before ``until``."""
    return op.effective and op.complete > t and op.invoke < until


def _suspects(ops: list[Op], target: Op, until: float) -> tuple[Op, ...]:
    """For a report: other calls that may have acted since ``target`` began,
    and the last few that were cut off (or failed) before it."""
    since = [o for o in ops if o is not target and _after(o, target.invoke, until)]
    cut = [o for o in ops if o.effective and not o.ok and o.complete <= target.invoke]
    return tuple(cut[-3:] + since[:5])


def _hint(suspects: tuple[Op, ...]) -> str:
    return f"; suspects: {', '.join(map(_fmt, suspects))}" if suspects else ""


def check(history: list[Op], final: Truth, samples: Iterable[Sample] = ()) -> list[Violation]:
    """The violations in ``history`` against Ceph at the end (``final``, every
    call over) and while calls ran (``samples``): each found once, the first
    time it shows."""
    objects = _by_object(history)
    found: dict[tuple[int, str, str, tuple[int, ...]], Violation] = {}
    seen: dict[tuple[int, str, str, tuple[int, ...]], int] = {}
    inf = float("inf")
    for sample in [*samples, Sample(inf, inf, final)]:
        for v in _check_at(objects, sample):
            key = (v.invariant, v.kind, v.name, v.ops[:1])
            found.setdefault(key, v)
            seen[key] = seen.get(key, 0) + 1
    for v in _records_match(objects, final):
        found.setdefault((v.invariant, v.kind, v.name, v.ops[:1]), v)
    out = []
    for key, v in found.items():
        n = seen.get(key, 1)
        out.append(Violation(v.invariant, v.kind, v.name, v.message + (
            f" [in {n} samples]" if n > 1 else ""), v.ops))
    return sorted(out, key=lambda v: (v.invariant, v.kind, v.name))


def _check_at(objects: dict[tuple[str, str], list[Op]], sample: Sample) -> list[Violation]:
    out: list[Violation] = []
    truth = sample.truth
    when = "at the end" if sample.start == float("inf") else \
        f"at {sample.start:.2f}..{sample.end:.2f}"
    for (kind, name), ops in sorted(objects.items()):
        done = [o for o in ops if o.complete < sample.start]
        deletes = [o for o in ops if DELETE.get(o.method) == kind]
        out += _deletes_hold(kind, name, ops, done, truth, sample.end, when)
        out += _acks_hold(kind, name, ops, done, deletes, truth, sample.end, when)
        if kind == VOLUME and name in truth.volumes:
            out += _qos_holds(name, ops, done, deletes, truth.volumes[name], sample.end, when)
    return out


def _deletes_hold(kind: str, name: str, ops: list[Op], done: list[Op], truth: Truth,
                  until: float, when: str) -> list[Violation]:
    oks = [d for d in done if d.ok and DELETE.get(d.method) == kind]
    if not oks or not truth.exists(kind, name):
        return []
    last = max(oks, key=lambda d: d.invoke)
    if any(CREATE.get(c.method) == kind and _after(c, last.invoke, until) for c in ops):
        return []  # a create concurrent with it or after it may stand
    sus = _suspects(ops, last, until)
    return [Violation(1, kind, name, f"exists {when}, but {_fmt(last)} deleted it and no "
                      f"create ran after it{_hint(sus)}", (last.id, *(o.id for o in sus)))]


def _acks_hold(kind: str, name: str, ops: list[Op], done: list[Op], deletes: list[Op],
               truth: Truth, until: float, when: str) -> list[Violation]:
    acks = [o for o in done if o.ok and (CREATE.get(o.method) == kind or o.method == EXPAND)
            and not any(_after(d, o.invoke, until) for d in deletes)]
    if not acks:
        return []
    if not truth.exists(kind, name) or (kind == GROUP and not truth.groups[name]):
        last = max(acks, key=lambda o: o.invoke)
        sus = _suspects(ops, last, until)
        return [Violation(2, kind, name, f"is gone {when}, but {_fmt(last)} acknowledged it "
                          f"and no delete ran after it{_hint(sus)}",
                          (last.id, *(o.id for o in sus)))]
    if kind != VOLUME:
        return []
    biggest = max(acks, key=lambda o: o.capacity)
    size = truth.volumes[name].size
    if size < biggest.capacity:
        sus = _suspects(ops, biggest, until)
        return [Violation(2, kind, name, f"is {size} bytes {when}, but {_fmt(biggest)} "
                          f"acknowledged {biggest.capacity} bytes (sizes never shrink)"
                          f"{_hint(sus)}", (biggest.id, *(o.id for o in sus)))]
    return []


def _qos_holds(name: str, ops: list[Op], done: list[Op], deletes: list[Op],
               image: VolumeTruth, until: float, when: str) -> list[Violation]:
    out = []
    for param, (key, _) in sorted(QOS_META.items()):
        oks = [o for o in done if o.method == MODIFY and o.ok and param in o.params]
        if not oks:
            continue
        last = max(oks, key=lambda o: o.complete)
        racing = [o for o in ops if o is not last and o.method == MODIFY
                  and param in o.params and _after(o, last.invoke, until)]
        if racing or any(_after(d, last.invoke, until) for d in deletes):
            continue  # not determined: another value, or another image, may stand
        want = meta_value(param, last.params[param])
        have = image.meta.get(key)
        if have != want:
            sus = _suspects(ops, last, until)
            out.append(Violation(3, VOLUME, name, f"{key} is {have!r} {when}, but "
                                 f"{_fmt(last)} set {param}={last.params[param]} "
                                 f"({want!r}) and no other modify of it ran since"
                                 f"{_hint(sus)}", (last.id, *(o.id for o in sus))))
    return out


def _records_match(objects: dict[tuple[str, str], list[Op]],
                   truth: Truth) -> list[Violation]:
    """Invariant 4, at the end only (a create claims, makes, then records)."""
    out = []
    for obj, (kind, name) in sorted(truth.objects.items()):
        ops = objects.get((kind, name), [])
        if not ops:
            continue
        last = max(ops, key=lambda o: o.invoke)
        settled = last.ok and all(o.complete < last.invoke for o in ops if o is not last)
        if not settled:
            continue
        exists = truth.exists(kind, name)
        state = truth.records.get(obj)
        if exists and state is None:
            out.append(Violation(4, kind, name, f"{obj} exists but has no record (settled by "
                                 f"{_fmt(last)})", (last.id,)))
        if state == "created" and not exists:
            out.append(Violation(4, kind, name, f"the record of {obj} says created but it "
                                 f"does not exist (settled by {_fmt(last)})", (last.id,)))
    return out


# -- the history on disk: JSON lines, one call, event or sample a line ---------------
def dump(history: Iterable[Op], path: Path, header: dict[str, Any],
         samples: Iterable[Sample] = ()) -> None:
    """The header (seed, names, the final truth as ``truth``), then the calls
    and events, then the samples."""
    with path.open("w") as f:
        f.write(json.dumps({"header": header}) + "\n")
        for op in history:
            f.write(json.dumps(asdict(op), sort_keys=True) + "\n")
        for s in samples:
            f.write(json.dumps({"sample": [s.start, s.end, s.truth.to_json()]}) + "\n")


def load(path: Path) -> tuple[dict[str, Any], list[Op], list[Sample]]:
    """What ``dump`` wrote: check(ops, Truth.from_json(header["truth"]), samples)
    checks it again."""
    header: dict[str, Any] = {}
    ops, samples = [], []
    for line in path.read_text().splitlines():
        data = json.loads(line)
        if "header" in data:
            header = data["header"]
        elif "sample" in data:
            start, end, truth = data["sample"]
            samples.append(Sample(start, end, Truth.from_json(truth)))
        else:
            ops.append(Op(**data))
    return header, ops, samples
