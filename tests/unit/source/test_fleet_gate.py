"""The rollout gate in a sync of the GitOps source (issue 40), with real git
and ssh-signed commits over file:// and a fake gate: a revision with a
fleet.yaml at the repository's root is applied by a node in a fleet only
when the gate answers Apply; anything else leaves the applied revision as
it is and says why (result ``waiting``, ``heldBack``); a bad fleet.yaml
refuses the revision at fleet.yaml:line:column; a node in no fleet applies
at once; a node whose path is the root does not load fleet.yaml as a
volume file; ``source hold`` holds, ``resume`` lets go."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from source_signing import VOLUME_YAML, Signing, SshKey
from test_sync import applied_files, make_config, push

from reconciler.source.gating import GateAnswer
from reconciler.source.layout import Layout
from reconciler.source.report import source_status
from reconciler.source.sync import Syncer
from reconciler.spec.config import Config
from reconciler.spec.fleet import Rollout
from reconciler.spec.source import SourceFleet

FLEET = """\
apiVersion: rbd-reconciler/v1
kind: Rollout
metadata: {name: edge}
spec:
  waves:
    - {name: canary, nodes: [c]}
    - {name: rest, nodes: ["*"]}
  gate: {healthySeconds: 5}
"""


class FakeGate:
    """Answers what it is told; remembers what it was asked."""

    def __init__(self, answer: GateAnswer) -> None:
        self.answer = answer
        self.asked: list[tuple[str, Rollout]] = []

    def __call__(self, commit: str, rollout: Rollout) -> GateAnswer:
        self.asked.append((commit, rollout))
        return self.answer


WAITING = GateAnswer("Waiting", "wave rest waits for c (applied, converging)",
                     {"waitingFor": [{"node": "c", "why": "converging",
                                      "detail": "applied, converging"}]})


def fleet_config(tmp_path: Path, signer: Signing, alice: SshKey, **src: object) -> Config:
    config = make_config(tmp_path, signer, alice, **src)
    assert config.git is not None
    return replace(config, git=replace(config.git, fleet=SourceFleet("fleet")))


def vol(size: str) -> str:
    return VOLUME_YAML.format(name="v", size=size)


def start(tmp_path: Path, signer: Signing, alice: SshKey, config: Config) -> str:
    """The first revision, applied (no gate asked: no fleet.yaml yet)."""
    good = push(signer, tmp_path, alice, "good", {"nodes/a/v.yaml": vol("1Gi")})
    assert Syncer(config).sync().result == "applied"
    return good


def test_waiting_does_not_switch_and_apply_does(tmp_path: Path, signer: Signing,
                                                alice: SshKey) -> None:
    config = fleet_config(tmp_path, signer, alice)
    good = start(tmp_path, signer, alice, config)
    new = push(signer, tmp_path, alice, "grow", {"nodes/a/v.yaml": vol("2Gi"),
                                                 "fleet.yaml": FLEET})
    gate = FakeGate(WAITING)
    out = Syncer(config, gate=gate).sync()
    assert (out.result, out.reason, out.commit) == ("waiting", "Waiting", new), out
    assert out.ok and "waits for c" in out.message
    [(commit, rollout)] = gate.asked
    assert commit == new and [w.name for w in rollout.waves] == ["canary", "rest"]
    assert rollout.gate.healthy_seconds == 5
    assert applied_files(config) == {"v.yaml": vol("1Gi")}
    layout = Layout(config.source_dir)
    assert layout.applied()["commit"] == good  # type: ignore[index]
    state = layout.read_state()
    hb = state["heldBack"]
    assert (hb["commit"], hb["state"], hb["revision"]) == (new, "Waiting", f"main@sha1:{new}")
    assert hb["waitingFor"][0]["node"] == "c" and hb["at"]
    assert "refusals" not in state and state["consecutiveFailures"] == 0
    st = source_status(config)
    assert st["rollout"]["state"] == "Waiting" and st["rollout"]["heldBack"]["commit"] == new
    ready = {c["type"]: c for c in st["conditions"]}
    assert (ready["Ready"]["status"], ready["Ready"]["reason"]) == ("False", "Waiting")
    assert ready["SourceVerified"]["status"] == "True"

    # Still waiting: asked again, still nothing switched.
    assert Syncer(config, gate=gate).sync().result == "waiting"
    assert len(gate.asked) == 2 and applied_files(config) == {"v.yaml": vol("1Gi")}

    gate.answer = GateAnswer("Apply")
    out = Syncer(config, gate=gate).sync()
    assert (out.result, out.commit) == ("applied", new), out
    assert applied_files(config) == {"v.yaml": vol("2Gi")}  # fleet.yaml is not under the path
    state = layout.read_state()
    assert "heldBack" not in state
    meta = layout.applied()
    assert meta is not None and meta["fleet"] == {"rollout": "edge", "wave": "rest"}
    assert source_status(config)["rollout"]["state"] == "Applied"
    assert source_status(config)["rollout"]["wave"] == "rest"
    # Applied: the gate is not asked again for it.
    assert Syncer(config, gate=gate).sync().result == "unchanged" and len(gate.asked) == 3


def test_every_state_but_apply_waits(tmp_path: Path, signer: Signing, alice: SshKey) -> None:
    config = fleet_config(tmp_path, signer, alice)
    start(tmp_path, signer, alice, config)
    new = push(signer, tmp_path, alice, "grow", {"nodes/a/v.yaml": vol("2Gi"),
                                                 "fleet.yaml": FLEET})
    for answer in (GateAnswer("OutsideWindow", "outside every window",
                              {"nextOpening": "2030-01-01T02:00:00+00:00"}),
                   GateAnswer("Halted", "halted: it failed on c, volume v: never shrink",
                              {"halted": {"node": "c", "volume": "v", "reason": "x"}}),
                   GateAnswer("Held", "held by this node")):
        out = Syncer(config, gate=FakeGate(answer)).sync()
        assert (out.result, out.reason, out.message) == ("waiting", answer.state,
                                                         answer.message), out
        hb = Layout(config.source_dir).read_state()["heldBack"]
        assert hb["state"] == answer.state and hb["commit"] == new
        assert {k: hb[k] for k in answer.details} == dict(answer.details)
        assert applied_files(config) == {"v.yaml": vol("1Gi")}


def test_a_bad_fleet_yaml_refuses_the_revision(tmp_path: Path, signer: Signing,
                                               alice: SshKey) -> None:
    config = fleet_config(tmp_path, signer, alice)
    start(tmp_path, signer, alice, config)
    bad = FLEET.replace("healthySeconds: 5", "healthySeconds: soon")
    sha = push(signer, tmp_path, alice, "bad fleet", {"nodes/a/v.yaml": vol("2Gi"),
                                                      "fleet.yaml": bad})
    gate = FakeGate(GateAnswer("Apply"))
    out = Syncer(config, gate=gate).sync()
    assert (out.result, out.reason, out.commit) == ("refused", "LoadFailed", sha), out
    assert "fleet.yaml:8:" in out.message and "healthySeconds" in out.message, out.message
    assert not gate.asked and applied_files(config) == {"v.yaml": vol("1Gi")}
    # A node in no fleet refuses it too: the policy is signed content of the revision.
    plain = make_config(tmp_path, signer, alice)
    out = Syncer(plain).sync()
    assert (out.result, out.reason) == ("refused", "LoadFailed"), out


def test_a_fleet_yaml_that_is_no_plain_file_is_refused(tmp_path: Path, signer: Signing,
                                                       alice: SshKey) -> None:
    config = fleet_config(tmp_path, signer, alice)
    start(tmp_path, signer, alice, config)
    (signer.work / "fleet.yaml").symlink_to("/etc/passwd")
    push(signer, tmp_path, alice, "link", {})
    out = Syncer(config, gate=FakeGate(GateAnswer("Apply"))).sync()
    assert (out.result, out.reason) == ("refused", "LoadFailed"), out
    assert "fleet.yaml:1:1" in out.message and "symlink" in out.message


def test_a_node_in_no_fleet_applies_at_once(tmp_path: Path, signer: Signing,
                                            alice: SshKey) -> None:
    config = make_config(tmp_path, signer, alice)  # no source.fleet
    start(tmp_path, signer, alice, config)
    new = push(signer, tmp_path, alice, "grow", {"nodes/a/v.yaml": vol("2Gi"),
                                                 "fleet.yaml": FLEET})
    gate = FakeGate(WAITING)
    out = Syncer(config, gate=gate).sync()
    assert (out.result, out.commit) == ("applied", new) and not gate.asked
    ro = source_status(config)["rollout"]
    assert (ro["inFleet"], ro["state"]) == (False, "NotInFleet"), ro
    assert "no fleet" in ro["message"]


def test_a_fleet_node_without_the_daemons_gate_applies_nothing(
        tmp_path: Path, signer: Signing, alice: SshKey) -> None:
    """`source sync` on a node of a fleet: fetched and verified, not applied."""
    config = fleet_config(tmp_path, signer, alice)
    start(tmp_path, signer, alice, config)
    push(signer, tmp_path, alice, "grow", {"nodes/a/v.yaml": vol("2Gi"), "fleet.yaml": FLEET})
    out = Syncer(config).sync()
    assert (out.result, out.reason) == ("waiting", "Waiting"), out
    assert "the daemon applies" in out.message
    assert applied_files(config) == {"v.yaml": vol("1Gi")}


def test_a_fleet_without_fleet_yaml_applies_at_once(tmp_path: Path, signer: Signing,
                                                    alice: SshKey) -> None:
    config = fleet_config(tmp_path, signer, alice)
    start(tmp_path, signer, alice, config)
    new = push(signer, tmp_path, alice, "grow", {"nodes/a/v.yaml": vol("2Gi")})
    gate = FakeGate(WAITING)
    assert Syncer(config, gate=gate).sync().commit == new
    assert applied_files(config) == {"v.yaml": vol("2Gi")} and not gate.asked


def test_at_the_root_fleet_yaml_is_no_volume_file(tmp_path: Path, signer: Signing,
                                                  alice: SshKey) -> None:
    config = fleet_config(tmp_path, signer, alice, path="")
    sha = push(signer, tmp_path, alice, "root", {"v.yaml": vol("1Gi"), "fleet.yaml": FLEET})
    out = Syncer(config, gate=FakeGate(GateAnswer("Apply"))).sync()
    assert (out.result, out.commit) == ("applied", sha), out
    assert applied_files(config) == {"v.yaml": vol("1Gi")}


def test_hold_and_resume(tmp_path: Path, signer: Signing, alice: SshKey) -> None:
    config = fleet_config(tmp_path, signer, alice)
    good = start(tmp_path, signer, alice, config)
    assert Syncer(config).hold("disk swap on Tuesday") == good
    new = push(signer, tmp_path, alice, "grow", {"nodes/a/v.yaml": vol("2Gi"),
                                                 "fleet.yaml": FLEET})
    gate = FakeGate(GateAnswer("Apply"))
    out = Syncer(config, gate=gate).sync()
    assert (out.result, out.reason) == ("held", "Held"), out
    assert "source hold" in out.message and "disk swap on Tuesday" in out.message
    assert not gate.asked and applied_files(config) == {"v.yaml": vol("1Gi")}
    ro = source_status(config)["rollout"]
    assert (ro["state"], ro["held"]) == ("Held", "disk swap on Tuesday"), ro
    assert ro["heldBack"]["commit"] == new
    Syncer(config).resume()
    assert source_status(config)["rollout"]["held"] is None
    out = Syncer(config, gate=gate).sync()
    assert (out.result, out.commit) == ("applied", new) and len(gate.asked) == 1
    assert "heldBack" not in Layout(config.source_dir).read_state()


def test_one_revision_waits_not_each_one_pushed_meanwhile(tmp_path: Path, signer: Signing,
                                                          alice: SshKey) -> None:
    config = fleet_config(tmp_path, signer, alice)
    good = start(tmp_path, signer, alice, config)
    gate = FakeGate(WAITING)
    layout = Layout(config.source_dir)
    for size in ("2Gi", "3Gi", "4Gi"):
        new = push(signer, tmp_path, alice, size, {"nodes/a/v.yaml": vol(size),
                                                   "fleet.yaml": FLEET})
        assert Syncer(config, gate=gate).sync().result == "waiting"
        kept = sorted(p.name for p in layout.revs.iterdir() if p.is_dir())
        assert [n.split("-")[0] for n in kept] == sorted([good, new]), kept
    assert applied_files(config) == {"v.yaml": vol("1Gi")}
