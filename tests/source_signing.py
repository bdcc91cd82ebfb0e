"""A signer's side of the GitOps source, for tests: a work repository, ssh and
OpenPGP keys, signed and unsigned commits and tags, crafted objects, and a
bare mirror (``reconciler.source.gitenv.Git``) that fetches from it; the
fleet's side: a bare repository pushed to, and the ``source:`` that follows it.

Everything runs with real git, ssh-keygen and gpg in an environment of its
own (HOME, GNUPGHOME, no system or global git config) under a temporary
directory. ``Signing`` is a context manager: leaving it stops the gpg-agent
that key generation and signing started.

    with Signing(tmp_path / "signer") as s:
        key = s.ssh_key("alice")
        sha = s.commit("hello", key)
        git = mirror(tmp_path / "source")
        fetch(git, s)
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from reconciler.drivers.run import Runner
from reconciler.source.gitenv import Git
from reconciler.spec.source import SourceConfig, SourceRef, SourceVerify

PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
# A small desired-volume file the tests commit (.format(name=, size=)).
VOLUME_YAML = """\
apiVersion: rbd-reconciler/v1
kind: Volume
metadata:
  name: {name}
spec:
  state: present
  image: {{pool: rbd, size: {size}}}
"""


@dataclass(frozen=True)
class SshKey:
    path: Path  # the private key; its public key is path + ".pub"
    public: str  # "ssh-ed25519 AAAA... comment"
    fingerprint: str  # "SHA256:..."


@dataclass(frozen=True)
class GpgKey:
    fingerprint: str  # the primary key's, 40 upper hex
    uid: str
    signing: str = ""  # a signing subkey's fingerprint, if one was added

    @property
    def signs_with(self) -> str:
        return self.signing or self.fingerprint


Key = SshKey | GpgKey


class Signing:
    """The signer: keys and a work repository (branch ``main``) under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        for d in ("home", "gnupg"):
            (root / d).mkdir(mode=0o700, parents=True)
        self.work = root / "work"
        self.env = {"PATH": PATH, "HOME": str(root / "home"), "GNUPGHOME": str(root / "gnupg"),
                    "LC_ALL": "C", "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null",
                    "GIT_TERMINAL_PROMPT": "0", "SSH_AUTH_SOCK": ""}
        self.run(["git", "init", "--quiet", "--initial-branch=main", str(self.work)])
        self._crafted = 0

    def __enter__(self) -> Signing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        # Key generation and signing started an agent in our GNUPGHOME.
        subprocess.run(["gpgconf", "--kill", "gpg-agent"], env=self.env, check=False,
                       capture_output=True, timeout=30)

    def run(self, argv: list[str], *, stdin: bytes | None = None,
            env: dict[str, str] | None = None) -> bytes:
        res = subprocess.run(argv, input=stdin, capture_output=True, timeout=60,
                             env={**self.env, **(env or {})}, cwd=self.root)
        if res.returncode != 0:
            raise AssertionError(f"{argv}: exit {res.returncode}: "
                                 f"{res.stderr.decode(errors='replace')}")
        return res.stdout

    def git(self, *args: str, env: dict[str, str] | None = None,
            stdin: bytes | None = None) -> str:
        return self.run(["git", "-C", str(self.work), "-c", "user.name=Signer",
                         "-c", "user.email=signer@example.invalid", *args],
                        env=env, stdin=stdin).decode().strip()

    # --- keys ---------------------------------------------------------------

    def ssh_key(self, name: str) -> SshKey:
        path = self.root / f"{name}.ssh"
        self.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", name, "-f", str(path)])
        fpr = self.run(["ssh-keygen", "-l", "-f", f"{path}.pub"]).decode().split()[1]
        return SshKey(path, Path(f"{path}.pub").read_text().strip(), fpr)

    def gpg(self, *args: str, stdin: bytes | None = None) -> bytes:
        return self.run(["gpg", "--batch", "--no-tty", "--pinentry-mode", "loopback",
                         "--passphrase", "", *args], stdin=stdin)

    def gpg_key(self, uid: str, *, expire: str = "never", faked_time: str | None = None,
                signing_subkey: bool = False) -> GpgKey:
        """``faked_time`` (gpg's ``--faked-system-time``, e.g. 20200101T000000):
        a key made then, with ``expire`` (e.g. 1d) from then."""
        fake = ["--faked-system-time", faked_time] if faked_time else []
        self.gpg(*fake, "--quick-gen-key", uid, "ed25519", "sign", expire)
        fpr = self._fingerprints(uid)[0]
        if not signing_subkey:
            return GpgKey(fpr, uid)
        self.gpg("--quick-add-key", fpr, "ed25519", "sign", "never")
        return GpgKey(fpr, uid, self._fingerprints(uid)[1])

    def _fingerprints(self, uid: str) -> list[str]:
        out = self.gpg("--with-colons", "--list-keys", f"={uid}").decode()
        return [ln.split(":")[9] for ln in out.splitlines() if ln.startswith("fpr:")]

    def revoke(self, key: GpgKey) -> None:
        """Import the key's revocation certificate (gpg made it with the key)."""
        cert = (self.root / "gnupg" / "openpgp-revocs.d" / f"{key.fingerprint}.rev").read_bytes()
        # The certificate's armor line is prefixed with ':' against an accidental import.
        self.gpg("--import", stdin=cert.replace(b":-----BEGIN", b"-----BEGIN"))

    def faked_gpg(self, when: str) -> Path:
        """A gpg program that lives at ``when`` (to sign with a key expired by now)."""
        path = self.root / f"gpg-at-{when}"
        path.write_text(f'#!/bin/sh\nexec gpg --faked-system-time {when} "$@"\n')
        path.chmod(0o755)
        return path

    def keyring(self, path: Path, *keys: GpgKey, armor: bool = False) -> Path:
        """``gpg --export`` of ``keys``: the file a node's keyringFile names."""
        path.write_bytes(self.gpg("--export", *(["--armor"] if armor else []),
                                  *(k.fingerprint for k in keys)))
        return path

    def allowed_signers(self, path: Path, *entries: tuple[str, SshKey] | str) -> Path:
        """Lines ``principal key``; a plain string is written as it is."""
        lines = [e if isinstance(e, str) else f"{e[0]} {e[1].public}" for e in entries]
        path.write_text("".join(f"{ln}\n" for ln in lines))
        return path

    def revocation_list(self, path: Path, *keys: SshKey, krl: bool = False) -> Path:
        """Revoked ssh keys: a plain list of public keys, or a KRL."""
        if krl:
            self.run(["ssh-keygen", "-q", "-k", "-f", str(path),
                      *(f"{k.path}.pub" for k in keys)])
        else:
            path.write_text("".join(f"{k.public}\n" for k in keys))
        return path

    # --- commits, tags, objects -------------------------------------------

    def _sign_opts(self, key: Key | None, gpg_program: Path | None = None) -> list[str]:
        if key is None:
            return []
        if isinstance(key, SshKey):
            return ["-c", "gpg.format=ssh", "-c", f"user.signingkey={key.path}"]
        program = ["-c", f"gpg.program={gpg_program}"] if gpg_program else []
        return ["-c", "gpg.format=openpgp", *program, "-c", f"user.signingkey={key.signs_with}!"]

    def commit(self, message: str, key: Key | None = None, *, date: str | None = None,
               gpg_program: Path | None = None) -> str:
        """An empty commit on ``main``, signed by ``key``; ``date``: author and
        committer date (git's formats, e.g. 2019-06-01T00:00:00Z)."""
        env = {"GIT_AUTHOR_DATE": date, "GIT_COMMITTER_DATE": date} if date else None
        sign = ["-S"] if key else []
        self.git(*self._sign_opts(key, gpg_program), "commit", "--quiet", "--allow-empty",
                 *sign, "-m", message, env=env)
        return self.git("rev-parse", "HEAD")

    def push(self, url: str, message: str, files: dict[str, str | None],
             key: Key | None = None) -> str:
        """Write ``files`` (paths in the repository; None removes one), commit
        them on ``main`` signed by ``key`` and push to ``url``; the commit."""
        for rel, text in files.items():
            f = self.work / rel
            if text is None:
                f.unlink()
            else:
                f.parent.mkdir(parents=True, exist_ok=True)
                f.write_text(text)
        self.git("add", "-A")
        sha = self.commit(message, key)
        self.git("push", "--quiet", url, "main")
        return sha

    def tag(self, name: str, target: str, key: Key | None = None) -> str:
        """An annotated tag (signed with ``key``, else ``tag -a``); its object's sha."""
        kind = "-s" if key else "-a"
        self.git(*self._sign_opts(key), "tag", kind, "-m", f"tag {name}", name, target)
        return self.git("rev-parse", f"refs/tags/{name}")

    def raw(self, sha: str) -> bytes:
        kind = self.git("cat-file", "-t", sha)
        return self.run(["git", "-C", str(self.work), "cat-file", kind, sha])

    def write_object(self, kind: str, raw: bytes) -> str:
        """A hand-made object, kept reachable (a branch) so that a fetch brings it."""
        sha = self.git("hash-object", "-t", kind, "-w", "--stdin", stdin=raw)
        self._crafted += 1
        self.git("update-ref", f"refs/heads/crafted-{self._crafted}", sha)
        return sha

    def ssh_sign(self, payload: bytes, key: SshKey, namespace: str = "git") -> bytes:
        return self.run(["ssh-keygen", "-q", "-Y", "sign", "-n", namespace, "-f", str(key.path)],
                        stdin=payload)

    def gpg_sign(self, payload: bytes, *keys: GpgKey) -> bytes:
        users = [a for k in keys for a in ("-u", f"{k.signs_with}!")]
        return self.gpg(*users, "--detach-sign", "--armor", stdin=payload)


def with_signature(unsigned_commit: bytes, *signatures: tuple[str, bytes]) -> bytes:
    """A raw commit with signature headers (name, value) added after its
    committer line, as git writes ``gpgsig`` (continuation lines indented)."""
    head, sep, body = unsigned_commit.partition(b"\n\n")
    headers = [f"{name} ".encode() + value.rstrip(b"\n").replace(b"\n", b"\n ")
               for name, value in signatures]
    return b"\n".join([head, *headers]) + sep + body


def without_signature(commit: bytes) -> bytes:
    """The commit with its gpgsig* headers removed: the bytes its signature covers."""
    head, sep, body = commit.partition(b"\n\n")
    kept: list[bytes] = []
    in_sig = False
    for line in head.split(b"\n"):
        in_sig = line.startswith(b"gpgsig") or (in_sig and line.startswith(b" "))
        if not in_sig:
            kept.append(line)
    return b"\n".join(kept) + sep + body


def bare_repository(path: Path) -> str:
    """An empty bare repository (the fleet's server); its file:// URL."""
    subprocess.run(["git", "init", "--quiet", "--bare", str(path)], check=True,
                   capture_output=True, timeout=60)
    return f"file://{path}"


def source_yaml(url: str, allowed_signers: Path, interval: float,
                path: str = "nodes/{nodeName}") -> str:
    """A node config's ``source:`` following ``main`` of ``url``, commits
    verified against the allowed-signers file."""
    return f"""\
source:
  url: {url}
  ref: {{branch: main}}
  path: {path}
  intervalSeconds: {interval:g}
  verify: {{mode: head, format: ssh, allowedSignersFile: {allowed_signers}}}
"""



def node_config_file(root: Path, url: str, allowed: Path, *, extra: str = "",
                     verify_extra: str = "") -> Path:
    """``root/config.yaml``: node ``a`` (state in ``root/state``) following
    ``url``'s main, commits verified against ``allowed``, as an operator
    writes it. ``extra``: more ``source:`` keys, each line indented by two
    spaces; ``verify_extra``: more keys of ``verify:`` (", revocationFile: F")."""
    state = root / "state"
    state.mkdir(mode=0o755, exist_ok=True)
    cfg = root / "config.yaml"
    cfg.write_text(f"""\
stateDir: {state}
nodeName: a
allowedRoots: [/srv]
source:
  url: {url}
  ref: {{branch: main}}
  path: nodes/{{nodeName}}
{extra}  verify: {{mode: head, format: ssh, allowedSignersFile: {allowed}{verify_extra}}}
""")
    return cfg

def mirror(root: Path, verify: SourceVerify | None = None) -> Git:
    """A bare mirror as the daemon keeps it (``<root>/repo.git``); ``verify``
    only fills in the config (the verify functions take the policy)."""
    config = SourceConfig(url="file:///nonexistent", ref=SourceRef("branch", "main"), path="",
                          verify=verify or SourceVerify(mode="head", format="ssh"))
    git = Git(config, root, Runner())
    git.init()
    return git


def fetch(git: Git, signing: Signing) -> None:
    """Every branch and tag of the work repository into the mirror."""
    git.run(["fetch", "--quiet", "--no-write-fetch-head", f"file://{signing.work}",
             "+refs/heads/*:refs/heads/*", "+refs/tags/*:refs/tags/*"])
