"""reconciler.source.verify with real git, ssh-keygen and gpg: commits and tags
signed in a work repository, fetched into the daemon's bare mirror, verified
there against a policy (tests/source_signing.py makes both sides)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from source_signing import (
    GpgKey,
    Signing,
    SshKey,
    fetch,
    mirror,
    with_signature,
    without_signature,
)

from reconciler.source.gitenv import Git
from reconciler.source.verify import (
    KEYRING_STAMP,
    Refused,
    Signer,
    prepare_keys,
    signature_format,
    verify_commit,
    verify_revision,
    verify_tag,
)
from reconciler.spec.source import SourceVerify

OLD = "2019-06-01T00:00:00Z"  # a committer date the signer picked, before valid-before


@pytest.fixture(scope="module")
def signer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Signing]:
    with Signing(tmp_path_factory.mktemp("signer")) as s:
        yield s


@pytest.fixture(scope="module")
def alice(signer: Signing) -> SshKey:
    return signer.ssh_key("alice")


@pytest.fixture(scope="module")
def bob(signer: Signing) -> SshKey:
    return signer.ssh_key("bob")


@pytest.fixture(scope="module")
def pgp_a(signer: Signing) -> GpgKey:
    return signer.gpg_key("Alice <alice@example.invalid>")


@pytest.fixture(scope="module")
def pgp_b(signer: Signing) -> GpgKey:
    return signer.gpg_key("Bob <bob@example.invalid>")


def ssh_policy(signer: Signing, tmp_path: Path, *entries: tuple[str, SshKey] | str,
               revoked: tuple[SshKey, ...] = (), krl: bool = False,
               mode: str = "head") -> SourceVerify:
    allowed = signer.allowed_signers(tmp_path / "allowed_signers", *entries)
    revocation = (signer.revocation_list(tmp_path / "revoked", *revoked, krl=krl)
                  if revoked else None)
    return SourceVerify(mode=mode, format="ssh", allowed_signers=allowed, revocation=revocation)


def pgp_policy(signer: Signing, tmp_path: Path, keyring: tuple[GpgKey, ...],
               allowed: tuple[GpgKey, ...], mode: str = "head") -> SourceVerify:
    ring = signer.keyring(tmp_path / "keyring.gpg", *keyring)
    return SourceVerify(mode=mode, format="openpgp", keyring=ring,
                        fingerprints=tuple(k.fingerprint for k in allowed))


def synced(signer: Signing, tmp_path: Path) -> Git:
    git = mirror(tmp_path / "source")
    fetch(git, signer)
    return git


def refused(reason: str, call: object, *args: object) -> Refused:
    with pytest.raises(Refused) as info:
        call(*args)  # type: ignore[operator]
    assert info.value.reason == reason, info.value.message
    assert "\n" not in info.value.message
    return info.value


# --- ssh -----------------------------------------------------------------------


def test_good_ssh_commit(signer: Signing, alice: SshKey, tmp_path: Path) -> None:
    sha = signer.commit("good ssh", alice)
    policy = ssh_policy(signer, tmp_path, ("alice@example.invalid", alice))
    git = synced(signer, tmp_path)
    want = Signer("ssh", alice.fingerprint, "alice@example.invalid")
    assert verify_commit(git, sha, policy) == want
    assert verify_revision(git, sha, None, policy) == [want]


def test_unsigned_commit(signer: Signing, alice: SshKey, pgp_a: GpgKey, tmp_path: Path) -> None:
    sha = signer.commit("unsigned")
    git = synced(signer, tmp_path)
    err = refused("Unsigned", verify_commit, git, sha,
                  ssh_policy(signer, tmp_path, ("alice@example.invalid", alice)))
    assert sha[:12] in err.message
    refused("Unsigned", verify_commit, git, sha, pgp_policy(signer, tmp_path, (pgp_a,), (pgp_a,)))


def test_ssh_signer_not_allowed(signer: Signing, alice: SshKey, bob: SshKey,
                                tmp_path: Path) -> None:
    sha = signer.commit("by bob", bob)
    git = synced(signer, tmp_path)
    err = refused("UnknownSigner", verify_commit, git, sha,
                  ssh_policy(signer, tmp_path, ("alice@example.invalid", alice)))
    assert bob.fingerprint in err.message


@pytest.mark.parametrize("krl", [False, True], ids=["key-list", "krl"])
def test_ssh_revoked(signer: Signing, alice: SshKey, bob: SshKey, tmp_path: Path,
                     krl: bool) -> None:
    sha = signer.commit("by bob, revoked", bob)
    good = signer.commit("by alice", alice)
    policy = ssh_policy(signer, tmp_path, ("alice@example.invalid", alice),
                        ("bob@example.invalid", bob), revoked=(bob,), krl=krl)
    git = synced(signer, tmp_path)
    refused("Revoked", verify_commit, git, sha, policy)
    assert verify_commit(git, good, policy).name == "alice@example.invalid"


def test_valid_before_is_checked_against_the_commit_date(signer: Signing, bob: SshKey,
                                                          tmp_path: Path) -> None:
    # git 2.39 passes -Overify-time=<committer date>: the signer picks it.
    # A retired key still signs "in the past"; only the revocation file stops it.
    backdated = signer.commit("backdated", bob, date=OLD)
    today = signer.commit("today", bob)
    entry = f'bob@example.invalid valid-before="20200101" {bob.public}'
    policy = ssh_policy(signer, tmp_path, entry)
    git = synced(signer, tmp_path)
    assert verify_commit(git, backdated, policy).name == "bob@example.invalid"
    refused("ExpiredKey", verify_commit, git, today, policy)
    retired = ssh_policy(signer, tmp_path, entry, revoked=(bob,))
    refused("Revoked", verify_commit, git, backdated, retired)


def test_ssh_namespace_file_is_refused(signer: Signing, bob: SshKey, tmp_path: Path) -> None:
    sha = signer.commit("bob, key for files only", bob)
    policy = ssh_policy(signer, tmp_path, f'bob@example.invalid namespaces="file" {bob.public}')
    refused("NotAllowed", verify_commit, synced(signer, tmp_path), sha, policy)


def test_ssh_signature_made_for_another_namespace(signer: Signing, alice: SshKey,
                                                  tmp_path: Path) -> None:
    unsigned = signer.raw(signer.commit("to be signed for 'file'"))
    sha = signer.write_object("commit", with_signature(
        unsigned, ("gpgsig", signer.ssh_sign(unsigned, alice, namespace="file"))))
    policy = ssh_policy(signer, tmp_path, ("alice@example.invalid", alice))
    refused("BadSignature", verify_commit, synced(signer, tmp_path), sha, policy)


def test_ssh_principal_not_utf8(signer: Signing, alice: SshKey, tmp_path: Path) -> None:
    sha = signer.commit("latin-1 principal", alice)
    allowed = tmp_path / "allowed_signers"
    allowed.write_bytes(b"b\xe9b@example.invalid " + alice.public.encode() + b"\n")
    policy = SourceVerify(mode="head", format="ssh", allowed_signers=allowed)
    signed = verify_commit(synced(signer, tmp_path), sha, policy)
    assert signed.name == "b\ufffdb@example.invalid"


def test_ssh_tampered_commit(signer: Signing, alice: SshKey, tmp_path: Path) -> None:
    raw = signer.raw(signer.commit("the real message", alice))
    sha = signer.write_object("commit", raw.replace(b"the real message", b"another message"))
    policy = ssh_policy(signer, tmp_path, ("alice@example.invalid", alice))
    refused("BadSignature", verify_commit, synced(signer, tmp_path), sha, policy)


# --- formats ---------------------------------------------------------------------


def test_wrong_format_both_ways(signer: Signing, alice: SshKey, pgp_a: GpgKey,
                                tmp_path: Path) -> None:
    by_ssh = signer.commit("ssh-signed", alice)
    by_pgp = signer.commit("pgp-signed", pgp_a)
    git = synced(signer, tmp_path)
    ssh = ssh_policy(signer, tmp_path, ("alice@example.invalid", alice))
    pgp = pgp_policy(signer, tmp_path, (pgp_a,), (pgp_a,))
    prepare_keys(git, pgp)
    refused("WrongFormat", verify_commit, git, by_ssh, pgp)
    refused("WrongFormat", verify_commit, git, by_pgp, ssh)


@pytest.mark.parametrize(("header", "reason"), [
    (b"-----BEGIN SSH SIGNATURE-----\nU1NIU0lH\xff\xfe\x80garbage\n-----END SSH SIGNATURE-----",
     "BadSignature"),
    (b"-----BEGIN SSH SIGNATURE-----\n\n-----END SSH SIGNATURE-----", "BadSignature"),
    (b"-----BEGIN PGP SIGNATURE-----\n\n\xff\xfe\x01garbage\n-----END PGP SIGNATURE-----",
     "WrongFormat"),
    (b"\xff\xfe not a signature at all", "WrongFormat"),
], ids=["ssh-binary", "ssh-empty", "pgp-under-ssh-policy", "unknown"])
def test_garbage_signature(signer: Signing, alice: SshKey, tmp_path: Path, header: bytes,
                           reason: str) -> None:
    unsigned = signer.raw(signer.commit("garbage"))
    sha = signer.write_object("commit", with_signature(unsigned, ("gpgsig", header)))
    policy = ssh_policy(signer, tmp_path, ("alice@example.invalid", alice))
    refused(reason, verify_commit, synced(signer, tmp_path), sha, policy)


def test_garbage_openpgp_signature(signer: Signing, pgp_a: GpgKey, tmp_path: Path) -> None:
    unsigned = signer.raw(signer.commit("garbage pgp"))
    garbage = (b"-----BEGIN PGP SIGNATURE-----\n\niHUEABYI\xff\xfe\x80\n=abcd\n"
               b"-----END PGP SIGNATURE-----")
    sha = signer.write_object("commit", with_signature(unsigned, ("gpgsig", garbage)))
    git = synced(signer, tmp_path)
    policy = pgp_policy(signer, tmp_path, (pgp_a,), (pgp_a,))
    prepare_keys(git, policy)
    refused("BadSignature", verify_commit, git, sha, policy)


def test_two_signature_headers(signer: Signing, alice: SshKey, tmp_path: Path) -> None:
    unsigned = signer.raw(signer.commit("twice"))
    sig = signer.ssh_sign(unsigned, alice)
    both = signer.write_object("commit", with_signature(
        unsigned, ("gpgsig", sig), ("gpgsig-sha256", sig)))
    repeated = signer.write_object("commit", with_signature(
        unsigned, ("gpgsig", sig), ("gpgsig", sig)))
    git = synced(signer, tmp_path)
    policy = ssh_policy(signer, tmp_path, ("alice@example.invalid", alice))
    refused("MultipleSignatures", verify_commit, git, both, policy)
    refused("MultipleSignatures", verify_commit, git, repeated, policy)
    # The helper builds what git builds: the same signature, once, verifies.
    once = signer.write_object("commit", with_signature(unsigned, ("gpgsig", sig)))
    fetch(git, signer)
    assert verify_commit(git, once, policy).fingerprint == alice.fingerprint


def test_signature_format_pure() -> None:
    head = b"tree " + b"0" * 40 + b"\nauthor A <a@x> 1 +0000\ncommitter A <a@x> 1 +0000\n"
    ssh = b"gpgsig -----BEGIN SSH SIGNATURE-----\n U1NI\n -----END SSH SIGNATURE-----\n"
    pgp = b"gpgsig -----BEGIN PGP SIGNATURE-----\n \n iHUE\n -----END PGP SIGNATURE-----\n"
    assert signature_format(head + b"\nmessage\n") is None
    assert signature_format(head + ssh + b"\nmessage\n") == "ssh"
    assert signature_format(head + pgp + b"\nmessage\n") == "openpgp"
    assert signature_format(head + ssh + pgp + b"\nm\n") == "multiple"
    assert signature_format(head + b"gpgsig -----BEGIN SIGNED MESSAGE-----\n\nm\n") == "x509"
    assert signature_format(head + b"gpgsig \xff\n\nm\n") == "unknown"
    # In a commit, only a header signs: a signature-looking message does not,
    # nor the signature of a merged tag (mergetag's continuation lines).
    assert signature_format(head + b"\n-----BEGIN SSH SIGNATURE-----\n") is None
    mergetag = b"mergetag object x\n tag v0\n \n -----BEGIN PGP SIGNATURE-----\n x\n"
    assert signature_format(head + mergetag + b"\nmerge\n") is None
    tag = b"object " + b"0" * 40 + b"\ntype commit\ntag v1\ntagger A <a@x> 1 +0000\n\nv1\n"
    assert signature_format(tag) is None
    assert signature_format(tag + b"-----BEGIN PGP SIGNATURE-----\n\niHUE\n") == "openpgp"
    # A tag's signature is its last block (git's parse_signed_buffer); one in
    # the message before it is signed text.
    assert signature_format(tag + b"-----BEGIN PGP SIGNATURE-----\nx\n"
                                  b"-----BEGIN SSH SIGNATURE-----\ny\n") == "ssh"
    assert signature_format(b"") is None


# --- openpgp -----------------------------------------------------------------------


def test_good_openpgp_commit(signer: Signing, pgp_a: GpgKey, pgp_b: GpgKey,
                             tmp_path: Path) -> None:
    sha = signer.commit("good pgp", pgp_a)
    git = synced(signer, tmp_path)
    policy = pgp_policy(signer, tmp_path, (pgp_a, pgp_b), (pgp_a,))
    prepare_keys(git, policy)
    assert verify_commit(git, sha, policy) == Signer("openpgp", pgp_a.fingerprint, pgp_a.uid)


def test_openpgp_signing_subkey_reports_the_primary(signer: Signing, tmp_path: Path) -> None:
    key = signer.gpg_key("Sub <sub@example.invalid>", signing_subkey=True)
    sha = signer.commit("by a subkey", key)
    git = synced(signer, tmp_path)
    policy = pgp_policy(signer, tmp_path, (key,), (key,))
    signed = verify_revision(git, sha, None, policy)  # imports the keyring itself
    assert signed == [Signer("openpgp", key.fingerprint, key.uid)]
    assert key.signing != key.fingerprint


def test_openpgp_key_in_keyring_but_not_allowed(signer: Signing, pgp_a: GpgKey, pgp_b: GpgKey,
                                                tmp_path: Path) -> None:
    sha = signer.commit("by b", pgp_b)
    git = synced(signer, tmp_path)
    policy = pgp_policy(signer, tmp_path, (pgp_a, pgp_b), (pgp_a,))
    prepare_keys(git, policy)
    err = refused("NotAllowed", verify_commit, git, sha, policy)
    assert pgp_b.fingerprint in err.message


def test_openpgp_key_not_in_keyring(signer: Signing, pgp_a: GpgKey, pgp_b: GpgKey,
                                    tmp_path: Path) -> None:
    sha = signer.commit("by b, unknown", pgp_b)
    git = synced(signer, tmp_path)
    policy = pgp_policy(signer, tmp_path, (pgp_a,), (pgp_a, pgp_b))
    prepare_keys(git, policy)
    refused("UnknownSigner", verify_commit, git, sha, policy)


def test_openpgp_revoked_key(signer: Signing, tmp_path: Path) -> None:
    key = signer.gpg_key("Gone <gone@example.invalid>")
    sha = signer.commit("then revoked", key)
    signer.revoke(key)
    git = synced(signer, tmp_path)
    policy = pgp_policy(signer, tmp_path, (key,), (key,))  # the export carries the revocation
    prepare_keys(git, policy)
    refused("Revoked", verify_commit, git, sha, policy)


def test_openpgp_expired_key(signer: Signing, tmp_path: Path) -> None:
    key = signer.gpg_key("Old <old@example.invalid>", expire="1d", faked_time="20200101T000000")
    sha = signer.commit("back then", key, gpg_program=signer.faked_gpg("20200101T120000"))
    git = synced(signer, tmp_path)
    policy = pgp_policy(signer, tmp_path, (key,), (key,))
    prepare_keys(git, policy)
    refused("ExpiredKey", verify_commit, git, sha, policy)


def test_openpgp_two_signatures_in_one_block(signer: Signing, pgp_a: GpgKey, pgp_b: GpgKey,
                                             tmp_path: Path) -> None:
    unsigned = signer.raw(signer.commit("signed by two"))
    sig = signer.gpg_sign(unsigned, pgp_a, pgp_b)
    sha = signer.write_object("commit", with_signature(unsigned, ("gpgsig", sig)))
    git = synced(signer, tmp_path)
    policy = pgp_policy(signer, tmp_path, (pgp_a, pgp_b), (pgp_a, pgp_b))
    prepare_keys(git, policy)
    refused("MultipleSignatures", verify_commit, git, sha, policy)
    # One of them alone, in the same place, verifies.
    one = signer.write_object("commit", with_signature(
        unsigned, ("gpgsig", signer.gpg_sign(unsigned, pgp_b))))
    fetch(git, signer)
    assert verify_commit(git, one, policy).fingerprint == pgp_b.fingerprint
    assert without_signature(signer.raw(one)) == unsigned


def test_keyring_changed_drops_a_key(signer: Signing, pgp_a: GpgKey, pgp_b: GpgKey,
                                     tmp_path: Path) -> None:
    sha = signer.commit("by b, soon dropped", pgp_b)
    git = synced(signer, tmp_path)
    policy = pgp_policy(signer, tmp_path, (pgp_a, pgp_b), (pgp_a, pgp_b))
    prepare_keys(git, policy)
    assert verify_commit(git, sha, policy).name == pgp_b.uid
    # Unchanged: no gpg runs again.
    runs = len(git.runner.history)
    prepare_keys(git, policy)
    assert len(git.runner.history) == runs
    # The same file now holds only a (armored this time): b no longer verifies.
    assert policy.keyring is not None
    signer.keyring(policy.keyring, pgp_a, armor=True)
    prepare_keys(git, policy)
    refused("UnknownSigner", verify_commit, git, sha, policy)
    assert (git.gnupg_home / KEYRING_STAMP).exists()
    assert sorted(p.name for p in git.root.iterdir()) == ["gnupg", "home", "repo.git"]


def test_keyring_unreadable_empties_the_home(signer: Signing, pgp_a: GpgKey,
                                             tmp_path: Path) -> None:
    sha = signer.commit("by a", pgp_a)
    git = synced(signer, tmp_path)
    policy = pgp_policy(signer, tmp_path, (pgp_a,), (pgp_a,))
    prepare_keys(git, policy)
    assert policy.keyring is not None
    policy.keyring.write_bytes(b"\xff\xfe not a keyring")
    refused("KeysUnreadable", prepare_keys, git, policy)
    refused("UnknownSigner", verify_commit, git, sha, policy)  # no old key survives
    policy.keyring.unlink()
    refused("KeysUnreadable", prepare_keys, git, policy)
    refused("KeysUnreadable", verify_revision, git, sha, None, policy)
    assert sorted(p.name for p in git.root.iterdir()) == ["gnupg", "home", "repo.git"]


def test_ssh_files_missing(signer: Signing, alice: SshKey, tmp_path: Path) -> None:
    sha = signer.commit("files missing", alice)
    git = synced(signer, tmp_path)
    missing = tmp_path / "nonexistent"
    no_allowed = SourceVerify(mode="head", format="ssh", allowed_signers=missing)
    refused("KeysUnreadable", verify_commit, git, sha, no_allowed)
    refused("KeysUnreadable", prepare_keys, git, no_allowed)
    # git itself only warns about a missing revocation file and verifies without it.
    allowed = signer.allowed_signers(tmp_path / "allowed", ("alice@example.invalid", alice))
    no_revocation = SourceVerify(mode="head", format="ssh", allowed_signers=allowed,
                                 revocation=missing)
    err = refused("KeysUnreadable", verify_commit, git, sha, no_revocation)
    assert str(missing) in err.message


# --- tags and modes ------------------------------------------------------------------


def test_signed_tag_over_unsigned_head(signer: Signing, alice: SshKey, tmp_path: Path) -> None:
    head = signer.commit("unsigned head")
    tag = signer.tag("v-ssh-1", head, alice)
    git = synced(signer, tmp_path)
    entry = ("alice@example.invalid", alice)
    want = Signer("ssh", alice.fingerprint, "alice@example.invalid")
    assert verify_tag(git, tag, ssh_policy(signer, tmp_path, entry)) == want
    assert verify_revision(git, head, tag, ssh_policy(signer, tmp_path, entry, mode="tag")) \
        == [want]
    refused("Unsigned", verify_revision, git, head, tag,
            ssh_policy(signer, tmp_path, entry, mode="tagAndHead"))
    refused("Unsigned", verify_revision, git, head, tag, ssh_policy(signer, tmp_path, entry))
    refused("NoTag", verify_revision, git, head, None,
            ssh_policy(signer, tmp_path, entry, mode="tag"))


def test_tag_and_head_both_signed(signer: Signing, alice: SshKey, pgp_a: GpgKey,
                                  tmp_path: Path) -> None:
    head = signer.commit("signed head", pgp_a)
    tag = signer.tag("v-pgp-1", head, pgp_a)
    git = synced(signer, tmp_path)
    policy = pgp_policy(signer, tmp_path, (pgp_a,), (pgp_a,), mode="tagAndHead")
    want = Signer("openpgp", pgp_a.fingerprint, pgp_a.uid)
    assert verify_revision(git, head, tag, policy) == [want, want]


def test_tag_must_name_the_commit(signer: Signing, alice: SshKey, tmp_path: Path) -> None:
    old = signer.commit("tagged", alice)
    tag = signer.tag("v-ssh-2", old, alice)
    new = signer.commit("not tagged", alice)
    git = synced(signer, tmp_path)
    policy = ssh_policy(signer, tmp_path, ("alice@example.invalid", alice), mode="tag")
    err = refused("TagMismatch", verify_revision, git, new, tag, policy)
    assert old[:12] in err.message and new[:12] in err.message


def test_object_types_are_checked(signer: Signing, alice: SshKey, tmp_path: Path) -> None:
    head = signer.commit("signed", alice)
    unsigned_tag = signer.tag("v-plain-1", head)
    signed_tag = signer.tag("v-ssh-3", head, alice)
    git = synced(signer, tmp_path)
    policy = ssh_policy(signer, tmp_path, ("alice@example.invalid", alice))
    # verify-commit would peel the tag and check its (signed) commit.
    refused("NotACommit", verify_commit, git, signed_tag, policy)
    refused("NotATag", verify_tag, git, head, policy)
    refused("Unsigned", verify_tag, git, unsigned_tag, policy)
    refused("NotACommit", verify_commit, git, "f" * 40, policy)
    refused("NotACommit", verify_commit, git, "--help", policy)
    refused("NotATag", verify_tag, git, "HEAD", policy)




def test_a_verdict_too_long_to_read_whole_is_refused(signer: Signing, pgp_a: GpgKey,
                                                     pgp_b: GpgKey, tmp_path: Path) -> None:
    """git's verdict is read from the verifier's lines; past what the Runner
    keeps of stderr (its head and tail) a line could go unseen (a second
    signature's NEWSIG), so the commit is refused, never judged on part of
    them. Here three signatures, each with two notations of 4000 "%" (gpg
    expands "%%" to one; its status escapes each as "%25"): ~85 KB of status."""
    carol = signer.gpg_key("Carol <carol@example.invalid>")
    unsigned = signer.raw(signer.commit("long notations"))
    users = [a for k in (pgp_a, pgp_b, carol) for a in ("-u", f"{k.signs_with}!")]
    notations = [a for name in ("n", "m")
                 for a in ("--sig-notation", f"{name}@example.invalid=" + "%" * 8000)]
    signature = signer.gpg(*users, "--detach-sign", "--armor", *notations, stdin=unsigned)
    sha = signer.write_object("commit", with_signature(unsigned, ("gpgsig", signature)))
    policy = pgp_policy(signer, tmp_path, (pgp_a, pgp_b, carol), (pgp_a,))
    said = refused("BadSignature", verify_revision, synced(signer, tmp_path), sha, None, policy)
    assert "the verifier said too much to be read whole" in said.message, said.message
