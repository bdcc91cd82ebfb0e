"""An adversarial review of the GitOps source's trust rules (issue 36): the
server, the pusher and a fault injector against the distrust, the descent
base and the tag-name check. Each test is one defect found (fixed, or
``xfail(strict=True)`` with why), or one attack that held."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from source_signing import VOLUME_YAML, Signing, SshKey, node_config_file
from test_source_attacks import revocable
from test_sync import applied_files, conditions, make_config, push

from reconciler.source import sync as sync_mod
from reconciler.source.layout import Layout
from reconciler.source.report import distrust, source_status
from reconciler.source.sync import Syncer
from reconciler.spec.source import SourceRef

VOLUME = VOLUME_YAML


def vol(size: str) -> dict[str, str | None]:
    return {"nodes/a/v.yaml": VOLUME.format(name="v", size=size)}


# -- the server stops answering: the policy still applies ---------------------------

def test_a_server_that_stops_answering_does_not_keep_a_revoked_revision_trusted(
        tmp_path: Path, signer: Signing, alice: SshKey) -> None:
    """The server may stop updates; it must not thereby keep a revision
    whose key root revoked from being held. The recheck came after the
    fetch: a server gone (or one that just hangs up) skipped it forever."""
    config, revoked, _ = revocable(tmp_path, signer, alice)
    push(signer, tmp_path, alice, "one", vol("1Gi"))
    assert Syncer(config).sync().result == "applied"
    (tmp_path / "fleet.git").rename(tmp_path / "gone.git")  # the server hangs up
    signer.revocation_list(revoked, alice)
    out = Syncer(config).sync()
    # Distrusted is the result (counted under Revoked: RbdSourceRefused
    # fires), the failed fetch said with it.
    assert (out.result, out.reason) == ("distrusted", "Revoked"), out
    assert "fetch" in out.message, out.message
    assert source_status(config)["refusals"] == {"Revoked": 1}
    assert distrust(config) is not None, source_status(config)
    assert conditions(config)["SourceVerified"] == ("False", "Revoked")
    # Back: still held (nothing new verifies), and said so.
    (tmp_path / "gone.git").rename(tmp_path / "fleet.git")
    assert Syncer(config).sync().result == "distrusted"


# -- descent: a pinned commit is not the newest revision -----------------------------

def test_a_pin_to_an_older_commit_does_not_move_the_descent_base_back(
        tmp_path: Path, signer: Signing, alice: SshKey) -> None:
    """A → B → C applied; root pins A for a while, then follows main again.
    The pusher then force-pushes main back to B: an old signed revision,
    which must be refused as not descending from C. The pin had moved
    refs/source/newest to A ("it passed the descent check": it was never
    checked), so B passed."""
    config = make_config(tmp_path, signer, alice)
    assert config.git is not None
    a = push(signer, tmp_path, alice, "A", vol("1Gi"))
    assert Syncer(config).sync().result == "applied"
    b = push(signer, tmp_path, alice, "B", vol("2Gi"))
    assert Syncer(config).sync().result == "applied"
    c = push(signer, tmp_path, alice, "C", vol("3Gi"))
    assert Syncer(config).sync().result == "applied"
    pinned = replace(config, git=replace(config.git, ref=SourceRef("commit", a)))
    out = Syncer(pinned).sync()
    assert (out.result, out.commit) == ("applied", a), out
    assert source_status(config)["newest"] == f"main@sha1:{c}"  # status agrees with the ref
    signer.git("push", "--quiet", "--force", f"file://{tmp_path / 'fleet.git'}",
               f"{b}:refs/heads/main")
    out = Syncer(config).sync()
    assert (out.result, out.reason) == ("refused", "NotDescendant"), out
    assert c[:12] in out.message, out.message
    assert "1Gi" in applied_files(config)["v.yaml"]  # the pin's A stays
    # Main back at C (or on top of it) applies again.
    signer.git("push", "--quiet", "--force", f"file://{tmp_path / 'fleet.git'}",
               f"{c}:refs/heads/main")
    assert Syncer(config).sync().result == "applied"
    # A pin forward (a descendant) does move the base.
    d = push(signer, tmp_path, alice, "D", vol("4Gi"))
    assert Syncer(replace(config, git=replace(config.git, ref=SourceRef("commit", d)))
                  ).sync().result == "applied"
    signer.git("push", "--quiet", "--force", f"file://{tmp_path / 'fleet.git'}",
               f"{c}:refs/heads/main")
    assert Syncer(config).sync().reason == "NotDescendant"


# -- the digest is of the policy the revision was verified under --------------------

def test_a_key_revoked_while_a_revision_is_exported_is_noticed(
        tmp_path: Path, signer: Signing, alice: SshKey,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Root revokes alice while the sync that verified alice's revision is
    still exporting it. The digest kept with the revision was taken after
    the export, of the new policy: the revision then counted as verified
    under it, and was never checked again."""
    config, revoked, _ = revocable(tmp_path, signer, alice)
    push(signer, tmp_path, alice, "one", vol("1Gi"))
    real = sync_mod._step

    def step(name: str) -> None:
        if name == "exported":
            signer.revocation_list(revoked, alice)
        real(name)

    monkeypatch.setattr(sync_mod, "_step", step)
    out = Syncer(config).sync()
    assert out.result == "applied", out  # verified before the revocation: applied
    monkeypatch.setattr(sync_mod, "_step", real)
    out = Syncer(config).sync()
    assert (out.result, out.reason) == ("distrusted", "Revoked"), out
    assert distrust(config) is not None


# -- a rollback killed half way ------------------------------------------------------

class Killed(BaseException):
    pass


def _kill_at_switch(monkeypatch: pytest.MonkeyPatch, nth: int) -> None:
    """The ``nth`` Layout.switch (1: current, 2: previous) is killed."""
    real, calls = Layout.switch, []

    def switch(self: Layout, link: str, name: str) -> None:
        calls.append(link)
        if len(calls) == nth:
            raise Killed
        real(self, link, name)

    monkeypatch.setattr(Layout, "switch", switch)


def test_a_rollback_killed_at_each_step_never_serves_a_revoked_revision(
        tmp_path: Path, signer: Signing, alice: SshKey,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """rollback switched ``current`` first and wrote the verdict on what it
    switched to after: a kill in between left alice's revision, revoked
    since, current and not held (until the next sync). Now the verdict is
    written first; each kill leaves what is current judged."""
    config, revoked, bob = revocable(tmp_path, signer, alice)
    push(signer, tmp_path, alice, "one", vol("1Gi"))
    assert Syncer(config).sync().result == "applied"
    push(signer, tmp_path, bob, "two", vol("2Gi"))
    assert Syncer(config).sync().result == "applied"
    signer.revocation_list(revoked, alice)
    assert Syncer(config).sync().result == "unchanged"  # bob's still verifies
    for nth, current in ((1, "2Gi"), (2, "1Gi")):
        _kill_at_switch(monkeypatch, nth)
        with pytest.raises(Killed):
            Syncer(config).rollback()
        monkeypatch.undo()
        assert current in applied_files(config)["v.yaml"], nth
        # bob's (trusted) stays served; alice's (revoked) is held.
        assert (distrust(config) is None) == (current == "2Gi"), (nth, source_status(config))
        if current == "1Gi":
            break
        Syncer(config).resume()
        assert Syncer(config).sync().result == "unchanged"
        assert distrust(config) is None
    # (Killed between its two switches, previous is current too: bob's is
    # applied again by the next sync once resumed.)
    Syncer(config).resume()
    assert Syncer(config).sync().result == "applied"
    assert distrust(config) is None
    Syncer(config).rollback()  # completed: to alice's, held for the revocation
    assert distrust(config) is not None
    # The other way: from alice's (distrusted) back to bob's, killed before
    # the switch: alice's is still held.
    _kill_at_switch(monkeypatch, 1)
    with pytest.raises(Killed):
        Syncer(config).rollback()
    monkeypatch.undo()
    assert "1Gi" in applied_files(config)["v.yaml"]
    assert distrust(config) is not None
    assert Syncer(config).rollback()  # completed: bob's, trusted
    assert "2Gi" in applied_files(config)["v.yaml"]
    assert distrust(config) is None
    Syncer(config).resume()
    assert Syncer(config).sync().result == "unchanged"


def test_a_sync_killed_after_its_switch_still_moves_the_descent_base(
        tmp_path: Path, signer: Signing, alice: SshKey,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Killed between the switch and the ref update: the next sync finds
    the revision applied ("unchanged") and must still make it the newest,
    else a sibling of it on the old base passes the descent check."""
    config = make_config(tmp_path, signer, alice)
    a = push(signer, tmp_path, alice, "A", vol("1Gi"))
    assert Syncer(config).sync().result == "applied"
    b = push(signer, tmp_path, alice, "B", vol("2Gi"))
    real = sync_mod._step

    def step(name: str) -> None:
        if name == "switched":
            raise Killed
        real(name)

    monkeypatch.setattr(sync_mod, "_step", step)
    with pytest.raises(Killed):
        Syncer(config).sync()
    monkeypatch.setattr(sync_mod, "_step", real)
    assert "2Gi" in applied_files(config)["v.yaml"]
    assert Syncer(config).sync().result == "unchanged"
    assert source_status(config)["newest"] == f"main@sha1:{b}"
    # The pusher: a signed sibling of B on A, force-pushed.
    signer.git("checkout", "--quiet", "-B", "side", a)
    (signer.work / "nodes/a/v.yaml").write_text(VOLUME.format(name="v", size="9Gi"))
    signer.git("add", "-A")
    signer.commit("sibling", alice)
    signer.git("push", "--quiet", "--force", f"file://{tmp_path / 'fleet.git'}", "side:main")
    out = Syncer(config).sync()
    assert (out.result, out.reason) == ("refused", "NotDescendant"), out
    assert b[:12] in out.message
    assert "2Gi" in applied_files(config)["v.yaml"]


def test_the_daemon_is_woken_and_told_when_a_revision_is_distrusted_with_the_server_gone(
        tmp_path: Path, signer: Signing, alice: SshKey,
        caplog: pytest.LogCaptureFixture) -> None:
    """The follower wakes a pass when the applied revision turns distrusted
    (the pass then holds every volume), also when the fetch failed; its one
    log line says the revision is held, and a retry logs nothing new."""
    import logging

    from reconciler.daemon.follow import Follower
    from reconciler.daemon.metrics import Metrics
    from reconciler.drivers.run import Halt

    config, revoked, _ = revocable(tmp_path, signer, alice)
    woken: list[str] = []
    follower = Follower(lambda: config, Metrics(), Halt(), woken.append)
    one = push(signer, tmp_path, alice, "one", vol("1Gi"))
    assert follower.once(config).result == "applied"
    assert woken == [f"main@sha1:{one}"]
    (tmp_path / "fleet.git").rename(tmp_path / "gone.git")
    signer.revocation_list(revoked, alice)
    caplog.set_level(logging.INFO, "rbd-reconciler")
    assert follower.once(config).result == "distrusted"
    assert len(woken) == 2, woken  # a pass now holds every volume
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and "held" in lines[0], lines
    assert follower.once(config).result == "distrusted"
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1
    assert len(woken) == 2


def test_a_held_sync_over_a_distrusted_revision_says_distrusted(
        tmp_path: Path, signer: Signing, alice: SshKey) -> None:
    """Rolled back and held; then the key of what it is held at is revoked,
    and a new revision that verifies arrives. The sync answered "held" (ok:
    `source sync` exit 0, the failure count reset, Stalled never) while
    every volume is held for the distrust: its result is distrusted."""
    config, revoked, bob = revocable(tmp_path, signer, alice)
    push(signer, tmp_path, alice, "one", vol("1Gi"))
    assert Syncer(config).sync().result == "applied"
    push(signer, tmp_path, alice, "two", vol("2Gi"))
    assert Syncer(config).sync().result == "applied"
    Syncer(config).rollback()
    signer.revocation_list(revoked, alice)
    push(signer, tmp_path, bob, "three", vol("3Gi"))
    for _ in range(3):
        out = Syncer(config).sync()
        assert (out.result, out.reason) == ("distrusted", "Revoked"), out
    assert not out.ok
    assert source_status(config)["consecutiveFailures"] == 3
    assert "1Gi" in applied_files(config)["v.yaml"]
    # Resumed: bob's revision on top verifies and is applied; trust is back.
    Syncer(config).resume()
    assert Syncer(config).sync().result == "applied"
    assert distrust(config) is None


# -- the command line over a distrusted revision -------------------------------------

def test_source_rollback_to_a_distrusted_revision_says_so(
        tmp_path: Path, signer: Signing, alice: SshKey,
        capsys: pytest.CaptureFixture[str]) -> None:
    """`source rollback` onto a revision signed by a key revoked since: it
    is held, not served; the command said "rolled back" and exit 0."""
    import argparse

    from reconciler.cli.source import cmd_source

    config, revoked, bob = revocable(tmp_path, signer, alice)
    push(signer, tmp_path, alice, "one", vol("1Gi"))
    assert Syncer(config).sync().result == "applied"
    push(signer, tmp_path, bob, "two", vol("2Gi"))
    assert Syncer(config).sync().result == "applied"
    signer.revocation_list(revoked, alice)
    rc = cmd_source(argparse.Namespace(action="rollback", output="human", rev=""), config)
    out, err = capsys.readouterr()
    assert rc == 1, (out, err)
    assert "Revoked" in out + err and "held" in out + err, (out, err)


def test_a_local_apply_does_not_act_on_a_distrusted_revision(
        tmp_path: Path, signer: Signing, alice: SshKey,
        capsys: pytest.CaptureFixture[str]) -> None:
    """With no daemon, `apply` runs here over desiredDir (source/current):
    the daemon's passes hold a distrusted revision, and so must it."""
    import argparse

    from reconciler.cli.reconcile import cmd_apply

    config, revoked, _ = revocable(tmp_path, signer, alice)
    config = replace(config, control_socket=tmp_path / "no-daemon.sock")
    push(signer, tmp_path, alice, "one", vol("1Gi"))
    assert Syncer(config).sync().result == "applied"
    signer.revocation_list(revoked, alice)
    assert Syncer(config).sync().result == "distrusted"
    for release in (False, True):
        rc = cmd_apply(argparse.Namespace(paths=[], output="human", release=release,
                                          verbose=False), config)
        out, err = capsys.readouterr()
        assert rc == 1, (out, err)
        assert "held" in err and "Revoked" in err, (out, err)


# -- what held ------------------------------------------------------------------------

def test_tag_name_tricks_a_pusher_can_play_are_refused(tmp_path: Path, signer: Signing,
                                                       alice: SshKey) -> None:
    """``ref: {tag: prod}``, mode tag. The pusher cannot sign; it can reuse
    signed objects and make unsigned ones: a signed tag ``canary`` whose
    message has a ``tag prod`` line; an unsigned tag named prod wrapping
    the signed canary (nested). Each is refused; prod's revision stays."""
    from test_source_attacks import push_tag, tag_config

    config = tag_config(tmp_path, signer, alice, "prod", "tag")
    one = push(signer, tmp_path, alice, "one", vol("1Gi"))
    signer.git(*signer._sign_opts(alice), "tag", "-s", "-m", "prod\n\ntag prod\n", "prod", one)
    signer.git("push", "--quiet", f"file://{tmp_path / 'fleet.git'}", "refs/tags/prod")
    assert Syncer(config).sync().result == "applied"
    two = push(signer, tmp_path, alice, "two", vol("2Gi"))
    signer.git("tag", "-d", "prod")
    signer.git(*signer._sign_opts(alice), "tag", "-s", "-m", "x\ntag prod\n\ntag prod",
               "canary", two)
    canary = signer.git("rev-parse", "refs/tags/canary")
    signer.git("update-ref", "refs/keep/canary", canary)
    push_tag(signer, tmp_path, "prod", canary)
    out = Syncer(config).sync()
    assert (out.result, out.reason) == ("refused", "TagNameMismatch"), out
    # Nested: an unsigned tag object named prod on top of the signed canary.
    raw = (f"object {canary}\ntype tag\ntag prod\ntagger P <p@x> 1700000000 +0000\n\n"
           "nested\n").encode()
    outer = signer.git("hash-object", "-t", "tag", "-w", "--stdin", stdin=raw)
    push_tag(signer, tmp_path, "prod", outer)
    out = Syncer(config).sync()
    assert (out.result, out.reason) == ("refused", "Unsigned"), out
    assert "1Gi" in applied_files(config)["v.yaml"]


def test_a_kill_at_every_step_out_of_a_distrust_converges(
        tmp_path: Path, signer: Signing, alice: SshKey) -> None:
    """Distrusted (alice revoked); bob's revisions on top are applied, each
    sync SIGKILLed at one step. Whatever the kill left, what is current is
    never alice's revision served as trusted, and the next sync applies
    bob's and clears the distrust."""
    import signal
    import subprocess
    import sys

    from test_sync import CHILD, STEPS

    from reconciler.spec.config import load_config

    revoked = signer.revocation_list(tmp_path / "revoked_keys")
    bob = signer.ssh_key("bob")
    allowed = signer.allowed_signers(tmp_path / "allowed_signers", ("alice", alice),
                                     ("bob", bob))
    bare = tmp_path / "fleet.git"
    subprocess.run(["git", "init", "--quiet", "--bare", str(bare)], check=True)
    cfg = node_config_file(tmp_path, f"file://{bare}", allowed,
                           verify_extra=f", revocationFile: {revoked}")
    config = load_config(cfg)
    alices = push(signer, tmp_path, alice, "alice's", vol("1Gi"))
    assert Syncer(config).sync().result == "applied"
    for i, (step, nth) in enumerate(STEPS):
        signer.revocation_list(revoked, alice)
        # Each round starts from alice's revision, distrusted: rolled back to.
        if Layout(config.source_dir).applied()["commit"] != alices:  # type: ignore[index]
            Syncer(config).rollback()
            Syncer(config).resume()
        else:
            assert Syncer(config).sync().result == "distrusted"
        assert distrust(config) is not None, step
        files: dict[str, str | None] = {
            f"nodes/a/v{j}.yaml": VOLUME.format(name=f"v{j}", size=f"{i + 2}Gi")
            for j in range(3)}
        sha = push(signer, tmp_path, bob, f"bob {i}", {**files, "nodes/a/v.yaml": None}
                   if i == 0 else files)
        child = subprocess.run([sys.executable, "-c", CHILD, str(cfg), step, str(nth)],
                               capture_output=True, text=True, timeout=120)
        assert child.returncode == -signal.SIGKILL, (step, child.stdout, child.stderr)
        cur = Layout(config.source_dir).applied()
        assert cur is not None
        # alice's, held; or bob's, trusted.
        assert (distrust(config) is not None) == (cur["commit"] == alices), (step, cur)
        out = Syncer(config).sync()
        assert (out.result, out.commit) in (("applied", sha), ("unchanged", sha)), (step, out)
        assert distrust(config) is None, step
        assert f"{i + 2}Gi" in applied_files(config)["v0.yaml"]


def test_a_tag_signed_again_by_a_key_still_allowed_ends_the_distrust(
        tmp_path: Path, signer: Signing, alice: SshKey) -> None:
    """``ref: {tag: prod}``, mode tag: alice's prod tag applied, alice
    revoked: held. Bob signs prod again, on the same commit (the remedy a
    tag allows: no new commit needed). The sync found the commit applied
    ("unchanged") and never looked at the new tag: held for good."""
    from test_source_attacks import _tag_object, push_tag, tag_config

    config = tag_config(tmp_path, signer, alice, "prod", "tag")
    assert config.git is not None
    revoked = signer.revocation_list(tmp_path / "revoked_keys")
    config = replace(config, git=replace(config.git, verify=replace(
        config.git.verify, revocation=revoked)))
    bob = signer.ssh_key("bob")
    signer.allowed_signers(tmp_path / "allowed_signers", ("alice", alice), ("bob", bob))
    one = push(signer, tmp_path, alice, "one", vol("1Gi"))
    push_tag(signer, tmp_path, "prod", _tag_object(signer, "prod", one, alice))
    assert Syncer(config).sync().result == "applied"
    signer.revocation_list(revoked, alice)
    assert Syncer(config).sync().result == "distrusted"
    bobs = _tag_object(signer, "prod", one, bob)
    push_tag(signer, tmp_path, "prod", bobs)
    out = Syncer(config).sync()
    assert (out.result, out.commit) == ("unchanged", one), out
    assert distrust(config) is None
    applied = source_status(config)["applied"]
    assert applied["tag"] == bobs and applied["signers"][0]["name"] == "bob", applied
    assert conditions(config)["Ready"] == ("True", "UpToDate")
    # An unsigned tag object on the same commit does not end a distrust.
    signer.revocation_list(revoked, alice, bob)
    assert Syncer(config).sync().result == "distrusted"
    raw = (f"object {one}\ntype commit\ntag prod\ntagger P <p@x> 1700000000 +0000\n\n"
           "x\n").encode()
    push_tag(signer, tmp_path, "prod", signer.git("hash-object", "-t", "tag", "-w",
                                                  "--stdin", stdin=raw))
    assert Syncer(config).sync().result == "distrusted"
