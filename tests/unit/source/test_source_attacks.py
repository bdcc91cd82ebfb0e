"""The GitOps source as an attacker who can push (or runs the server) sees
it (issue 36): each test is one way to get past the trust model of
docs/gitops-source.md, tried with real git and real ssh signatures over
file://, and what must happen instead. docs/threat-model.md names each."""

from __future__ import annotations

import ast
import os
import re
from dataclasses import replace
from pathlib import Path

import yaml
from source_signing import VOLUME_YAML, Signing, SshKey
from test_sync import applied_files, conditions, make_config, push

from reconciler.source import reasons
from reconciler.source.layout import Layout
from reconciler.source.report import source_status
from reconciler.source.sync import Syncer
from reconciler.spec.config import Config
from reconciler.spec.source import SourceRef, SourceVerify

REPO = Path(__file__).resolve().parents[3]
VOLUME = VOLUME_YAML


def tag_config(tmp_path: Path, signer: Signing, alice: SshKey, tag: str, mode: str) -> Config:
    config = make_config(tmp_path, signer, alice, ref=SourceRef("tag", tag))
    assert config.git is not None
    return replace(config, git=replace(config.git, verify=replace(config.git.verify, mode=mode)))


def push_tag(signer: Signing, tmp_path: Path, ref: str, target: str) -> None:
    signer.git("update-ref", f"refs/tags/{ref}", target)
    signer.git("push", "--quiet", "--force", f"file://{tmp_path / 'fleet.git'}",
               f"refs/tags/{ref}")


# -- item 2: the tag that was signed is the tag that is followed ---------------------

def test_a_ref_pointed_at_another_signed_tag_is_refused(tmp_path: Path, signer: Signing,
                                                        alice: SshKey) -> None:
    """``ref: {tag: prod}``: the pusher points refs/tags/prod at the signed
    tag object ``canary`` (a newer commit that descends). The tag object's
    own signed ``tag`` header says canary: refused, prod stays applied."""
    for mode in ("tag", "tagAndHead"):
        root = tmp_path / mode
        root.mkdir()
        config = tag_config(root, signer, alice, "prod", mode)
        one = push(signer, root, alice, "one", {"nodes/a/v.yaml": VOLUME.format(
            name="v", size="1Gi")})
        push_tag(signer, root, "prod", signer.tag(f"prod-{mode}", one, alice))
        # A tag object named prod-<mode> behind refs/tags/prod is refused too:
        out = Syncer(config).sync()
        assert (out.result, out.reason) == ("refused", "TagNameMismatch"), out
        signer.git("tag", "-d", f"prod-{mode}")
        push_tag(signer, root, "prod", _tag_object(signer, "prod", one, alice))
        out = Syncer(config).sync()
        assert (out.result, out.commit) == ("applied", one), out
        two = push(signer, root, alice, "two", {"nodes/a/v.yaml": VOLUME.format(
            name="v", size="2Gi")})
        canary = _tag_object(signer, "canary", two, alice)
        push_tag(signer, root, "prod", canary)
        out = Syncer(config).sync()
        assert (out.result, out.reason) == ("refused", "TagNameMismatch"), out
        assert "canary" in out.message and "prod" in out.message
        assert "1Gi" in applied_files(config)["v.yaml"]
        assert conditions(config)["SourceVerified"] == ("False", "TagNameMismatch")
        # `source verify` says the same of the mirror's object.
        assert Syncer(config).verify_only(canary).reason == "TagNameMismatch"


def _tag_object(signer: Signing, name: str, target: str, key: SshKey) -> str:
    """A signed annotated tag object named ``name`` on ``target``, its local ref removed."""
    signer.git("update-ref", "-d", f"refs/tags/{name}")  # push_tag's, if any
    sha = signer.tag(name, target, key)
    signer.git("tag", "-d", name)
    signer.git("update-ref", f"refs/keep/{sha}", sha)  # keeps the object reachable
    return sha


# -- item 5: one verdict per refusal reason, and the alert covers each ---------------

def _raised_reasons() -> set[str]:
    """Every reason word the source code can put in a refusal or failure:
    the first string argument of Refused/TreeRefused, the second of Failed."""
    found: set[str] = set()
    for path in sorted((REPO / "reconciler" / "source").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "id", getattr(node.func, "attr", ""))
            at = {"Refused": 0, "TreeRefused": 0, "Failed": 1}.get(name)
            if at is None or len(node.args) <= at:
                continue
            arg = node.args[at]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.add(arg.value)
            elif isinstance(arg, ast.BinOp):  # "NotA" + kind.capitalize()
                found |= {"NotACommit", "NotATag"}
            elif isinstance(arg, ast.Name):  # a loop over (gpg's word, reason, why) rows
                found |= _table_reasons(path)
            else:
                raise AssertionError(f"{path.name}:{node.lineno}: a reason that is not a "
                                     "literal cannot be checked against reasons.VERDICTS")
    return found


def _table_reasons(path: Path) -> set[str]:
    """The CamelCase words of the module's tables of string tuples."""
    return {e.value for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Tuple) for e in node.elts
            if isinstance(e, ast.Constant) and isinstance(e.value, str)
            and re.fullmatch(r"[A-Z][a-z]+[A-Za-z]*", e.value)}


def test_every_reason_has_one_verdict_and_the_alert_selects_each_refusal() -> None:
    raised = _raised_reasons()
    assert {"Unsigned", "NoTag", "MultipleSignatures", "LoadFailed"} <= raised  # the walk works
    missing = raised - set(reasons.VERDICTS)
    assert not missing, f"reasons with no verdict in source/reasons.py: {sorted(missing)}"
    rules = yaml.safe_load((REPO / "examples/monitoring/alerts.yaml").read_text())
    [rule] = [r for g in rules["groups"] for r in g["rules"]
              if r.get("alert") == "RbdSourceRefused"]
    selected = set(re.search(r'reason=~"([^"]*)"', rule["expr"])[1].split("|"))
    alerting = {r for r, v in reasons.VERDICTS.items() if v.alert}
    assert selected == alerting, (sorted(alerting - selected), sorted(selected - alerting))
    for reason, verdict in reasons.VERDICTS.items():
        assert verdict.kind in ("signature", "revision", "unverified", "failure", "command"), reason
        if verdict.kind == "signature":
            assert verdict.alert, f"{reason}: a signature refusal must alert"


def test_a_lightweight_tag_is_not_reported_as_verified(tmp_path: Path, signer: Signing,
                                                       alice: SshKey) -> None:
    config = tag_config(tmp_path, signer, alice, "v1", "tag")
    head = push(signer, tmp_path, alice, "one", {"nodes/a/v.yaml": VOLUME.format(
        name="v", size="1Gi")})
    push_tag(signer, tmp_path, "v1", head)  # a lightweight tag: a ref to the commit
    out = Syncer(config).sync()
    assert (out.result, out.reason) == ("refused", "NoTag"), out
    assert conditions(config)["SourceVerified"] == ("False", "NoTag")
    assert conditions(config)["Ready"][0] == "False"


# -- item 6: descent is checked against the newest revision ever applied -------------

def test_a_rollback_does_not_forget_the_newest_revision(tmp_path: Path, signer: Signing,
                                                        alice: SshKey) -> None:
    config = make_config(tmp_path, signer, alice)
    a = push(signer, tmp_path, alice, "A", {"nodes/a/v.yaml": VOLUME.format(
        name="v", size="1Gi")})
    assert Syncer(config).sync().result == "applied"
    b = push(signer, tmp_path, alice, "B", {"nodes/a/v.yaml": VOLUME.format(
        name="v", size="2Gi")})
    assert Syncer(config).sync().result == "applied"
    # O: a signed side commit on A, force-pushed.
    signer.git("checkout", "--quiet", "-B", "side", a)
    (signer.work / "nodes/a/v.yaml").write_text(VOLUME.format(name="v", size="3Gi"))
    signer.git("add", "-A")
    o = signer.commit("O", alice)
    signer.git("push", "--quiet", "--force", f"file://{tmp_path / 'fleet.git'}", "side:main")
    out = Syncer(config).sync()
    assert (out.result, out.reason, out.commit) == ("refused", "NotDescendant", o), out
    assert Syncer(config).rollback() == a
    Syncer(config).resume()
    out = Syncer(config).sync()
    assert (out.result, out.reason) == ("refused", "NotDescendant"), out
    assert b[:12] in out.message, out.message  # named against the newest, B
    assert "1Gi" in applied_files(config)["v.yaml"]  # A, where the rollback put it
    assert source_status(config)["newest"] == f"main@sha1:{b}"
    # The operator says otherwise: allowNonDescendant applies O, which is then the newest.
    assert config.git is not None
    allow = replace(config, git=replace(config.git, allow_non_descendant=True))
    assert Syncer(allow).sync().result == "applied"
    assert source_status(config)["newest"] == f"main@sha1:{o}"


# -- item 7: trust follows the revocation file ---------------------------------------

def revocable(tmp_path: Path, signer: Signing, alice: SshKey) -> tuple[Config, Path, SshKey]:
    """alice and bob allowed, an empty revocation file: the config, that
    file, and bob's key."""
    revoked = signer.revocation_list(tmp_path / "revoked_keys")
    config = make_config(tmp_path, signer, alice)
    assert config.git is not None
    config = replace(config, git=replace(config.git, verify=replace(
        config.git.verify, revocation=revoked)))
    bob = signer.ssh_key("bob")
    signer.allowed_signers(tmp_path / "allowed_signers", ("alice", alice), ("bob", bob))
    return config, revoked, bob


def test_a_revoked_key_no_longer_verifies_what_is_applied(tmp_path: Path, signer: Signing,
                                                          alice: SshKey) -> None:
    config, revoked, bob = revocable(tmp_path, signer, alice)
    one = push(signer, tmp_path, alice, "one", {"nodes/a/v.yaml": VOLUME.format(
        name="v", size="1Gi")})
    assert Syncer(config).sync().result == "applied"
    assert conditions(config)["SourceVerified"] == ("True", "Verified")
    signer.revocation_list(revoked, alice)
    out = Syncer(config).sync()  # the remote did not move: the policy did
    assert (out.result, out.reason) == ("distrusted", "Revoked"), out
    cond = conditions(config)
    assert cond["SourceVerified"] == ("False", "Revoked"), cond
    assert cond["Ready"] == ("False", "Revoked"), cond
    assert source_status(config)["distrusted"]["commit"] == one
    # Held: nothing is switched, the files stay as they are (frozen by the daemon).
    assert "1Gi" in applied_files(config)["v.yaml"]
    assert Layout(config.source_dir).target("current", ).startswith(one)  # type: ignore[union-attr]
    # Still revoked on the next sync (no re-verification skipped as "unchanged").
    assert Syncer(config).sync().result == "distrusted"
    # A new revision that verifies (bob's, on top) is applied and trust is back.
    two = push(signer, tmp_path, bob, "two", {"nodes/a/v.yaml": VOLUME.format(
        name="v", size="2Gi")})
    out = Syncer(config).sync()
    assert (out.result, out.commit) == ("applied", two), out
    assert conditions(config)["SourceVerified"] == ("True", "Verified")
    assert source_status(config)["distrusted"] is None
    # Removing bob from the allowed signers is a policy change too.
    signer.allowed_signers(tmp_path / "allowed_signers", ("alice", alice))
    out = Syncer(config).sync()
    assert (out.result, out.reason) == ("distrusted", "UnknownSigner"), out
    # Put back: trusted again without any new revision.
    signer.allowed_signers(tmp_path / "allowed_signers", ("alice", alice), ("bob", bob))
    out = Syncer(config).sync()
    assert (out.result, out.commit) == ("unchanged", two), out
    assert conditions(config)["SourceVerified"] == ("True", "Verified")


def test_a_key_revoked_in_the_keyring_distrusts_what_it_signed(
        tmp_path: Path, signer: Signing, alice: SshKey) -> None:
    """OpenPGP: the keyring root exports again, now carrying the key's
    revocation; the applied revision is verified again and held."""
    ops = signer.gpg_key("Ops <ops@example.invalid>")
    keyring = signer.keyring(tmp_path / "keys.gpg", ops)
    config = make_config(tmp_path, signer, alice, verify=SourceVerify(
        mode="head", format="openpgp", keyring=keyring, fingerprints=(ops.fingerprint,)))
    push(signer, tmp_path, ops, "ops", {"nodes/a/v.yaml": VOLUME.format(name="v", size="1Gi")})
    assert Syncer(config).sync().result == "applied"
    signer.revoke(ops)
    signer.keyring(keyring, ops)  # the export now carries the revocation
    out = Syncer(config).sync()
    assert (out.result, out.reason) == ("distrusted", "Revoked"), out
    assert conditions(config)["SourceVerified"] == ("False", "Revoked")
    # A rollback to a revision that does not verify either stays held.
    assert "1Gi" in applied_files(config)["v.yaml"]


def test_a_rollback_is_verified_under_the_policy_of_now(tmp_path: Path, signer: Signing,
                                                        alice: SshKey) -> None:
    config, revoked, bob = revocable(tmp_path, signer, alice)
    push(signer, tmp_path, alice, "one", {"nodes/a/v.yaml": VOLUME.format(name="v", size="1Gi")})
    assert Syncer(config).sync().result == "applied"
    push(signer, tmp_path, bob, "two", {"nodes/a/v.yaml": VOLUME.format(name="v", size="2Gi")})
    assert Syncer(config).sync().result == "applied"
    signer.revocation_list(revoked, alice)
    assert Syncer(config).sync().result == "unchanged"  # bob's revision still verifies
    Syncer(config).rollback()  # to alice's, revoked since
    status = source_status(config)
    assert status["distrusted"] is not None and status["distrusted"]["reason"] == "Revoked"


# -- item 8: file names that are not UTF-8 --------------------------------------------

def test_two_names_that_decode_alike_refuse_the_revision(tmp_path: Path, signer: Signing,
                                                         alice: SshKey) -> None:
    config = make_config(tmp_path, signer, alice)
    push(signer, tmp_path, alice, "good", {"nodes/a/v.yaml": VOLUME.format(
        name="v", size="1Gi")})
    assert Syncer(config).sync().result == "applied"
    d = os.fsencode(signer.work / "nodes/a")
    for raw in (b"x\xff.yaml", b"x\xfe.yaml"):
        with open(os.path.join(d, raw), "w") as f:
            f.write(VOLUME.format(name="w" + str(raw[1]), size="1Gi"))
    signer.git("add", "-A")
    signer.commit("names", alice)
    signer.git("push", "--quiet", f"file://{tmp_path / 'fleet.git'}", "main")
    for _ in range(2):  # the same verdict each time, not a retry with backoff
        out = Syncer(config).sync()
        assert (out.result, out.reason) == ("refused", "BadFileName"), out
        assert r"x\xff.yaml" in out.message and r"x\xfe.yaml" in out.message, out.message
    assert applied_files(config) == {"v.yaml": VOLUME.format(name="v", size="1Gi")}
