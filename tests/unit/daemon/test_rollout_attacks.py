"""Attacks on a fleet's rollout from its least-trusted parties, without Ceph:
a compromised node (its key writes only under ``node/<itself>/``) filling
the namespace or slowing the listing, this node's own report object or
counter file damaged, and a signed but hostile fleet.yaml. A fake ioctx
stands for librados under the real drivers/fleetstore.py."""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from test_rollouts import (
    Clock,
    FakeStore,
    apply_revision,
    fleet_config,
    report,
    rollouts,
)

from reconciler.daemon.metrics import Metrics
from reconciler.daemon.rollout import COUNTER_FILE, Rollouts
from reconciler.drivers import fleetstore
from reconciler.drivers.fleetstore import FleetStore, FleetUnavailable, object_name
from reconciler.facts.fleetreport import MAX_COUNTER, Report
from reconciler.spec.fleet import parse_fleet

NEW = "e" * 40


class _Obj:
    def __init__(self, key: str) -> None:
        self.key = key


class _Completion:
    def __init__(self, rc: int, data: bytes | None, cb: Any) -> None:
        self.rc, self.data, self.cb = rc, data, cb

    def wait_for_complete_and_cb(self) -> None:
        self.cb(self, self.data)

    def get_return_value(self) -> int:
        return self.rc


class FakeIoctx:
    """Objects in listing order (RADOS lists in hash order: any order)."""

    def __init__(self, objects: list[tuple[str, bytes]], per_object_s: float = 0.0) -> None:
        self.objects = objects
        self.per_object_s = per_object_s

    def list_objects(self) -> Iterator[_Obj]:
        for key, _ in self.objects:
            if self.per_object_s:
                time.sleep(self.per_object_s)  # a slow OSD answering the listing
            yield _Obj(key)

    def aio_read(self, name: str, length: int, offset: int, cb: Any) -> _Completion:
        data = dict(self.objects).get(name)
        if data is None:
            return _Completion(-errno.ENOENT, None, cb)
        data = data[offset:offset + length]
        return _Completion(len(data), data, cb)

    def stat(self, name: str) -> tuple[int, float]:
        return (0, 0.0)

    def close(self) -> None:
        pass


def store_on(io: FakeIoctx, timeout: float = 10.0) -> FleetStore:
    store = FleetStore(None, "fleet", timeout=timeout)  # type: ignore[arg-type]
    store._ioctx = io  # type: ignore[assignment]
    return store


GLOB_CANARY = b"""\
apiVersion: rbd-reconciler/v1
kind: Rollout
metadata: {name: edge}
spec:
  waves:
    - {name: canary, nodes: ["canary-*"]}
    - {name: rest, nodes: ["edge-*"]}
  gate: {healthySeconds: 0}
"""


def test_a_node_flooding_its_prefix_cannot_hide_a_failed_canary(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compromised edge-9 writes thousands of objects under node/edge-9/:
    the listing stops at MAX_OBJECTS before it reaches the failed canary
    (hash order). A glob wave names only nodes that reported: with the
    canary unseen, wave canary would be empty and the gate would pass."""
    monkeypatch.setattr(fleetstore, "MAX_OBJECTS", 50)
    failed = report("canary-1", NEW, "Failed", failed_reason="never shrink")
    junk = [(f"node/edge-9/junk{i}", b"x") for i in range(100)]
    io = FakeIoctx([*junk, (object_name("canary-1"), failed.to_bytes())])
    store = store_on(io)
    read = store.read_all()
    assert "canary-1" not in read.reports  # the attack: the canary is cut off
    assert not read.complete
    config = fleet_config(tmp_path, node="edge-2")
    r = Rollouts(lambda: config, Metrics(), store=lambda _c: store, mono=Clock())
    r.wall = lambda: datetime(2026, 1, 1, tzinfo=UTC)
    rollout = parse_fleet(GLOB_CANARY).rollout
    assert rollout is not None
    answer = r.gate(NEW, rollout)
    assert answer.state == "Waiting", answer
    assert "not every report" in answer.message
    # Once the flood is gone the canary is seen, and it halts the revision.
    io.objects = io.objects[100:]
    assert r.gate(NEW, rollout).state == "Halted"


def test_a_slow_listing_ends_at_the_stores_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """A flooded or slow listing is ended at the store's timeout, not when
    the listing is done (the gate's read is bounded: it runs on the source
    thread)."""
    io = FakeIoctx([(f"node/edge-9/junk{i}", b"x") for i in range(2000)], per_object_s=0.002)
    store = store_on(io, timeout=0.3)
    start = time.monotonic()
    with pytest.raises(FleetUnavailable):
        store.read_all()
    assert time.monotonic() - start < 1.5


# -- this node's report: its counter ------------------------------------------------

def test_a_report_at_the_highest_counter_does_not_stop_this_nodes_reports(
        tmp_path: Path) -> None:
    """Anyone writing this node's object (or a damaged one) sets its counter
    to the maximum: this node still writes reports (readers see a change by
    any field, not by the counter growing)."""
    config = fleet_config(tmp_path)
    apply_revision(config, "a" * 40)
    store, clock = FakeStore(), Clock()
    store.reports["edge-2"] = Report(node="edge-2", applied=None, health="Converging",
                                     counter=MAX_COUNTER,
                                     written_at="2026-01-01T00:00:00+00:00")
    r = rollouts(config, store, clock)
    r.tick()
    assert store.written, "no report written"
    first = store.written[-1]
    assert 0 < first.counter <= MAX_COUNTER
    clock.t += 10
    r.tick()
    assert store.written[-1] != first


@pytest.mark.parametrize("damage", ["truncated", "garbage", "huge", "symlink", "directory"])
def test_a_damaged_counter_file_does_not_stop_this_nodes_reports(
        tmp_path: Path, damage: str) -> None:
    config = fleet_config(tmp_path)
    apply_revision(config, "a" * 40)
    path = config.state_dir / COUNTER_FILE
    if damage == "truncated":
        path.write_bytes(b'{"coun')
    elif damage == "garbage":
        path.write_bytes(b"\xff\x00" * 10)
    elif damage == "huge":
        path.write_text('{"counter": ' + "9" * 40 + "}")
    elif damage == "symlink":
        (tmp_path / "elsewhere").write_text('{"counter": 5}')
        os.symlink(tmp_path / "elsewhere", path)
    else:
        path.mkdir()
    store, clock = FakeStore(), Clock()
    store.reports["edge-2"] = Report(node="edge-2", applied=None, health="Converging",
                                     counter=7, written_at="2026-01-01T00:00:00+00:00")
    r = rollouts(config, store, clock)
    r.tick()
    assert store.written and store.written[-1].counter == 8  # Ceph's counter still bounds it
    if damage == "symlink":
        assert (tmp_path / "elsewhere").read_text() == '{"counter": 5}'  # never written through


# -- a signed, hostile fleet.yaml ----------------------------------------------------

def test_the_largest_fleet_yaml_the_schema_allows_is_gated_in_bounded_time(
        tmp_path: Path) -> None:
    """64 waves of 145 globs each (the YAML loader's bound is 10,000
    nodes), and 2,000 nodes reporting: one gate call must not hold the
    source thread for long."""
    waves = "\n".join(
        f"    - {{name: w{i}, nodes: [{', '.join(f'n{i}x{j}-*' for j in range(145))}]}}"
        for i in range(64))
    raw = (b"apiVersion: rbd-reconciler/v1\nkind: Rollout\nmetadata: {name: edge}\n"
           b"spec:\n  waves:\n" + waves.encode() + b"\n")
    start = time.monotonic()
    load = parse_fleet(raw)
    loaded_in = time.monotonic() - start
    if not load.ok:  # refused at load: bounded by refusing, and said where
        assert loaded_in < 30
        assert any("waves" in d.field or "nodes" in d.field for d in load.diagnostics), \
            load.diagnostics
        return
    rollout = load.rollout
    assert rollout is not None
    store, clock = FakeStore(), Clock()
    for k in range(2000):
        node = f"n63x144-{k}"
        store.reports[node] = report(node, NEW, "Healthy")
    config = fleet_config(tmp_path, node="late-node")
    r = rollouts(config, store, clock)
    start = time.monotonic()
    r.gate(NEW, rollout)
    assert time.monotonic() - start < 5


def test_pathological_globs_are_refused_or_cheap(tmp_path: Path) -> None:
    """Globs of many stars ("*a*a*a...", 253 characters), each distinct: each
    compiles slowly and may backtrack: 3,500 of them (within 1 MiB) against every node's name."""
    def pattern(i: int, j: int) -> str:  # each one distinct (none is compiled once for all)
        return ("*a" * 126)[:-9] + f"{i:04}x{j:04}b"

    waves = "\n".join(
        f"    - {{name: w{i}, nodes: [{', '.join(pattern(i, j) for j in range(500))}]}}"
        for i in range(7))
    raw = (b"apiVersion: rbd-reconciler/v1\nkind: Rollout\nmetadata: {name: edge}\n"
           b"spec:\n  waves:\n    - {name: canary, nodes: [c1]}\n" + waves.encode() + b"\n")
    assert len(raw) < 1024 * 1024
    load = parse_fleet(raw)
    if not load.ok:
        assert "*" in str(load.diagnostics[0]), load.diagnostics
        return
    rollout = load.rollout
    assert rollout is not None
    store, clock = FakeStore(), Clock()
    for k in range(2):
        node = "a" * 240 + f"-{k}"
        store.reports[node] = report(node, NEW, "Healthy")
    r = rollouts(fleet_config(tmp_path, node="late-node"), store, clock)
    start = time.monotonic()
    r.gate(NEW, rollout)
    assert time.monotonic() - start < 5


class ProblemStore(FakeStore):
    """A compromised node renames its 200 junk objects before every read."""

    def __init__(self) -> None:
        super().__init__()
        self.round = 0

    def read_all(self) -> Any:
        from reconciler.drivers.fleetstore import FleetRead
        self.round += 1
        junk = tuple(f"'node/edge-9/junk{self.round}-{i}': not the name of a report"
                     for i in range(200))
        return FleetRead(dict(self.reports), junk)


def test_junk_renamed_every_sync_does_not_flood_the_journal(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store, clock = ProblemStore(), Clock()
    r = rollouts(fleet_config(tmp_path, node="edge-2"), store, clock)  # type: ignore[arg-type]
    rollout = parse_fleet(GLOB_CANARY).rollout
    assert rollout is not None
    with caplog.at_level("INFO", logger="rbd-reconciler"):
        for _ in range(10):
            r.gate(NEW, rollout)
            clock.t += 60
    lines = [rec for rec in caplog.records if "not read" in rec.getMessage()]
    assert len(lines) <= 10 * 6, len(lines)  # a few lines per read, not one per object
    assert any("200" in rec.getMessage() for rec in lines)  # how many, said


def test_fleet_status_says_when_not_every_report_was_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`fleet status` of a cut listing must not show a wave's gate as if
    every node of the waves before it were known."""
    from reconciler.engine.fleet import fleet_status
    monkeypatch.setattr(fleetstore, "MAX_OBJECTS", 50)
    failed = report("canary-1", NEW, "Failed", failed_reason="never shrink")
    io = FakeIoctx([*[(f"node/edge-9/junk{i}", b"x") for i in range(100)],
                    (object_name("canary-1"), failed.to_bytes())])
    summary = fleet_status(fleet_config(tmp_path), store_on(io))
    assert summary.problems and "not every report was read" in summary.problems[0]


@pytest.mark.parametrize("text", ["x\\ud800y", "\\udfff", "a\\u200bb", "\\ufeffx",
                                  "a\\u2060b", "\\u00ad"])
def test_a_report_text_with_a_lone_surrogate_or_an_invisible_character_is_refused(
        text: str) -> None:
    """A lone surrogate (JSON may escape one) passed the reader: no UTF-8
    encoder takes it (the CLI and stderr escape it with backslashreplace;
    any other writer of it raises); an invisible character hides what a
    reason says in `fleet status`."""
    from reconciler.facts.fleetreport import clip, parse
    raw = ('{"v":1,"node":"edge-1","applied":"' + "a" * 40 + '","health":"Failed",'
           '"counter":1,"writtenAt":"2026-01-01T00:00:00+00:00","failedReason":"'
           + text + '"}').encode()
    with pytest.raises(ValueError, match="control or bidi"):
        parse(raw)
    decoded = text.encode().decode("unicode_escape")
    clip(decoded).encode("utf-8")  # this node's own texts are escaped, never refused
    assert clip(decoded) != decoded


def test_a_wall_clock_jump_neither_shortens_nor_lengthens_healthy_time(tmp_path: Path) -> None:
    """The gate times healthy and stale on the monotonic clock: a wall
    clock set a day ahead (or ten years back) passes no node early."""
    from test_rollouts import rollout_of
    store, clock = FakeStore(), Clock()
    r = rollouts(fleet_config(tmp_path, node="edge-2"), store, clock)
    walls = iter([datetime(2026, 1, 1, tzinfo=UTC), datetime(2026, 1, 2, tzinfo=UTC),
                  datetime(2016, 1, 1, tzinfo=UTC), datetime(2036, 1, 1, tzinfo=UTC)])
    r.wall = lambda: next(walls)
    store.reports["edge-1"] = report("edge-1", NEW, "Healthy", 2)
    assert r.gate(NEW, rollout_of()).state == "Waiting"  # seen healthy now
    clock.t += 10
    assert "healthy for only 10s" in r.gate(NEW, rollout_of()).message  # wall: a day later
    clock.t += 10
    store.reports["edge-1"] = report("edge-1", NEW, "Healthy", 3)
    assert "healthy for only 20s" in r.gate(NEW, rollout_of()).message  # wall: 10 years back
    clock.t += 11
    store.reports["edge-1"] = report("edge-1", NEW, "Healthy", 4)
    assert r.gate(NEW, rollout_of()).applies


@pytest.mark.parametrize("zone", ["localtime", "posixrules"])
def test_a_time_zone_that_is_each_nodes_own_is_refused(zone: str) -> None:
    """``localtime`` is the node's own /etc/localtime (and ``posixrules``
    whatever the system links it to): one signed window would open at a
    different instant on each node, and be refused where it is absent."""
    raw = GLOB_CANARY + (f"  windows:\n    - {{days: [Mon], start: '02:00', end: '04:00', "
                         f"timeZone: {zone}}}\n").encode()
    load = parse_fleet(raw)
    assert not load.ok and "timeZone" in load.diagnostics[0].field, load.diagnostics
