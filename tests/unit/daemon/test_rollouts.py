"""The daemon's part in a fleet's rollout (daemon/rollout.py,
daemon/fleethealth.py), without Ceph: a fake store stands for
drivers/fleetstore.py. The health a report says of the applied revision,
the report's counter across a restart, a write that fails kept (the newest
one) and written once Ceph answers, one write per interval when idle, and
the gate's decisions on this node's own clock."""

from __future__ import annotations

import os
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from reconciler.daemon.fleethealth import health_of
from reconciler.daemon.metrics import Metrics
from reconciler.daemon.rollout import COUNTER_FILE, Rollouts, Said, said_of
from reconciler.drivers.fleetstore import FleetRead, FleetUnavailable
from reconciler.facts.fleetreport import Report
from reconciler.source.layout import Layout
from reconciler.spec.config import Config, default_config
from reconciler.spec.fleet import parse_fleet
from reconciler.spec.source import SourceConfig, SourceFleet, SourceRef, SourceVerify
from reconciler.state.files import write_json

REV = "main@sha1:" + "a" * 40
OLD = "main@sha1:" + "b" * 40


def st(phase: str, rev: str = REV, **more: Any) -> dict[str, Any]:
    return {"phase": phase, "sourceRevision": rev, **more}


# -- health -------------------------------------------------------------------------

def test_healthy_once_every_volume_of_the_revision_converged_under_it() -> None:
    statuses = {"a": st("Published"), "b": st("Created"), "other": st("Failed", OLD)}
    h = health_of(REV, dict.fromkeys(["a", "b"]), statuses)
    assert (h.health, h.failed_volume, h.phases) == ("Healthy", None,
                                                     (("Created", 1), ("Published", 1)))
    assert health_of(REV, dict.fromkeys([]), {}).health == "Healthy"  # a revision with no volume


def test_a_status_of_the_revision_before_is_not_yet_converged() -> None:
    h = health_of(REV, dict.fromkeys(["a", "b"]),
                  {"a": st("Published"), "b": st("Published", OLD)})
    assert (h.health, h.phases) == ("Converging", (("Pending", 1), ("Published", 1)))
    for phase in ("Pending", "Unknown", "Stalled", "Degraded", "Fenced"):
        assert health_of(REV, dict.fromkeys(["a"]), {"a": st(phase)}).health == "Converging", phase


def test_a_status_of_another_spec_is_not_of_this_revision() -> None:
    """A chain begun before the switch, ended after it: about the old spec."""
    old = st("Failed", observedGeneration="old", lastError="x")
    assert health_of(REV, {"a": "new"}, {"a": old}).health == "Converging"
    assert health_of(REV, {"a": "new"}, {"a": st("Created", observedGeneration="new")}
                     ).health == "Healthy"
    assert health_of(REV, {"a": "old"}, {"a": old}).health == "Failed"


def test_failed_names_the_volume_and_why() -> None:
    refused = st("Failed", refusal="shrinking 2 GiB to 1 GiB is refused (never shrink)",
                 lastError="x")
    h = health_of(REV, dict.fromkeys(["z", "b", "a"]), {"a": st("Published"), "b": refused,
                                         "z": st("Frozen", message="its file failed")})
    assert (h.health, h.failed_volume) == ("Failed", "b")
    assert h.failed_reason is not None and "never shrink" in h.failed_reason
    noisy = st("Failed", lastError="map: timed out\x1b[2J" * 100)
    h = health_of(REV, {"a": None}, {"a": noisy})
    assert h.health == "Failed" and h.failed_reason is not None
    assert len(h.failed_reason) <= 512 and "\x1b" not in h.failed_reason


def test_nothing_applied_or_a_refused_pass_is_converging() -> None:
    assert health_of(None, dict.fromkeys(["a"]), {}).health == "Converging"
    assert health_of(REV, {"a": None}, {"a": st("Published")},
                     refusing="untrusted").health == "Converging"


# -- the node's report ----------------------------------------------------------------

class FakeStore:
    def __init__(self) -> None:
        self.up = True
        self.written: list[Report] = []
        self.reports: dict[str, Report] = {}
        self.reads = 0

    def _check(self) -> None:
        if not self.up:
            raise FleetUnavailable("cannot reach the cluster")

    def write(self, report: Report) -> None:
        self._check()
        self.written.append(report)
        self.reports[report.node] = report

    def read_all(self) -> FleetRead:
        self._check()
        self.reads += 1
        return FleetRead(dict(self.reports), ())

    def read_one(self, node: str) -> Report | None:
        self._check()
        return self.reports.get(node)

    def close(self) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def fleet_config(tmp_path: Path, node: str = "edge-2", interval: float = 10) -> Config:
    src = SourceConfig(url="file:///srv/fleet.git", ref=SourceRef("branch", "main"),
                       path="nodes/{nodeName}",
                       verify=SourceVerify(mode="head", format="ssh"),
                       interval_seconds=interval, fleet=SourceFleet("fleet"))
    state = tmp_path / "state"
    state.mkdir(parents=True, exist_ok=True)
    return replace(default_config(), state_dir=state, node_name=node, git=src,
                   desired_dir=state / "source" / "current")


def apply_revision(config: Config, commit: str, wave: str | None = "canary") -> None:
    """What a sync leaves: revs/<name>, its meta, the current link."""
    layout = Layout(config.source_dir)
    name = f"{commit}-12345678"
    (layout.revs / name).mkdir(parents=True, exist_ok=True)
    write_json(layout.meta_file(name), {"commit": commit,
                                        "fleet": {"rollout": "edge", "wave": wave}})
    layout.switch("current", name)


def rollouts(config: Config, store: FakeStore, clock: Clock) -> Rollouts:
    return Rollouts(lambda: config, Metrics(), store=lambda _c: store,  # type: ignore[arg-type,return-value]
                    mono=clock)


def test_said_of_the_source_and_the_last_pass(tmp_path: Path) -> None:
    config = fleet_config(tmp_path)
    commit = "a" * 40
    apply_revision(config, commit)
    layout = Layout(config.source_dir)
    state = {"heldBack": {"commit": "c" * 40, "state": "Waiting", "message": "waits for x"},
             "held": {"at": "t", "commit": commit, "by": "hold", "reason": "disk swap"}}
    layout.write_state(state)
    said = said_of(config, (REV, {"v": None}, None), {"v": st("Published")})
    assert said == Said(applied=commit, health="Healthy", wave="canary",
                        held_back="c" * 40, held_back_why="Waiting: waits for x", held=True,
                        hold_reason="disk swap", phases=(("Published", 1),))
    # A pass under the revision before: converging, whatever its statuses say.
    assert said_of(config, (OLD, {"v": None}, None), {"v": st("Published")}).health \
        == "Converging"
    # Nothing applied yet.
    empty = fleet_config(tmp_path / "x")
    assert said_of(empty, None, {}) == Said(applied=None, health="Converging")


def test_a_failed_write_is_kept_and_the_newest_written_when_ceph_answers(
        tmp_path: Path) -> None:
    config = fleet_config(tmp_path)
    apply_revision(config, "a" * 40)
    store, clock = FakeStore(), Clock()
    r = rollouts(config, store, clock)
    r.pass_ended(REV, None, None)
    assert r.tick() == pytest.approx(10)  # written; the next in one interval
    [first] = store.written
    assert (first.node, first.applied, first.health, first.counter) == (
        "edge-2", "a" * 40, "Healthy", 1)

    store.up = False
    apply_revision(config, "d" * 40)  # a new revision: news
    assert r.tick() == pytest.approx(5)  # kept; tried again in RETRY_S
    assert r.pending is not None and r.pending[1].applied == "d" * 40
    kept = r.pending[1]
    clock.t += 5
    r.tick()  # still down: the same report kept (nothing new to say)
    assert r.pending is not None and r.pending[1] is kept
    r.status_written("v", st("Published", "main@sha1:" + "d" * 40))
    r.pass_ended("main@sha1:" + "d" * 40, None, None)
    r.tick()  # something new while down: the newest replaces it
    assert r.pending is not None and r.pending[1].counter > kept.counter
    newest = r.pending[1]
    store.up = True
    clock.t += 5
    r.tick()
    assert store.written[-1] == newest and r.pending is None
    assert [w.counter for w in store.written] == [1, newest.counter]


def test_idle_one_write_per_interval_and_no_read(tmp_path: Path) -> None:
    config = fleet_config(tmp_path, interval=10)
    apply_revision(config, "a" * 40)
    store, clock = FakeStore(), Clock()
    r = rollouts(config, store, clock)
    for _ in range(50):  # woken often (statuses, passes), nothing new
        r.tick()
        clock.t += 1
    assert len(store.written) == 5 and store.reads == 0
    assert [w.counter for w in store.written] == [1, 2, 3, 4, 5]


def test_the_counter_starts_above_the_local_and_the_remote_one(tmp_path: Path) -> None:
    config = fleet_config(tmp_path)
    apply_revision(config, "a" * 40)
    store, clock = FakeStore(), Clock()
    r = rollouts(config, store, clock)
    r.tick()
    r.tick()
    counter = config.state_dir / COUNTER_FILE
    assert os.stat(counter).st_mode & 0o777 == 0o600
    # A restart: the local file says 1; Ceph holds a later one (a lost stateDir).
    store.reports["edge-2"] = replace(store.written[-1], counter=41)
    r2 = rollouts(config, store, clock)
    r2.tick()
    assert store.written[-1].counter == 42
    # And a local counter above Ceph's (a report never written).
    write_json(counter, {"counter": 100})
    r3 = rollouts(config, store, clock)
    r3.tick()
    assert store.written[-1].counter == 101


def test_ceph_down_at_start_keeps_the_report_until_the_counter_is_known(
        tmp_path: Path) -> None:
    config = fleet_config(tmp_path)
    apply_revision(config, "a" * 40)
    store, clock = FakeStore(), Clock()
    store.reports["edge-2"] = Report(node="edge-2", applied=None, health="Converging",
                                     counter=7, written_at="2026-01-01T00:00:00+00:00")
    store.up = False
    r = rollouts(config, store, clock)
    assert r.tick() == pytest.approx(5) and not store.written
    store.up = True
    clock.t += 5
    r.tick()
    assert [w.counter for w in store.written] == [8]


# -- the gate -------------------------------------------------------------------------

FLEET = b"""\
apiVersion: rbd-reconciler/v1
kind: Rollout
metadata: {name: edge}
spec:
  waves:
    - {name: canary, nodes: [edge-1]}
    - {name: rest, nodes: ["edge-*"]}
  gate: {healthySeconds: 30, staleSeconds: 300}
"""


def rollout_of(raw: bytes = FLEET):  # type: ignore[no-untyped-def]
    load = parse_fleet(raw)
    assert load.ok and load.rollout is not None, load.diagnostics
    return load.rollout


def report(node: str, applied: str | None, health: str, counter: int = 1,
           **more: Any) -> Report:
    return Report(node=node, applied=applied, health=health, counter=counter,
                  written_at="2026-01-01T00:00:00+00:00", **more)


def test_the_gate_waits_for_the_canary_healthy_long_enough_on_its_own_clock(
        tmp_path: Path) -> None:
    config = fleet_config(tmp_path, node="edge-2")
    store, clock = FakeStore(), Clock()
    r = rollouts(config, store, clock)
    r.wall = lambda: datetime(2026, 1, 1, tzinfo=UTC)
    new = "e" * 40
    store.reports["edge-1"] = report("edge-1", "a" * 40, "Healthy")
    answer = r.gate(new, rollout_of())
    assert (answer.state, answer.details["waitingFor"][0]["node"]) == ("Waiting", "edge-1")
    assert answer.details["waitingFor"][0]["why"] == "not-applied"
    store.reports["edge-1"] = report("edge-1", new, "Healthy", 2)
    answer = r.gate(new, rollout_of())
    assert answer.state == "Waiting" and "healthy for only 0s" in answer.message
    clock.t += 31
    store.reports["edge-1"] = report("edge-1", new, "Healthy", 3)  # its counter moved
    assert r.gate(new, rollout_of()).applies
    # The canary itself applies at once.
    canary = rollouts(fleet_config(tmp_path / "c", node="edge-1"), store, clock)
    assert canary.gate("f" * 40, rollout_of()).applies


def test_the_gate_halts_on_a_failed_node_and_waits_when_ceph_does_not_answer(
        tmp_path: Path) -> None:
    config = fleet_config(tmp_path, node="edge-2")
    store, clock = FakeStore(), Clock()
    r = rollouts(config, store, clock)
    new = "e" * 40
    store.reports["edge-1"] = report("edge-1", new, "Failed", failed_volume="pg",
                                     failed_reason="never shrink")
    answer = r.gate(new, rollout_of())
    assert answer.state == "Halted"
    assert answer.details["halted"] == {"node": "edge-1", "volume": "pg",
                                        "reason": "never shrink"}
    assert "edge-1, volume pg: never shrink" in answer.message
    store.up = False
    answer = r.gate(new, rollout_of())
    assert answer.state == "Waiting" and "cannot read the fleet's reports" in answer.message


def test_the_rollout_state_metric_follows_the_source(tmp_path: Path) -> None:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    def series(r: Rollouts) -> list[dict[str, str]]:
        fams = {f.name: f for f in text_string_to_metric_families(
            generate_latest(r.metrics.registry).decode())}
        return [s.labels for s in fams["rbd_reconciler_rollout_state"].samples]

    config = fleet_config(tmp_path)
    apply_revision(config, "a" * 40)
    r = rollouts(config, FakeStore(), Clock())
    # From start-up, before any tick: an alert reads it (tests/cluster/test_metrics.py).
    assert series(r) == [{"state": "NotInFleet", "revision": ""}]
    r.tick()
    assert series(r) == [{"state": "Applied", "revision": ""}]
    Layout(config.source_dir).write_state({"heldBack": {
        "commit": "c" * 40, "revision": "main@sha1:" + "c" * 40, "state": "Halted",
        "message": "halted"}})
    r.tick()
    assert series(r) == [{"state": "Halted", "revision": "main@sha1:" + "c" * 40}]
