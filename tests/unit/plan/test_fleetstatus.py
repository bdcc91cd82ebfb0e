"""fleet status as data (plan/fleetstatus.py): node rows placed by fleet.yaml
(never by a report's claim), missing and stale nodes, and per revision the
waves done, the current wave's gate as decide() sees it, and a halt."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from reconciler.facts.fleetreport import Report
from reconciler.plan.fleetstatus import NO_WAVE, document, gate_text, summarize
from reconciler.plan.rollout import Apply, OutsideWindow, Sighting, Waiting
from reconciler.spec.fleet import Gate, Rollout, Wave, Window, known_zone

R, OLD = "a" * 40, "b" * 40
NOW = 10_000.0
NOON = datetime(2024, 5, 6, 12, 0, tzinfo=UTC)  # a Monday


def fleet(healthy: int = 60, stale: int = 300, most: int = 0,
          windows: tuple[Window, ...] = ()) -> Rollout:
    return Rollout("edge", (Wave("canary", ("c1",)), Wave("early", ("e*",)),
                            Wave("rest", ("r1", "r2"))), Gate(healthy, most, False, stale),
                   windows)


def rep(node: str, applied: str | None = R, health: str = "Healthy", **kw: object) -> Report:
    if health == "Failed":
        kw.setdefault("failed_reason", "never shrink")
    return Report(node=node, applied=applied, health=health, counter=3,
                  written_at="2024-05-06T12:00:00+00:00", **kw)  # type: ignore[arg-type]


def seen(report: Report, healthy_for: float = 600, quiet: float = 1) -> Sighting:
    return Sighting(report, NOW - healthy_for, NOW - quiet)


def test_node_rows_waves_missing_stale_and_claims() -> None:
    s = summarize(fleet(), {
        "c1": seen(rep("c1", wave="rest")),  # claims another wave: fleet.yaml says canary
        "e1": seen(rep("e1", OLD, held_back=R, held_back_why="waiting for canary"), quiet=400),
        "x9": seen(rep("x9", OLD)),
    }, NOW, NOON)
    rows = {r.node: r for r in s.nodes}
    assert [r.node for r in s.nodes] == ["c1", "e1", "r1", "r2", "x9"]  # by wave, then name
    assert rows["c1"].wave == "canary" and rows["c1"].claimed_wave == "rest"
    assert rows["e1"].wave == "early" and rows["e1"].stale and rows["e1"].unchanged_for == 400
    assert rows["e1"].held_back == R and rows["e1"].held_back_why == "waiting for canary"
    assert not rows["c1"].stale
    assert rows["r1"].missing and rows["r1"].wave == "rest" and rows["r1"].applied is None
    assert rows["x9"].wave is None and not rows["x9"].missing


def test_healthy_for_on_the_readers_clock() -> None:
    s = summarize(fleet(), {"c1": seen(rep("c1"), healthy_for=42.5),
                            "e1": seen(rep("e1", health="Converging"), healthy_for=99)},
                  NOW, NOON)
    rows = {r.node: r for r in s.nodes}
    assert rows["c1"].healthy_for == 42.5 and rows["e1"].healthy_for is None
    assert rows["r1"].healthy_for is None  # missing
    nodes = {n["node"]: n for n in document(s)["nodes"]}
    assert nodes["c1"]["healthyForSeconds"] == 42.5
    assert nodes["e1"]["healthyForSeconds"] is None


def test_a_revision_wave_by_wave() -> None:
    s = summarize(fleet(), {"c1": seen(rep("c1")),
                            "e1": seen(rep("e1")), "e2": seen(rep("e2", OLD)),
                            "r1": seen(rep("r1", OLD)), "r2": seen(rep("r2", OLD))},
                  NOW, NOON)
    r = next(x for x in s.revisions if x.commit == R)
    assert r.applied_by == ("c1", "e1")
    assert r.waves_done == ("canary",)
    assert r.current == "early" and isinstance(r.gate, Apply)  # its gate holds: e2 applies
    assert r.state == "Applying" and gate_text(r) == "wave early applies it"
    assert [w.healthy for w in r.waves] == [("c1",), ("e1",), ()]
    old = next(x for x in s.revisions if x.commit == OLD)
    assert old.applied_by == ("e2", "r1", "r2")


def test_waiting_names_whom_and_why() -> None:
    s = summarize(fleet(healthy=60), {"c1": seen(rep("c1"), healthy_for=10),
                                      "e1": seen(rep("e1", OLD))}, NOW, NOON)
    r = next(x for x in s.revisions if x.commit == R)
    assert r.waves_done == ("canary",)  # every canary node is at R and Healthy ...
    assert r.current == "early" and isinstance(r.gate, Waiting)  # ... but not long enough
    assert [(w.node, w.why) for w in r.gate.waiting_for] == [("c1", "too-briefly-healthy")]
    assert "waits for c1 (healthy for only 10s of 60s)" in gate_text(r)
    assert r.state == "Waiting"


def test_halted_by_whom_and_why() -> None:
    s = summarize(fleet(), {"c1": seen(rep("c1", health="Failed", failed_volume="pg")),
                            "e1": seen(rep("e1", OLD, held_back=R, held_back_why="halted"))},
                  NOW, NOON)
    r = next(x for x in s.revisions if x.commit == R)
    assert r.state == "Halted" and r.halted is not None
    assert (r.halted.node, r.halted.volume, r.halted.reason) == ("c1", "pg", "never shrink")
    assert r.held_back_by == ("e1",) and r.waves_done == ()
    assert gate_text(r) == "halted: it failed on c1, volume pg: never shrink"
    doc = document(s)
    json.dumps(doc)
    rev = next(x for x in doc["revisions"] if x["commit"] == R)  # type: ignore[union-attr]
    assert rev["halted"] == {"node": "c1", "volume": "pg", "reason": "never shrink"}


def test_outside_window_and_done_and_no_rollout() -> None:
    zone = known_zone("UTC")
    assert zone is not None
    closed = Window(frozenset({0}), NOON.time().replace(hour=2), NOON.time().replace(hour=4),
                    "UTC", zone)
    s = summarize(fleet(windows=(closed,)),
                  {"c1": seen(rep("c1", OLD, held_back=R, held_back_why="outside"))}, NOW, NOON)
    r = next(x for x in s.revisions if x.commit == R)
    assert isinstance(r.gate, OutsideWindow) and r.current == "canary"
    assert r.gate.next_opening == datetime(2024, 5, 13, 2, 0, tzinfo=UTC)
    all_done = {n: seen(rep(n)) for n in ("c1", "e1", "r1", "r2")}
    assert summarize(fleet(), all_done, NOW, NOON).revisions[0].state == "Done"
    plain = summarize(None, all_done, NOW, NOON)
    assert plain.rollout is None and plain.revisions[0].state == "NoRollout"
    assert all(r.wave is None and not r.missing for r in plain.nodes)


def test_nodes_in_no_wave_are_a_last_wave() -> None:
    s = summarize(Rollout("x", (Wave("canary", ("c1",)),)),
                  {"c1": seen(rep("c1")), "z1": seen(rep("z1", OLD))}, NOW, NOON)
    r = next(x for x in s.revisions if x.commit == R)
    assert [w.name for w in r.waves] == ["canary", NO_WAVE]
    assert r.current == NO_WAVE and isinstance(r.gate, Apply)


def test_each_revision_by_its_own_rollout() -> None:
    other = Rollout("other", (Wave("first", ("e1",)), Wave("then", ("c1",))))
    s = summarize(fleet(), {"c1": seen(rep("c1", OLD)), "e1": seen(rep("e1", OLD))},
                  NOW, NOON, rollouts={OLD: other})
    assert [w.name for w in s.revisions[0].waves] == ["first", "then"]
    assert s.revisions[0].state == "Done"


def test_a_revision_a_newer_rollout_moved_past_is_superseded_not_applying() -> None:
    """The canary applied a newer commit (halted there); the others keep R
    and hold the newer one back: R is not "applying" to the canary."""
    new = "c" * 40
    s = summarize(fleet(), {
        "c1": seen(rep("c1", new, "Failed")),
        "e1": seen(rep("e1", R, held_back=new, held_back_why="Halted")),
        "r1": seen(rep("r1", R, held_back=new, held_back_why="Halted")),
        "r2": seen(rep("r2", R, held_back=new, held_back_why="Halted"))}, NOW, NOON)
    rows = {r.commit: r for r in s.revisions}
    assert rows[new].state == "Halted"
    assert rows[R].state == "Superseded" and rows[R].superseded_by == new
    assert gate_text(rows[R]).startswith("superseded: wave canary applies cccccccccccc")
    assert next(r for r in document(s)["revisions"] if r["commit"] == R)["supersededBy"] == new
    # While a node holds R back, R is still being rolled out: not superseded.
    s = summarize(fleet(), {"c1": seen(rep("c1", new, held_back=R, held_back_why="Waiting")),
                            "e1": seen(rep("e1", R, held_back=new, held_back_why="Waiting"))},
                  NOW, NOON)
    assert {r.commit: r for r in s.revisions}[R].superseded_by is None
