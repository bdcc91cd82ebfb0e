"""The node config's source: what is accepted, and what is refused at file:line."""

from __future__ import annotations

from pathlib import Path

import pytest

from reconciler.spec.config import ConfigError, load_config

GOOD = """\
nodeName: edge-1
stateDir: /var/lib/rbdr
source:
  url: ssh://git@git.example.com:2222/fleet.git
  ref: {branch: main}
  path: nodes/{nodeName}
  credentials:
    sshKeyFile: /etc/rbd-reconciler/git/deploy_key
    knownHostsFile: /etc/rbd-reconciler/git/known_hosts
  verify:
    mode: head
    format: ssh
    allowedSignersFile: /etc/rbd-reconciler/git/allowed_signers
    revocationFile: /etc/rbd-reconciler/git/revoked
"""


def load(tmp_path: Path, text: str):  # type: ignore[no-untyped-def]
    f = tmp_path / "config.yaml"
    f.write_text(text)
    return load_config(f)


def test_a_source_replaces_desired_dir(tmp_path: Path) -> None:
    c = load(tmp_path, GOOD)
    assert c.git is not None
    assert c.desired_dir == Path("/var/lib/rbdr/source/current")
    assert c.git.node_path("edge-1") == "nodes/edge-1"
    assert c.git.ref.remote == "refs/heads/main" and c.git.ref.label == "main"
    assert c.git.verify.revocation == Path("/etc/rbd-reconciler/git/revoked")
    assert (c.git.interval_seconds, c.git.depth, c.git.allow_non_descendant) == (60, 1, False)
    assert c.git.max_fetch_bytes == 256 << 20


def test_max_fetch_bytes_is_read(tmp_path: Path) -> None:
    c = load(tmp_path, GOOD.replace("  path:", "  maxFetchBytes: 1073741824\n  path:"))
    assert c.git is not None and c.git.max_fetch_bytes == 1 << 30


def test_openpgp_fingerprints_are_normalised(tmp_path: Path) -> None:
    c = load(tmp_path, """\
source:
  url: file:///srv/fleet.git
  ref: {tag: v1}
  verify:
    mode: tagAndHead
    format: openpgp
    keyringFile: /etc/rbd-reconciler/git/keys.gpg
    fingerprints: ["0123 4567 89ab cdef 0123  4567 89AB CDEF 0123 4567"]
""".replace("  4567", " 4567"))
    assert c.git is not None and c.git.ref.remote == "refs/tags/v1"
    assert c.git.verify.fingerprints == ("0123456789ABCDEF0123456789ABCDEF01234567",)


@pytest.mark.parametrize("change, field, word", [
    (("url: ssh://git@git.example.com:2222/fleet.git", "url: git@host:fleet.git"),
     "source.url", "ssh://"),
    (("url: ssh://git@git.example.com:2222/fleet.git", "url: https://u:tok@h/x.git"),
     "source.url", "tokenFile"),
    (("url: ssh://git@git.example.com:2222/fleet.git", "url: ext::sh -c evil"),
     "source.url", "ssh://"),
    (("    knownHostsFile: /etc/rbd-reconciler/git/known_hosts\n", ""),
     "source.credentials", "knownHostsFile"),
    (("path: nodes/{nodeName}", "path: ../nodes/{nodeName}"), "source.path", "relative"),
    (("path: nodes/{nodeName}", "path: nodes/{node}"), "source.path", "placeholder"),
    (("mode: head", "mode: tag"), "source.verify.mode", "ref.tag"),
    (("    allowedSignersFile: /etc/rbd-reconciler/git/allowed_signers\n", ""),
     "source.verify", "allowedSignersFile"),
    (("format: ssh", "format: x509"), "source.verify.format", ""),
    (("ref: {branch: main}", "ref: {branch: main, tag: v1}"), "source.ref", ""),
    (("ref: {branch: main}", "ref: {branch: -upload-pack=evil}"), "source.ref.branch", ""),
    (("  path:", "  maxFetchBytes: 65536\n  path:"), "source.maxFetchBytes", "1048576"),
    (("nodeName: edge-1", "desiredDir: /etc/x\nnodeName: edge-1"), "desiredDir", "source"),
    (("    knownHostsFile:", "    caFile: /etc/rbd-reconciler/git/ca.pem\n    knownHostsFile:"),
     "source.credentials.caFile", "https URLs only"),
    (("    knownHostsFile:", "    tokenFile: /etc/rbd-reconciler/git/token\n    knownHostsFile:"),
     "source.credentials.tokenFile", "https URLs only"),
    (("    knownHostsFile:", "    caFile: ca.pem\n    knownHostsFile:"),
     "source.credentials.caFile", ""),
])
def test_bad_source_is_refused_at_its_line(tmp_path: Path, change: tuple[str, str],
                                           field: str, word: str) -> None:
    old, new = change
    assert old in GOOD
    with pytest.raises(ConfigError) as err:
        load(tmp_path, GOOD.replace(old, new))
    said = str(err.value)
    assert f" {field}" in said or f"{field}:" in said, said
    assert word in said, said
    assert "config.yaml:" in said


def test_an_https_source_with_a_token_and_a_private_ca(tmp_path: Path) -> None:
    c = load(tmp_path, """\
source:
  url: https://git.example.com/fleet.git
  ref: {branch: main}
  credentials:
    tokenFile: /etc/rbd-reconciler/git/token
    caFile: /etc/rbd-reconciler/git/ca.pem
    username: fleet-bot
  verify: {mode: head, format: ssh, allowedSignersFile: /etc/rbd-reconciler/git/allowed}
""")
    assert c.git is not None
    creds = c.git.credentials
    assert creds.ca_file == Path("/etc/rbd-reconciler/git/ca.pem")
    assert (creds.token_file, creds.username) == (Path("/etc/rbd-reconciler/git/token"),
                                                  "fleet-bot")


def test_openpgp_needs_fingerprints(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="fingerprints"):
        load(tmp_path, """\
source:
  url: file:///srv/fleet.git
  ref: {branch: main}
  verify: {mode: head, format: openpgp, keyringFile: /k.gpg}
""")
