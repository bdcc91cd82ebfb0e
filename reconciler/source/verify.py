"""Signed commits and tags of the source, checked against the node's policy.

git does the cryptography and, above all, cuts the signed payload out of the
object (``git verify-commit`` / ``verify-tag``): a second parser of our own
could disagree with git's about which bytes are signed (two ``gpgsig``
headers, a signature-looking line in a tag message) and accept an object git
reads differently. What git 2.39 does not do is done here:

- It picks the verifier from the signature itself, whatever ``gpg.format``
  says: the format is read from the raw object and pinned
  (``WrongFormat``).
- Any key in a GnuPG keyring passes: the signing key's *primary*
  fingerprint (``VALIDSIG``) must be one of ``policy.fingerprints``.
- ``valid-before`` in allowed-signers is checked against the commit's own
  date (``-Overify-time=<committer date>``), which the signer writes:
  retirement is the revocation file's job.
- A revocation file that is missing is only a warning to git (it verifies
  without it): here it is ``KeysUnreadable``.
- Its exit code says too little (the ssh "Good ... signature" line is also
  printed by a check that matched no principal): a signature is good only
  with exit 0 *and* a positive parse of the output.

Why not ``ssh-keygen -Y verify`` on a payload we extract (it would let us
check ``valid-before`` against now and name a revoked key): see above, the
payload must be git's. The one thing git's output does not tell, that a
key was refused because it is revoked, is found by asking once more without
the revocation file.

Exit codes git uses for a verdict (0, 1; 128 for an object it cannot parse)
give a ``Refused``; anything else (a deadline, a missing program) is a
``CommandError`` from the runner: a failure to check, not a verdict.

Imported by source/sync.py, source/trust.py.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

from reconciler.drivers.run import DEFAULT_MAX_STDOUT, OutputTooLarge
from reconciler.source.gitenv import Git
from reconciler.spec.source import SHA1, SourceVerify

VERDICT_CODES = (0, 1, 128)
KEYRING_STAMP = "keyring.sha256"  # in the GnuPG home: the keyring file it was made from
# git's signature formats, by the first line of the signature (gpg-interface.c).
MARKERS = {
    b"-----BEGIN PGP SIGNATURE-----": "openpgp",
    b"-----BEGIN PGP MESSAGE-----": "openpgp",
    b"-----BEGIN SSH SIGNATURE-----": "ssh",
    b"-----BEGIN SIGNED MESSAGE-----": "x509",
}
# ssh-keygen -Y verify's line; without " for PRINCIPAL" it is the check that
# matched no allowed signer (git prints it when none matched).
SSH_GOOD = re.compile(r'^Good "git" signature for (.+) with (\S+) key (SHA256:[A-Za-z0-9+/=]+)$')
SSH_ANY_KEY = re.compile(r'^Good "git" signature with \S+ key (SHA256:[A-Za-z0-9+/=]+)$')


@dataclass(frozen=True)
class Signer:
    format: str  # "ssh" | "openpgp"
    fingerprint: str  # ssh: "SHA256:..."; openpgp: the primary key's, 40 upper hex
    name: str  # ssh: the allowed-signers principal; openpgp: the uid


class Refused(Exception):
    """The object does not pass the policy. ``reason``: one CamelCase word
    (status, metrics); ``message``: one line naming the object and why."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message


def signature_format(raw_object: bytes) -> str | None:
    """The format of the signature git checks in a raw commit or tag object
    (``git cat-file commit|tag``): "ssh", "openpgp", "x509", "unknown" (a
    signature header git does not recognise), "multiple" (more than one
    signature header), or None (unsigned)."""
    found = _signatures(raw_object)
    if not found:
        return None
    return found[0] if len(found) == 1 else "multiple"


def _signatures(raw: bytes) -> list[str]:
    lines = raw.split(b"\n")
    if lines[0].startswith(b"object "):
        # A tag: the signature starts at the last line that begins one, as
        # git's parse_signed_buffer finds it (earlier ones are signed text).
        last = next((_marker(line) for line in reversed(lines) if _marker(line)), None)
        return [last] if last else []
    # A commit: every gpgsig* header (gpgsig; gpgsig-sha256, a signature
    # over the object's SHA-256 form) up to the blank line ending the headers.
    # Several are refused rather than chosen from: git 2.39 concatenates
    # repeated gpgsig headers and checks only the one of the repository's hash.
    found = []
    for line in lines:
        if not line:
            break
        name, _, value = line.partition(b" ")
        if name.startswith(b"gpgsig"):
            found.append(_marker(value) or "unknown")
    return found


def _marker(line: bytes) -> str | None:
    return next((fmt for m, fmt in MARKERS.items() if line.rstrip(b"\r").startswith(m)), None)


def verify_commit(git: Git, sha: str, policy: SourceVerify) -> Signer:
    return _verify(git, "commit", sha, policy)


def verify_tag(git: Git, tag_object_sha: str, policy: SourceVerify,
               name: str | None = None) -> Signer:
    """An annotated tag object (not the commit it names). ``name``: the tag
    the node follows, which the object's own signed ``tag`` header must say:
    else whoever can push could point ``refs/tags/prod`` at the signed tag
    ``canary`` and have it applied as prod."""
    return _verify(git, "tag", tag_object_sha, policy, name)


def verify_revision(git: Git, commit: str, tag_object: str | None,
                    policy: SourceVerify, tag_name: str | None = None) -> list[Signer]:
    """What ``policy.mode`` asks: head, the commit; tag, the tag object
    (which must peel to ``commit`` and, given ``tag_name``, be named so);
    tagAndHead, both. Returns the signers, the tag's first. For openpgp,
    imports a changed keyring first."""
    if policy.format == "openpgp":
        prepare_keys(git, policy)
    signers = []
    if policy.mode in ("tag", "tagAndHead"):
        if tag_object is None:
            raise Refused("NoTag", f"commit {commit[:12]}: verify mode {policy.mode} needs a "
                                   "signed tag, and there is none")
        signers.append(verify_tag(git, tag_object, policy, tag_name))
        peeled = git.run(["rev-parse", "--verify", "--quiet", "--end-of-options",
                          f"{tag_object}^{{commit}}"], ok_codes=(0, 1)).stdout.strip()
        if peeled != commit:
            raise Refused("TagMismatch", f"tag {tag_object[:12]} names commit "
                                         f"{peeled[:12] or 'none'}, not {commit[:12]}")
    if policy.mode in ("head", "tagAndHead"):
        signers.append(verify_commit(git, commit, policy))
    if not signers:
        raise Refused("BadPolicy", f"commit {commit[:12]}: unknown verify mode {policy.mode!r}")
    return signers


def _verify(git: Git, kind: str, sha: str, policy: SourceVerify,
            tag_name: str | None = None) -> Signer:
    what = f"{kind} {sha[:12]}"
    if not SHA1.match(sha):
        raise Refused("NotA" + kind.capitalize(), f"{kind} {sha[:40]!r}: not an object name "
                                                  "(40 hex digits)")
    # verify-commit peels a tag to its commit (cat-file commit too): the
    # type is checked on the object itself. --batch: "<sha> <type> <size>"
    # (or "<sha> missing"), then the raw object; bytes that are not UTF-8
    # arrive as U+FFFD, the lines and the ASCII armor lines intact.
    # An object past the Runner's bound (a pusher's 17 MiB message costs a
    # few kB of pack) is the revision's, at every attempt: refused, as a
    # push the node will not take, not reported as git failing.
    try:
        out = git.run(["cat-file", "--batch"], stdin=f"{sha}\n".encode()).stdout
    except OutputTooLarge:
        raise Refused("ObjectTooLarge", f"{what}: the object is over "
                                        f"{DEFAULT_MAX_STDOUT >> 20} MiB (no commit or tag "
                                        "of a desired state is): refused unverified") from None
    header, _, raw = out.partition("\n")
    got = header.split(" ")[1] if header.count(" ") == 2 else "not in the mirror"
    if got != kind:
        raise Refused("NotA" + kind.capitalize(), f"{what}: is {got}")
    fmt = signature_format(raw.encode())
    if fmt is None:
        raise Refused("Unsigned", f"{what}: not signed")
    if fmt == "multiple":
        raise Refused("MultipleSignatures", f"{what}: more than one signature header "
                                            "(which one counts is ambiguous)")
    if fmt != policy.format:
        said = "a format git does not know" if fmt == "unknown" else fmt
        raise Refused("WrongFormat", f"{what}: signed with {said}, the policy asks for "
                                     f"{policy.format}")
    if fmt == "ssh":
        signer = _verify_ssh(git, kind, sha, policy, what)
    else:
        signer = _verify_openpgp(git, kind, sha, policy, what)
    if tag_name is not None:
        _check_tag_name(raw, tag_name, what)
    return signer


def _check_tag_name(raw: str, want: str, what: str) -> None:
    """The tag object's ``tag`` header (covered by its signature) is the name
    the ref has. git writes object, type, tag, tagger, then a blank line;
    exactly one ``tag`` header is accepted."""
    headers = raw.split("\n\n", 1)[0].split("\n")
    names = [h[4:] for h in headers if h.startswith("tag ")]
    if names != [want]:
        said = ", ".join(repr(n) for n in names) or "no name"
        raise Refused("TagNameMismatch", f"{what}: the signed tag object is named {said}, "
                                         f"not {want!r} (refs/tags/{want} points at another "
                                         "tag's object: refused)")


def _readable(path: Path | None, what: str, label: str) -> str:
    """The file git or gpg will read, as an absolute path; missing or
    unreadable is a refusal (git would go on without a revocation file)."""
    if path is None:
        raise Refused("KeysUnreadable", f"{what}: no {label} configured")
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise Refused("KeysUnreadable", f"{what}: {label} {path}: "
                                        f"{exc.strerror or exc}") from exc
    return os.path.abspath(path)


def _git_verify(git: Git, kind: str, sha: str, config: list[str]) -> tuple[int, list[str]]:
    args = [a for kv in config for a in ("-c", kv)]
    res = git.run([*args, f"verify-{kind}", "--raw", "--", sha], ok_codes=VERDICT_CODES)
    # --raw: the verifier's output on stderr (stdout stays empty). Its
    # verdict is read from those lines: with some not kept (the Runner keeps
    # the head and tail of a flood), a second signature could go unseen.
    if res.stderr_dropped:
        raise Refused("BadSignature", f"{kind} {sha[:12]}: the verifier said too much to be "
                                      f"read whole ({res.stderr_dropped} bytes not kept)")
    return res.returncode, (res.stderr + res.stdout).splitlines()


def _verify_ssh(git: Git, kind: str, sha: str, policy: SourceVerify, what: str) -> Signer:
    allowed = _readable(policy.allowed_signers, what, "allowed-signers file")
    config = ["gpg.format=ssh", "gpg.ssh.program=ssh-keygen",
              f"gpg.ssh.allowedSignersFile={allowed}"]
    if policy.revocation is not None:
        revoked = _readable(policy.revocation, what, "revocation file")
        config.append(f"gpg.ssh.revocationFile={revoked}")
    rc, lines = _git_verify(git, kind, sha, config)
    if any("revocation file configured but not found" in ln for ln in lines):
        raise Refused("KeysUnreadable", f"{what}: the revocation file went away (git checked "
                                        "without it)")
    good = [m for m in map(SSH_GOOD.match, lines) if m]
    if rc == 0 and len(good) == 1 and not any("Could not verify" in ln for ln in lines):
        principal, _, fingerprint = good[0].groups()
        return Signer("ssh", fingerprint, principal)
    said = " ".join(lines)
    if "not permitted for use in signature namespace" in said:
        raise Refused("NotAllowed", f"{what}: the key is not allowed to sign for git "
                                    "(namespaces= in the allowed-signers file)")
    if "key has expired" in said:
        raise Refused("ExpiredKey", f"{what}: the key's valid-before has passed")
    # No principal: git then checks the signature alone (check-novalidate);
    # "Good" there is a sound signature by a key no allowed signer has.
    novalidate = [m for m in map(SSH_ANY_KEY.match, lines) if m]
    if "No principal matched" in said and novalidate:
        raise Refused("UnknownSigner", f"{what}: signed by {novalidate[0][1]}, not in the "
                                       "allowed-signers file")
    if policy.revocation is not None:
        # ssh-keygen says only "Could not verify signature" for a revoked
        # key: the same check without the revocation file tells it apart.
        rc2, lines2 = _git_verify(git, kind, sha, config[:-1])
        if rc2 == 0 and any(SSH_GOOD.match(ln) for ln in lines2):
            raise Refused("Revoked", f"{what}: the signing key is in the revocation file")
    raise Refused("BadSignature", f"{what}: the signature does not verify: "
                                  f"{_tail(lines) or f'git exit {rc}'}")


def _verify_openpgp(git: Git, kind: str, sha: str, policy: SourceVerify,
                    what: str) -> Signer:
    rc, lines = _git_verify(git, kind, sha, ["gpg.format=openpgp", "gpg.program=gpg"])
    status: dict[str, list[list[str]]] = {}
    for line in lines:
        if line.startswith("[GNUPG:] "):
            word, *args = line[9:].split(" ")
            status.setdefault(word, []).append(args)
    n = len(status.get("NEWSIG", ()))
    # One signature, exactly: which of several would count is a policy no
    # one asked for (gpg reports each, git only the last).
    if n > 1:
        raise Refused("MultipleSignatures", f"{what}: {n} OpenPGP signatures in one block")
    if "NO_PUBKEY" in status or any(a[5:6] == ["9"] for a in status.get("ERRSIG", ())):
        key = (status.get("NO_PUBKEY") or status["ERRSIG"])[0][:1] or ["?"]
        raise Refused("UnknownSigner", f"{what}: signed by key {key[0]}, not in the keyring")
    for word, reason, why in (
            ("ERRSIG", "BadSignature", "gpg cannot check the signature"),
            ("BADSIG", "BadSignature", "the signature does not verify"),
            ("REVKEYSIG", "Revoked", "the signing key is revoked"),
            ("EXPKEYSIG", "ExpiredKey", "the signing key has expired"),
            ("EXPSIG", "ExpiredSignature", "the signature has expired")):
        if word in status:
            key = (status[word][0] or ["?"])[0]
            raise Refused(reason, f"{what}: {why} (key {key})")
    goods, valids = status.get("GOODSIG", []), status.get("VALIDSIG", [])
    if rc != 0 or n != 1 or len(goods) != 1 or len(valids) != 1 or len(valids[0]) < 10:
        raise Refused("BadSignature", f"{what}: no good signature: "
                                      f"{_tail(lines) or f'git exit {rc}'}")
    signing, primary = valids[0][0].upper(), valids[0][9].upper()
    keyid, uid = goods[0][0].upper(), unquote(" ".join(goods[0][1:]), errors="replace")
    if not signing.endswith(keyid):  # GOODSIG and VALIDSIG about one key, or no verdict
        raise Refused("BadSignature", f"{what}: gpg's status lines disagree on the key")
    if primary not in {f.replace(" ", "").upper() for f in policy.fingerprints}:
        raise Refused("NotAllowed", f"{what}: signed by {primary} ({uid}), not one of the "
                                    "allowed fingerprints")
    return Signer("openpgp", primary, uid)


def _tail(lines: list[str]) -> str:
    return " | ".join(ln.strip() for ln in lines[-3:] if ln.strip())


def prepare_keys(git: Git, policy: SourceVerify) -> None:
    """openpgp: the GnuPG home (``git.gnupg_home``) holds exactly the keys of
    ``policy.keyring`` (``gpg --export`` output, binary or armored). Nothing
    is done while the file's sha256 is the one the home was made from; a
    changed file is imported into a fresh home that then replaces the old one
    (a key dropped from the file no longer verifies). A file that cannot be
    read or imported leaves an empty home and raises ``Refused``: no old key
    outlives a keyring that changed. ssh: the files are checked readable."""
    if policy.format == "ssh":
        _readable(policy.allowed_signers, "source", "allowed-signers file")
        if policy.revocation is not None:
            _readable(policy.revocation, "source", "revocation file")
        return
    home = git.gnupg_home
    try:
        if policy.keyring is None:
            raise OSError("no keyringFile configured")
        data = policy.keyring.read_bytes()
    except OSError as exc:
        _replace_home(git, None)
        raise Refused("KeysUnreadable", f"source: keyring {policy.keyring}: "
                                        f"{exc.strerror or exc}") from exc
    digest = hashlib.sha256(data).hexdigest()
    try:
        if (home / KEYRING_STAMP).read_text() == digest:
            return
    except OSError:
        pass  # no home yet, or one from no keyring: made below
    fresh = Path(tempfile.mkdtemp(prefix=".gnupg-", dir=git.root))  # 0700, next to the home
    try:
        res = git.runner.run(["gpg", "--homedir", str(fresh), "--batch", "--no-tty",
                              "--no-autostart", "--status-fd", "1", "--import"],
                             stdin=data, ok_codes=(0, 1, 2), env=git.env(),
                             timeout=git.config.timeout_seconds)
        if res.returncode != 0 or "[GNUPG:] IMPORT_OK " not in res.stdout:
            _replace_home(git, None)
            raise Refused("KeysUnreadable", f"source: keyring {policy.keyring}: gpg imports "
                                            f"no keys from it: {_tail(res.stderr.splitlines())}")
        (fresh / KEYRING_STAMP).write_text(digest)
        _replace_home(git, fresh)
    finally:
        shutil.rmtree(fresh, ignore_errors=True)


def _replace_home(git: Git, fresh: Path | None) -> None:
    """Put ``fresh`` (None: an empty home) in place of the GnuPG home. Two
    renames: in between there is no home, and no signature verifies."""
    home = git.gnupg_home
    if fresh is None:
        fresh = Path(tempfile.mkdtemp(prefix=".gnupg-", dir=git.root))
    old = Path(tempfile.mkdtemp(prefix=".gnupg-old-", dir=git.root))
    try:
        if home.exists():
            os.rename(home, old / "home")
        os.rename(fresh, home)
    finally:
        shutil.rmtree(old, ignore_errors=True)
