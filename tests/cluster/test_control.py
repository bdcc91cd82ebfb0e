"""The command line beside the running daemon (README: The command line
beside the daemon): it does its job through the daemon's control socket and
prints what a command of its own would print."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import rbd
from conftest import NodeUnderTest
from test_daemon import ROOT, Daemon, set_resync, spec, start, wait_for  # noqa: F401
from test_encryption import enc_node  # noqa: F401  (a fixture)

from reconciler.facts import meta
from reconciler.facts.claim import Claim

pytestmark = pytest.mark.ceph

NOBODY = 65534


def normal(out: str, *names: str) -> str:
    """Output with what differs between two volumes of the same spec (their
    names, loop devices, paths under the test's root) made alike."""
    for i, name in enumerate(names):
        out = out.replace(name, f"<vol{i}>")
    return re.sub(r"/dev/loop\d+", "/dev/loopN", out)


def local_config(node: NodeUnderTest) -> Path:
    """The node's config with a control socket nobody serves: the command
    line then works alone (as with no daemon), beside the daemon."""
    alone = node.root / "alone.yaml"
    alone.write_text(node.config.read_text().replace(
        f"controlSocket: {node.state}/control.sock", f"controlSocket: {node.root}/none.sock"))
    return alone


def cli_as(node: NodeUnderTest, config: Path, *args: str) -> tuple[int, str]:
    """The CLI in this process with another config file."""
    saved = node.config
    node.config = config
    try:
        return node.cli(*args)
    finally:
        node.config = saved


def run_cli(node: NodeUnderTest, *args: str) -> subprocess.Popen[str]:
    """The CLI as a process of its own (for several at once)."""
    return subprocess.Popen([sys.executable, "-m", "reconciler", "--config", str(node.config),
                             *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT)


def no_look_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on this process (the command line) may not observe the node
    or reach Ceph: what it prints comes from the daemon."""
    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("the command line looked for itself")

    from reconciler.drivers import ceph
    from reconciler.observe import node as observe_node

    monkeypatch.setattr(observe_node, "observe", refuse)
    monkeypatch.setattr(ceph, "connect", refuse)


def steps_logged(d: Daemon, name: str) -> list[str]:
    """Each step the daemon ran for ``name`` (one log line each)."""
    return re.findall(rf"reconciler\.apply: {re.escape(name)}: (.+?): \w+ in \d+ ms",
                      d.log.read_text())


def claim_elsewhere(node: NodeUnderTest, image: str) -> None:
    """``image``, made and claimed by another node that maps nothing."""
    with node.cluster.client() as c, c.open_ioctx(node.cluster.pool) as ioctx:
        rbd.RBD().create(ioctx, image, 64 << 20)
        with rbd.Image(ioctx, image) as img:
            img.metadata_set(meta.HOLDER, Claim("elsewhere", ()).encode())
    node.images.add(image)


def test_apply_through_the_daemon_prints_what_apply_prints_alone(
        node: NodeUnderTest, start: Callable[..., Daemon],  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    alone, there = node.name("alone"), node.name("there")
    node.write(alone, spec(node, target=alone))
    rc_alone, out_alone = node.cli("apply", alone)  # no daemon: this process does it
    assert rc_alone == 0
    set_resync(node, 3600)  # only events and the command line start passes
    d = start()
    wait_for(lambda: d.saw("READY=1"), "READY=1")
    no_look_here(monkeypatch)
    # The same spec once more: the daemon's chain starts on the file's event;
    # apply, typed at once, prints that chain (it never runs a second one).
    node.write(there, spec(node, target=there))
    rc, out = node.cli("apply", there)
    assert (rc, normal(out, there)) == (rc_alone, normal(out_alone, alone)), (out, out_alone)
    assert len(steps_logged(d, there)) == 5, steps_logged(d, there)  # each step once
    assert d.status(there)["phase"] == "Published"
    # Nothing to do: as alone, and the JSON document is the same one.
    rc, out = node.cli("apply", there)
    assert rc == 0 and out == f"ok: [{there}]\nrecap: ok=1 changed=0 failed=0\n", out
    rc, doc = node.cli_json("apply", there)
    assert rc == 0 and set(doc) == {"recap", "errors", "thawed", "volumes"}, doc
    assert doc["volumes"] == [{"name": there, "status": "ok", "error": None, "notes": [],
                               "undone": [], "steps": []}], doc
    assert d.stop() == 0


def test_through_the_daemon_a_refusal_and_nothing_to_do_exit_as_alone(
        node: NodeUnderTest, start: Callable[..., Daemon]) -> None:  # noqa: F811
    taken, fine = node.name("taken"), node.name("fine")
    claim_elsewhere(node, taken)
    node.write(taken, f"  image: {{pool: {node.cluster.pool}, size: 64Mi}}\n"
                      "  map: {mapper: fuse}\n")
    node.write(fine, spec(node, target="fine"))
    alone = local_config(node)
    rc_alone, out_alone = cli_as(node, alone, "apply", taken)
    assert rc_alone == 1 and "claimed by node elsewhere" in out_alone
    d = start()
    d.wait_phase(fine, "Published")
    rc, out = node.cli("apply", taken)
    assert (rc, out) == (rc_alone, out_alone)  # failed: [taken] ..., recap failed=1
    rc, doc = node.cli_json("apply", taken)
    assert rc == 1 and doc["recap"] == {"ok": 0, "changed": 0, "failed": 1}
    rc, out = node.cli("apply", fine)
    assert rc == 0 and out == f"ok: [{fine}]\nrecap: ok=1 changed=0 failed=0\n", out
    rc, out = node.cli("apply", "no-such-volume")
    assert rc == 1 and out == ""
    rc, out = node.cli("plan", taken)
    assert rc == 1 and "REFUSED: " in out and "claimed by node elsewhere" in out
    assert d.stop() == 0


def test_status_plan_explain_answer_from_a_look_of_the_daemon(
        node: NodeUnderTest, start: Callable[..., Daemon],  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    a = node.name("view")
    node.write(a, spec(node, target="view"))
    d = start()
    d.wait_phase(a, "Published")
    assert node.cli("status")[0] == 0  # once the daemon has looked again after its chain
    alone = local_config(node)
    views = {cmd: cli_as(node, alone, cmd) for cmd in ("status", "plan")}
    views["explain"] = cli_as(node, alone, "explain", a)
    json_alone = cli_as(node, alone, "status", "-o", "json")

    no_look_here(monkeypatch)
    for cmd, (rc_alone, out_alone) in views.items():
        rc, out = node.cli(cmd, *([a] if cmd == "explain" else []))
        assert rc == rc_alone == 0, (cmd, out)
        assert out == out_alone, (cmd, out, out_alone)
    rc, doc = node.cli_json("status")
    want = json.loads(json_alone[1])
    assert doc["volumes"][0]["phase"] == "PUBLISHED"
    assert set(doc) == set(want) and set(doc["volumes"][0]) == set(want["volumes"][0])
    assert "control: status" in d.log.read_text()
    # A command of its own process takes the short way (cli/fast.py): the same words.
    for args in (["status"], ["plan", "-o", "json"], ["explain", a]):
        proc = run_cli(node, *args)
        out, err = proc.communicate(timeout=60)
        assert (proc.returncode, unstamped(out)) == tuple(map(unstamped, node.cli(*args))), \
            (args, err)
        if "json" in args:  # who looked, and when: the daemon, after the question
            doc = json.loads(out)
            assert doc["answeredBy"] == f"the daemon (pid {d.proc.pid})", doc
    assert d.stop() == 0


def unstamped(out: str | int) -> str | int:
    """The answer less when it was observed (two looks: two times)."""
    return re.sub(r'"observedAt": "[^"]*"', '"observedAt": "T"', out) \
        if isinstance(out, str) else out


def test_release_holds_down_until_apply_across_a_restart(
        node: NodeUnderTest, start: Callable[..., Daemon]) -> None:  # noqa: F811
    a = node.name("held")
    node.write(a, spec(node, target="held"))
    d = start()
    d.wait_phase(a, "Published")
    rc, out = node.cli("release", a)
    assert rc == 0 and out.startswith(f"changed: [{a}]\n  changed unpublish"), out
    assert str(node.srv / "held") not in node.mounts()
    status = d.wait_phase(a, "Released")
    assert status["reason"] == "Held", status
    rc, out = node.cli("status")
    assert rc == 0 and re.search(rf"{a}\s+CREATED\s+PUBLISHED", out), out
    assert d.stop() == 0
    d = start()  # a restart keeps it down
    wait_for(lambda: d.saw("READY=1"), "READY=1")
    rc, doc = node.cli_json("status")
    assert doc["volumes"][0]["phase"] == "CREATED", doc
    rc, out = node.cli("apply", a)
    assert rc == 0 and out.startswith(f"changed: [{a}]\n  changed map"), out
    assert str(node.srv / "held") in node.mounts()
    # Held again, then applied with the daemon stopped: the daemon, when it
    # starts, does not take it down again.
    assert node.cli("release", a)[0] == 0
    assert d.stop() == 0
    assert json.loads((node.state / "held.json").read_text()) == {"names": [a]}
    assert node.cli("apply", a)[0] == 0  # alone
    assert not (node.state / "held.json").exists()
    d = start()
    d.wait_phase(a, "Published")
    assert node.cli("plan")[0] == 0
    assert d.stop() == 0


def test_allow_removal_and_takeover_run_in_the_daemon(
        node: NodeUnderTest, start: Callable[..., Daemon]) -> None:  # noqa: F811
    names = [node.name(f"gone{i}") for i in range(2)]
    for n in names:
        node.write(n, spec(node, target=n))
    taken = node.name("taken")
    claim_elsewhere(node, taken)
    node.write(taken, f"  image: {{pool: {node.cluster.pool}, size: 64Mi}}\n"
                      "  map: {mapper: fuse}\n")
    d = start()
    for n in names:
        d.wait_phase(n, "Published")
    d.wait_phase(taken, "Failed")  # refused: another node's claim
    for n in names:
        (node.desired / f"{n}.yaml").unlink()
    wait_for(lambda: "vanished in one pass" in d.log.read_text(), "the guard to speak")
    rc, out = node.cli("allow-removal", "--all")
    assert rc == 0, out
    assert out.startswith("allowed: every pending removal; the daemon lets them go now\n")
    for n in names:
        assert f"changed: [{n}]\n  changed unpublish" in out, out
    assert out.endswith("recap: ok=0 changed=2 failed=0\n"), out
    assert not any(str(node.srv / n) in node.mounts() for n in names)

    rc, out = node.cli("takeover", taken)
    assert rc == 1 and "would blocklist nothing" in out, out
    rc, out = node.cli("takeover", taken, "--yes-i-am-sure")
    assert rc == 0, out
    assert out.endswith("claimed by test-node (taken over from elsewhere); the daemon maps "
                        "it here now\n"), out
    d.wait_phase(taken, "Mapped")
    log = d.log.read_text()
    assert "control: takeover" in log and "control: allow-removal" in log
    rc, _ = node.cli("rotate-key", taken)  # no encryption: refused, by the daemon
    assert rc == 1 and "control: rotate-key" in d.log.read_text()
    assert d.stop() == 0


def test_root_only_a_stopped_daemon_and_a_stale_socket(
        node: NodeUnderTest, start: Callable[..., Daemon],  # noqa: F811
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    a = node.name("sock")
    node.write(a, spec(node, target="sock"))
    d = start()
    d.wait_phase(a, "Published")
    sock = node.state / "control.sock"
    assert (sock.stat().st_mode & 0o777, sock.stat().st_uid) == (0o600, 0)
    # A client of nobody's, let through the file's mode (CAP_DAC_OVERRIDE
    # kept across the uid change): the daemon refuses it by its uid.
    client = ("import socket, sys; s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); "
              "s.sendall(b'{\"protocol\": 1, \"command\": \"status\", \"stateDir\": \"' + "
              "sys.argv[2].encode() + b'\"}\\n'); print(s.makefile().read())")
    nobody = ["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups"]
    caps = ["--inh-caps", "+dac_override", "--ambient-caps", "+dac_override"]
    r = subprocess.run([*nobody, *caps, sys.executable, "-c", client, str(sock),
                        str(node.state)], capture_output=True, text=True, timeout=60)
    answer = json.loads(r.stdout)
    assert answer == {"exit": 1, "error": f"the control socket answers root only (this client "
                                          f"runs as uid {NOBODY})"}, r.stdout + r.stderr
    assert "refused a client of uid 65534" in d.log.read_text()
    r = subprocess.run([*nobody, sys.executable, "-c", client, str(sock), str(node.state)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "PermissionError" in r.stderr  # the mode, before any cred

    # Stopped (or stuck): it accepts, but says nothing. What only reports is
    # made alone, with a warning; what changes the node is not asked at all.
    from reconciler.daemon import protocol

    monkeypatch.setattr(protocol, "LINE_TIMEOUT_S", 1.0)
    d.proc.send_signal(signal.SIGSTOP)
    try:
        capsys.readouterr()
        rc, out = node.cli("status")
        assert rc == 0 and re.search(rf"{a}\s+PUBLISHED", out), out
        assert "does not answer (stopped or stuck?); looking without it" in capsys.readouterr().err
        rc, out = node.cli("apply", a)
        assert rc == 1 and "nothing asked of it" in capsys.readouterr().err
    finally:
        d.proc.send_signal(signal.SIGCONT)
        monkeypatch.setattr(protocol, "LINE_TIMEOUT_S", 10.0)
    capsys.readouterr()
    assert node.cli("plan")[0] == 0  # awake: through it again
    assert "looking without it" not in capsys.readouterr().err
    wait_for(lambda: "control: apply dropped: its client went away" in d.log.read_text(),
             "the request of the command gone to be dropped", 30)

    # Killed: its socket stays, nobody listens. The command line works alone.
    d.stop(signal.SIGKILL)
    stale = sock.stat().st_ino
    rc, out = node.cli("status")
    assert rc == 0 and re.search(rf"{a}\s+PUBLISHED", out), out
    # Another daemon given the same socket (its own stateDir) refuses to
    # start while one answers there; a stale socket is replaced.
    d = start()
    wait_for(lambda: d.saw("READY=1"), "READY=1")
    assert sock.stat().st_ino != stale and node.cli("plan")[0] == 0
    other = node.root / "other"
    for sub in ("desired", "state"):
        (other / sub).mkdir(parents=True)
    other_cfg = node.root / "other.yaml"
    other_cfg.write_text(node.config.read_text().replace(f"{node.desired}", f"{other}/desired")
                         .replace(f"stateDir: {node.state}", f"stateDir: {other}/state"))
    proc = subprocess.run(["setpriv", "--pdeathsig", "KILL", sys.executable, "-m", "reconciler",
                           "--config", str(other_cfg), "run", "--log-format", "plain"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 1, proc.stderr
    assert (f"controlSocket {sock}: another rbd-reconciler daemon answers there (pid "
            f"{d.proc.pid}, stateDir {node.state})") in proc.stderr, proc.stderr
    assert node.cli("plan")[0] == 0  # still the first daemon's
    assert d.stop() == 0
    assert not sock.exists()  # removed at stop


def test_two_commands_and_the_daemon_at_once_run_each_step_once(
        node: NodeUnderTest, start: Callable[..., Daemon]) -> None:  # noqa: F811
    set_resync(node, 3600)
    d = start()
    wait_for(lambda: d.saw("READY=1"), "READY=1")
    x, y = node.name("x"), node.name("y")
    node.write(x, spec(node, target="x"))
    node.write(y, spec(node, target="y"))
    procs = [run_cli(node, "apply"), run_cli(node, "apply", x), run_cli(node, "apply", y)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, out + err
        assert "in use" not in err and "Traceback" not in err, err
    for name in (x, y):
        logged = steps_logged(d, name)
        assert len(logged) == len(set(logged)) == 5, logged  # no step twice
        assert d.status(name)["phase"] == "Published"
    for out, _ in outs:  # each printed that chain, or found nothing left to do
        for m in re.finditer(r"^(\w+): \[.+?\]\n((?:  .*\n)*)", out, re.M):
            steps = m.group(2).splitlines()
            assert (m.group(1), len(steps)) in (("changed", 5), ("ok", 0)), out
    all_out = outs[0][0]
    assert f"[{x}]" in all_out and f"[{y}]" in all_out and "failed=0" in all_out
    assert d.stop() == 0


def test_a_path_outside_the_daemon_is_planned_alone(
        node: NodeUnderTest, start: Callable[..., Daemon]) -> None:  # noqa: F811
    d = start()
    wait_for(lambda: d.saw("READY=1"), "READY=1")
    elsewhere = node.root / "elsewhere"
    elsewhere.mkdir()
    name = node.name("out")
    saved = node.desired
    node.desired = elsewhere
    f = node.write(name, spec(node, target="out"))
    node.desired = saved
    rc, out = node.cli("plan", str(f))
    assert rc == 2 and f"volume {name}: ABSENT -> PUBLISHED" in out, out
    assert "control: plan" not in d.log.read_text()
    rc, out = node.cli("apply", str(f))
    assert rc == 1 and out == ""  # the daemon converges its own directories only
    assert d.stop() == 0
    os.unlink(f)


def test_rotate_key_runs_in_the_daemon_holding_the_volume(
        enc_node: NodeUnderTest, start: Callable[..., Daemon]) -> None:  # noqa: F811
    from test_encryption import formatted, image_meta, node_key_path

    n = enc_node
    name = n.name("rot")
    formatted(n, name)
    n.write(name, f"  image: {{pool: {n.cluster.pool}, size: 64Mi}}\n  map: {{}}\n"
                  f"  encryption: {{type: luks2, key: {{wrappedBy: {node_key_path(n)}}}}}\n")
    d = start()
    d.wait_phase(name, "Mapped")
    before = image_meta(n, name)[meta.LUKS_KEY]
    rc, out = n.cli("rotate-key", name)
    assert rc == 0 and "rotated" in out, out
    assert image_meta(n, name)[meta.LUKS_KEY] != before
    assert "control: rotate-key" in d.log.read_text()  # done by the daemon
    assert d.status(name)["phase"] == "Mapped"  # and the volume given back to it
    assert d.stop() == 0


def test_while_the_daemon_refuses_apply_says_why_and_status_looks_alone(
        node: NodeUnderTest, start: Callable[..., Daemon],  # noqa: F811
        capsys: pytest.CaptureFixture[str]) -> None:
    a = node.name("refused")
    node.write(a, spec(node, target="refused"))
    d = start()
    d.wait_phase(a, "Published")
    node.desired.chmod(0o777)
    try:
        capsys.readouterr()
        rc, out = node.cli("apply", a)
        err = capsys.readouterr().err
        assert rc == 1 and out == "" and "the daemon is not reconciling: " in err, err
        assert "writable by group or others" in err
        rc, out = node.cli("status")
        err = capsys.readouterr().err
        assert rc == 1 and "not reconciling" in err and "looking without it" in err, err
        assert "refusing to read it" in err  # this command's own loader says why too
    finally:
        node.desired.chmod(0o755)
    assert node.cli("apply", a)[0] == 0
    assert d.stop() == 0
