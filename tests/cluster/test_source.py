"""The daemon following a git repository on the real cluster: a signed commit
becomes a published volume, an unsigned one changes nothing, a commit
removing every file waits for allow-removal, and each volume's status names
the revision it converged from."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import NodeUnderTest
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
    """The fleet's repository (a bare one on disk, pushed to over file://),
    one signing key allowed, and the nodes that follow it."""

    def __init__(self, root: Path, signer: Signing, key: SshKey) -> None:
        self.signer, self.key = signer, key
        self.url = bare_repository(root / "fleet.git")
        self.allowed = signer.allowed_signers(root / "allowed_signers", ("ops", key))

    def follow(self, node: NodeUnderTest, interval: float) -> None:
        """``node`` reads what the source applies (no desiredDir of its own)."""
        lines = [ln for ln in node.config.read_text().splitlines()
                 if not ln.startswith("desiredDir:")]
        node.config.write_text("\n".join(lines) + "\n"
                               + source_yaml(self.url, self.allowed, interval))
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
