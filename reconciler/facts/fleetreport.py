"""A node's report to the fleet, as data: ``Report``, its bytes
(``to_bytes``: compact JSON) and back (``parse``). Pure; no I/O.

Each node writes its own report (a RADOS object named after it) and reads
everyone's. What it reads was written by another node, or by anyone holding
that pool's key: ``parse`` treats it as hostile. At most MAX_REPORT_BYTES, a
JSON object of known fields with strict types (a bool is no number, a float
no count), names as the node config's nodeName and wave names allow, commit
ids as hex, every text bounded and free of control and bidi characters;
anything else is a ValueError whose message says what is wrong. Unknown
fields are ignored (a newer node may add some; the format's ``v`` changes
when a known field changes meaning), at most MAX_FIELDS of them.

The report's ``node`` is what the writer claims: the reader knows which
object it read and must check that it names that node (``parse`` cannot).
``written_at`` is the writer's wall clock, for people only: the gate never
compares two nodes' clocks; ``counter`` grows with every write, so a reader
sees a report change without trusting any clock (plan/rollout.py).

Imported by plan/rollout.py (the gate reads reports) and by whoever writes
and reads the report objects (the daemon's wiring, the fleet status).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime

from reconciler.facts.text import FORBIDDEN, NODE_NAME
from reconciler.facts.text import clip as text_clip

FORMAT = 1
MAX_REPORT_BYTES = 16 * 1024
MAX_FIELDS = 32
MAX_REASON = 512  # characters of a reason (the writer clips longer ones: ``clip``)
MAX_VOLUME = 253
MAX_PHASES = 32
MAX_COUNT = 10**9
MAX_COUNTER = 2**63 - 1
HEALTHY, FAILED, CONVERGING = "Healthy", "Failed", "Converging"
HEALTHS = (HEALTHY, FAILED, CONVERGING)

WAVE_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
COMMIT = re.compile(r"[0-9a-f]{40}([0-9a-f]{24})?")  # SHA-1 or SHA-256
PHASE = re.compile(r"[A-Za-z]{1,32}")
MAX_WRITTEN_AT = 40


def clip(text: str, limit: int = MAX_REASON) -> str:
    """``text`` as a report may carry it (facts/text.py)."""
    return text_clip(text, limit)


@dataclass(frozen=True)
class Report:
    """What one node says about itself. ``applied``: the commit it applies
    now (None: none yet); ``health``: of that revision, Healthy once every
    volume converged, Failed (``failed_volume`` and ``failed_reason``; no
    volume when the revision failed as a whole) or Converging.
    ``held_back``: a newer verified commit it does not apply, and
    ``held_back_why`` (waiting for a wave, outside a window, halted, held).
    ``held``: the node's own veto (``source hold``), with ``hold_reason``
    ("" if none was given). ``phases``: volumes per phase. Checked when
    built: an invalid report cannot be made, so none is ever written."""

    node: str
    applied: str | None
    health: str
    counter: int
    written_at: str  # ISO 8601, the writer's wall clock: informational only
    wave: str | None = None  # None: in no wave (or no fleet.yaml)
    failed_volume: str | None = None
    failed_reason: str | None = None
    held_back: str | None = None
    held_back_why: str | None = None
    held: bool = False
    hold_reason: str | None = None
    phases: tuple[tuple[str, int], ...] = field(default=())  # sorted by phase

    def __post_init__(self) -> None:
        _check(self)

    @property
    def phase_counts(self) -> dict[str, int]:
        return dict(self.phases)

    def to_bytes(self) -> bytes:
        """Compact JSON, keys sorted, ASCII: what ``parse`` reads back."""
        doc: dict[str, object] = {
            "v": FORMAT, "node": self.node, "applied": self.applied, "health": self.health,
            "counter": self.counter, "writtenAt": self.written_at, "held": self.held,
            "phases": dict(self.phases)}
        for key, value in (("wave", self.wave), ("failedVolume", self.failed_volume),
                           ("failedReason", self.failed_reason), ("heldBack", self.held_back),
                           ("heldBackWhy", self.held_back_why),
                           ("holdReason", self.hold_reason)):
            if value is not None:
                doc[key] = value
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def phases_of(counts: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    """``Report.phases`` from a mapping (sorted, so equal counts compare equal)."""
    return tuple(sorted(counts.items()))


def _text(name: str, value: object, limit: int, pattern: re.Pattern[str] | None = None,
          optional: bool = True) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str):
        raise ValueError(f"{name} is not a string")
    if len(value) > limit:
        raise ValueError(f"{name} is longer than {limit} characters")
    if pattern is not None and not pattern.fullmatch(value):
        raise ValueError(f"{name} {value[:64]!r} is not valid")
    if FORBIDDEN.search(value):
        raise ValueError(f"{name} holds a control or bidi character")


def _int(name: str, value: object, most: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} is not an integer")
    if not 0 <= value <= most:
        raise ValueError(f"{name} {value} is out of range (0 to {most})")


def _check(r: Report) -> None:
    _text("node", r.node, 253, NODE_NAME, optional=False)
    _text("wave", r.wave, 63, WAVE_NAME)
    _text("applied", r.applied, 64, COMMIT)
    _text("heldBack", r.held_back, 64, COMMIT)
    if r.health not in HEALTHS:
        raise ValueError(f"health {str(r.health)[:32]!r} is not one of {', '.join(HEALTHS)}")
    _int("counter", r.counter, MAX_COUNTER)
    _text("writtenAt", r.written_at, MAX_WRITTEN_AT, optional=False)
    try:
        datetime.fromisoformat(r.written_at)
    except ValueError:
        raise ValueError(f"writtenAt {r.written_at!r} is not an ISO 8601 time") from None
    _text("failedVolume", r.failed_volume, MAX_VOLUME)
    _text("failedReason", r.failed_reason, MAX_REASON)
    _text("heldBackWhy", r.held_back_why, MAX_REASON)
    _text("holdReason", r.hold_reason, MAX_REASON)
    if not isinstance(r.held, bool):
        raise ValueError("held is not true or false")
    if r.health == FAILED and r.failed_reason is None:
        raise ValueError("a Failed report says why (failedReason)")
    if r.health != FAILED and (r.failed_volume is not None or r.failed_reason is not None):
        raise ValueError(f"a {r.health} report names no failed volume or reason")
    if r.applied is None and r.health != CONVERGING:
        raise ValueError(f"no revision applied, yet {r.health}")
    if (r.held_back is None) != (r.held_back_why is None):
        raise ValueError("heldBack and heldBackWhy come together")
    if r.held_back is not None and r.held_back == r.applied:
        raise ValueError("heldBack is the applied revision")
    if not r.held and r.hold_reason is not None:
        raise ValueError("holdReason without held")
    if not isinstance(r.phases, tuple) or len(r.phases) > MAX_PHASES:
        raise ValueError(f"phases: at most {MAX_PHASES} of them")
    for item in r.phases:
        if not isinstance(item, tuple) or len(item) != 2:
            raise ValueError("phases is not a mapping of phase to count")
        _text("a phase", item[0], 32, PHASE, optional=False)
        _int(f"phases.{item[0]}", item[1], MAX_COUNT)
    if list(r.phases) != sorted(r.phases) or len(dict(r.phases)) != len(r.phases):
        raise ValueError("phases are not sorted, or repeat a phase")


_KNOWN = {"v", "node", "applied", "health", "counter", "writtenAt", "wave", "failedVolume",
          "failedReason", "heldBack", "heldBackWhy", "held", "holdReason", "phases"}
_REQUIRED = ("v", "node", "applied", "health", "counter", "writtenAt")


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {key[:32]!r} is given twice")
        out[key] = value
    return out


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")


def parse(raw: bytes) -> Report:
    """The report in ``raw``, or ValueError saying what is wrong with it.
    Checks everything but whether ``node`` is the node whose object this
    is (the caller's check)."""
    if not isinstance(raw, bytes | bytearray | memoryview):
        raise ValueError("not bytes")
    if len(raw) > MAX_REPORT_BYTES:
        raise ValueError(f"{len(raw)} bytes: a report is at most {MAX_REPORT_BYTES}")
    try:
        text = bytes(raw).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 (byte {exc.start})") from None
    try:
        doc = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("not a report: nested too deeply") from None
    except ValueError as exc:
        raise ValueError(f"not JSON: {str(exc)[:120]}") from None
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    if len(doc) > MAX_FIELDS:
        raise ValueError(f"{len(doc)} fields: a report has at most {MAX_FIELDS}")
    for key in _REQUIRED:
        if key not in doc:
            raise ValueError(f"{key} is missing")
    if type(doc["v"]) is not int or doc["v"] != FORMAT:
        raise ValueError(f"format {str(doc['v'])[:16]!r} is not understood (this node reads "
                         f"{FORMAT}): a newer node wrote it?")
    phases = doc.get("phases", {})
    if not isinstance(phases, dict):
        raise ValueError("phases is not an object")
    if len(phases) > MAX_PHASES:
        raise ValueError(f"phases: at most {MAX_PHASES} of them")
    return Report(
        node=doc["node"], applied=doc["applied"], health=doc["health"],
        counter=doc["counter"], written_at=doc["writtenAt"], wave=doc.get("wave"),
        failed_volume=doc.get("failedVolume"), failed_reason=doc.get("failedReason"),
        held_back=doc.get("heldBack"), held_back_why=doc.get("heldBackWhy"),
        held=doc.get("held", False), hold_reason=doc.get("holdReason"),
        phases=_sorted_phases(phases))  # type: ignore[arg-type]  # checked by Report


def _sorted_phases(phases: dict[str, object]) -> tuple[tuple[str, object], ...]:
    for key in phases:
        _text("a phase", key, 32, PHASE, optional=False)
    return tuple(sorted(phases.items()))
