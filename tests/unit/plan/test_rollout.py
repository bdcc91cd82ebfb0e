"""The rollout gate (plan/rollout.py): waves in order, the healthy time on the
reader's clock, staleness, the unhealthy allowance, a halt on R Failed, the
node's hold, and windows by each zone's wall clock through DST."""

from __future__ import annotations

import zoneinfo
from datetime import UTC, datetime, time, timedelta

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from reconciler.facts.fleetreport import Report
from reconciler.plan.rollout import (
    Apply,
    Halted,
    Held,
    OutsideWindow,
    Sighting,
    Wait,
    Waiting,
    decide,
    describe,
    earlier_nodes,
    in_window,
    next_opening,
    sight,
    wave_of,
)
from reconciler.spec.fleet import Gate, Rollout, Wave, Window

R, OLD = "a" * 40, "b" * 40
NOW = 10_000.0  # the reader's monotonic clock
MONDAY_NOON = datetime(2024, 5, 6, 12, 0, tzinfo=UTC)


def fleet(*waves: tuple[str, list[str]], healthy: int = 60, most: int = 0,
          percent: bool = False, stale: int = 300, windows: tuple[Window, ...] = ()) -> Rollout:
    waves = waves or (("canary", ["c1", "c2"]), ("early", ["e*"]), ("rest", ["*"]))
    return Rollout("edge", tuple(Wave(n, tuple(nodes)) for n, nodes in waves),
                   Gate(healthy, most, percent, stale), windows)


def rep(node: str, applied: str | None = R, health: str = "Healthy", counter: int = 1,
        held: bool = False, failed: str | None = None) -> Report:
    return Report(node=node, applied=applied, health=health, counter=counter,
                  written_at="2024-05-06T12:00:00+00:00",
                  failed_volume="db" if failed else None, failed_reason=failed,
                  held=held, hold_reason="maintenance" if held else None)


def good(node: str, age: float = 600) -> Sighting:
    """R applied and Healthy, seen so for ``age`` seconds, changed just now."""
    return Sighting(rep(node), NOW - age, NOW - 1)


def at(node: str, report: Report, first_age: float = 600, quiet: float = 1) -> Sighting:
    return Sighting(report, NOW - first_age, NOW - quiet)


def window(days: set[int], start: str, end: str, zone: str = "UTC") -> Window:
    h1, m1 = map(int, start.split(":"))
    h2, m2 = map(int, end.split(":"))
    return Window(frozenset(days), time(h1, m1), time(h2, m2), zone, zoneinfo.ZoneInfo(zone))


def run(rollout: Rollout, me: str, seen: dict[str, Sighting], held: str | None = None,
        now_utc: datetime = MONDAY_NOON) -> object:
    return decide(rollout, me, R, seen, held, NOW, now_utc)


def waits(decision: object) -> dict[str, str]:
    assert isinstance(decision, Waiting), decision
    return {w.node: w.why for w in decision.waiting_for}


CANARY_OK = {"c1": good("c1"), "c2": good("c2")}

# (id, rollout, me, seen, expected: "apply" | {node: why} | a Decision)
CASES: list[tuple[str, Rollout, str, dict[str, Sighting], object]] = [
    ("canary-at-once", fleet(), "c1", {}, "apply"),
    ("canary-ignores-its-peer", fleet(), "c2", {"c1": at("c1", rep("c1", OLD))}, "apply"),
    ("early-after-canary", fleet(), "e1", CANARY_OK, "apply"),
    ("early-too-soon", fleet(), "e1", {**CANARY_OK, "c2": good("c2", 59)},
     {"c2": "too-briefly-healthy"}),
    ("gate-exactly", fleet(), "e1", {**CANARY_OK, "c2": good("c2", 60)}, "apply"),
    ("no-wait-gate", fleet(healthy=0), "e1", {**CANARY_OK, "c2": good("c2", 0)}, "apply"),
    ("canary-missing", fleet(), "e1", {"c1": good("c1")}, {"c2": "missing"}),
    ("canary-missing-allowed", fleet(most=1), "e1", {"c1": good("c1")}, "apply"),
    ("canary-all-missing-1", fleet(most=1), "e1", {}, {"c1": "missing", "c2": "missing"}),
    ("stale", fleet(), "e1", {**CANARY_OK, "c2": at("c2", rep("c2"), quiet=300)},
     {"c2": "stale"}),
    ("nearly-stale", fleet(), "e1", {**CANARY_OK, "c2": at("c2", rep("c2"), quiet=299)},
     "apply"),
    ("stale-50%", fleet(most=50, percent=True), "e1",
     {**CANARY_OK, "c2": at("c2", rep("c2"), quiet=900)}, "apply"),
    ("percent-rounds-down", fleet(most=49, percent=True), "e1",
     {**CANARY_OK, "c2": at("c2", rep("c2"), quiet=900)}, {"c2": "stale"}),
    ("not-applied", fleet(), "e1", {**CANARY_OK, "c2": at("c2", rep("c2", OLD))},
     {"c2": "not-applied"}),
    ("not-applied-is-no-allowance", fleet(most=1), "e1",
     {**CANARY_OK, "c2": at("c2", rep("c2", OLD))}, {"c2": "not-applied"}),
    ("nothing-applied", fleet(), "e1", {**CANARY_OK, "c2": at("c2", rep("c2", None,
                                                                       "Converging"))},
     {"c2": "not-applied"}),
    ("converging", fleet(), "e1", {**CANARY_OK, "c2": at("c2", rep("c2", health="Converging"))},
     {"c2": "converging"}),
    ("held-back", fleet(), "e1", {**CANARY_OK, "c2": at("c2", rep("c2", OLD, held=True))},
     {"c2": "held"}),
    ("held-back-allowed", fleet(most=1), "e1",
     {**CANARY_OK, "c2": at("c2", rep("c2", OLD, held=True))}, "apply"),
    ("held-at-R-is-fine", fleet(), "e1", {**CANARY_OK, "c2": at("c2", rep("c2", held=True))},
     "apply"),
    ("failed-elsewhere", fleet(), "e1",
     {**CANARY_OK, "c2": at("c2", rep("c2", OLD, "Failed", failed="boom"))}, {"c2": "failed"}),
    ("failed-elsewhere-allowed", fleet(most=1), "e1",
     {**CANARY_OK, "c2": at("c2", rep("c2", OLD, "Failed", failed="boom"))}, "apply"),
    ("halt", fleet(), "e1", {**CANARY_OK, "c2": at("c2", rep("c2", health="Failed",
                                                             failed="never shrink"))},
     Halted("c2", "db", "never shrink")),
    ("halt-the-canary-too", fleet(), "c1", {"c2": at("c2", rep("c2", health="Failed",
                                                               failed="x"))},
     Halted("c2", "db", "x")),
    ("halt-by-a-later-wave", fleet(most=5), "e1",
     {**CANARY_OK, "r1": at("r1", rep("r1", health="Failed", failed="x"))},
     Halted("r1", "db", "x")),
    ("halt-even-stale", fleet(), "r1",
     {"c1": at("c1", rep("c1", health="Failed", failed="x"), quiet=10**6)},
     Halted("c1", "db", "x")),
    ("kept-if-applied", fleet(), "e1",
     {"e1": good("e1"), "c2": at("c2", rep("c2", health="Failed", failed="x"))}, "apply"),
    ("rest-waits-for-reported-globs", fleet(), "r1", {**CANARY_OK, "e5": at("e5",
                                                                            rep("e5", OLD))},
     {"e5": "not-applied"}),
    ("rest-after-all", fleet(), "r1", {**CANARY_OK, "e5": good("e5"), "e6": good("e6")},
     "apply"),
    ("rest-unmatched-glob-is-empty", fleet(), "r1", CANARY_OK, "apply"),
    ("same-wave-peers-do-not-gate", fleet(), "e1",
     {**CANARY_OK, "e2": at("e2", rep("e2", OLD)), "r1": at("r1", rep("r1", OLD))}, "apply"),
    ("the-key-names-the-node", fleet(), "e1", {"c1": good("c1"), "c3": good("c2")},
     {"c2": "missing"}),
    ("in-no-wave-waits-for-all", fleet(("canary", ["c1"]), ("early", ["e*"])), "x1",
     {"c1": good("c1"), "e3": at("e3", rep("e3", health="Converging"))},
     {"e3": "converging"}),
    ("in-no-wave-after-all", fleet(("canary", ["c1"]), ("early", ["e*"])), "x1",
     {"c1": good("c1"), "e3": good("e3"), "x2": at("x2", rep("x2", OLD))}, "apply"),
    ("first-wave-wins", fleet(("canary", ["c*"]), ("early", ["c9", "e1"])), "e1",
     {"c1": good("c1")}, {"c9": "missing"}),
]


@pytest.mark.parametrize(("rollout", "me", "seen", "expected"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_decide(rollout: Rollout, me: str, seen: dict[str, Sighting], expected: object) -> None:
    decision = run(rollout, me, seen)
    if expected == "apply":
        assert decision == Apply(), decision
    elif isinstance(expected, dict):
        assert waits(decision) == expected
    else:
        assert decision == expected


def test_waiting_names_the_wave_and_says_why() -> None:
    d = run(fleet(), "e1", {**CANARY_OK, "c2": good("c2", 12.4)})
    assert d == Waiting("early", (Wait("c2", "too-briefly-healthy",
                                       "healthy for only 12s of 60s"),))
    assert describe(d) == "wave early waits for c2 (healthy for only 12s of 60s)"
    d = run(fleet(("canary", ["c1"])), "x1", {})
    assert isinstance(d, Waiting) and d.wave is None
    assert describe(d) == "a node in no wave waits for c1 (no report)"


def test_over_the_allowance_every_unhealthy_node_is_named() -> None:
    rollout = fleet(("canary", ["c1", "c2", "c3"]), ("rest", ["*"]), most=1)
    d = run(rollout, "r1", {"c3": at("c3", rep("c3", OLD))})
    assert waits(d) == {"c1": "missing", "c2": "missing", "c3": "not-applied"}


def test_a_hold_wins_over_everything() -> None:
    halted = {"c2": at("c2", rep("c2", health="Failed", failed="x"))}
    assert run(fleet(), "c1", halted, held="disk swap") == Held("disk swap")
    assert run(fleet(), "c1", {}, held="") == Held("")
    assert describe(Held("")) == "held by this node"
    assert describe(Held("disk swap")) == "held by this node: disk swap"


BERLIN_NIGHTS = window({0, 1, 2, 3, 4}, "02:00", "04:00", "Europe/Berlin")


def test_outside_every_window_says_when_the_next_opens() -> None:
    rollout = fleet(windows=(BERLIN_NIGHTS,))
    d = run(rollout, "c1", {})
    # Monday 14:00 in Berlin: Tuesday 02:00 CEST is 00:00 UTC.
    assert d == OutsideWindow(datetime(2024, 5, 7, 0, 0, tzinfo=UTC))
    assert describe(d) == "outside every window; the next opens at 2024-05-07T00:00:00+00:00"
    inside = datetime(2024, 5, 7, 0, 30, tzinfo=UTC)
    assert run(rollout, "c1", {}, now_utc=inside) == Apply()
    assert waits(run(rollout, "e1", {}, now_utc=inside)) == {"c1": "missing", "c2": "missing"}


def test_a_halt_is_told_before_the_window() -> None:
    rollout = fleet(windows=(BERLIN_NIGHTS,))
    d = run(rollout, "e1", {"c2": at("c2", rep("c2", health="Failed", failed="x"))})
    assert d == Halted("c2", "db", "x")
    assert describe(d) == "halted: it failed on c2, volume db: x"
    assert describe(Halted("c2", None, "x")) == "halted: it failed on c2: x"


def test_wave_of_and_earlier_nodes() -> None:
    rollout = fleet()
    assert [wave_of(rollout, n) for n in ("c1", "c2", "e1", "c3", "x")] == [0, 0, 1, 2, 2]
    assert wave_of(fleet(("a", ["c1"])), "x") is None
    assert earlier_nodes(rollout, 0, ["c1", "e1"]) == []
    assert earlier_nodes(rollout, 1, []) == ["c1", "c2"]
    assert earlier_nodes(rollout, 2, ["e7", "r1", "c1"]) == ["c1", "c2", "e7"]
    assert earlier_nodes(rollout, 3, ["e7", "r1"]) == ["c1", "c2", "e7", "r1"]


# ---------------------------------------------------------------- sightings


def test_sight_keeps_the_healthy_time_across_counter_bumps() -> None:
    first = sight(None, rep("c1", counter=1), 100.0)
    assert first == Sighting(rep("c1", counter=1), 100.0, 100.0)
    assert sight(first, rep("c1", counter=1), 150.0) is first  # unchanged: not seen changing
    bumped = sight(first, rep("c1", counter=2), 160.0)
    assert (bumped.first_seen_mono, bumped.last_change_mono) == (100.0, 160.0)
    sick = sight(bumped, rep("c1", health="Converging", counter=3), 170.0)
    assert (sick.first_seen_mono, sick.last_change_mono) == (170.0, 170.0)
    moved = sight(sick, rep("c1", OLD, health="Converging", counter=4), 180.0)
    assert moved.first_seen_mono == 180.0
    held = sight(moved, rep("c1", OLD, health="Converging", counter=5, held=True), 190.0)
    assert held.first_seen_mono == 180.0  # a hold is not a change of revision or health
    replayed = sight(held, rep("c1", OLD, health="Converging", counter=1), 200.0)
    assert replayed.last_change_mono == 200.0  # a counter going back is a change too


# ---------------------------------------------------------------- windows


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


# (id, windows, instant, open?)
OPEN: list[tuple[str, tuple[Window, ...], datetime, bool]] = [
    ("none-is-any-time", (), utc(2024, 5, 5, 3), True),
    ("inside", (BERLIN_NIGHTS,), utc(2024, 5, 6, 0, 30), True),
    ("start-included", (BERLIN_NIGHTS,), utc(2024, 5, 6, 0, 0), True),
    ("end-excluded", (BERLIN_NIGHTS,), utc(2024, 5, 6, 2, 0), False),
    ("just-before-end", (BERLIN_NIGHTS,), utc(2024, 5, 6, 1, 59, 59), True),
    ("sunday", (BERLIN_NIGHTS,), utc(2024, 5, 5, 0, 30), False),
    ("winter-offset", (BERLIN_NIGHTS,), utc(2024, 1, 8, 1, 30), True),  # 02:30 CET
    ("winter-offset-out", (BERLIN_NIGHTS,), utc(2024, 1, 8, 0, 30), False),  # 01:30 CET
    ("cross-before-midnight", (window({4}, "22:00", "02:00"),), utc(2024, 5, 10, 23), True),
    ("cross-after-midnight", (window({4}, "22:00", "02:00"),), utc(2024, 5, 11, 1), True),
    ("cross-closed", (window({4}, "22:00", "02:00"),), utc(2024, 5, 11, 2), False),
    ("cross-day-before-not-listed", (window({4}, "22:00", "02:00"),), utc(2024, 5, 10, 1),
     False),
    ("cross-sunday-into-monday", (window({6}, "23:00", "01:00"),), utc(2024, 5, 6, 0, 30),
     True),
    ("second-window", (BERLIN_NIGHTS, window({6}, "10:00", "11:00")), utc(2024, 5, 5, 10, 5),
     True),
    ("spring-gap-opens-at-the-jump", (window({6}, "02:30", "04:00", "Europe/Berlin"),),
     utc(2024, 3, 31, 1, 0), True),
    ("spring-gap-before", (window({6}, "02:30", "04:00", "Europe/Berlin"),),
     utc(2024, 3, 31, 0, 59), False),
    ("fall-back-first", (window({6}, "02:00", "02:30", "Europe/Berlin"),),
     utc(2024, 10, 27, 0, 15), True),
    ("fall-back-between", (window({6}, "02:00", "02:30", "Europe/Berlin"),),
     utc(2024, 10, 27, 0, 45), False),
    ("fall-back-second", (window({6}, "02:00", "02:30", "Europe/Berlin"),),
     utc(2024, 10, 27, 1, 15), True),
]


@pytest.mark.parametrize(("windows", "instant", "expected"), [c[1:] for c in OPEN],
                         ids=[c[0] for c in OPEN])
def test_in_window(windows: tuple[Window, ...], instant: datetime, expected: bool) -> None:
    assert in_window(windows, instant) is expected


# (id, windows, now, next opening)
NEXT: list[tuple[str, tuple[Window, ...], datetime, datetime | None]] = [
    ("open-now", (BERLIN_NIGHTS,), utc(2024, 5, 6, 0, 30), utc(2024, 5, 6, 0, 30)),
    ("none-is-now", (), utc(2024, 5, 6, 7), utc(2024, 5, 6, 7)),
    ("tonight", (BERLIN_NIGHTS,), utc(2024, 5, 6, 12), utc(2024, 5, 7, 0)),
    ("after-the-weekend", (BERLIN_NIGHTS,), utc(2024, 5, 10, 12), utc(2024, 5, 13, 0)),
    ("winter", (BERLIN_NIGHTS,), utc(2024, 1, 8, 12), utc(2024, 1, 9, 1)),
    ("seconds-kept", (window({0}, "13:00", "14:00"),), utc(2024, 5, 6, 12, 59, 59),
     utc(2024, 5, 6, 13)),
    ("spring-gap", (window({6}, "02:30", "04:00", "Europe/Berlin"),), utc(2024, 3, 31, 0),
     utc(2024, 3, 31, 1)),
    ("gone-in-the-gap", (window({6}, "02:15", "02:45", "Europe/Berlin"),),
     utc(2024, 3, 30, 12), utc(2024, 4, 7, 0, 15)),
    ("fall-back-again", (window({6}, "02:00", "02:30", "Europe/Berlin"),),
     utc(2024, 10, 27, 0, 45), utc(2024, 10, 27, 1)),
    ("fall-back-second-reading", (window({6}, "02:20", "02:30", "Europe/Berlin"),),
     utc(2024, 10, 27, 0, 45), utc(2024, 10, 27, 1, 20)),
    ("fall-back-clock-jumps-in", (window({6}, "01:00", "02:30", "Europe/Berlin"),),
     utc(2024, 10, 27, 0, 45), utc(2024, 10, 27, 1)),
    ("new-york", (window({5}, "09:00", "10:00", "America/New_York"),),
     utc(2024, 3, 9, 15), utc(2024, 3, 16, 13)),
    ("earliest-of-two", (BERLIN_NIGHTS, window({0}, "20:00", "21:00")),
     utc(2024, 5, 6, 12), utc(2024, 5, 6, 20)),
]


@pytest.mark.parametrize(("windows", "now", "expected"), [c[1:] for c in NEXT],
                         ids=[c[0] for c in NEXT])
def test_next_opening(windows: tuple[Window, ...], now: datetime,
                      expected: datetime | None) -> None:
    assert next_opening(windows, now) == expected


def test_a_naive_time_is_refused() -> None:
    with pytest.raises(ValueError, match="aware"):
        in_window((BERLIN_NIGHTS,), datetime(2024, 5, 6, 12))


ZONES = ["UTC", "Europe/Berlin", "America/New_York", "Australia/Lord_Howe",
         "America/Santiago", "Asia/Kolkata", "Pacific/Chatham"]
QUARTERS = st.integers(0, 95).map(lambda q: f"{q // 4:02d}:{q % 4 * 15:02d}")
WINDOWS = st.builds(lambda days, start, end, zone: window(days, start, end, zone),
                    st.sets(st.integers(0, 6), min_size=1), QUARTERS, QUARTERS,
                    st.sampled_from(ZONES))
# Near the DST changes of 2024 in both hemispheres, on the quarter hour.
INSTANTS = st.builds(lambda base, q: base + timedelta(minutes=15 * q),
                     st.sampled_from([utc(2024, 3, 29), utc(2024, 4, 5), utc(2024, 10, 25),
                                      utc(2024, 11, 1), utc(2024, 9, 6), utc(2024, 6, 1)]),
                     st.integers(0, 4 * 24 * 4))


@settings(max_examples=60, deadline=None)
@given(st.lists(WINDOWS, min_size=1, max_size=2), INSTANTS)
def test_next_opening_is_the_first_open_quarter_hour(windows: list[Window],
                                                     now: datetime) -> None:
    assume(all(w.start != w.end for w in windows))
    # Every start and every offset change here falls on a quarter hour (the
    # zones' too, Chatham's :45 included), so a scan by quarters finds the
    # first open instant.
    found = next_opening(tuple(windows), now)
    scan = now
    while not in_window(tuple(windows), scan):
        scan += timedelta(minutes=15)
        assert scan < now + timedelta(days=8)
    assert found == scan


# ---------------------------------------------------------------- properties

NODES = ["c1", "c2", "e1", "e2", "e3", "r1", "r2", "x9"]
SIGHTINGS = st.builds(
    lambda node, applied, health, held, first, quiet, n: Sighting(
        rep(node, applied, "Converging" if applied is None else health, counter=n,
            held=held, failed="x" if health == "Failed" and applied else None),
        NOW - first, NOW - quiet),
    st.sampled_from(NODES), st.sampled_from([R, R, R, OLD, None]),
    st.sampled_from(["Healthy", "Healthy", "Failed", "Converging"]), st.booleans(),
    st.floats(0, 1000), st.floats(0, 400), st.integers(0, 50))
FLEETS = st.builds(lambda healthy, most, stale: fleet(
    ("canary", ["c1", "c2"]), ("early", ["e*"]), ("rest", ["r*"]),
    healthy=healthy, most=most, stale=stale),
    st.integers(0, 300), st.integers(0, 2), st.integers(1, 600))


@settings(max_examples=500, deadline=None)
@given(FLEETS, st.sampled_from(NODES), st.dictionaries(st.sampled_from(NODES), SIGHTINGS))
def test_apply_only_when_the_earlier_waves_passed(rollout: Rollout, me: str,
                                                  seen: dict[str, Sighting]) -> None:
    decision = run(rollout, me, seen)
    mine = seen.get(me)
    if not isinstance(decision, Apply) or (mine is not None and mine.report.applied == R):
        return
    # Never while any node reports R Failed.
    assert not any(s.report.applied == R and s.report.health == "Failed"
                   for s in seen.values())
    k = wave_of(rollout, me)
    k = len(rollout.waves) if k is None else k
    gate = rollout.gate
    bad = 0
    for node in earlier_nodes(rollout, k, seen):
        s = seen.get(node)
        fresh = s is not None and NOW - s.last_change_mono < gate.stale_seconds
        passed = fresh and s is not None and s.report.applied == R and \
            s.report.health == "Healthy" and NOW - s.first_seen_mono >= gate.healthy_seconds
        if not passed:
            bad += 1
            # Only the unhealthy may be let through, never one on its way.
            assert not fresh or s is None or (s.report.applied != R and (
                s.report.held or s.report.health == "Failed"))
    assert bad <= gate.allowed(len(earlier_nodes(rollout, k, seen)))


@settings(max_examples=200, deadline=None)
@given(FLEETS, st.dictionaries(st.sampled_from(NODES), SIGHTINGS))
def test_wave_order_is_kept(rollout: Rollout, seen: dict[str, Sighting]) -> None:
    """With no allowance, a node applies only if every node of an earlier
    wave would (a later wave never runs ahead of an earlier one)."""
    rollout = fleet(*((w.name, list(w.nodes)) for w in rollout.waves), most=0,
                    healthy=rollout.gate.healthy_seconds, stale=rollout.gate.stale_seconds)
    order = ["c1", "e1", "r1", "x9"]
    for i, later in enumerate(order):
        if isinstance(run(rollout, later, seen), Apply) and later not in seen:
            for earlier in order[:i]:
                assert isinstance(run(rollout, earlier, seen), Apply | Halted), earlier
