"""A node's report: what it writes reads back the same, and what anyone else
could write is refused with a reason (never an exception of another kind)."""

from __future__ import annotations

import contextlib
import json
import string
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reconciler.facts.fleetreport import (
    MAX_REASON,
    MAX_REPORT_BYTES,
    Report,
    clip,
    parse,
    phases_of,
)

R1 = "a" * 40
R2 = "b" * 64
GOOD = Report(node="edge-001", applied=R1, health="Healthy", counter=7,
              written_at="2024-05-01T02:00:00.123+00:00", wave="canary",
              phases=phases_of({"Published": 3, "Mapped": 1}))


def doc(**changes: object) -> bytes:
    d = json.loads(GOOD.to_bytes())
    for key, value in changes.items():
        if value is ...:
            d.pop(key, None)
        else:
            d[key] = value
    return json.dumps(d).encode()


def test_to_bytes_is_compact_sorted_json() -> None:
    raw = GOOD.to_bytes()
    assert raw == (b'{"applied":"' + R1.encode() + b'","counter":7,"health":"Healthy",'
                   b'"held":false,"node":"edge-001","phases":{"Mapped":1,"Published":3},'
                   b'"v":1,"wave":"canary","writtenAt":"2024-05-01T02:00:00.123+00:00"}')
    assert parse(raw) == GOOD
    assert GOOD.phase_counts == {"Mapped": 1, "Published": 3}


def test_a_full_report_round_trips() -> None:
    r = Report(node="n1", applied=R1, health="Failed", counter=2**63 - 1,
               written_at="2024-05-01T02:00:00Z", wave=None, failed_volume="db",
               failed_reason="size 1Gi is below the image's 2Gi: never shrink",
               held_back=R2, held_back_why="Halted: edge-001 failed db", held=True,
               hold_reason="")
    assert parse(r.to_bytes()) == r
    # A revision that failed as a whole names no volume.
    r2 = replace(r, failed_volume=None)
    assert parse(r2.to_bytes()) == r2


def test_the_largest_report_fits() -> None:
    reason = "x" * MAX_REASON
    r = Report(node="n" * 253, applied=R2, health="Failed", counter=2**63 - 1,
               written_at="2024-05-01T02:00:00.123456+00:00", wave="w" * 63,
               failed_volume="v" * 253, failed_reason=reason, held_back="c" * 64,
               held_back_why=reason, held=True, hold_reason=reason,
               phases=phases_of({c * 32: 10**9 for c in string.ascii_letters[:32]}))
    assert len(r.to_bytes()) <= MAX_REPORT_BYTES
    assert parse(r.to_bytes()) == r


# (id, raw bytes, a word of the reason)
BAD: list[tuple[str, bytes, str]] = [
    ("huge", b" " * (MAX_REPORT_BYTES + 1), "at most"),
    ("not-utf8", b'{"node":"\xff"}', "UTF-8"),
    ("not-json", b"{node", "not JSON"),
    ("a-list", b"[1]", "object"),
    ("deep", b"[" * 100_000 + b"]" * 100_000, "at most"),
    ("deep-small", b'{"x":' + b"[" * 5000 + b"]" * 5000 + b"}", "deeply"),
    ("nan", doc(counter="NaN").replace(b'"NaN"', b"NaN"), "JSON number"),
    ("dup-key", doc().replace(b'"v": 1', b'"v": 1, "health": "Healthy"', 1)[:-1]
     + b', "health": "Failed"}', "twice"),
    ("no-node", doc(node=...), "node is missing"),
    ("no-counter", doc(counter=...), "counter is missing"),
    ("version", doc(v=2), "not understood"),
    ("version-bool", doc(v=True), "not understood"),
    ("version-float", doc(v=1.0), "not understood"),
    ("node-int", doc(node=5), "node is not a string"),
    ("node-chars", doc(node="edge/../x"), "node"),
    ("node-long", doc(node="n" * 300), "longer"),
    ("node-bidi", doc(node="edge\u202e1"), "node"),
    ("commit", doc(applied="main"), "applied"),
    ("commit-upper", doc(applied="A" * 40), "applied"),
    ("health", doc(health="Fine"), "not one of"),
    ("health-list", doc(health=["Healthy"]), "not one of"),
    ("counter-bool", doc(counter=True), "counter is not an integer"),
    ("counter-float", doc(counter=7.0), "counter is not an integer"),
    ("counter-neg", doc(counter=-1), "out of range"),
    ("counter-huge", doc(counter=2**64), "out of range"),
    ("written-at", doc(writtenAt="yesterday"), "ISO"),
    ("written-at-int", doc(writtenAt=5), "writtenAt is not a string"),
    ("held-str", doc(held="yes"), "held is not"),
    ("failed-no-why", doc(health="Failed"), "says why"),
    ("healthy-with-failure", doc(failedReason="x"), "names no failed"),
    ("healthy-nothing", doc(applied=None), "no revision applied"),
    ("held-back-alone", doc(heldBack=R2), "together"),
    ("held-back-applied", doc(heldBack=R1, heldBackWhy="x"), "is the applied"),
    ("hold-reason-alone", doc(holdReason="x"), "without held"),
    ("reason-long", doc(health="Failed", failedReason="x" * (MAX_REASON + 1)), "longer"),
    ("reason-newline", doc(health="Failed", failedReason="a\nb"), "control"),
    ("phases-list", doc(phases=[1]), "phases is not an object"),
    ("phase-name", doc(phases={"Pub lished": 1}), "phase"),
    ("phase-count", doc(phases={"Published": -1}), "out of range"),
    ("phase-float", doc(phases={"Published": 1.5}), "not an integer"),
    ("phases-many", doc(phases={f"P{'a' * i}": 1 for i in range(33)}), "at most"),
    ("fields-many", doc(**{f"x{i}": 1 for i in range(40)}), "fields"),
    ("wave", doc(wave="Canary"), "wave"),
]


@pytest.mark.parametrize(("raw", "word"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_hostile_reports_are_refused_with_a_reason(raw: bytes, word: str) -> None:
    with pytest.raises(ValueError, match=None) as err:
        parse(raw)
    assert word in str(err.value), str(err.value)
    assert len(str(err.value)) < 300


def test_unknown_fields_are_ignored() -> None:
    assert parse(doc(futureField={"a": 1})) == GOOD


def test_a_report_that_says_another_node_is_read_as_written() -> None:
    # The caller knows which object it read: parse only says what it claims.
    assert parse(doc(node="edge-002")).node == "edge-002"


def test_an_invalid_report_cannot_be_made() -> None:
    with pytest.raises(ValueError, match="says why"):
        replace(GOOD, health="Failed")
    with pytest.raises(ValueError, match="sorted"):
        replace(GOOD, phases=(("Published", 1), ("Mapped", 1)))


def test_clip() -> None:
    assert clip("fine") == "fine"
    assert clip("a\nb\x1b[31m") == "a\\nb\\x1b[31m"
    long = clip("x" * 2000)
    assert len(long) == MAX_REASON and long.endswith("…")
    Report(node="n", applied=R1, health="Failed", counter=0, written_at="2024-01-01",
           failed_reason=clip("boom\n" * 500))


REPORTS = st.builds(
    lambda node, applied, health, counter, wave, held, reason, phases: Report(
        node=node, applied=applied if health == "Converging" else applied or R1,
        health=health, counter=counter, written_at="2024-05-01T02:00:00+00:00", wave=wave,
        failed_reason=clip(reason) if health == "Failed" else None, held=held,
        hold_reason=clip(reason) if held else None, phases=phases_of(phases)),
    st.from_regex(r"[a-z0-9]([-a-z0-9.]{0,20}[a-z0-9])?", fullmatch=True),
    st.sampled_from([None, R1, R2]), st.sampled_from(["Healthy", "Failed", "Converging"]),
    st.integers(0, 2**63 - 1), st.sampled_from([None, "canary", "rest"]), st.booleans(),
    st.text(max_size=600), st.dictionaries(st.from_regex(r"[A-Za-z]{1,12}", fullmatch=True),
                                           st.integers(0, 10**9), max_size=8))


@settings(max_examples=200, deadline=None)
@given(REPORTS)
def test_every_report_round_trips(report: Report) -> None:
    raw = report.to_bytes()
    assert len(raw) <= MAX_REPORT_BYTES
    assert parse(raw) == report


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400) | st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["v", "node", "applied", "health", "counter", "writtenAt", "held",
                         "phases", "failedReason", "heldBack", "x"]), inner, max_size=8),
    max_leaves=12).map(lambda d: json.dumps(d).encode()))
def test_nothing_but_value_error_comes_out(raw: bytes) -> None:
    with contextlib.suppress(ValueError):
        parse(raw)
