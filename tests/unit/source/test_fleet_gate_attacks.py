"""Attacks and faults on the rollout gate in a sync (source/sync.py,
source/fleetfile.py), with real git and ssh-signed commits: a signed
fleet.yaml at a name the loader does not read (a case variant, ``.yml``,
under the node's path), a kill of the daemon inside the gate (between the
export and the switch), and ``source hold`` racing a sync."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from source_signing import Signing, SshKey
from test_fleet_gate import FLEET, WAITING, FakeGate, fleet_config, start, vol
from test_sync import applied_files, push

from reconciler.source.gating import GateAnswer
from reconciler.source.layout import Layout
from reconciler.source.sync import Syncer
from reconciler.spec.fleet import Rollout


@pytest.mark.parametrize("name", ["Fleet.yaml", "FLEET.YAML", "fleet.yml", "fleet.YAML"])
def test_a_fleet_yaml_at_a_near_miss_name_is_refused_not_ignored(
        tmp_path: Path, signer: Signing, alice: SshKey, name: str) -> None:
    """The policy at a name the loader does not read would roll the revision
    out to every node at once, with no wave and no gate."""
    config = fleet_config(tmp_path, signer, alice)
    start(tmp_path, signer, alice, config)
    push(signer, tmp_path, alice, "grow", {"nodes/a/v.yaml": vol("2Gi"), name: FLEET})
    gate = FakeGate(GateAnswer("Apply"))
    out = Syncer(config, gate=gate).sync()
    assert (out.result, out.reason) == ("refused", "LoadFailed"), out
    assert name in out.message and "fleet.yaml" in out.message
    assert applied_files(config) == {"v.yaml": vol("1Gi")}


def test_a_fleet_yaml_under_the_nodes_path_is_no_silent_policy(
        tmp_path: Path, signer: Signing, alice: SshKey) -> None:
    config = fleet_config(tmp_path, signer, alice)
    start(tmp_path, signer, alice, config)
    push(signer, tmp_path, alice, "grow", {"nodes/a/v.yaml": vol("2Gi"),
                                           "nodes/a/fleet.yaml": FLEET})
    out = Syncer(config, gate=FakeGate(GateAnswer("Apply"))).sync()
    assert out.result == "refused", out
    assert applied_files(config) == {"v.yaml": vol("1Gi")}


class Killed(BaseException):
    """A SIGKILL, as far as the sync can tell: nothing after it runs."""


def test_a_kill_inside_the_gate_leaves_the_old_revision_and_the_new_is_applied_once(
        tmp_path: Path, signer: Signing, alice: SshKey) -> None:
    config = fleet_config(tmp_path, signer, alice)
    start(tmp_path, signer, alice, config)
    layout = Layout(config.source_dir)
    first = push(signer, tmp_path, alice, "grow", {"nodes/a/v.yaml": vol("2Gi"),
                                                   "fleet.yaml": FLEET})
    assert Syncer(config, gate=FakeGate(WAITING)).sync().result == "waiting"
    assert layout.read_state()["heldBack"]["commit"] == first
    new = push(signer, tmp_path, alice, "grow more", {"nodes/a/v.yaml": vol("3Gi")})

    def kill(commit: str, rollout: Rollout) -> GateAnswer:
        raise Killed

    with pytest.raises(Killed):
        Syncer(config, gate=kill).sync()
    # Nothing half done: the old revision applied, the record of what waits
    # still names a revision that really waits (not applied).
    assert applied_files(config) == {"v.yaml": vol("1Gi")}
    back = layout.read_state().get("heldBack")
    assert back is None or back["commit"] != layout.applied()["commit"]  # type: ignore[index]
    gate = FakeGate(GateAnswer("Apply"))
    out = Syncer(config, gate=gate).sync()
    assert (out.result, out.commit) == ("applied", new), out
    assert applied_files(config) == {"v.yaml": vol("3Gi")}
    assert "heldBack" not in layout.read_state()
    out = Syncer(config, gate=gate).sync()
    assert out.result == "unchanged" and len(gate.asked) == 1  # applied exactly once


def test_a_hold_during_a_sync_is_never_lost_nor_applied_past(
        tmp_path: Path, signer: Signing, alice: SshKey) -> None:
    """`source hold` while the daemon's sync is inside the gate (it holds the
    source's lock): the hold waits for it, is recorded after it, and the
    next revision is held back, many times over."""
    config = fleet_config(tmp_path, signer, alice)
    start(tmp_path, signer, alice, config)
    layout = Layout(config.source_dir)
    for i in range(4):
        done = threading.Event()
        held: list[str | None] = []

        def hold(held: list[str | None] = held, done: threading.Event = done,
                 i: int = i) -> None:
            held.append(Syncer(config).hold(f"h{i}"))
            done.set()

        def gate(commit: str, rollout: Rollout, hold: object = hold) -> GateAnswer:
            threading.Thread(target=hold).start()  # type: ignore[arg-type]
            return GateAnswer("Apply")

        size = f"{i + 2}Gi"
        sha = push(signer, tmp_path, alice, size, {"nodes/a/v.yaml": vol(size),
                                                   "fleet.yaml": FLEET})
        assert Syncer(config, gate=gate).sync().result == "applied"
        assert done.wait(30)
        assert held == [sha]  # held at what the sync applied, after it
        assert layout.read_state()["held"]["reason"] == f"h{i}"
        later = push(signer, tmp_path, alice, "later", {"nodes/a/v.yaml": vol(f"{i + 2}0Gi")})
        out = Syncer(config, gate=FakeGate(GateAnswer("Apply"))).sync()
        assert out.result == "held" and layout.applied()["commit"] == sha  # type: ignore[index]
        assert layout.read_state()["heldBack"]["commit"] == later
        Syncer(config).resume()
        assert Syncer(config, gate=FakeGate(GateAnswer("Apply"))).sync().result == "applied"


CHILD = """
import os, pickle, sys, time
from reconciler.source.sync import Syncer
config = pickle.load(open(sys.argv[1], "rb"))
def gate(commit, rollout):
    open(sys.argv[2], "w").write(str(os.getpid()))
    while True:
        time.sleep(1)  # killed here: between the export and the switch
Syncer(config, gate=gate).sync()
"""


def test_a_sigkill_between_export_and_switch_leaves_no_half_state(
        tmp_path: Path, signer: Signing, alice: SshKey) -> None:
    import os
    import pickle
    import signal
    import subprocess
    import sys
    import time

    config = fleet_config(tmp_path, signer, alice)
    good = start(tmp_path, signer, alice, config)
    layout = Layout(config.source_dir)
    new = push(signer, tmp_path, alice, "grow", {"nodes/a/v.yaml": vol("2Gi"),
                                                 "fleet.yaml": FLEET})
    (tmp_path / "config.pickle").write_bytes(pickle.dumps(config))
    marker = tmp_path / "in-gate"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path / "config.pickle"),
                              str(marker)], env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert child.poll() is None, "the sync ended before its gate"
            assert time.monotonic() < deadline, "the sync never reached its gate"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
        child.wait(30)
    assert layout.applied()["commit"] == good  # type: ignore[index]
    assert applied_files(config) == {"v.yaml": vol("1Gi")}
    assert not [p for p in layout.revs.iterdir() if p.name.startswith(".tmp-")]
    back = layout.read_state().get("heldBack")
    assert back is None or back["commit"] == new
    # On restart the gate waits, then applies it, once.
    out = Syncer(config, gate=FakeGate(WAITING)).sync()  # the lock died with the process
    assert out.result == "waiting" and layout.read_state()["heldBack"]["commit"] == new
    gate = FakeGate(GateAnswer("Apply"))
    assert Syncer(config, gate=gate).sync().result == "applied"
    assert Syncer(config, gate=gate).sync().result == "unchanged" and len(gate.asked) == 1
    assert applied_files(config) == {"v.yaml": vol("2Gi")}
    assert "heldBack" not in layout.read_state()


@pytest.mark.parametrize("shape", ["directory", "too-big", "not-utf8"])
def test_a_fleet_yaml_that_is_a_directory_too_big_or_not_text_is_refused(
        tmp_path: Path, signer: Signing, alice: SshKey, shape: str) -> None:
    config = fleet_config(tmp_path, signer, alice)
    start(tmp_path, signer, alice, config)
    files = {"nodes/a/v.yaml": vol("2Gi")}
    if shape == "directory":
        files["fleet.yaml/x.yaml"] = FLEET
    elif shape == "too-big":
        files["fleet.yaml"] = FLEET + "#" * (2 * 1024 * 1024) + "\n"
    else:
        files["fleet.yaml"] = FLEET
    push(signer, tmp_path, alice, shape, files)
    if shape == "not-utf8":
        (signer.work / "fleet.yaml").write_bytes(FLEET.encode() + b"# \xff\xfe\n")
        push(signer, tmp_path, alice, "bytes", {})
    gate = FakeGate(GateAnswer("Apply"))
    out = Syncer(config, gate=gate).sync()
    assert (out.result, out.reason) == ("refused", "LoadFailed"), out
    assert "fleet.yaml:" in out.message and not gate.asked
    assert applied_files(config) == {"v.yaml": vol("1Gi")}
