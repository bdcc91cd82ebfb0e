"""``fleet status`` as the daemon answers it (daemon/rollout.py
``Rollouts.fleet_view``), without Ceph (test_rollouts.py's fake store): the
reports sighted into the gate's own sightings, so a node's healthy time and
a report's age count on this node's clock from the first read (the gate's
or this one's), and the errors a command turns into words."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from test_rollouts import Clock, FakeStore, fleet_config, report, rollout_of, rollouts

from reconciler.drivers.fleetstore import FleetUnavailable
from reconciler.engine.fleet import NotInFleet

NEW = "e" * 40


def nodes(doc: dict) -> dict[str, dict]:
    return {n["node"]: n for n in doc["nodes"]}


def test_the_healthy_time_grows_on_the_daemons_clock(tmp_path: Path) -> None:
    store, clock = FakeStore(), Clock()
    r = rollouts(fleet_config(tmp_path), store, clock)
    store.reports["edge-1"] = report("edge-1", NEW, "Healthy", 1)
    store.reports["edge-2"] = report("edge-2", NEW, "Converging", 1)
    doc = r.fleet_view()
    assert doc["observedForSeconds"] == 0
    assert nodes(doc)["edge-1"]["healthyForSeconds"] == 0
    assert nodes(doc)["edge-2"]["healthyForSeconds"] is None
    clock.t += 12
    store.reports["edge-1"] = report("edge-1", NEW, "Healthy", 2)  # rewritten, as it is
    store.reports["edge-2"] = report("edge-2", NEW, "Healthy", 2)  # now healthy
    doc = r.fleet_view()
    assert doc["observedForSeconds"] == 12
    assert nodes(doc)["edge-1"]["healthyForSeconds"] == 12
    assert nodes(doc)["edge-1"]["unchangedForSeconds"] == 0
    assert nodes(doc)["edge-2"]["healthyForSeconds"] == 0  # healthy since this read
    assert set(r.sightings) == {"edge-1", "edge-2"}  # the gate's own, now


def test_a_silent_node_goes_stale_and_the_gates_sightings_count(tmp_path: Path) -> None:
    store, clock = FakeStore(), Clock()
    r = rollouts(fleet_config(tmp_path), store, clock)
    store.reports["edge-1"] = report("edge-1", NEW, "Healthy", 1)
    r.gate(NEW, rollout_of())  # the gate read first: the daemon has watched since
    clock.t += 400
    doc = r.fleet_view()
    assert doc["observedForSeconds"] == 400
    row = nodes(doc)["edge-1"]
    assert (row["unchangedForSeconds"], row["stale"], row["healthyForSeconds"]) == (
        400, True, 400)


def test_not_in_a_fleet_and_ceph_that_does_not_answer(tmp_path: Path) -> None:
    config = fleet_config(tmp_path)
    store, clock = FakeStore(), Clock()
    alone = rollouts(replace(config, git=replace(config.git, fleet=None)), store, clock)
    with pytest.raises(NotInFleet, match=r"no source\.fleet"):
        alone.fleet_view()
    r = rollouts(config, store, clock)
    store.up = False
    with pytest.raises(FleetUnavailable):
        r.fleet_view()
    assert r.first_read is None  # nothing read: nothing watched
