"""fleet.yaml: what a good file builds (defaults filled), every bad one
refused at its line and field with what was expected, hostile input refused
without a traceback, and the file read with the desired files' trust checks."""

from __future__ import annotations

import os
from datetime import time
from pathlib import Path

import jsonschema
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from reconciler.spec.fastschema import surely_valid
from reconciler.spec.fleet import (
    FLEET_FILE,
    Gate,
    glob_problem,
    known_zone,
    load_fleet,
    parse_fleet,
)
from reconciler.spec.schemas import schema, validator

GOOD = """\
apiVersion: rbd-reconciler/v1
kind: Rollout
metadata: {name: edge}
spec:
  waves:
    - {name: canary, nodes: [edge-001, edge-002]}
    - {name: early,  nodes: ["edge-0[0-4]*"]}
    - {name: rest,   nodes: ["*"]}
  gate:
    healthySeconds: 60
    maxUnhealthy: 0
    staleSeconds: 300
  windows:
    - {days: [Mon, Tue, Wed, Thu, Fri], start: "02:00", end: "04:00", timeZone: Europe/Berlin}
"""

MINIMAL = """\
apiVersion: rbd-reconciler/v1
kind: Rollout
metadata:
  name: edge
spec:
  waves:
    - name: all
      nodes: ["*"]
"""


def edit(text: str, **swaps: str) -> str:
    for old, new in swaps.items():
        old = old.replace("__", " ")
        assert old in text, old
        text = text.replace(old, new)
    return text


def test_the_issue_example_builds() -> None:
    res = parse_fleet(GOOD.encode())
    assert res.ok and res.rollout is not None, res.diagnostics
    r = res.rollout
    assert r.name == "edge"
    assert [w.name for w in r.waves] == ["canary", "early", "rest"]
    assert r.waves[0].nodes == ("edge-001", "edge-002")
    assert r.waves[0].names == {"edge-001", "edge-002"} and r.waves[1].names == frozenset()
    assert r.gate == Gate(60, 0, False, 300)
    (w,) = r.windows
    assert w.days == {0, 1, 2, 3, 4} and (w.start, w.end) == (time(2), time(4))
    assert w.time_zone == "Europe/Berlin" and str(w.zone) == "Europe/Berlin"
    assert not w.crosses_midnight
    assert r.source == Path(FLEET_FILE)


def test_defaults_are_the_documented_ones() -> None:
    r = parse_fleet(MINIMAL.encode()).rollout
    assert r is not None
    assert r.gate == Gate(healthy_seconds=60, max_unhealthy=0, percent=False, stale_seconds=300)
    assert r.windows == ()  # any time
    props = schema("fleet")["$defs"]["gate"]["properties"]
    assert {k: v["default"] for k, v in props.items()} == {
        "healthySeconds": 60, "maxUnhealthy": 0, "staleSeconds": 300}


def test_a_percentage_and_a_window_across_midnight() -> None:
    text = edit(GOOD, **{"maxUnhealthy:__0": 'maxUnhealthy: "10%"',
                         '"02:00",__end:__"04:00"': '"22:30", end: "01:15"'})
    r = parse_fleet(text.encode()).rollout
    assert r is not None
    assert (r.gate.max_unhealthy, r.gate.percent) == (10, True)
    assert [r.gate.allowed(n) for n in (0, 9, 10, 19, 20)] == [0, 0, 1, 1, 2]  # rounds down
    assert r.windows[0].crosses_midnight


def test_percent_extremes() -> None:
    assert Gate(max_unhealthy=100, percent=True).allowed(7) == 7
    assert Gate(max_unhealthy=0, percent=True).allowed(7) == 0
    assert Gate(max_unhealthy=3).allowed(1) == 3  # a count is a count


# (id, text, field, line, a word the message must hold)
BAD: list[tuple[str, str, str, int, str]] = [
    ("kind", edit(GOOD, Rollout="Volume"), "kind", 2, "'Rollout'"),
    ("api", edit(GOOD, v1="v2"), "apiVersion", 1, "rbd-reconciler/v1"),
    ("no-name", edit(GOOD, **{"{name:__edge}": "{}"}), "metadata.name", 3, "required"),
    ("name", edit(GOOD, **{"name:__edge": "name: Edge"}), "metadata.name", 3, "DNS label"),
    ("unknown-field", edit(GOOD, **{"gate:": "gates:"}), "spec.gates", 9, "expected one of"),
    ("no-waves", MINIMAL.split("  waves:")[0] + "  waves: []\n", "spec.waves", 6,
     "at least 1"),
    ("waves-missing", edit(GOOD, waves="wave"), "spec.wave", 5, "unknown field"),
    ("no-nodes", edit(GOOD, **{"nodes:__[edge-001,__edge-002]": "nodes: []"}),
     "spec.waves[0].nodes", 6, "at least 1"),
    ("dup-wave", edit(GOOD, early="canary"), "spec.waves[1].name", 7, "unique"),
    ("dup-node", edit(GOOD, **{"edge-002]": "edge-001]"}), "spec.waves[0].nodes", 6,
     "repeated"),
    ("unclosed", edit(GOOD, **{"edge-0[0-4]*": "edge-0[0-4*"}), "spec.waves[1].nodes[0]", 7,
     "never closed"),
    ("reversed", edit(GOOD, **{"edge-0[0-4]*": "edge-0[4-0]*"}), "spec.waves[1].nodes[0]", 7,
     "reversed"),
    ("stray-bracket", edit(GOOD, **{"edge-0[0-4]*": "edge-0]*"}), "spec.waves[1].nodes[0]", 7,
     "closes no"),
    ("bang", edit(GOOD, **{"edge-0[0-4]*": "!edge"}), "spec.waves[1].nodes[0]", 7,
     "outside brackets"),
    ("node-chars", edit(GOOD, **{"edge-002": "edge 002"}), "spec.waves[0].nodes[1]", 6,
     "node name"),
    ("healthy-neg", edit(GOOD, **{"healthySeconds:__60": "healthySeconds: -1"}),
     "spec.gate.healthySeconds", 10, "minimum"),
    ("healthy-float", edit(GOOD, **{"healthySeconds:__60": "healthySeconds: 1.5"}),
     "spec.gate.healthySeconds", 10, "integer"),
    ("healthy-string", edit(GOOD, **{"healthySeconds:__60": 'healthySeconds: "60"'}),
     "spec.gate.healthySeconds", 10, "integer"),
    ("stale-zero", edit(GOOD, **{"staleSeconds:__300": "staleSeconds: 0"}),
     "spec.gate.staleSeconds", 12, "minimum"),
    ("percent-big", edit(GOOD, **{"maxUnhealthy:__0": 'maxUnhealthy: "150%"'}),
     "spec.gate.maxUnhealthy", 11, "100%"),
    ("percent-words", edit(GOOD, **{"maxUnhealthy:__0": "maxUnhealthy: some"}),
     "spec.gate.maxUnhealthy", 11, "percentage"),
    ("unhealthy-neg", edit(GOOD, **{"maxUnhealthy:__0": "maxUnhealthy: -1"}),
     "spec.gate.maxUnhealthy", 11, "percentage"),
    ("day", edit(GOOD, Wed="Wednesday"), "spec.windows[0].days[2]", 14, "'Wed'"),
    ("no-days", edit(GOOD, **{"[Mon,__Tue,__Wed,__Thu,__Fri]": "[]"}),
     "spec.windows[0].days", 14, "at least 1"),
    ("clock", edit(GOOD, **{'"04:00"': '"24:00"'}), "spec.windows[0].end", 14, "HH:MM"),
    ("clock-short", edit(GOOD, **{'"02:00"': '"2:00"'}), "spec.windows[0].start", 14, "HH:MM"),
    ("clock-number", edit(GOOD, **{'"02:00"': "0200"}), "spec.windows[0].start", 14, "string"),
    ("empty-window", edit(GOOD, **{'"04:00"': '"02:00"'}), "spec.windows[0].end", 14,
     "crosses midnight"),
    ("zone", edit(GOOD, **{"Europe/Berlin": "Europe/Atlantis"}),
     "spec.windows[0].timeZone", 14, "not a time zone"),
    ("zone-path", edit(GOOD, **{"Europe/Berlin": "../../etc/passwd"}),
     "spec.windows[0].timeZone", 14, "IANA"),
    ("zone-missing", edit(GOOD, **{",__timeZone:__Europe/Berlin": ""}),
     "spec.windows[0].timeZone", 14, "required"),
    ("control-char", edit(GOOD, **{"edge-002": '"edge-\\u202e002"'}),
     "spec.waves[0].nodes[1]", 6, "bidi"),
    ("tag", edit(GOOD, **{"edge-002": "!!python/object:os.system edge"}),
     "(document)", 6, "tag"),
    ("timestamp", edit(GOOD, **{'"02:00"': "2020-01-01"}), "spec.windows[0].start", 14,
     "quote it"),
    ("dup-key", edit(GOOD, **{"staleSeconds:__300": "staleSeconds: 300\n    staleSeconds: 3"}),
     "spec.gate.staleSeconds", 13, "duplicate key"),
    ("syntax", edit(GOOD, **{"{name:__edge}": "{name: edge"}), "(document)", 4, "YAML"),
    ("two-docs", GOOD + "---\n" + GOOD, "(document)", 16, "one document"),
    ("empty", "", "(file)", 1, "empty"),
    ("only-comment", "# nothing\n", "(file)", 1, "empty"),
    ("a-list", "- 1\n", "(document)", 1, "object"),
    ("nan", edit(GOOD, **{"healthySeconds:__60": "healthySeconds: .nan"}),
     "spec.gate.healthySeconds", 10, "finite"),
]


@pytest.mark.parametrize(("text", "field", "line", "word"), [c[1:] for c in BAD],
                         ids=[c[0] for c in BAD])
def test_bad_files_are_refused_at_their_line(text: str, field: str, line: int,
                                             word: str) -> None:
    res = parse_fleet(text.encode())
    assert res.rollout is None and not res.ok
    shown = [str(d) for d in res.diagnostics]
    match = [d for d in res.diagnostics if d.field == field and word in d.message]
    assert match, shown
    assert match[0].line == line, shown
    assert all(s.startswith("fleet.yaml:") for s in shown)
    assert "Traceback" not in "".join(shown)


def test_every_problem_is_reported_at_once() -> None:
    text = edit(GOOD, early="canary", **{"Europe/Berlin": "Nowhere/Here", '"04:00"': '"02:00"'})
    fields = {d.field for d in parse_fleet(text.encode()).diagnostics}
    assert fields == {"spec.waves[1].name", "spec.windows[0].timeZone", "spec.windows[0].end"}


HOSTILE: list[tuple[str, bytes, str]] = [
    ("not-utf8", GOOD.encode().replace(b"edge-001", b"edge-\xff01"), "UTF-8"),
    ("deep", (b"[" * 5000) + (b"]" * 5000), "nesting"),
    ("deep-map", b"a:\n" + b"".join(b"  " * i + b"b:\n" for i in range(1, 80)), "nesting"),
    ("laughs", b'a: &a ["x","x","x","x","x","x","x","x","x"]\n'
               + b"".join(f"{c}: &{c} [*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p}]\n".encode()
                          for p, c in zip("abcdefgh", "bcdefghi", strict=True)), "YAML nodes"),
    ("merge-loop", b"a: &a\n  <<: *a\n", "merge key"),
    ("python-tag", b"a: !!python/name:os.system ''\n", "tag"),
    # A tag on a collection is ignored (plain data, as in volume files): never run.
    ("python-tag-list", b"!!python/object/apply:os.system ['true']\n", "not of type"),
    ("nul", b"apiVersion: \x00\n", "YAML"),
]


@pytest.mark.parametrize(("raw", "word"), [c[1:] for c in HOSTILE], ids=[c[0] for c in HOSTILE])
def test_hostile_input_is_a_diagnostic(raw: bytes, word: str) -> None:
    res = parse_fleet(raw)
    assert res.rollout is None and res.diagnostics
    assert any(word in d.message for d in res.diagnostics), res.diagnostics
    assert not any("internal error" in d.message for d in res.diagnostics)


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_no_input_raises_or_hits_the_last_defence(raw: bytes) -> None:
    res = parse_fleet(raw)
    assert (res.rollout is None) == bool(res.diagnostics)
    assert not any("internal error" in d.message for d in res.diagnostics)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.text(alphabet="abz09-._*?![]", min_size=1, max_size=12), min_size=1,
                max_size=4))
def test_a_file_loads_exactly_when_its_globs_are_valid(patterns: list[str]) -> None:
    doc = yaml.safe_load(MINIMAL)
    doc["spec"]["waves"][0]["nodes"] = sorted(set(patterns))
    res = parse_fleet(yaml.safe_dump(doc).encode())
    assert res.ok == all(glob_problem(p) is None for p in patterns), res.diagnostics
    if res.rollout is not None:
        wave = res.rollout.waves[0]
        assert all(wave.names_node(name) for name in wave.names)  # a name names itself


@pytest.mark.parametrize(("pattern", "ok"), [
    ("edge-001", True), ("*", True), ("edge-0[0-4]*", True), ("edge-[!a]?", True),
    ("[]]x", True), ("edge-[a-c][0-9]", True),
    ("edge-[", False), ("edge-[z-a]", False), ("a]b", False), ("!a", False), ("[!]", False),
])
def test_glob_problem(pattern: str, ok: bool) -> None:
    assert (glob_problem(pattern) is None) == ok, glob_problem(pattern)


def test_wave_membership_is_case_sensitive_and_by_glob() -> None:
    r = parse_fleet(GOOD.encode()).rollout
    assert r is not None
    canary, early, rest = r.waves
    assert canary.names_node("edge-001") and not canary.names_node("EDGE-001")
    assert early.names_node("edge-0399") and not early.names_node("edge-0500")
    assert early.names_node("edge-001x")  # a glob of a later wave: wave_of takes the first
    assert rest.names_node("anything")


def test_known_zone() -> None:
    assert known_zone("UTC") is not None and known_zone("Europe/Berlin") is not None
    for name in ("Nowhere/Here", "/etc/localtime", "../zoneinfo/UTC", "Europe/../UTC", ""):
        assert known_zone(name) is None, name


def test_the_schema_is_valid_and_the_fast_check_agrees() -> None:
    jsonschema.Draft202012Validator.check_schema(validator("fleet").schema)
    for text in (GOOD, MINIMAL):
        data = yaml.safe_load(text)
        assert surely_valid(schema("fleet"), data)
        assert not list(validator("fleet").iter_errors(data))


# ---------------------------------------------------------------- the file


def test_no_file_is_no_rollout(tmp_path: Path) -> None:
    res = load_fleet(tmp_path)
    assert res.rollout is None and res.ok


def test_the_file_is_read_and_named(tmp_path: Path) -> None:
    (tmp_path / FLEET_FILE).write_text(GOOD)
    res = load_fleet(tmp_path)
    assert res.rollout is not None and res.rollout.source == tmp_path / FLEET_FILE
    (tmp_path / FLEET_FILE).write_text(edit(GOOD, early="canary"))
    (diag,) = load_fleet(tmp_path).diagnostics
    assert str(diag).startswith(f"{tmp_path / FLEET_FILE}:7:")


def test_a_broken_link_is_not_absent(tmp_path: Path) -> None:
    (tmp_path / FLEET_FILE).symlink_to(tmp_path / "gone.yaml")
    res = load_fleet(tmp_path)
    assert res.rollout is None and res.diagnostics


def test_a_link_out_of_the_directory_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside.yaml"
    outside.write_text(GOOD)
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / FLEET_FILE).symlink_to(outside)
    (diag,) = load_fleet(tmp_path / "repo").diagnostics
    assert "refusing to read it" in diag.message


def test_a_huge_file_is_refused_unread(tmp_path: Path) -> None:
    with open(tmp_path / FLEET_FILE, "wb") as f:
        f.truncate((1 << 20) + 1)
    (diag,) = load_fleet(tmp_path).diagnostics
    assert "limit" in diag.message


def test_a_file_others_may_write_is_refused(tmp_path: Path) -> None:
    path = tmp_path / FLEET_FILE
    path.write_text(GOOD)
    os.chmod(path, 0o666)
    (diag,) = load_fleet(tmp_path).diagnostics
    assert "writable by group or others" in diag.message


def test_a_directory_in_its_place_is_an_error(tmp_path: Path) -> None:
    (tmp_path / FLEET_FILE).mkdir()
    res = load_fleet(tmp_path)
    assert res.rollout is None and res.diagnostics
