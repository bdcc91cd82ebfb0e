"""Issue 40 on the real cluster: daemons in waves follow one signed
repository and report to each other through RADOS (source.fleet), each
with its own stateDir, control socket and Ceph user with the per-node caps
of docs/fleets.md, the reports in a pool of their own (tests/cluster/
fleet_rig.py). Volumes are image-only; the gate is a few seconds and the
source's interval 1 s, so a test costs seconds per wave.

- six nodes in three waves: a good commit applied wave by wave, each wave
  at least healthySeconds after its reader first saw the previous waves
  Healthy; then a commit failing on the canary halts, and a fix rolls on;
- a held canary holds the later waves, and the fleet sees why;
- a window closed now: nothing applied, the next opening shown; a commit
  opening it: applied;
- a node of wave 2 stopped: stale, the last wave waits with maxUnhealthy
  0 and proceeds under a commit allowing 1;
- a node whose report writes are refused while it applies: its report
  arrives once they are allowed again, its counter continued.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from conftest import NodeUnderTest
from fleet_rig import HEALTHY_S, INTERVAL_S, Fleet, Waves, fleet_rig, fleet_yaml
from test_daemon import wait_for
from test_source_fleet import anchor

pytestmark = pytest.mark.ceph

THREE = [["w1"], ["w2"], ["w3"]]  # one per wave
SIX = [["n1a", "n1b"], ["n2a", "n2b"], ["n3a", "n3b"]]
SLACK_S = 0.05  # between the gate's sighting and its log line's stamp


@pytest.fixture
def fleet_of(node: NodeUnderTest, tmp_path: Path, ceph_cluster: object
             ) -> Iterator[Callable[[Waves], Fleet]]:
    with contextlib.ExitStack() as stack:
        yield lambda waves: stack.enter_context(
            fleet_rig(node, tmp_path, ceph_cluster, waves))  # type: ignore[arg-type]


@pytest.fixture
def fleet(fleet_of: Callable[[Waves], Fleet]) -> Fleet:
    return fleet_of(THREE)


def roll_out(fleet: Fleet, message: str, files: dict[str, str | None],
             timeout: float = 120) -> str:
    """Push ``files``; every node applies it and reports it Healthy."""
    commit = fleet.repo.push(message, files)
    for n in fleet.names:
        wait_for(lambda n=n: fleet.applied(n) == commit, f"{n} to apply {message!r}",
                 timeout=timeout)
    for n in fleet.names:
        wait_for(lambda n=n: fleet.healthy(n, commit), f"{n} to report {message!r} Healthy")
    return commit


def gate_waits(fleet: Fleet, commit: str, n: str) -> dict[str, str]:
    """Whom ``n`` waits for before it applies ``commit`` (node -> why)."""
    back = fleet.held_back(n)
    if back.get("commit") != commit or back.get("state") != "Waiting":
        return {}
    return {w["node"]: w["why"] for w in back.get("waitingFor") or ()}


def wave_order(fleet: Fleet, commit: str) -> list[list[float]]:
    """Each wave's apply times (s after the first), after asserting that
    each node applied at least HEALTHY_S after it first saw every node of
    the earlier waves Healthy (its own gate's log)."""
    at = {n: fleet.applied_at(n) for n in fleet.names}
    for k, wave in enumerate(fleet.waves[1:], 1):
        for n in wave:
            for m in (m for earlier in fleet.waves[:k] for m in earlier):
                seen = fleet.first_seen_healthy(n, m, commit)
                assert seen is not None, (n, m, fleet.daemons[n].log.read_text()[-3000:])
                assert at[n] >= seen + HEALTHY_S - SLACK_S, (n, m, at[n] - seen)
        assert min(at[n] for n in wave) > max(at[m] for m in fleet.waves[k - 1]), at
    t0 = min(at.values())
    return [[at[n] - t0 for n in wave] for wave in fleet.waves]


def test_six_nodes_roll_out_wave_by_wave_and_a_failed_canary_halts_it(
        node: NodeUnderTest, fleet_of: Callable[[Waves], Fleet]) -> None:
    fleet = fleet_of(SIX)
    canary = fleet.waves[0][0]
    canary_file = f"nodes/{canary}/anchor.yaml"
    files = fleet.files()
    files[canary_file] = files[canary_file].replace("size: 1Mi", "size: 2Mi")
    t0 = time.monotonic()
    good = roll_out(fleet, "the fleet", {**files, "fleet.yaml": fleet_yaml(fleet.waves)})
    took = time.monotonic() - t0
    waves = wave_order(fleet, good)
    print("applied (s after the first): " + "; ".join(
        ", ".join(f"{t:.2f}" for t in w) for w in waves)
        + f"; all Healthy {took:.1f} s after the push")
    for n in fleet.names:
        ro = fleet.nodes[n].cli_json("source", "status")[1]["rollout"]
        wave = next(f"wave-{i}" for i, w in enumerate(fleet.waves, 1) if n in w)
        assert (ro["inFleet"], ro["state"], ro["wave"]) == (True, "Applied", wave), ro

    # A commit that shrinks the canary's image: refused there, Failed; halted.
    bad = fleet.repo.push("shrink the canary",
                          {canary_file: anchor(node, fleet.anchors[canary])})
    for n in fleet.waves[0]:
        wait_for(lambda n=n: fleet.applied(n) == bad, f"{n} (wave 1) to apply the bad commit")
    fleet.daemons[canary].wait_phase(fleet.anchors[canary], "Failed")
    later = [n for w in fleet.waves[1:] for n in w]
    for n in later:
        wait_for(lambda n=n: fleet.held_back(n).get("state") == "Halted",
                 f"{n} to see the rollout halted", timeout=60)
    # Held for 3 x (gate + interval): no later wave applies it.
    until = time.monotonic() + 3 * (HEALTHY_S + INTERVAL_S)
    while time.monotonic() < until:
        assert [fleet.applied(n) for n in later] == [good] * len(later)
        time.sleep(0.2)  # sampling a window in which nothing may happen
    for n in later:
        ro = fleet.nodes[n].cli_json("source", "status")[1]["rollout"]
        assert ro["state"] == "Halted", ro
        halted = ro["heldBack"]["halted"]
        assert (halted["node"], halted["volume"]) == (canary, fleet.anchors[canary]), ro
        assert "shrink" in halted["reason"], halted
        assert ro["heldBack"]["commit"] == bad
    _, text = fleet.nodes[later[-1]].cli("source", "status")
    assert f"halted by {canary}, volume {fleet.anchors[canary]}" in text, text

    # Fixed forward: a new signed commit rolls through again.
    roll_out(fleet, "fix the canary", {canary_file: files[canary_file]})
    fleet.daemons[canary].wait_phase(fleet.anchors[canary], "Created")


def test_a_held_canary_holds_the_later_waves_and_the_fleet_sees_why(
        node: NodeUnderTest, fleet: Fleet) -> None:
    good = roll_out(fleet, "the fleet", {**fleet.files(), "fleet.yaml": fleet_yaml(THREE)})
    canary = fleet.names[0]
    rc, out = fleet.nodes[canary].cli("source", "hold", "--reason", "disk swap")
    assert rc == 0 and "held at" in out, out
    new = fleet.repo.push("a second volume file", {
        f"nodes/{n}/more.yaml": anchor(node, node.name(f"more-{n}")) for n in fleet.names})
    wait_for(lambda: fleet.held_back(canary).get("commit") == new,
             "the canary to see the commit and hold it back")
    wait_for(lambda: (r := fleet.report(canary)) is not None and r.held
             and r.held_back == new, "the canary's report to say it is held")
    report = fleet.report(canary)
    assert (report.applied, report.hold_reason) == (good, "disk swap"), report
    for n in fleet.names[1:]:
        wait_for(lambda n=n: gate_waits(fleet, new, n).get(canary) == "held",
                 f"{n} to wait for the held canary")
    assert [fleet.applied(n) for n in fleet.names] == [good, good, good]
    _, text = fleet.nodes[fleet.names[1]].cli("source", "status")
    assert f"waiting for {canary}: held: disk swap" in text, text

    rc, out = fleet.nodes[canary].cli("source", "resume")
    assert rc == 0, out
    for n in fleet.names:
        wait_for(lambda n=n: fleet.applied(n) == new, f"{n} to apply it after the resume",
                 timeout=120)
    assert not fleet.report(canary).held


def window(opens: datetime, closes: datetime) -> str:
    return (f'    - {{days: [Mon, Tue, Wed, Thu, Fri, Sat, Sun], start: "{opens:%H:%M}", '
            f'end: "{closes:%H:%M}", timeZone: UTC}}\n')


def test_a_closed_window_applies_nothing_until_a_commit_opens_it(
        fleet_of: Callable[[Waves], Fleet]) -> None:
    fleet = fleet_of([["o1"], ["o2"]])
    now = datetime.now(UTC)
    opens = (now + timedelta(hours=2)).replace(second=0, microsecond=0)
    closed = fleet.repo.push("closed now", {**fleet.files(), "fleet.yaml": fleet_yaml(
        fleet.waves, windows=window(opens, opens + timedelta(hours=1)))})
    for n in fleet.names:
        wait_for(lambda n=n: fleet.held_back(n).get("commit") == closed
                 and fleet.held_back(n).get("state") == "OutsideWindow",
                 f"{n} to keep the commit back outside the window")
    for n in fleet.names:
        assert fleet.applied(n) is None, n
        assert not fleet.nodes[n].image_exists(fleet.anchors[n]), n
        ro = fleet.nodes[n].cli_json("source", "status")[1]["rollout"]
        assert ro["state"] == "OutsideWindow", ro
        assert datetime.fromisoformat(ro["heldBack"]["nextOpening"]) == opens, ro
        _, text = fleet.nodes[n].cli("source", "status")
        assert "next window opens at " + ro["heldBack"]["nextOpening"] in text, text
        wait_for(lambda n=n: (r := fleet.report(n)) is not None and r.held_back == closed
                 and (r.held_back_why or "").startswith("OutsideWindow: "),
                 f"{n}'s report to say why it holds the commit back")  # the fleet sees why

    # The next commit's fleet.yaml opens the window now: its own window decides.
    start = (datetime.now(UTC) - timedelta(hours=1)).replace(second=0, microsecond=0)
    opened = roll_out(fleet, "open now", {"fleet.yaml": fleet_yaml(
        fleet.waves, windows=window(start, start + timedelta(hours=2)))})
    for n in fleet.names:
        assert fleet.nodes[n].image_exists(fleet.anchors[n]), n
        assert fleet.nodes[n].cli_json("source", "status")[1]["rollout"]["state"] == "Applied"
    wave_order(fleet, opened)


STALE_S = 5


def test_a_stopped_node_goes_stale_and_holds_the_last_wave_unless_allowed(
        fleet_of: Callable[[Waves], Fleet]) -> None:
    fleet = fleet_of([["s1"], ["s2a", "s2b"], ["s3"]])
    files = fleet.files()
    first = roll_out(fleet, "the fleet",
                     {**files, "fleet.yaml": fleet_yaml(fleet.waves, stale=STALE_S)})
    fleet.pause("s2b")
    try:
        strict = fleet.repo.push("a second commit", {"README": "second\n"})
        for n in ("s1", "s2a"):
            wait_for(lambda n=n: fleet.applied(n) == strict, f"{n} to apply the commit")
        # s2b's report stops changing: stale to s3 after STALE_S, and
        # maxUnhealthy 0 keeps s3 waiting for it (and only for it).
        wait_for(lambda: gate_waits(fleet, strict, "s3") == {"s2b": "stale"},
                 "s3 to wait for the stale s2b alone", timeout=60)
        assert fleet.applied("s3") == first
        _, text = fleet.nodes["s3"].cli("source", "status")
        assert "waiting for s2b: stale: no change seen for" in text, text

        # A commit allowing one unhealthy node: s3 proceeds without s2b.
        lenient = fleet.repo.push("allow one unhealthy", {"fleet.yaml": fleet_yaml(
            fleet.waves, stale=STALE_S, max_unhealthy=1)})
        for n in ("s1", "s2a", "s3"):
            wait_for(lambda n=n: fleet.applied(n) == lenient, f"{n} to apply it", timeout=60)
        assert fleet.applied("s2b") == first
        assert fleet.applied_at("s3") > fleet.applied_at("s2a")
    finally:
        fleet.resume("s2b")
    wait_for(lambda: fleet.applied("s2b") == lenient, "s2b to catch up once resumed")


def test_a_node_whose_report_writes_fail_while_it_applies_reports_once_they_work(
        node: NodeUnderTest, fleet_of: Callable[[Waves], Fleet]) -> None:
    fleet = fleet_of([["c1"], ["c2"]])
    files = fleet.files()
    first = roll_out(fleet, "the fleet", {**files, "fleet.yaml": fleet_yaml(fleet.waves)})
    before = fleet.report("c1")
    fleet.cut("c1")
    wait_for(lambda: "this node's report is not written" in fleet.daemons["c1"].log.read_text(),
             "c1's report write to fail")
    more = node.name("more-c1")
    second = fleet.repo.push("a volume for c1", {"nodes/c1/more.yaml": anchor(node, more)})
    wait_for(lambda: fleet.applied("c1") == second, "c1 to apply the commit, cut")
    fleet.daemons["c1"].wait_phase(more, "Created")
    wait_for(lambda: gate_waits(fleet, second, "c2") == {"c1": "not-applied"},
             "c2 to wait for c1's report")
    stuck = fleet.report("c1")  # the last one written before the cut
    assert stuck is not None and stuck.applied == first, stuck
    assert before is not None and stuck.counter >= before.counter
    made = json.loads((fleet.nodes["c1"].state / "fleet-report.json").read_text())["counter"]
    assert made > stuck.counter, (made, stuck)  # reports made, kept, not written
    assert fleet.applied("c2") == first

    fleet.reconnect("c1")
    wait_for(lambda: fleet.healthy("c1", second), "c1's report to arrive")
    arrived = fleet.report("c1")
    assert arrived is not None and arrived.counter >= made, (arrived, made)  # continued
    assert "this node's report is written again" in fleet.daemons["c1"].log.read_text()
    wait_for(lambda: fleet.applied("c2") == second, "c2 to apply it after c1's report")


def test_fleet_status_through_the_daemon_and_a_direct_read_without_it(
        node: NodeUnderTest, fleet: Fleet) -> None:
    """The running daemon answers ``fleet status`` from its sightings: each
    node's healthy time grows on its clock between two asks. Without a
    daemon the command reads the reports itself and says it is a direct read."""
    good = roll_out(fleet, "the fleet", {**fleet.files(), "fleet.yaml": fleet_yaml(THREE)})
    names = fleet.names
    canary = fleet.nodes[names[0]]
    wait_for(lambda: all((r := fleet.report(n)) is not None and r.applied == good
                         and r.health == "Healthy" for n in names),
             "every node to report the commit Healthy")

    def ask() -> dict:
        rc, doc = canary.cli_json("fleet", "status")
        assert rc == 0, doc
        assert doc["answeredBy"] == f"the daemon (pid {fleet.daemons[names[0]].proc.pid})", doc
        return doc

    first = {n["node"]: n for n in ask()["nodes"]}
    assert {n: (r["applied"], r["health"]) for n, r in first.items()} == {
        n: (good, "Healthy") for n in names}, first
    grown: dict = {}

    def grew() -> bool:
        grown.update(ask())
        rows = {n["node"]: n for n in grown["nodes"]}
        return all(rows[n]["healthyForSeconds"] >= first[n]["healthyForSeconds"] + 2
                   for n in names)
    wait_for(grew, "the healthy times, as the daemon sees them, to grow by 2 s", timeout=30)
    assert grown["observedForSeconds"] >= 2 and not any(n["stale"] for n in grown["nodes"])
    # Its answer read live: a report that changed since is seen (the counter moved).
    assert {n["node"]: n["counter"] for n in grown["nodes"]} != {
        n: r["counter"] for n, r in first.items()}
    rc, text = canary.cli("fleet", "status")
    assert rc == 0 and "HEALTHY FOR" in text and "a direct read" not in text, text

    fleet.daemons[names[0]].stop()
    rc, doc = canary.cli_json("fleet", "status")
    assert rc == 0, doc
    assert doc["answeredBy"] == "this command" and doc["note"].startswith("a direct read"), doc
    assert doc["observedForSeconds"] == 0
    assert all(n["healthyForSeconds"] == 0 for n in doc["nodes"]), doc["nodes"]
    rc, text = canary.cli("fleet", "status")
    assert rc == 0 and "note: a direct read: no daemon answered" in text, text
