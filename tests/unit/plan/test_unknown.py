"""Unknown is not absent (safety rules 7 and 10, README): what cannot be seen in time
is reported UNKNOWN with its reason, never blank or absent, and fails the
command; a stuck call holds up nobody and is never piled up."""

from __future__ import annotations

import re
import socket
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import NodeUnderTest
from test_plan import CTX, LOOP, converged, plan_one, volume

from reconciler.drivers.bounded import Bounded, NoAnswer, StillStuck
from reconciler.plan.planner import actual_state
from reconciler.spec.model import Phase


def test_bounded_writes_off_a_stuck_call_and_never_piles_it_up() -> None:
    calls = Bounded(max_running=1, name="t")
    gate = threading.Event()
    stuck = calls.submit("dev", gate.wait)
    with pytest.raises(NoAnswer):
        calls.wait(stuck, per_call=0.05, deadline=float("inf"))
    with pytest.raises(StillStuck):  # one stuck call per key at most
        calls.submit("dev", lambda: 1)
    # Written off, it no longer holds the only slot: others still run.
    other = calls.submit("other", lambda: 42)
    assert calls.wait(other, per_call=5, deadline=float("inf")) == 42
    gate.set()
    assert calls.wait(stuck, per_call=5, deadline=float("inf")) is True
    done = calls.submit("dev", lambda: "again")  # free again once it returned
    assert calls.wait(done, per_call=5, deadline=float("inf")) == "again"


def test_bounded_never_runs_a_call_given_up_before_it_started() -> None:
    calls = Bounded(max_running=1, name="t")
    gate, ran = threading.Event(), threading.Event()
    busy = calls.submit("busy", gate.wait)
    late = calls.submit("late", ran.set)
    with pytest.raises(NoAnswer):
        calls.wait(late, per_call=5, deadline=time.monotonic() + 0.05)
    assert late.abandoned
    gate.set()
    assert calls.wait(busy, per_call=5, deadline=float("inf")) is True
    with pytest.raises(NoAnswer):  # settles without ever running (it could only stick)
        late.future.result(timeout=5)
    assert not ran.is_set()
    assert calls.inflight() == 0


def test_unknown_is_a_flag_beside_the_phase_never_an_ordered_phase() -> None:
    vol = volume()
    seen = converged(vol).observed()
    assert plan_one(vol, seen).unknown is None
    # Its pool was listed, but the image did not answer in time.
    obs = replace(seen, image_errors={("rbd", "pgdata"): "no answer within 5 s"})
    vp = plan_one(vol, obs)
    assert vp.phase_name == "UNKNOWN" and "no answer within 5 s" in (vp.unknown or "")
    assert vp.phase == Phase.PUBLISHED and not vp.steps  # what is mounted is still seen
    assert actual_state(vol, obs, CTX)["phase"] == "UNKNOWN"
    # A device probe that did not answer: unknown, never blank, nothing planned.
    w = converged(vol)
    w.devices[LOOP] = replace(w.devices[LOOP], fs_type=None, fs_uuid=None,
                              signature="unknown (probe timed out)",
                              unknown="probe timed out: no answer within 5 s")
    vp = plan_one(vol, w)
    assert vp.phase_name == "UNKNOWN" and "probe timed out" in (vp.unknown or "")
    assert not vp.steps
    # Releasing acts only on what is seen on the node (never the image): allowed.
    vp = plan_one(vol, obs, release=[vol.name])
    assert vp.unknown is None and vp.steps


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.ceph
def test_unreachable_ceph_is_unknown_not_absent(node: NodeUnderTest, tmp_path: Path) -> None:
    name = node.name("cut")
    node.write(name, f"  image: {{pool: {node.cluster.pool}, size: 64Mi}}\n"
                     f"  map: {{mapper: fuse}}\n  stage: {{fsType: ext4}}\n"
                     f"  publish:\n    - path: {node.srv / 'app'}\n")
    assert node.apply()["rc"] == 0
    # The same node, through a monitor address nobody answers on.
    conf = tmp_path / "unreachable.conf"
    conf.write_text(re.sub(r"(?m)^mon host = .*$", f"mon host = [v2:127.0.0.1:{_free_port()}]",
                           node.cluster.conf.read_text()))
    good = node.config
    cut = tmp_path / "cut.yaml"
    cut.write_text(good.read_text().replace(f"conf: {node.cluster.conf}", f"conf: {conf}")
                   + "observeTimeoutSeconds: 2\n")
    node.config = cut
    try:
        rc, doc = node.cli_json("status")
        [row] = doc["volumes"]
        assert rc == 1 and row["phase"] == "UNKNOWN", doc
        assert "cannot reach Ceph" in row["unknown"]
        rc, out = node.cli("status")
        assert rc == 1 and "UNKNOWN" in out and "ABSENT" not in out
        rc, out = node.cli("explain", name)
        assert rc == 1 and "phase:    UNKNOWN" in out and "cannot reach Ceph" in out
        # Mapped here (a watcher, our claim): unknown, never "none".
        assert "watchers: unknown (the image was not seen)" in out, out
        assert "claim:    unknown (the image was not seen)" in out, out
        rc, doc = node.cli_json("explain", name)
        assert doc["actual"]["watchers"] is None and doc["claim"] is None
        assert "cannot reach Ceph" in doc["actual"]["imageUnknown"]
        rc, plan = node.plan()
        assert rc == 1 and plan["volumes"][0]["phase"] == "UNKNOWN"
        assert not plan["volumes"][0]["steps"]
    finally:
        node.config = good
    assert str(node.srv / "app") in node.mounts()  # serving all along


@pytest.mark.ceph
def test_explain_on_a_dead_pool_says_unknown(node: NodeUnderTest, dead_pool: str) -> None:
    """A pool whose PGs map to no OSD (an outage): what only Ceph knows is
    unknown, never "none"."""
    name = node.name("dark")
    spec = node.write(name, f"  image: {{pool: {dead_pool}, size: 64Mi}}\n")
    node.config.write_text(node.config.read_text() + "observeTimeoutSeconds: 2\n")
    rc, out = node.cli("explain", name)
    spec.unlink()  # its pool goes with the fixture: nothing to release there
    assert rc == 1 and "phase:    UNKNOWN" in out and dead_pool in out, out
    lines = {line.split(":")[0].strip(): line for line in out.splitlines()}
    assert lines["watchers"] == "  watchers: unknown (the image was not seen)", out
    assert lines["claim"] == "  claim:    unknown (the image was not seen)", out
    assert lines["image"].endswith("size unknown"), out
