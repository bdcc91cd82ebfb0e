"""The node config's ``source:``: a git repository the daemon follows
(docs/gitops-source.md). Pure: what the config says, checked; the fetching,
verifying and switching live in reconciler/source/.

Imported by engine/fleet.py; source/ (5 modules); spec/config.py.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

SHA1 = re.compile(r"^[0-9a-f]{40}$")
FINGERPRINT = re.compile(r"^[0-9A-F]{40}$")  # an OpenPGP v4 fingerprint, upper case
NODE_NAME = "{nodeName}"
SCHEMES = ("ssh", "https", "file")
# A fetch writes the pack before anything in it is verified: this bounds what
# an untrusted pusher can make a node store. A config repository is small
# (YAML packs ~5-10x); 4 x maxTreeBytes leaves room for a fleet's whole tree
# at a depth-1 first fetch.
MAX_FETCH_BYTES = 256 << 20


@dataclass(frozen=True)
class SourceRef:
    kind: str  # branch | tag | commit
    name: str  # the branch or tag name, or the commit's 40 hex digits

    @property
    def remote(self) -> str:
        """What is asked of the remote: a full ref name, or the commit."""
        return {"branch": f"refs/heads/{self.name}", "tag": f"refs/tags/{self.name}"}.get(
            self.kind, self.name)

    @property
    def label(self) -> str:
        """``main``, ``tag v1.2``, ``commit 0123abc…``: how status names it."""
        return self.name if self.kind == "branch" else f"{self.kind} {self.name}"


@dataclass(frozen=True)
class SourceVerify:
    mode: str  # head | tag | tagAndHead
    format: str  # ssh | openpgp
    allowed_signers: Path | None = None  # ssh: ssh-keygen's allowed-signers file
    revocation: Path | None = None  # ssh: a KRL or a list of revoked public keys
    keyring: Path | None = None  # openpgp: exported public keys, imported into our own home
    fingerprints: tuple[str, ...] = ()  # openpgp: primary-key fingerprints allowed to sign


@dataclass(frozen=True)
class SourceCredentials:
    ssh_key: Path | None = None  # ssh: the deploy key (private)
    known_hosts: Path | None = None  # ssh: the pinned host keys (strict checking)
    token_file: Path | None = None  # https: a token, sent as the password
    username: str = "git"  # https: the user name sent with the token
    ca_file: Path | None = None  # https: the CAs to trust instead of the system's


FLEET_NAMESPACE = "rbd-reconciler-fleet"


@dataclass(frozen=True)
class SourceFleet:
    """Where the fleet's reports live: RADOS objects in this
    pool and namespace, one per node."""

    pool: str
    namespace: str = FLEET_NAMESPACE


@dataclass(frozen=True)
class SourceConfig:
    url: str
    ref: SourceRef
    path: str  # inside the repository; may hold {nodeName}
    verify: SourceVerify
    credentials: SourceCredentials = field(default_factory=SourceCredentials)
    interval_seconds: float = 60.0
    timeout_seconds: float = 60.0  # each git, ssh or gpg call
    depth: int = 1  # the first fetch's depth; 0: the whole history
    allow_non_descendant: bool = False  # a force-push back in time is applied
    max_file_bytes: int = 1 << 20  # the loader's own limit per file
    max_tree_bytes: int = 64 << 20  # all files under the node's path together
    max_fetch_bytes: int = MAX_FETCH_BYTES  # each file one fetch writes, before verification
    fleet: SourceFleet | None = None  # None: in no fleet; a revision applies at once

    def node_path(self, node_name: str) -> str:
        return self.path.replace(NODE_NAME, node_name)

    @property
    def scheme(self) -> str:
        return urlsplit(self.url).scheme


def source_problems(data: dict) -> list[tuple[tuple[str | int, ...], str]]:
    """What the schema cannot say about ``source:`` (field path, message)."""
    out: list[tuple[tuple[str | int, ...], str]] = []
    url = data.get("url", "")
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        out.append((("url",), f"must be an ssh://, https:// or file:// URL (got scheme "
                              f"{parts.scheme or 'none'!r}; write user@host:repo as "
                              "ssh://user@host/repo)"))
    elif parts.scheme == "https" and (parts.password is not None or parts.username):
        out.append((("url",), "must not hold credentials: put the token in "
                              "credentials.tokenFile (it is read from the file, never passed "
                              "on a command line or logged)"))
    elif parts.scheme == "file" and (parts.netloc or not parts.path.startswith("/")):
        out.append((("url",), "a file:// URL names an absolute local path (file:///srv/x.git)"))
    elif parts.scheme != "file" and not parts.hostname:
        out.append((("url",), "names no host"))
    creds = data.get("credentials") or {}
    if parts.scheme == "ssh":
        for key in ("sshKeyFile", "knownHostsFile"):
            if key not in creds:
                out.append((("credentials",), f"an ssh URL needs credentials.{key} (the deploy "
                                              "key, and the pinned host keys checked strictly)"))
    for key in ("tokenFile", "caFile"):
        if parts.scheme != "https" and key in creds:
            out.append((("credentials", key), "is for https URLs only"))
    path = data.get("path", "")
    plain = path.replace(NODE_NAME, "n")
    if "{" in plain or "}" in plain:
        out.append((("path",), f"the only placeholder is {NODE_NAME}"))
    elif path and (path.startswith("/") or os.path.normpath(plain) != plain
                   or plain.startswith("..")):
        out.append((("path",), "must be a clean relative path inside the repository "
                               "(no leading /, no '.', '..' or '//')"))
    verify = data.get("verify") or {}
    ref = data.get("ref") or {}
    if verify.get("mode") in ("tag", "tagAndHead") and "tag" not in ref:
        out.append((("verify", "mode"), f"{verify['mode']} verifies a signed tag: set ref.tag"))
    if verify.get("format") == "ssh":
        if "allowedSignersFile" not in verify:
            out.append((("verify",), "format ssh needs verify.allowedSignersFile"))
        if "keyringFile" in verify or "fingerprints" in verify:
            out.append((("verify",), "keyringFile and fingerprints are for format openpgp"))
    if verify.get("format") == "openpgp":
        if "keyringFile" not in verify or not verify.get("fingerprints"):
            out.append((("verify",), "format openpgp needs verify.keyringFile and "
                                     "verify.fingerprints (any key in a keyring would "
                                     "pass unless its fingerprint is allowed)"))
        if "allowedSignersFile" in verify or "revocationFile" in verify:
            out.append((("verify",), "allowedSignersFile and revocationFile are for format ssh"))
    return out


def build_source(data: dict) -> SourceConfig:
    ref = data["ref"]
    kind = next(k for k in ("branch", "tag", "commit") if k in ref)
    verify = data["verify"]
    creds = data.get("credentials") or {}

    def path(d: dict, key: str) -> Path | None:
        return Path(d[key]) if d.get(key) else None

    return SourceConfig(
        url=data["url"],
        ref=SourceRef(kind, ref[kind]),
        path=data.get("path", ""),
        verify=SourceVerify(
            mode=verify["mode"], format=verify["format"],
            allowed_signers=path(verify, "allowedSignersFile"),
            revocation=path(verify, "revocationFile"),
            keyring=path(verify, "keyringFile"),
            fingerprints=tuple(f.replace(" ", "").upper()
                               for f in verify.get("fingerprints", ()))),
        credentials=SourceCredentials(
            ssh_key=path(creds, "sshKeyFile"), known_hosts=path(creds, "knownHostsFile"),
            token_file=path(creds, "tokenFile"), username=creds.get("username", "git"),
            ca_file=path(creds, "caFile")),
        interval_seconds=float(data.get("intervalSeconds", 60)),
        timeout_seconds=float(data.get("timeoutSeconds", 60)),
        depth=int(data.get("depth", 1)),
        allow_non_descendant=bool(data.get("allowNonDescendant", False)),
        max_tree_bytes=int(data.get("maxTreeBytes", 64 << 20)),
        max_fetch_bytes=int(data.get("maxFetchBytes", MAX_FETCH_BYTES)),
        fleet=SourceFleet(pool=data["fleet"]["pool"],
                          namespace=data["fleet"].get("namespace", FLEET_NAMESPACE))
        if data.get("fleet") else None,
    )
