"""The daemon following a git repository on the real cluster: a signed commit
becomes a published volume, an unsigned one changes nothing, a commit
removing every file waits for allow-removal, and each volume's status names
the revision it converged from. Over ssh (a real sshd, tests/gitserver.py),
the server going away for a while changes nothing that is published, is
reported (FetchFailed, Stalled, one warning line), and what was pushed
meanwhile is applied once it is back, by itself."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import NodeUnderTest
from gitserver import GitServer
from source_signing import Signing, SshKey, bare_repository, source_yaml
from test_daemon import Daemon, wait_for

pytestmark = pytest.mark.ceph
NODE = "nodes/test-node"  # the node fixture's directory in the repository


def volume(node: NodeUnderTest, name: str, size: str) -> str:
    node.images.add(name)  # the fixture's teardown deletes it
    return f"""\
apiVersion: rbd-reconciler/v1
kind: Volume
metadata:
  name: {name}
spec:
  state: present
  image: {{pool: {node.cluster.pool}, size: {size}}}
  map: {{mapper: fuse}}
  stage: {{fsType: ext4}}
  publish:
    - path: {node.srv}/{name}
"""


class Repo:
    """The fleet's repository, one signing key allowed, and the nodes that
    follow it: a bare one on disk (file://), or ``server``'s over ssh (the
    deploy key, the pinned host key). Pushes go straight into the bare
    repository over file://, so they work while sshd is down."""

    def __init__(self, root: Path, signer: Signing, key: SshKey,
                 server: GitServer | None = None) -> None:
        self.signer, self.key, self.server = signer, key, server
        self.url = bare_repository(root / "fleet.git") if server is None else \
            f"file://{server.repo}"
        self.allowed = signer.allowed_signers(root / "allowed_signers", ("ops", key))

    def follow(self, node: NodeUnderTest, interval: float) -> None:
        """``node`` reads what the source applies (no desiredDir of its own)."""
        lines = [ln for ln in node.config.read_text().splitlines()
                 if not ln.startswith("desiredDir:")]
        if self.server is None:
            src = source_yaml(self.url, self.allowed, interval)
        else:
            src = source_yaml(self.server.url, self.allowed, interval) + (
                f"  timeoutSeconds: 10\n  credentials: {{sshKeyFile: {self.server.deploy_key}, "
                f"knownHostsFile: {self.server.known_hosts}}}\n")
        node.config.write_text("\n".join(lines) + "\n" + src)
        node.desired = node.state / "source" / "current"

    def push(self, message: str, files: dict[str, str | None], signed: bool = True) -> str:
        """``files``: paths in the repository (None removes one)."""
        return self.signer.push(self.url, message, files, self.key if signed else None)


@pytest.fixture
def repo(node: NodeUnderTest, tmp_path: Path) -> Iterator[Repo]:
    with Signing(tmp_path / "signer") as s:
        r = Repo(node.root, s, s.ssh_key("ops"))
        r.follow(node, interval=3600)  # only `source sync` moves it
        yield r
        if node.desired.exists() and any(node.desired.iterdir()):
            node.cli("release")


def test_signed_applied_unsigned_refused(node: NodeUnderTest, repo: Repo) -> None:
    name = node.name("git")
    d = Daemon(node)
    try:
        # No revision yet: the daemon runs, and waits.
        wait_for(lambda: "no revision applied yet" in d.log.read_text(),
                 "the daemon to wait for the first revision")
        sha = repo.push("a volume", {f"{NODE}/{name}.yaml": volume(node, name, "64Mi")})
        rc, out = node.cli("source", "sync")
        assert rc == 0, out
        t0 = time.monotonic()
        s = d.wait_phase(name, "Published")
        took = time.monotonic() - t0
        assert s["sourceRevision"] == f"main@sha1:{sha}", s
        (node.srv / name / "data").write_text("kept")
        print(f"source sync -> Published: {took:.2f} s")

        # Unsigned: refused, the volume untouched, status says why.
        bad = repo.push("grow, unsigned", {f"{NODE}/{name}.yaml": volume(node, name, "96Mi")},
                        signed=False)
        rc, out = node.cli("source", "sync")
        assert rc == 1 and "Unsigned" in out, out
        rc, doc = node.cli_json("status")
        src = doc["source"]
        assert src["applied"]["commit"] == sha and src["observed"] == f"main@sha1:{bad}"
        conds = {c["type"]: c for c in src["conditions"]}
        assert (conds["Ready"]["status"], conds["Ready"]["reason"]) == ("False", "Unsigned")
        assert conds["SourceVerified"]["status"] == "False"
        [vol] = [v for v in doc["volumes"] if v["name"] == name]
        assert vol["size"] == 64 << 20

        # Signed on top: applied, the volume grows, the data stays.
        good = repo.push("grow, signed", {f"{NODE}/{name}.yaml": volume(node, name, "96Mi")})
        rc, out = node.cli("source", "sync")
        assert rc == 0, out
        wait_for(lambda: d.status(name).get("sourceRevision") == f"main@sha1:{good}"
                 and d.status(name).get("phase") == "Published",
                 "the volume to converge from the signed revision")
        wait_for(lambda: node.cli_json("status")[1]["volumes"][0]["size"] == 96 << 20,
                 "the image to grow to 96Mi")
        assert (node.srv / name / "data").read_text() == "kept"

        # Every file removed: the mass-removal rule holds it until allow-removal.
        repo.push("remove all", {f"{NODE}/{name}.yaml": None})
        rc, out = node.cli("source", "sync")
        assert rc == 0, out
        wait_for(lambda: "vanished in one pass; doing nothing to them" in d.log.read_text(),
                 "the daemon to refuse the mass removal")
        assert d.status(name)["phase"] == "Published"
        assert (node.srv / name / "data").read_text() == "kept"
        rc, out = node.cli("allow-removal", name)
        assert rc == 0, out
        d.wait_phase(name, "Released")
    finally:
        assert d.stop() == 0, d.log.read_text()[-4000:]
    log = d.log.read_text()
    assert "Traceback" not in log, log[-4000:]


def test_the_daemon_follows_on_its_own(node: NodeUnderTest, tmp_path: Path) -> None:
    """No `source sync`: the daemon's own interval brings a signed commit in."""
    with Signing(tmp_path / "signer2") as s:
        repo = Repo(node.root, s, s.ssh_key("ops"))
        repo.follow(node, interval=1)
        name = node.name("follow")
        d = Daemon(node)
        try:
            sha = repo.push("a volume", {f"{NODE}/{name}.yaml": volume(node, name, "64Mi")})
            s1 = d.wait_phase(name, "Published")
            assert s1["sourceRevision"] == f"main@sha1:{sha}"
            text = (node.state / "status" / f"{name}.json").read_text()
            assert json.loads(text)["sourceRevision"].endswith(sha)
        finally:
            assert d.stop() == 0
            if node.desired.exists() and any(node.desired.iterdir()):
                node.cli("release")


def test_the_daemon_follows_over_ssh_through_the_server_going_away(
        node: NodeUnderTest, git_server: GitServer, tmp_path: Path) -> None:
    """intervalSeconds 1 over ssh: published from a signed commit; sshd
    stopped for several intervals: the daemon runs on, the volume stays
    Published, `source status` exits 1 (FetchFailed, then Stalled), the
    retries are one warning line; a signed commit pushed meanwhile is
    applied once sshd is back, with no `source sync`."""
    with Signing(tmp_path / "signer3") as s:
        repo = Repo(node.root, s, s.ssh_key("ops"), server=git_server)
        repo.follow(node, interval=1)
        name = node.name("ssh")
        d = Daemon(node)
        try:
            first = repo.push("a volume", {f"{NODE}/{name}.yaml": volume(node, name, "64Mi")})
            assert d.wait_phase(name, "Published")["sourceRevision"] == f"main@sha1:{first}"
            (node.srv / name / "data").write_text("kept")
            assert "Accepted publickey for git" in git_server.log.read_text()

            with git_server.down():
                wait_for(lambda: source_state(node)["consecutiveFailures"] >= 3,
                         "3 failed syncs in a row while sshd is down")
                wait_for(lambda: condition(node, "Stalled") == ("True", "FetchFailed"),
                         "Stalled after 3 intervals without a successful sync")
                rc, out = node.cli("source", "status")
                assert rc == 1, out
                assert "Connection refused" in out and "FetchFailed" in out, out
                assert condition(node, "Ready") == ("False", "FetchFailed")
                second = repo.push("touched while the server was down", {
                    f"{NODE}/{name}.yaml": volume(node, name, "64Mi") + "# while sshd was down\n"})
                failed = source_state(node)["consecutiveFailures"]
                wait_for(lambda: source_state(node)["consecutiveFailures"] >= failed + 2,
                         "2 more failed syncs after the push")
                assert d.proc.poll() is None, d.log.read_text()[-4000:]
                st = d.status(name)
                assert (st["phase"], st["sourceRevision"]) == ("Published", f"main@sha1:{first}")
                assert (node.srv / name / "data").read_text() == "kept"
                warned = [ln for ln in d.log.read_text().splitlines()
                          if "source: failed FetchFailed" in ln]
                assert len(warned) == 1, warned  # one line for every retry
                assert "WARNING" in warned[0] and "retrying with backoff" in warned[0]
                assert f"main@sha1:{first} stays applied" in warned[0]

            # sshd back on its port: nobody runs `source sync`.
            wait_for(lambda: d.status(name).get("sourceRevision") == f"main@sha1:{second}"
                     and d.status(name).get("phase") == "Published",
                     "the revision pushed while sshd was down to be applied")
            rc, out = node.cli("source", "status")
            assert rc == 0, out
            assert condition(node, "Stalled") == ("False", "Syncing")
            assert f"source: applied again (main@sha1:{second}) after" in d.log.read_text()
            assert (node.srv / name / "data").read_text() == "kept"
        finally:
            assert d.stop() == 0, d.log.read_text()[-4000:]
            if node.desired.exists() and any(node.desired.iterdir()):
                node.cli("release")
    assert "Traceback" not in d.log.read_text()


def source_state(node: NodeUnderTest) -> dict:
    """`source status -o json` (exit 1 while not Ready: the document stands)."""
    _, out = node.cli("source", "status", "-o", "json")
    return json.loads(out)


def condition(node: NodeUnderTest, kind: str) -> tuple[str, str]:
    c = next(c for c in source_state(node)["conditions"] if c["type"] == kind)
    return c["status"], c["reason"]


def test_a_revoked_key_holds_every_volume_until_trusted_again(
        node: NodeUnderTest, repo: Repo, capsys: pytest.CaptureFixture[str]) -> None:
    """Root revokes the key that signed the applied revision: `source sync`
    says Revoked, and the daemon holds (a pass refuses: nothing is taken
    down, nothing is changed) until the policy verifies it again."""
    revoked = node.root / "revoked_keys"
    revoked.write_text("")
    before = node.config.read_text()
    node.config.write_text(before.replace(
        f"allowedSignersFile: {repo.allowed}}}",
        f"allowedSignersFile: {repo.allowed}, revocationFile: {revoked}}}"))
    assert node.config.read_text() != before
    name = node.name("revoke")
    d = Daemon(node)
    try:
        repo.push("a volume", {f"{NODE}/{name}.yaml": volume(node, name, "64Mi")})
        rc, out = node.cli("source", "sync")
        assert rc == 0, out
        d.wait_phase(name, "Published")
        repo.signer.revocation_list(revoked, repo.key)
        rc, out = node.cli("source", "sync")
        assert rc == 1 and out.startswith("distrusted:") and "Revoked" in out, out
        assert condition(node, "SourceVerified") == ("False", "Revoked")
        capsys.readouterr()
        rc, _ = node.cli("apply")  # through the daemon: its pass refuses, and says why
        said = capsys.readouterr().err
        assert rc != 0 and "the applied revision of the git source is held" in said, said
        assert d.status(name)["phase"] == "Published"
        assert (node.srv / name).is_mount()
        revoked.write_text("")  # root takes the revocation back
        rc, out = node.cli("source", "sync")
        assert rc == 0 and out.startswith("unchanged:"), out
        rc, out = node.cli("apply")
        assert rc == 0, out
        wait_for(lambda: "no longer: not reconciling: the applied revision" in d.log.read_text(),
                 "the daemon to say it reconciles again")
    finally:
        assert d.stop() == 0, d.log.read_text()[-4000:]
    assert "Traceback" not in d.log.read_text()
