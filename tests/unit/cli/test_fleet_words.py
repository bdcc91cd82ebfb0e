"""fleet status's words (cli/show.py): the JSON (one node a line) reads
back as the document, the table says what the document says, a direct
read says it is one, and the caveat of a daemon that has not watched for
staleSeconds comes only then."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from reconciler.cli.show import FLEET_DIRECT_READ as DIRECT_READ
from reconciler.cli.show import fleet as show_fleet
from reconciler.cli.show import fleet_json as dumps
from reconciler.cli.show import fleet_note as _note
from reconciler.cli.show import fleet_table as human
from reconciler.engine.fleet import document
from reconciler.facts.fleetreport import Report
from reconciler.plan.fleetstatus import summarize
from reconciler.plan.rollout import Sighting
from reconciler.spec.fleet import Gate, Rollout, Wave

R, OLD = "a" * 40, "b" * 40
NOW = 5_000.0


def doc(observed_for: float | None, by: str = "this command") -> dict:
    rollout = Rollout("edge", (Wave("canary", ("c1",)), Wave("rest", ("*",))),
                      Gate(stale_seconds=30))
    seen = {
        "c1": Sighting(Report(node="c1", applied=R, health="Failed", counter=1,
                              written_at="2026-01-01T00:00:00+00:00", failed_volume="pg",
                              failed_reason="refusing to shrink"), NOW, NOW - 40),
        "r1": Sighting(Report(node="r1", applied=OLD, health="Healthy", counter=2,
                              written_at="2026-01-01T00:00:00+00:00", held_back=R,
                              held_back_why="halted", held=True, hold_reason="maint"),
                       NOW, NOW),
    }
    return {**document(summarize(rollout, seen, NOW, datetime(2026, 1, 5, tzinfo=UTC),
                                 observed_for=observed_for, problems=("'x': not JSON",))),
            "answeredBy": by}


def test_json_reads_back() -> None:
    d = doc(0.0)
    assert json.loads(dumps(d)) == d
    assert json.loads(dumps({"nodes": [], "rollout": None})) == {"nodes": [], "rollout": None}


def test_table_says_it() -> None:
    text = human(doc(0.0))
    assert text.startswith("rollout edge\n")
    assert "c1    canary" in text and "40s STALE" in text
    assert "failed pg: refusing to shrink" in text
    assert f"holds back {R[:12]}: halted; held: maint" in text
    assert f"revision {R[:12]}: Halted: halted: it failed on c1, volume pg" in text
    assert "1 problem(s) reading the fleet:\n  'x': not JSON" in text
    assert DIRECT_READ in text
    # r1 seen Healthy since NOW - 0 on the reader's clock; c1 is Failed.
    r1 = next(line for line in text.splitlines() if line.startswith("r1 "))
    assert " Healthy  0s  " in r1, r1
    assert " Failed   -   " in next(line for line in text.splitlines()
                                   if line.startswith("c1 "))


DAEMON = "the daemon (pid 7)"


def test_the_caveat_of_a_direct_read_always() -> None:
    assert _note(doc(0.0)) == DIRECT_READ and _note(doc(3600.0)) == DIRECT_READ
    assert "a direct read: no daemon answered" in DIRECT_READ


def test_the_daemons_caveat_only_while_young() -> None:
    young = _note(doc(29.0, DAEMON))
    assert young is not None and young.startswith("read for 29s of the 30s")
    assert _note(doc(30.0, DAEMON)) is None and _note(doc(None, DAEMON)) is None
    assert "note:" not in human(doc(3600.0, DAEMON))


def test_json_carries_the_note(capsys) -> None:  # type: ignore[no-untyped-def]
    show_fleet(doc(0.0), "json")
    got = json.loads(capsys.readouterr().out)
    assert got["note"] == DIRECT_READ and got["answeredBy"] == "this command"
    show_fleet(doc(3600.0, DAEMON), "json")
    got = json.loads(capsys.readouterr().out)
    assert "note" not in got and got["answeredBy"] == DAEMON
