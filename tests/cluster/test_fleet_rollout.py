"""Issue 40: three daemons in three waves follow one signed repository and
report to each other through RADOS (source.fleet). A good commit is applied
wave by wave, each wave only once the one before reported it applied and
Healthy for healthySeconds (on the reader's own clock); a commit that fails
on the canary (a size below the image's: never shrink) halts: the later
waves keep their revision and say who halted it, and why.

One cluster, one machine: each node has its own stateDir and control
socket (tests/cluster/test_move.py ``node_b``), the same Ceph user, and
image-only volumes (fast to converge).
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest
from conftest import NodeUnderTest
from source_signing import Signing
from test_daemon import Daemon, wait_for
from test_move import node_b
from test_source import Repo
from test_source_fleet import anchor

from reconciler.drivers.fleetstore import FleetStore
from reconciler.source.layout import Layout
from reconciler.spec.config import load_config

pytestmark = pytest.mark.ceph

NODES = ("w1", "w2", "w3")  # one per wave, in order
HEALTHY_S = 3
INTERVAL_S = 1


def fleet_yaml(healthy: int = HEALTHY_S) -> str:
    waves = "\n".join(f"    - {{name: wave-{n}, nodes: [{n}]}}" for n in NODES)
    return (f"apiVersion: rbd-reconciler/v1\nkind: Rollout\nmetadata: {{name: test}}\n"
            f"spec:\n  waves:\n{waves}\n"
            f"  gate: {{healthySeconds: {healthy}, staleSeconds: 60}}\n")


@dataclass
class Fleet:
    repo: Repo
    nodes: dict[str, NodeUnderTest]
    daemons: dict[str, Daemon]
    anchors: dict[str, str]  # node -> its image-only volume
    namespace: str  # of the reports in the cluster's pool

    def report(self, n: str):  # type: ignore[no-untyped-def]
        """Node ``n``'s report as the fleet reads it."""
        config = load_config(self.nodes[n].config)
        with FleetStore(config.ceph, self.nodes[n].cluster.pool, self.namespace) as store:
            return store.read_one(n)

    def applied(self, n: str) -> str | None:
        meta = Layout(self.nodes[n].state / "source").applied()
        return meta["commit"] if meta is not None else None

    def state(self, n: str) -> dict:
        return Layout(self.nodes[n].state / "source").read_state()

    def applied_at(self, n: str) -> float:
        """When node ``n`` last switched (its state's wall clock: one machine)."""
        return datetime.fromisoformat(self.state(n)["lastAppliedAt"]).timestamp()


@pytest.fixture
def fleet(node: NodeUnderTest, tmp_path: Path, ceph_cluster: object) -> Iterator[Fleet]:
    namespace = f"fleet-{uuid.uuid4().hex[:8]}"
    node.config.write_text(re.sub(r"(?m)^nodeName: .*$", f"nodeName: {NODES[0]}",
                                  node.config.read_text()) + "resyncSeconds: 3600\n")
    nodes = {NODES[0]: node, **{n: node_b(node, tmp_path, n) for n in NODES[1:]}}
    daemons: dict[str, Daemon] = {}
    with Signing(tmp_path / "signer") as signer:
        repo = Repo(tmp_path, signer, signer.ssh_key("ops"))
        for under in nodes.values():
            repo.follow(under, interval=INTERVAL_S)
            under.config.write_text(under.config.read_text()
                                    + f"  fleet: {{pool: {node.cluster.pool}, "
                                      f"namespace: {namespace}}}\n")
        anchors = {n: node.name(f"anchor-{n}") for n in NODES}
        try:
            for n, under in nodes.items():
                daemons[n] = Daemon(under, args=("--log-format", "json"))
            yield Fleet(repo, nodes, daemons, anchors, namespace)
        finally:
            for d in daemons.values():
                if d.proc.poll() is None:
                    d.stop()
            for under in nodes.values():
                under.cli("release", "--all")
            with ceph_cluster.client() as c, c.open_ioctx(node.cluster.pool) as io:  # type: ignore[attr-defined]
                io.set_namespace(namespace)
                for obj in list(io.list_objects()):
                    io.remove_object(obj.key)


def test_a_commit_rolls_out_wave_by_wave_and_a_failed_canary_halts_it(
        node: NodeUnderTest, fleet: Fleet) -> None:
    files = {f"nodes/{n}/anchor.yaml": anchor(node, fleet.anchors[n]) for n in NODES}
    canary = f"nodes/{NODES[0]}/anchor.yaml"
    files[canary] = files[canary].replace("size: 1Mi", "size: 2Mi")
    t0 = time.monotonic()
    good = fleet.repo.push("the fleet", {**files, "fleet.yaml": fleet_yaml()})
    for n in NODES:
        wait_for(lambda n=n: fleet.applied(n) == good, f"{n} to apply the good commit",
                 timeout=120)
        fleet.daemons[n].wait_phase(fleet.anchors[n], "Created")
    took = time.monotonic() - t0
    at = [fleet.applied_at(n) for n in NODES]
    print("applied after push: " + ", ".join(f"{n} {t - at[0]:+.2f} s"
                                             for n, t in zip(NODES, at, strict=True))
          + f"; all Created {took:.1f} s after the push")
    # Each wave waited for the one before: healthy for HEALTHY_S on its clock.
    assert at[0] < at[1] - HEALTHY_S and at[1] < at[2] - HEALTHY_S, at
    for n in NODES:
        ro = fleet.nodes[n].cli_json("source", "status")[1]["rollout"]
        assert (ro["inFleet"], ro["state"], ro["wave"]) == (True, "Applied", f"wave-{n}"), ro

    # A commit that shrinks the canary's image: refused there, Failed; halted.
    bad = fleet.repo.push("shrink the canary", {canary: anchor(node, fleet.anchors[NODES[0]])})
    wait_for(lambda: fleet.applied(NODES[0]) == bad, "the canary to apply the bad commit")
    fleet.daemons[NODES[0]].wait_phase(fleet.anchors[NODES[0]], "Failed")
    for n in NODES[1:]:
        wait_for(lambda n=n: (fleet.state(n).get("heldBack") or {}).get("state") == "Halted",
                 f"{n} to see the rollout halted", timeout=60)
    # Held for 3 x (gate + interval): no later wave applies it.
    until = time.monotonic() + 3 * (HEALTHY_S + INTERVAL_S)
    while time.monotonic() < until:
        assert [fleet.applied(n) for n in NODES[1:]] == [good, good]
        time.sleep(0.2)  # sampling a window in which nothing may happen
    for n in NODES[1:]:
        _, doc = fleet.nodes[n].cli_json("source", "status")
        ro = doc["rollout"]
        assert ro["state"] == "Halted", ro
        halted = ro["heldBack"]["halted"]
        assert (halted["node"], halted["volume"]) == (NODES[0], fleet.anchors[NODES[0]]), ro
        assert "shrink" in halted["reason"], halted
        assert ro["heldBack"]["commit"] == bad
        _, text = fleet.nodes[n].cli("source", "status")
        assert f"halted by {NODES[0]}, volume {fleet.anchors[NODES[0]]}" in text, text

    # Fixed forward: a new signed commit rolls through again.
    fixed = fleet.repo.push("fix the canary", {canary: files[canary]})
    for n in NODES:
        wait_for(lambda n=n: fleet.applied(n) == fixed, f"{n} to apply the fix", timeout=120)
    fleet.daemons[NODES[0]].wait_phase(fleet.anchors[NODES[0]], "Created")


def roll_out(node: NodeUnderTest, fleet: Fleet) -> str:
    """The first commit, applied by every node (wave by wave)."""
    files = {f"nodes/{n}/anchor.yaml": anchor(node, fleet.anchors[n]) for n in NODES}
    good = fleet.repo.push("the fleet", {**files, "fleet.yaml": fleet_yaml()})
    for n in NODES:
        wait_for(lambda n=n: fleet.applied(n) == good, f"{n} to apply the good commit",
                 timeout=120)
    return good


def test_a_held_canary_holds_the_later_waves_and_the_fleet_sees_why(
        node: NodeUnderTest, fleet: Fleet) -> None:
    good = roll_out(node, fleet)
    canary = NODES[0]
    rc, out = fleet.nodes[canary].cli("source", "hold", "--reason", "disk swap")
    assert rc == 0 and "held at" in out, out
    new = fleet.repo.push("a second volume file", {
        f"nodes/{n}/more.yaml": anchor(node, node.name(f"more-{n}")) for n in NODES})
    wait_for(lambda: (fleet.state(canary).get("heldBack") or {}).get("commit") == new,
             "the canary to see the commit and hold it back")
    wait_for(lambda: (r := fleet.report(canary)) is not None and r.held
             and r.held_back == new, "the canary's report to say it is held")
    report = fleet.report(canary)
    assert (report.applied, report.hold_reason) == (good, "disk swap"), report
    for n in NODES[1:]:
        def waits_for_held_canary(n: str = n) -> bool:
            back = fleet.state(n).get("heldBack") or {}
            return back.get("state") == "Waiting" and any(
                w["node"] == canary and w["why"] == "held" for w in back["waitingFor"])
        wait_for(waits_for_held_canary, f"{n} to wait for the held canary")
    assert [fleet.applied(n) for n in NODES] == [good, good, good]
    _, text = fleet.nodes[NODES[1]].cli("source", "status")
    assert f"waiting for {canary}: held: disk swap" in text, text

    rc, out = fleet.nodes[canary].cli("source", "resume")
    assert rc == 0, out
    for n in NODES:
        wait_for(lambda n=n: fleet.applied(n) == new, f"{n} to apply it after the resume",
                 timeout=120)
    assert not fleet.report(canary).held


def test_fleet_status_through_the_daemon_and_a_direct_read_without_it(
        node: NodeUnderTest, fleet: Fleet) -> None:
    """The running daemon answers ``fleet status`` from its sightings: each
    node's healthy time grows on its clock between two asks. Without a
    daemon the command reads the reports itself and says it is a direct read."""
    good = roll_out(node, fleet)
    canary = fleet.nodes[NODES[0]]
    wait_for(lambda: all((r := fleet.report(n)) is not None and r.applied == good
                         and r.health == "Healthy" for n in NODES),
             "every node to report the commit Healthy")

    def ask() -> dict:
        rc, doc = canary.cli_json("fleet", "status")
        assert rc == 0, doc
        assert doc["answeredBy"] == f"the daemon (pid {fleet.daemons[NODES[0]].proc.pid})", doc
        return doc

    first = {n["node"]: n for n in ask()["nodes"]}
    assert {n: (r["applied"], r["health"]) for n, r in first.items()} == {
        n: (good, "Healthy") for n in NODES}, first
    grown: dict = {}

    def grew() -> bool:
        grown.update(ask())
        rows = {n["node"]: n for n in grown["nodes"]}
        return all(rows[n]["healthyForSeconds"] >= first[n]["healthyForSeconds"] + 2
                   for n in NODES)
    wait_for(grew, "the healthy times, as the daemon sees them, to grow by 2 s", timeout=30)
    assert grown["observedForSeconds"] >= 2 and not any(n["stale"] for n in grown["nodes"])
    # Its answer read live: a report that changed since is seen (the counter moved).
    assert {n["node"]: n["counter"] for n in grown["nodes"]} != {
        n: r["counter"] for n, r in first.items()}
    rc, text = canary.cli("fleet", "status")
    assert rc == 0 and "HEALTHY FOR" in text and "a direct read" not in text, text

    fleet.daemons[NODES[0]].stop()
    rc, doc = canary.cli_json("fleet", "status")
    assert rc == 0, doc
    assert doc["answeredBy"] == "this command" and doc["note"].startswith("a direct read"), doc
    assert doc["observedForSeconds"] == 0
    assert all(n["healthyForSeconds"] == 0 for n in doc["nodes"]), doc["nodes"]
    rc, text = canary.cli("fleet", "status")
    assert rc == 0 and "note: a direct read: no daemon answered" in text, text
