"""What ``fleet status`` shows, from the rollout policy and the reports a
reader has seen: one row per node, one per revision being rolled out. Pure:
the reports come in as ``plan.rollout.Sighting`` (each with when THIS reader
saw it change, on its own monotonic clock), the clocks are passed in.

A node row: its wave (from fleet.yaml, never from the report's claim),
applied revision and health (the failed volume and reason; Healthy: for
how long this reader has seen it so, as the gate counts it), the revision
it holds back and why, its own hold, how long this reader has seen the
report unchanged (stale past the gate's staleSeconds) and ``writtenAt``
as the writer claims it (its clock; shown, never compared). A node that a
wave names outright and that has no report is a row too (missing).

A revision row, for each commit some node applies or holds back: the nodes
at it, the waves done (every node of the wave at it and Healthy), the
first wave not done and what its gate says now: open (it applies), waiting
for whom, outside every window (the next opening), or halted (by whom,
which volume, why). The gate is ``plan.rollout.decide`` itself, asked for
a node of that wave: what the nodes decide is what is shown.

``observed_for``: how long this reader has been reading. A one-shot reader
(the CLI without a daemon) has seen each report once: no report is stale to
it and no node has been healthy for any time; the document says so.

Imported by engine/fleet.py (which reads the reports and fleet.yaml) and by
the daemon's answer to ``fleet status``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime

from reconciler.facts.fleetreport import HEALTHY
from reconciler.plan.rollout import (
    Apply,
    Decision,
    Halted,
    OutsideWindow,
    Sighting,
    Waiting,
    decide,
    describe,
    wave_of,
)
from reconciler.spec.fleet import DEFAULT_STALE_SECONDS, Rollout

NO_WAVE = "(no wave)"  # the nodes no wave names: one more wave after the last


@dataclass(frozen=True)
class NodeRow:
    node: str
    wave: str | None  # None: no wave names it (or no fleet.yaml)
    missing: bool = False  # a wave names it, no report was read
    applied: str | None = None
    health: str | None = None
    failed_volume: str | None = None
    failed_reason: str | None = None
    held_back: str | None = None
    held_back_why: str | None = None
    held: bool = False
    hold_reason: str | None = None
    counter: int | None = None
    written_at: str | None = None  # the writer's own clock: a claim
    unchanged_for: float | None = None  # seconds, on this reader's clock
    stale: bool = False
    healthy_for: float | None = None  # Healthy at ``applied`` this long, on this reader's clock
    claimed_wave: str | None = None  # what the report says (shown when it differs)
    phases: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class WaveRow:
    name: str
    nodes: tuple[str, ...]  # its members: listed names and reported nodes it names first
    at_revision: tuple[str, ...]  # of them, those reporting it applied
    healthy: tuple[str, ...]  # of those, Healthy


@dataclass(frozen=True)
class RevisionRow:
    commit: str
    applied_by: tuple[str, ...]
    held_back_by: tuple[str, ...]
    waves: tuple[WaveRow, ...]  # () when no fleet.yaml: every node applies at once
    waves_done: tuple[str, ...]
    current: str | None  # the first wave not done; None: all done (or no waves)
    gate: Decision | None  # the current wave's gate (None: no current wave)
    halted: Halted | None
    # A newer revision under way that a node of this one's current wave
    # applies instead (no node holds this one back): it goes no further.
    superseded_by: str | None = None

    @property
    def state(self) -> str:
        if self.halted is not None:
            return "Halted"
        if self.superseded_by is not None:
            return "Superseded"
        if not self.waves:
            return "NoRollout"
        if self.current is None:
            return "Done"
        return "Applying" if isinstance(self.gate, Apply) else self.gate.state  # type: ignore[union-attr]


@dataclass(frozen=True)
class FleetSummary:
    rollout: str | None  # its name; None: no fleet.yaml
    nodes: tuple[NodeRow, ...]
    revisions: tuple[RevisionRow, ...]
    stale_seconds: int
    observed_for: float | None  # None: a daemon's long watch; else this reader's window
    problems: tuple[str, ...] = ()


def summarize(rollout: Rollout | None, seen: Mapping[str, Sighting], now_mono: float,
              now_utc: datetime, *, rollouts: Mapping[str, Rollout | None] | None = None,
              observed_for: float | None = None, problems: tuple[str, ...] = ()
              ) -> FleetSummary:
    """The summary. ``rollout``: the policy the node rows are placed by (the
    newest verified revision's); ``rollouts``: each revision's own policy
    (a commit absent from it is judged by ``rollout``)."""
    stale_s = rollout.gate.stale_seconds if rollout else DEFAULT_STALE_SECONDS
    waves = _Waves(rollout)
    rows = [_node_row(waves.name(node), node, s, now_mono, stale_s)
            for node, s in sorted(seen.items())]
    if rollout is not None:
        listed = {n for wave in rollout.waves for n in wave.names} - set(seen)
        rows += [NodeRow(n, waves.name(n), missing=True) for n in sorted(listed)]
    rows.sort(key=lambda r: (waves.rank(r.node), r.node))
    commits = sorted({c for s in seen.values()
                      for c in (s.report.applied, s.report.held_back) if c is not None})
    revisions = []
    for c in commits:
        own = (rollouts or {}).get(c, rollout)
        revisions.append(_revision(c, own, waves if own is rollout else _Waves(own), seen,
                                   now_mono, now_utc))
    revisions = [_superseded(r, seen) for r in revisions]
    revisions.sort(key=lambda r: (-len(r.applied_by) - len(r.held_back_by), r.commit))
    return FleetSummary(rollout.name if rollout else None, tuple(rows), tuple(revisions),
                        stale_s, observed_for, problems)


class _Waves:
    """``wave_of`` of one rollout, asked once per node (a glob match each)."""

    def __init__(self, rollout: Rollout | None) -> None:
        self.rollout = rollout
        self._of: dict[str, int | None] = {}

    def index(self, node: str) -> int | None:
        if self.rollout is None:
            return None
        if node not in self._of:
            self._of[node] = wave_of(self.rollout, node)
        return self._of[node]

    def name(self, node: str) -> str | None:
        k = self.index(node)
        return self.rollout.waves[k].name if self.rollout and k is not None else None

    def rank(self, node: str) -> int:
        k = self.index(node)
        return k if k is not None else 1 << 30


def _node_row(wave: str | None, node: str, s: Sighting, now_mono: float,
              stale_s: int) -> NodeRow:
    r = s.report
    quiet = max(0.0, now_mono - s.last_change_mono)
    healthy = max(0.0, now_mono - s.first_seen_mono) if r.health == HEALTHY else None
    return NodeRow(node, wave, applied=r.applied, health=r.health,
                   failed_volume=r.failed_volume, failed_reason=r.failed_reason,
                   held_back=r.held_back, held_back_why=r.held_back_why, held=r.held,
                   hold_reason=r.hold_reason, counter=r.counter, written_at=r.written_at,
                   unchanged_for=quiet, stale=quiet >= stale_s, healthy_for=healthy,
                   claimed_wave=r.wave,
                   phases=r.phases)


def _members(rollout: Rollout, waves: _Waves, seen: Mapping[str, Sighting]
             ) -> list[tuple[str, list[str]]]:
    """Each wave's name and nodes (and NO_WAVE's, if any reported node is in none)."""
    out: list[tuple[str, list[str]]] = [(w.name, []) for w in rollout.waves]
    lost: list[str] = []
    for node in sorted({n for w in rollout.waves for n in w.names}.union(seen)):
        k = waves.index(node)
        (out[k][1] if k is not None else lost).append(node)
    if lost:
        out.append((NO_WAVE, lost))
    return out


def _revision(commit: str, rollout: Rollout | None, index: _Waves,
              seen: Mapping[str, Sighting], now_mono: float, now_utc: datetime) -> RevisionRow:
    applied = tuple(n for n, s in sorted(seen.items()) if s.report.applied == commit)
    held_back = tuple(n for n, s in sorted(seen.items()) if s.report.held_back == commit)
    if rollout is None:
        return RevisionRow(commit, applied, held_back, (), (), None, None, None)
    waves: list[WaveRow] = []
    for name, nodes in _members(rollout, index, seen):
        at = tuple(n for n in nodes if n in applied)
        waves.append(WaveRow(name, tuple(nodes), at,
                             tuple(n for n in at if seen[n].report.health == HEALTHY)))
    done: list[str] = []
    current = None
    for w in waves:  # a wave with no node (globs nobody matched) gates nothing
        if w.nodes and len(w.healthy) < len(w.nodes):
            current = w
            break
        if w.nodes:
            done.append(w.name)
    halted = None
    gate: Decision | None = None
    if current is not None:
        # The current wave's gate, as one of its nodes that has not applied
        # the commit decides it (one that has would just keep it).
        me = next((n for n in current.nodes if n not in applied), current.nodes[0])
        gate = decide(rollout, me, commit, {n: s for n, s in seen.items() if n != me}, None,
                      now_mono, now_utc)
        if me in seen and seen[me].report.applied == commit and not isinstance(gate, Halted):
            gate = Apply()  # every node of the wave is at it: converging, not gated
    # Rule 3 of decide (a halt) reads only the reports at the commit; ""
    # is nobody's name.
    whole = decide(rollout, "", commit, {n: seen[n] for n in applied}, None, now_mono,
                   now_utc)
    if isinstance(whole, Halted):
        halted = whole
    elif isinstance(gate, Halted):
        halted = gate
    return RevisionRow(commit, applied, held_back, tuple(waves), tuple(done),
                       current.name if current else None, gate, halted)


def _superseded(row: RevisionRow, seen: Mapping[str, Sighting]) -> RevisionRow:
    """``row`` marked superseded when nobody holds it back and a node of its
    current wave applies another revision that some node holds back (a newer
    rollout under way): without git no reader knows which commit is newer,
    but a revision held back by someone is one being rolled out now."""
    if row.halted is not None or row.current is None or row.held_back_by:
        return row
    wave = next(w for w in row.waves if w.name == row.current)
    held = {s.report.held_back for s in seen.values()} - {None, row.commit}
    newer = sorted({a for n in wave.nodes if n in seen
                    and (a := seen[n].report.applied) in held})
    return replace(row, superseded_by=newer[0]) if newer else row


def gate_text(row: RevisionRow) -> str:
    """One line: where the rollout of ``row.commit`` is, and why."""
    if row.halted is not None:
        return describe(row.halted)
    if row.superseded_by is not None:
        return (f"superseded: wave {row.current} applies {row.superseded_by[:12]}, "
                "which is being rolled out")
    if not row.waves:
        return "no fleet.yaml: every node applies it at once"
    if row.current is None:
        return "every wave applied it"
    match row.gate:
        case Apply():
            return f"wave {row.current} applies it"
        case Waiting(waiting_for=nodes):
            return f"wave {row.current} waits for {', '.join(map(str, nodes))}"
        case OutsideWindow() as d:
            return describe(d)
        case d if d is not None:
            return describe(d)
    return ""


def document(summary: FleetSummary) -> dict[str, object]:
    """The summary as ``fleet status -o json`` prints it."""
    def node(r: NodeRow) -> dict[str, object]:
        return {"node": r.node, "wave": r.wave, "missing": r.missing, "applied": r.applied,
                "health": r.health, "failedVolume": r.failed_volume,
                "failedReason": r.failed_reason, "heldBack": r.held_back,
                "heldBackWhy": r.held_back_why, "held": r.held, "holdReason": r.hold_reason,
                "counter": r.counter, "writtenAt": r.written_at,
                "unchangedForSeconds": None if r.unchanged_for is None
                else round(r.unchanged_for, 1),
                "stale": r.stale, "healthyForSeconds": None if r.healthy_for is None
                else round(r.healthy_for, 1),
                "reportedWave": r.claimed_wave, "phases": dict(r.phases)}

    def revision(r: RevisionRow) -> dict[str, object]:
        gate = r.gate
        waits = [{"node": w.node, "why": w.why, "detail": w.detail}
                 for w in (gate.waiting_for if isinstance(gate, Waiting) else ())]
        return {"commit": r.commit, "state": r.state, "appliedBy": list(r.applied_by),
                "heldBackBy": list(r.held_back_by), "wavesDone": list(r.waves_done),
                "currentWave": r.current, "waitingFor": waits,
                "nextWindow": gate.next_opening.isoformat()
                if isinstance(gate, OutsideWindow) and gate.next_opening else None,
                "supersededBy": r.superseded_by,
                "halted": None if r.halted is None else {
                    "node": r.halted.node, "volume": r.halted.volume,
                    "reason": r.halted.reason},
                "waves": [{"name": w.name, "nodes": list(w.nodes), "applied": list(w.at_revision),
                           "healthy": list(w.healthy)} for w in r.waves],
                "summary": gate_text(r)}

    return {"rollout": summary.rollout, "staleSeconds": summary.stale_seconds,
            "observedForSeconds": None if summary.observed_for is None
            else round(summary.observed_for, 1),
            "nodes": [node(r) for r in summary.nodes],
            "revisions": [revision(r) for r in summary.revisions],
            "problems": list(summary.problems)}
