"""A sync of the GitOps source with real git and ssh-keygen over file://:
what is applied and what status says, for each kind of revision a remote
can offer (signed, unsigned, unknown signer, a force-push back in time, a
file that fails to load, every file removed, a symlink, a very large file,
the server gone), and a SIGKILL at every step of a sync."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from source_signing import VOLUME_YAML, Signing, SshKey, node_config_file

from reconciler.source.layout import Layout
from reconciler.source.report import source_status
from reconciler.source.sync import Syncer
from reconciler.spec.config import Config, default_config
from reconciler.spec.source import SourceConfig, SourceRef, SourceVerify

VOLUME = VOLUME_YAML


def make_config(tmp_path: Path, signer: Signing, alice: SshKey, **src: object) -> Config:
    bare = tmp_path / "fleet.git"
    if not bare.exists():
        subprocess.run(["git", "init", "--quiet", "--bare", str(bare)], check=True)
    allowed = signer.allowed_signers(tmp_path / "allowed_signers", ("alice", alice))
    source = SourceConfig(url=f"file://{bare}", ref=SourceRef("branch", "main"),
                          path="nodes/{nodeName}",
                          verify=SourceVerify(mode="head", format="ssh",
                                              allowed_signers=allowed),
                          timeout_seconds=30)
    source = replace(source, **src)  # type: ignore[arg-type]
    state = tmp_path / "state"
    state.mkdir(mode=0o755, exist_ok=True)
    return replace(default_config(), state_dir=state, node_name="a", git=source,
                   desired_dir=state / "source" / "current", allowed_roots=("/srv",))


def push(signer: Signing, tmp_path: Path, key: SshKey | None, message: str,
         files: dict[str, str | None] | None = None, force: bool = False) -> str:
    for rel, text in (files or {}).items():
        f = signer.work / rel
        if text is None:
            f.unlink()
        else:
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(text)
    signer.git("add", "-A")
    sha = signer.commit(message, key)
    signer.git("push", "--quiet", *(["--force"] if force else []),
               f"file://{tmp_path / 'fleet.git'}", "main")
    return sha


def applied_files(config: Config) -> dict[str, str]:
    cur = config.desired_dir
    return {p.name: p.read_text() for p in sorted(cur.iterdir())} if cur.exists() else {}


def conditions(config: Config) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in source_status(config)["conditions"]}


def test_a_signed_commit_is_applied_and_reported(tmp_path: Path, signer: Signing,
                                                 alice: SshKey) -> None:
    config = make_config(tmp_path, signer, alice)
    sha = push(signer, tmp_path, alice, "one", {"nodes/a/v.yaml": VOLUME.format(
        name="v", size="1Gi"), "nodes/b/w.yaml": VOLUME.format(name="w", size="1Gi")})
    out = Syncer(config).sync()
    assert (out.result, out.commit) == ("applied", sha), out
    assert applied_files(config) == {"v.yaml": VOLUME.format(name="v", size="1Gi")}
    st = os.stat(config.desired_dir / "v.yaml")
    assert (st.st_mode & 0o777, st.st_uid) == (0o644, os.geteuid())
    assert os.readlink(config.desired_dir).startswith("revs/" + sha)
    status = source_status(config)
    assert status["applied"]["revision"] == f"main@sha1:{sha}"
    [who] = status["applied"]["signers"]
    assert (who["name"], who["format"], who["fingerprint"]) == ("alice", "ssh",
                                                                alice.fingerprint)
    assert conditions(config) == {"Ready": ("True", "UpToDate"),
                                  "SourceVerified": ("True", "Verified"),
                                  "Stalled": ("False", "Syncing")}
    # Nothing new: one ls-remote, no fetch, nothing switched.
    syncer = Syncer(config)
    out = syncer.sync()
    assert out.result == "unchanged"
    assert not [a for a in syncer.git.runner.history if "fetch" in a], syncer.git.runner.history


@pytest.mark.parametrize("case", ["unsigned", "unknown-signer", "load-fails", "symlink",
                                  "too-large", "submodule"])
def test_a_refused_revision_leaves_the_last_good_one(tmp_path: Path, signer: Signing,
                                                     alice: SshKey, case: str) -> None:
    config = make_config(tmp_path, signer, alice)
    good = push(signer, tmp_path, alice, "good", {"nodes/a/v.yaml": VOLUME.format(
        name="v", size="1Gi")})
    assert Syncer(config).sync().result == "applied"
    before = applied_files(config)
    key: SshKey | None = alice
    files: dict[str, str | None] = {"nodes/a/v.yaml": VOLUME.format(name="v", size="2Gi")}
    if case == "unsigned":
        key = None
    elif case == "unknown-signer":
        key = signer.ssh_key("mallory")
    elif case == "load-fails":
        files["nodes/a/bad.yaml"] = VOLUME.format(name="bad", size="2 gigs")
    elif case == "too-large":
        files["nodes/a/big.yaml"] = "#" * (2 << 20)
    elif case == "symlink":
        os.symlink("/etc/shadow", signer.work / "nodes/a/x.yaml")
    elif case == "submodule":
        sub = signer.work / "nodes/a/sub"  # a nested repository: `add -A` makes a gitlink
        signer.run(["git", "init", "--quiet", str(sub)])
        signer.run(["git", "-C", str(sub), "-c", "user.name=S", "-c", "user.email=s@x.invalid",
                    "commit", "--quiet", "--allow-empty", "-m", "sub"])
    sha = push(signer, tmp_path, key, case, files)
    out = Syncer(config).sync()
    reason = {"unsigned": "Unsigned", "unknown-signer": "UnknownSigner",
              "load-fails": "LoadFailed", "symlink": "SymlinkInTree",
              "too-large": "FileTooLarge", "submodule": "SpecialFileInTree"}[case]
    assert (out.result, out.reason, out.commit) == ("refused", reason, sha), out
    assert applied_files(config) == before
    status = source_status(config)
    assert status["applied"]["commit"] == good and status["observed"] == f"main@sha1:{sha}"
    cond = conditions(config)
    assert cond["Ready"] == ("False", reason)
    verified = "False" if case in ("unsigned", "unknown-signer") else "True"
    assert cond["SourceVerified"][0] == verified
    if case == "load-fails":  # named as in the repository, with its line
        assert "nodes/a/bad.yaml:7" in out.message, out.message
    if case == "symlink":
        assert "nodes/a/x.yaml" in out.message


def test_a_force_push_back_in_time_is_refused_unless_allowed(
        tmp_path: Path, signer: Signing, alice: SshKey) -> None:
    config = make_config(tmp_path, signer, alice)
    old = push(signer, tmp_path, alice, "old", {"nodes/a/v.yaml": VOLUME.format(
        name="v", size="1Gi")})
    new = push(signer, tmp_path, alice, "new", {"nodes/a/v.yaml": VOLUME.format(
        name="v", size="2Gi")})
    assert Syncer(config).sync().commit == new
    signer.git("reset", "--quiet", "--hard", old)
    signer.git("push", "--quiet", "--force", f"file://{tmp_path / 'fleet.git'}", "main")
    out = Syncer(config).sync()
    assert (out.result, out.reason) == ("refused", "NotDescendant"), out
    assert "2Gi" in applied_files(config)["v.yaml"]
    allowed = replace(config, git=replace(config.git, allow_non_descendant=True))
    assert Syncer(allowed).sync().result == "applied"
    assert "1Gi" in applied_files(config)["v.yaml"]


def test_a_shallow_mirror_still_sees_descent(tmp_path: Path, signer: Signing,
                                             alice: SshKey) -> None:
    config = make_config(tmp_path, signer, alice)  # depth 1
    for i in range(3):
        push(signer, tmp_path, alice, f"c{i}", {"nodes/a/v.yaml": VOLUME.format(
            name="v", size=f"{i + 1}Gi")})
    assert Syncer(config).sync().result == "applied"
    for i in range(3, 5):
        last = push(signer, tmp_path, alice, f"c{i}", {"nodes/a/v.yaml": VOLUME.format(
            name="v", size=f"{i + 1}Gi")})
    out = Syncer(config).sync()
    assert (out.result, out.commit) == ("applied", last), out


def test_removing_every_file_applies_an_empty_directory(tmp_path: Path, signer: Signing,
                                                        alice: SshKey) -> None:
    config = make_config(tmp_path, signer, alice)
    push(signer, tmp_path, alice, "one", {"nodes/a/v.yaml": VOLUME.format(name="v",
                                                                         size="1Gi")})
    Syncer(config).sync()
    push(signer, tmp_path, alice, "none", {"nodes/a/v.yaml": None})
    out = Syncer(config).sync()
    assert out.result == "applied"
    # An empty directory: the daemon's mass-removal rule decides (allow-removal).
    assert config.desired_dir.is_dir() and applied_files(config) == {}


def test_the_server_gone_keeps_the_last_good_revision_and_stalls(
        tmp_path: Path, signer: Signing, alice: SshKey) -> None:
    config = make_config(tmp_path, signer, alice)
    push(signer, tmp_path, alice, "one", {"nodes/a/v.yaml": VOLUME.format(name="v",
                                                                         size="1Gi")})
    Syncer(config).sync()
    (tmp_path / "fleet.git").rename(tmp_path / "gone.git")
    for _ in range(3):
        out = Syncer(config).sync()
        assert (out.result, out.reason) == ("failed", "FetchFailed"), out
    assert applied_files(config)
    cond = conditions(config)
    assert cond["Ready"][0] == "False" and cond["Stalled"] == ("False", "Syncing")
    # No success for 3 intervals: Stalled (the last success is backdated).
    layout = Layout(config.source_dir)
    state = layout.read_state()
    state["lastSuccessAt"] = "2020-01-01T00:00:00+00:00"
    layout.write_state(state)
    assert conditions(config)["Stalled"] == ("True", "FetchFailed")
    (tmp_path / "gone.git").rename(tmp_path / "fleet.git")
    assert Syncer(config).sync().result == "unchanged"
    assert conditions(config)["Ready"] == ("True", "UpToDate")


def test_a_file_repository_root_does_not_own_is_refused_clearly(
        tmp_path: Path, signer: Signing, alice: SshKey) -> None:
    """git (as root) will not read a local repository another user owns:
    its config could make root run that user's commands. Nothing is
    applied, the status says what to do, and never to trust every
    repository (git's own advice, safe.directory)."""
    config = make_config(tmp_path, signer, alice)
    bare = tmp_path / "fleet.git"
    sha = push(signer, tmp_path, alice, "one", {"nodes/a/v.yaml": VOLUME.format(
        name="v", size="1Gi")})
    nobody = 65534
    chown_tree(bare, nobody)
    out = Syncer(config).sync()
    assert (out.result, out.reason) == ("failed", "FetchFailed"), out
    assert out.message == (f"{config.git.url}: git refuses {bare}: the repository is not owned "
                           "by root (git: \"detected dubious ownership\"); a file:// repository "
                           "must be root's (chown -R root), or serve it over ssh"), out.message
    assert "safe.directory" not in out.message
    assert applied_files(config) == {} and Layout(config.source_dir).applied() is None
    status = source_status(config)
    assert status["applied"] is None and status["observed"] is None
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "FetchFailed")
    assert "not owned by root" in ready["message"]
    # root's again: applied.
    chown_tree(bare, 0)
    out = Syncer(config).sync()
    assert (out.result, out.commit) == ("applied", sha), out


def chown_tree(root: Path, uid: int) -> None:
    for path in [root, *root.rglob("*")]:
        os.lchown(path, uid, uid)


def test_a_signed_tag_over_an_unsigned_head(tmp_path: Path, signer: Signing,
                                            alice: SshKey) -> None:
    config = make_config(tmp_path, signer, alice, ref=SourceRef("tag", "v1"))
    config = replace(config, git=replace(config.git, verify=replace(config.git.verify,
                                                                    mode="tag")))
    head = push(signer, tmp_path, None, "unsigned", {"nodes/a/v.yaml": VOLUME.format(
        name="v", size="1Gi")})
    signer.tag("v1", head, alice)
    signer.git("push", "--quiet", f"file://{tmp_path / 'fleet.git'}", "refs/tags/v1")
    out = Syncer(config).sync()
    assert (out.result, out.commit) == ("applied", head), out
    assert source_status(config)["applied"]["revision"] == f"v1@sha1:{head}"
    both = replace(config, git=replace(config.git, verify=replace(config.git.verify,
                                                                  mode="tagAndHead")))
    Layout(both.source_dir).current.unlink()  # as if nothing were applied
    out = Syncer(both).sync()
    assert (out.result, out.reason) == ("refused", "Unsigned"), out


def test_rollback_holds_until_resume(tmp_path: Path, signer: Signing, alice: SshKey) -> None:
    config = make_config(tmp_path, signer, alice)
    one = push(signer, tmp_path, alice, "one", {"nodes/a/v.yaml": VOLUME.format(
        name="v", size="1Gi")})
    Syncer(config).sync()
    two = push(signer, tmp_path, alice, "two", {"nodes/a/v.yaml": VOLUME.format(
        name="v", size="2Gi")})
    Syncer(config).sync()
    assert Syncer(config).rollback() == one
    assert "1Gi" in applied_files(config)["v.yaml"]
    out = Syncer(config).sync()
    assert (out.result, out.commit) == ("held", two)
    assert conditions(config)["Ready"] == ("False", "Held")
    assert "1Gi" in applied_files(config)["v.yaml"]
    Syncer(config).resume()
    assert Syncer(config).sync().result == "applied"
    assert "2Gi" in applied_files(config)["v.yaml"]


# A sync in a child process that SIGKILLs itself when it logs a step.
CHILD = """
import logging, os, signal, sys
from reconciler.source.sync import Syncer
from reconciler.spec.config import load_config
target, nth = sys.argv[2], int(sys.argv[3])
seen = []
class Kill(logging.Handler):
    def emit(self, record):
        msg = record.getMessage()
        if msg.startswith("source step: ") and msg[13:].startswith(target):
            seen.append(msg)
            if len(seen) == nth:
                os.kill(os.getpid(), signal.SIGKILL)
log = logging.getLogger("rbd-reconciler.source")
log.setLevel(logging.DEBUG)
log.addHandler(Kill())
from pathlib import Path
print(Syncer(load_config(Path(sys.argv[1]))).sync().result)
"""
STEPS = [("fetched", 1), ("verified", 1), ("wrote", 1), ("wrote", 2), ("written", 1),
         ("meta written", 1), ("exported", 1), ("previous switched", 1), ("switched", 1),
         ("ref updated", 1), ("pruned", 1), ("repacked", 1)]


def test_a_kill_at_every_step_leaves_the_old_or_the_new_revision(
        tmp_path: Path, signer: Signing, alice: SshKey) -> None:
    allowed = signer.allowed_signers(tmp_path / "allowed_signers", ("alice", alice))
    bare = tmp_path / "fleet.git"
    subprocess.run(["git", "init", "--quiet", "--bare", str(bare)], check=True)
    cfg = node_config_file(tmp_path, f"file://{bare}", allowed)
    from reconciler.spec.config import load_config

    config = load_config(cfg)
    revisions = {}
    for i, (step, nth) in enumerate(STEPS):
        files = {f"nodes/a/v{j}.yaml": VOLUME.format(name=f"v{j}", size=f"{i + 1}Gi")
                 for j in range(3)}
        old = applied_files(config)
        sha = push(signer, tmp_path, alice, f"rev {i}", files)
        revisions[sha] = {k.rpartition("/")[2]: v for k, v in files.items()}
        child = subprocess.run([sys.executable, "-c", CHILD, str(cfg), step, str(nth)],
                               capture_output=True, text=True, timeout=120)
        assert child.returncode == -signal.SIGKILL, (step, child.stdout, child.stderr)
        now = applied_files(config)
        assert now in (old, revisions[sha]), (step, now)  # never a mix
        st = source_status(config)  # status reads whatever the kill left
        assert st["applied"] is None or st["applied"]["commit"] in (*revisions, None)
        # The next sync converges: the new revision, complete.
        out = Syncer(config).sync()
        assert out.result in ("applied", "unchanged"), (step, out)
        assert applied_files(config) == revisions[sha], step
        assert not list((config.source_dir / "revs").glob(".tmp-*"))
        kept = {p.name for p in (config.source_dir / "revs").iterdir() if p.is_dir()}
        assert len(kept) <= 2, kept  # current and previous; older ones pruned


def test_openpgp_applied_only_for_an_allowed_fingerprint(tmp_path: Path, signer: Signing,
                                                         alice: SshKey) -> None:
    ops, other = signer.gpg_key("Ops <ops@example.invalid>"), signer.gpg_key(
        "Other <other@example.invalid>")
    keyring = signer.keyring(tmp_path / "keys.gpg", ops, other)  # both in the keyring
    config = make_config(tmp_path, signer, alice, verify=SourceVerify(
        mode="head", format="openpgp", keyring=keyring, fingerprints=(ops.fingerprint,)))
    one = push(signer, tmp_path, ops, "ops", {"nodes/a/v.yaml": VOLUME.format(
        name="v", size="1Gi")})
    out = Syncer(config).sync()
    assert (out.result, out.commit) == ("applied", one), out
    assert out.signers[0]["fingerprint"] == ops.fingerprint
    # In the keyring, so git alone would accept it; not in the allow-list.
    push(signer, tmp_path, other, "other", {"nodes/a/v.yaml": VOLUME.format(
        name="v", size="2Gi")})
    out = Syncer(config).sync()
    assert (out.result, out.reason) == ("refused", "NotAllowed"), out
    # An ssh signature while OpenPGP is pinned: the wrong format.
    push(signer, tmp_path, alice, "ssh", {"nodes/a/v.yaml": VOLUME.format(
        name="v", size="3Gi")})
    out = Syncer(config).sync()
    assert (out.result, out.reason) == ("refused", "WrongFormat"), out
    assert "1Gi" in applied_files(config)["v.yaml"]


def test_a_revoked_key_is_refused_from_the_next_sync(tmp_path: Path, signer: Signing,
                                                     alice: SshKey) -> None:
    revoked = tmp_path / "revoked"
    revoked.write_text("")
    config = make_config(tmp_path, signer, alice)
    config = replace(config, git=replace(config.git, verify=replace(
        config.git.verify, revocation=revoked)))
    push(signer, tmp_path, alice, "one", {"nodes/a/v.yaml": VOLUME.format(name="v",
                                                                         size="1Gi")})
    assert Syncer(config).sync().result == "applied"
    signer.revocation_list(revoked, alice)
    push(signer, tmp_path, alice, "two", {"nodes/a/v.yaml": VOLUME.format(name="v",
                                                                         size="2Gi")})
    out = Syncer(config).sync()
    assert (out.result, out.reason) == ("refused", "Revoked"), out
    assert "1Gi" in applied_files(config)["v.yaml"]


def test_a_pinned_commit_is_fetched_by_its_id(tmp_path: Path, signer: Signing,
                                              alice: SshKey) -> None:
    config = make_config(tmp_path, signer, alice)
    one = push(signer, tmp_path, alice, "one", {"nodes/a/v.yaml": VOLUME.format(
        name="v", size="1Gi")})
    push(signer, tmp_path, alice, "two", {"nodes/a/v.yaml": VOLUME.format(
        name="v", size="2Gi")})
    pinned = replace(config, git=replace(config.git, ref=SourceRef("commit", one)))
    out = Syncer(pinned).sync()
    assert (out.result, out.commit) == ("applied", one), out
    assert "1Gi" in applied_files(pinned)["v.yaml"]
    assert source_status(pinned)["applied"]["revision"] == f"sha1:{one}"
    assert Syncer(pinned).sync().result == "unchanged"
