"""A Jepsen-style history of CSI controller calls and a pure checker for it.

The history is what clients saw: each call's invoke and complete time, the
replica it went to, the request and the answer (OK with the answer's fields,
or a gRPC code and message). The truth is what Ceph holds: images with their
size and QoS image-meta, snapshots, group snapshots, the controller's
records, and the pool's free bytes as Ceph reports them; read once the
replicas settled (the final truth) and, as samples, while the calls ran.
``check`` relates history and truth; it knows nothing of the adapter's
internals, only the CSI API, librbd's own keys and the records' states
(``creating``: a claim, ``deleting``: a tombstone).

Semantics. A call answered OK took effect between its invoke and its
complete. A call answered with a definite refusal (``DEFINITE``: nothing was
written; ALREADY_EXISTS, a create whose name stands with other parameters,
among them) took no effect. Any other answer (DEADLINE_EXCEEDED, UNAVAILABLE
when a replica was killed, INTERNAL, FAILED_PRECONDITION, ...) is
indeterminate: it may have taken effect, but only while the client waited: a
call that is over, whatever its answer, never acts after a later call began
(the controller's stated design: a file left by a cut-off call never acts on
its own later; a replica paused past its client's deadline and resumed acts
no more either). So a call "ran after" a moment t when it may have taken
effect and had not completed by t. The questions (ListVolumes,
ValidateVolumeCapabilities, GetCapacity) change nothing.

The invariants, each per object (a volume, snapshot or group snapshot name),
at the end and at each sample (a sample taken between s0 and s1 judges the
calls completed before s0, and excuses any call begun before s1):

1. An OK delete is never undone: after the last OK delete D (by invoke), if
   no create ran after D was invoked, the object is gone. (An expand or a
   modify racing D does not excuse it: neither may create.)
2. An acknowledged create or size holds: for each OK create or expand A
   with no delete running after A was invoked, the object exists and (a
   volume) is at least A's acknowledged capacity.
3. An acknowledged QoS value holds: for each QoS key, the last OK call that
   set it (by complete) determines it when no other modify of that key and
   no delete ran after it was invoked; the image-meta then holds its value
   (or no key: "0" lifts the limit). The calls that set a key: a modify
   naming it, and a create that made the volume (an OK create with no other
   create running since the last OK delete, or since the start: the volume
   did not exist, so its mutable_parameters are all the QoS it has; a key
   it does not name is not set). An expand beside it must keep it.
4. Records match Ceph (at the end only): for each settled object (its last
   call answered OK and no other call overlapped it), an existing object has
   a record and a record in state ``created`` has its object.
5. No claim or tombstone outlives its call (at the end only, after the CO's
   drain finished every pending delete): a record in state ``creating`` or
   ``deleting`` whose object still exists is a violation when the object is
   settled (as in 4), or when a call that finishes it (a create for a claim,
   a delete for a tombstone) was invoked more than ``stale_s`` after every
   call that may have written it had ended (creates, expands and modifies
   write claims, deletes tombstones): by then the record was stale and that
   call should have taken it over.
6. Answers about a volume's existence are true. A volume listed by an OK
   ListVolumes, or answered OK by ValidateVolumeCapabilities, existed at
   some moment during the call: it is a violation when no create may have
   made it by then (none ran since the last OK delete before the call, or
   none ever began) and no sample of Ceph next to the call (the last one
   before it, those during it, the first one after it) shows it; a create
   in progress may or may not be listed. An acknowledged volume (an OK
   create, expand or modify completed before the call, no delete running
   since it was invoked until the call ended) is listed by every OK
   ListVolumes (one answer, no paging) and never answered NOT_FOUND by an
   expand, a modify or a validation (judged on the history alone: a volume
   Ceph lost is invariant 2's as well).
7. GetCapacity answers what Ceph reports: an OK answer's available_capacity
   lies within what the samples next to the call read for the pool (the
   run writes no data, so Ceph's figure holds still between them).
"""

from __future__ import annotations

import bisect
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
# The questions: they change nothing (not in KIND: never an object's call).
LIST, VALIDATE, CAPACITY = "ListVolumes", "ValidateVolumeCapabilities", "GetCapacity"
QUESTIONS = (LIST, VALIDATE, CAPACITY)
# A record's states that a call holds while it runs.
CLAIM, TOMBSTONE = "creating", "deleting"

# CSI mutable parameter -> librbd's per-image config key (image-meta), and
# whether its value is a size ("100Mi") in bytes.
QOS_META = {"qosIopsLimit": ("conf_rbd_qos_iops_limit", False),
            "qosWriteBpsLimit": ("conf_rbd_qos_write_bps_limit", True)}
_UNITS = {"Ki": 1 << 10, "Mi": MiB, "Gi": 1 << 30}
INF = float("inf")


@dataclass
class Op:
    """One call as the client saw it (or an event: Kill, Restart, Pause, with no name)."""

    id: int
    thread: str
    replica: str
    method: str
    name: str  # the request name of the object: volume, snapshot or group ("": none)
    invoke: float  # seconds since the run began (monotonic)
    complete: float
    outcome: str  # "OK" or the gRPC code's name
    message: str = ""
    timeout: float = 0.0
    capacity: int = 0  # an OK create / expand: the acknowledged capacity_bytes
    # The mutable_parameters of a modify or a create.
    params: dict[str, str] = field(default_factory=dict)
    request: dict[str, Any] = field(default_factory=dict)
    response: dict[str, Any] = field(default_factory=dict)
    listed: list[str] = field(default_factory=list)  # an OK ListVolumes: the request names

    @property
    def ok(self) -> bool:
        return self.outcome == "OK"

    @property
    def effective(self) -> bool:
        """It did, or may have, taken effect."""
        return self.outcome not in DEFINITE and self.method not in QUESTIONS

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
    # request name -> the group snapshot exists (its RBD group, or a member snapshot of
    # it on an image): whether it is complete
    groups: dict[str, bool]
    # Object (image / snapshot / group) name -> (kind, request name), for every name used.
    objects: dict[str, tuple[str, str]]
    records: dict[str, str]  # object name -> the record's state, for records of our names
    available: int | None = None  # the pool's free bytes as Ceph reports them (None: unread)

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
                "records": self.records, "available": self.available}

    @staticmethod
    def from_json(data: dict[str, Any]) -> Truth:
        return Truth({n: VolumeTruth(**v) for n, v in data["volumes"].items()},
                     set(data["snapshots"]), dict(data["groups"]),
                     {o: (k, n) for o, (k, n) in data["objects"].items()},
                     dict(data["records"]), data.get("available"))


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


def _makers(ops: list[Op]) -> set[int]:
    """The OK CreateVolume calls that made the volume (ids): it did not exist
    when they began (an OK delete before, or nothing before) and no other
    create may have made it meanwhile."""
    out = set()
    for c in ops:
        if c.method != "CreateVolume" or not c.ok:
            continue
        deleted = [d.invoke for d in ops if d.ok and d.method == "DeleteVolume"
                   and d.complete < c.invoke]
        since = max(deleted, default=-INF)
        if not any(o is not c and o.method == "CreateVolume" and o.effective
                   and o.complete > since and o.invoke < c.complete for o in ops):
            out.add(c.id)
    return out


def check(history: list[Op], final: Truth, samples: Iterable[Sample] = (),
          stale_s: float | None = None) -> list[Violation]:
    """The violations in ``history`` against Ceph at the end (``final``, every
    call over) and while calls ran (``samples``): each found once, the first
    time it shows. ``stale_s``: after how long a claim or tombstone must be
    taken over (invariant 5's second half; None: not judged)."""
    objects = _by_object(history)
    makers = {obj: _makers(ops) for obj, ops in objects.items() if obj[0] == VOLUME}
    samples = sorted(samples, key=lambda s: s.start)
    found: dict[tuple[int, str, str, tuple[int, ...]], Violation] = {}
    seen: dict[tuple[int, str, str, tuple[int, ...]], int] = {}
    for sample in [*samples, Sample(INF, INF, final)]:
        for v in _check_at(objects, makers, sample):
            key = (v.invariant, v.kind, v.name, v.ops[:1])
            found.setdefault(key, v)
            seen[key] = seen.get(key, 0) + 1
    once = [*_records_match(objects, final), *_leftovers(objects, final, stale_s),
            *_answers(history, objects, samples), *_capacity(history, samples)]
    for v in once:
        found.setdefault((v.invariant, v.kind, v.name, v.ops[:1]), v)
    out = []
    for key, v in found.items():
        n = seen.get(key, 1)
        out.append(Violation(v.invariant, v.kind, v.name, v.message + (
            f" [in {n} samples]" if n > 1 else ""), v.ops))
    return sorted(out, key=lambda v: (v.invariant, v.kind, v.name))


def _check_at(objects: dict[tuple[str, str], list[Op]], makers: dict[tuple[str, str], set[int]],
              sample: Sample) -> list[Violation]:
    out: list[Violation] = []
    truth = sample.truth
    when = "at the end" if sample.start == INF else \
        f"at {sample.start:.2f}..{sample.end:.2f}"
    for (kind, name), ops in sorted(objects.items()):
        done = [o for o in ops if o.complete < sample.start]
        deletes = [o for o in ops if DELETE.get(o.method) == kind]
        out += _deletes_hold(kind, name, ops, done, truth, sample.end, when)
        out += _acks_hold(kind, name, ops, done, deletes, truth, sample.end, when)
        if kind == VOLUME and name in truth.volumes:
            out += _qos_holds(name, ops, done, deletes, makers[(kind, name)],
                              truth.volumes[name], sample.end, when)
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
    # A delete that may have acted after an ack's invoke excuses it: only acks
    # invoked once every such delete (begun before ``until``) was over count.
    cutoff = max((d.complete for d in deletes if d.effective and d.invoke < until),
                 default=-INF)
    acks = [o for o in done if o.ok and (CREATE.get(o.method) == kind or o.method == EXPAND)
            and o.invoke >= cutoff]
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


def _qos_holds(name: str, ops: list[Op], done: list[Op], deletes: list[Op], makers: set[int],
               image: VolumeTruth, until: float, when: str) -> list[Violation]:
    out = []
    for param, (key, _) in sorted(QOS_META.items()):
        setters = [o for o in done if o.ok and (
            (o.method == MODIFY and param in o.params) or o.id in makers)]
        if not setters:
            continue
        last = max(setters, key=lambda o: o.complete)
        racing = [o for o in ops if o is not last and o.method == MODIFY
                  and param in o.params and _after(o, last.invoke, until)]
        if racing or any(_after(d, last.invoke, until) for d in deletes):
            continue  # not determined: another value, or another image, may stand
        value = last.params.get(param)
        want = None if value is None else meta_value(param, value)
        have = image.meta.get(key)
        if have != want:
            sus = _suspects(ops, last, until)
            what = (f"set {param}={value} ({want!r})" if last.method == MODIFY else
                    "made the volume with " + (f"{param}={value} ({want!r})" if value is not None
                                               else f"no {param}"))
            out.append(Violation(3, VOLUME, name, f"{key} is {have!r} {when}, but "
                                 f"{_fmt(last)} {what} and no other modify of it ran since"
                                 f"{_hint(sus)}", (last.id, *(o.id for o in sus))))
    return out


def _settled(ops: list[Op]) -> Op | None:
    """The object's last call, when it answered OK and no other call overlapped it."""
    last = max(ops, key=lambda o: o.invoke)
    if last.ok and all(o.complete < last.invoke for o in ops if o is not last):
        return last
    return None


def _records_match(objects: dict[tuple[str, str], list[Op]],
                   truth: Truth) -> list[Violation]:
    """Invariant 4, at the end only (a create claims, makes, then records)."""
    out = []
    for obj, (kind, name) in sorted(truth.objects.items()):
        ops = objects.get((kind, name), [])
        last = _settled(ops) if ops else None
        if last is None:
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


def _leftovers(objects: dict[tuple[str, str], list[Op]], truth: Truth,
               stale_s: float | None) -> list[Violation]:
    """Invariant 5, at the end only: claims and tombstones left with their object."""
    out = []
    for obj, (kind, name) in sorted(truth.objects.items()):
        state = truth.records.get(obj)
        ops = objects.get((kind, name), [])
        if state not in (CLAIM, TOMBSTONE) or not ops or not truth.exists(kind, name):
            continue
        what = "claim" if state == CLAIM else "tombstone"
        last = _settled(ops)
        if last is not None:
            out.append(Violation(5, kind, name, f"a {what} ({obj} {state}) stands with its "
                                 f"{kind} at the end, but the last call {_fmt(last)} was "
                                 "answered OK and no other call overlapped it", (last.id,)))
            continue
        if stale_s is None:
            continue
        tomb = state == TOMBSTONE
        writers = [o for o in ops if o.effective and (DELETE.get(o.method) == kind) == tomb]
        ended = max((o.complete for o in writers), default=-INF)
        finishers = [o for o in ops if (DELETE.get(o.method) == kind if tomb else
                                        CREATE.get(o.method) == kind)
                     and o.invoke > ended + stale_s]
        if finishers:
            first, lastf = finishers[0], finishers[-1]
            writer = max(writers, key=lambda o: o.complete) if writers else None
            since = f"{_fmt(writer)}" if writer else "none"
            out.append(Violation(5, kind, name, f"a {what} ({obj} {state}) stands with its "
                                 f"{kind} at the end, though {len(finishers)} call(s) that "
                                 f"finish it came more than {stale_s:g} s after every call "
                                 f"that may have written it had ended (the last: {since}): "
                                 f"{_fmt(first)} .. {_fmt(lastf)}",
                                 tuple(o.id for o in ([writer] if writer else []) +
                                       [first, lastf])))
    return out


# -- the questions (invariants 6 and 7) ------------------------------------------------
class _Near:
    """The samples next to a call: the last one that ended before it began,
    those that overlap it, and the first one that began after it ended."""

    def __init__(self, samples: list[Sample]) -> None:
        self.samples = samples  # by start; one sampler at a time: by end as well
        self.ends = [s.end for s in samples]
        self.starts = [s.start for s in samples]

    def __call__(self, op: Op) -> list[Sample]:
        lo = max(0, bisect.bisect_right(self.ends, op.invoke) - 1)
        hi = bisect.bisect_left(self.starts, op.complete) + 1
        return self.samples[lo:hi]


def _acknowledged(ops: list[Op], q: Op) -> Op | None:
    """The last call that acknowledged the volume (an OK create, expand or
    modify completed before ``q`` began) with no delete running after it was
    invoked until ``q`` ended; None: it may not exist during ``q``."""
    cutoff = max((d.complete for d in ops if d.method == "DeleteVolume" and d.effective
                  and d.invoke < q.complete), default=-INF)
    acks = [o for o in ops if o.ok and o.method in ("CreateVolume", EXPAND, MODIFY)
            and o.complete < q.invoke and o.invoke >= cutoff]
    return max(acks, key=lambda o: o.invoke) if acks else None


def _absent(ops: list[Op], q: Op) -> tuple[bool, Op | None]:
    """Whether no create may have made the volume by the time ``q`` ended
    (since the last OK delete completed before ``q`` began, or ever), and
    that delete."""
    oks = [d for d in ops if d.ok and d.method == "DeleteVolume" and d.complete < q.invoke]
    last = max(oks, key=lambda d: d.invoke) if oks else None
    since = last.invoke if last is not None else -INF
    made = any(c.method == "CreateVolume" and c.effective and c.complete > since
               and c.invoke < q.complete for c in ops)
    return not made, last


def _answers(history: list[Op], objects: dict[tuple[str, str], list[Op]],
             samples: list[Sample]) -> list[Violation]:
    """Invariant 6: listed / validated volumes exist; acknowledged ones are
    listed and never NOT_FOUND."""
    out: list[Violation] = []
    near = _Near(samples)
    volumes = {name: ops for (kind, name), ops in objects.items() if kind == VOLUME}

    def phantom(name: str, q: Op, how: str) -> None:
        ops = volumes.get(name, [])
        absent, deleted = _absent(ops, q)
        if not absent or any(name in s.truth.volumes for s in near(q)):
            return
        why = (f"{_fmt(deleted)} deleted it and no create ran since" if deleted else
               "no create of it had begun")
        out.append(Violation(6, VOLUME, name, f"{_fmt(q)} {how} it, but {why}, and Ceph "
                             "did not show it next to the call",
                             (q.id, *((deleted.id,) if deleted else ()))))

    def missing(name: str, q: Op, how: str) -> None:
        ack = _acknowledged(volumes.get(name, []), q)
        if ack is not None:
            out.append(Violation(6, VOLUME, name, f"{_fmt(q)} {how}, but {_fmt(ack)} "
                                 "acknowledged it and no delete ran since", (q.id, ack.id)))

    for q in history:
        if q.method == LIST and q.ok:
            for name in q.listed:
                phantom(name, q, "listed")
            for name in sorted(volumes.keys() - set(q.listed)):
                missing(name, q, "did not list it")
        elif q.method == VALIDATE and q.ok:
            phantom(q.name, q, "validated")
        elif q.outcome == "NOT_FOUND" and q.method in (VALIDATE, EXPAND, MODIFY):
            missing(q.name, q, "answered NOT_FOUND")
    return out


def _capacity(history: list[Op], samples: list[Sample]) -> list[Violation]:
    """Invariant 7: GetCapacity within what Ceph reported next to the call."""
    out = []
    near = _Near(samples)
    for q in history:
        if q.method != CAPACITY or not q.ok:
            continue
        seen = [s.truth.available for s in near(q) if s.truth.available is not None]
        have = int(q.response.get("available_capacity", 0))
        if seen and not min(seen) <= have <= max(seen):
            out.append(Violation(7, "pool", "", f"{_fmt(q)} answered {have} bytes available, "
                                 f"but Ceph reported {min(seen)}..{max(seen)} next to it",
                                 (q.id,)))
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
    """What ``dump`` wrote: check(ops, Truth.from_json(header["truth"]), samples,
    header.get("stale_s")) checks it again."""
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
