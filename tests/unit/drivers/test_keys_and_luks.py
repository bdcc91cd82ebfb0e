"""LUKS2 keys and cryptsetup, for real on an image file (luksFormat, keyslots
and the header need no device-mapper; opening does: see tests/kernel).

Key files are trusted only as root's, closed to group and others, under the
key root (opened below its descriptor: no '..', no symlink); a sealed
passphrase opens only with the node key that sealed it, only for the image
it was sealed for (or a clone Ceph says descends from it), and its record
cannot choose the scrypt cost."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from keyrecords import wrap_v1

from reconciler.drivers import keys, safepath
from reconciler.drivers.crypt import Cryptsetup, Pbkdf, describe, keyslots
from reconciler.drivers.run import Runner
from reconciler.facts import luks

needs_cryptsetup = pytest.mark.skipif(shutil.which("cryptsetup") is None,
                                      reason="cryptsetup not installed (scripts/setup.sh)")
FAST = Pbkdf("pbkdf2", iterations=1000)


@pytest.fixture
def keyroot(tmp_path: Path) -> Path:
    root = tmp_path / "keys"
    root.mkdir(mode=0o700)
    return root


def key_file(root: Path, name: str = "node.key", mode: int = 0o600,
             data: bytes = b"k" * 64) -> Path:
    p = root / name
    p.write_bytes(data)
    p.chmod(mode)
    return p


def test_key_file_rules(keyroot: Path, tmp_path: Path) -> None:
    good = key_file(keyroot)
    assert keys.read_key_file(str(good), str(keyroot)) == b"k" * 64
    loose = key_file(keyroot, "loose.key", 0o640)
    with pytest.raises(keys.KeyProblem, match="open to group or others"):
        keys.read_key_file(str(loose), str(keyroot))
    outside = key_file(tmp_path, "outside.key")
    with pytest.raises(keys.KeyProblem, match="not under the key root"):
        keys.read_key_file(str(outside), str(keyroot))
    link = keyroot / "link.key"
    link.symlink_to(good)
    with pytest.raises(keys.KeyProblem, match="symlink"):
        keys.read_key_file(str(link), str(keyroot))
    theirs = key_file(keyroot, "theirs.key")
    os.chown(theirs, 1000, 1000)
    with pytest.raises(keys.KeyProblem, match="owned by uid 1000"):
        keys.read_key_file(str(theirs), str(keyroot))
    empty = key_file(keyroot, "empty.key", data=b"")
    with pytest.raises(keys.KeyProblem, match="empty"):
        keys.read_key_file(str(empty), str(keyroot))
    with pytest.raises(keys.KeyProblem, match="No such file"):
        keys.read_key_file(str(keyroot / "missing.key"), str(keyroot))


def test_key_files_stay_below_the_key_root(keyroot: Path, tmp_path: Path) -> None:
    """A text prefix is not a place: ROOT/../x starts with ROOT/ and leads
    out of it; so does a symlinked directory inside the root."""
    outside = tmp_path / "etc"
    outside.mkdir()
    secret = key_file(outside, "host.key")  # root's, 0600: a key file in every other way
    escape = f"{keyroot}/../etc/host.key"
    assert os.path.exists(escape)
    with pytest.raises(keys.KeyProblem, match="not a clean absolute path"):
        keys.read_key_file(escape, str(keyroot))
    with pytest.raises(keys.KeyProblem, match="not a clean absolute path"):
        keys.read_key_file(f"{keyroot}/./node.key", str(keyroot))
    with pytest.raises(keys.KeyProblem, match="not a clean absolute path"):
        keys.read_key_file(f"{keyroot}//node.key", str(keyroot))
    (keyroot / "sub").symlink_to(outside)  # a symlink component, not the last one
    with pytest.raises(keys.KeyProblem, match="sub is a symlink"):
        keys.read_key_file(f"{keyroot}/sub/host.key", str(keyroot))
    with pytest.raises(keys.KeyProblem, match="not under the key root"):
        keys.read_key_file(str(secret), str(keyroot))
    with pytest.raises(keys.KeyProblem, match="not under the key root"):
        keys.read_key_file(str(keyroot), str(keyroot))  # the root itself names no file
    # The walk without openat2 (older kernels) refuses the same.
    old = safepath._HAVE_OPENAT2
    safepath._HAVE_OPENAT2 = False
    try:
        with pytest.raises(keys.KeyProblem, match="sub is a symlink"):
            keys.read_key_file(f"{keyroot}/sub/host.key", str(keyroot))
        assert keys.read_key_file(str(key_file(keyroot)), str(keyroot)) == b"k" * 64
    finally:
        safepath._HAVE_OPENAT2 = old
    with pytest.raises(safepath.UnsafePath, match="leads out"):
        safepath.open_beneath(str(keyroot), "../etc/host.key")


A = keys.ImageRef(3, "10a2b3c4d5e6")
B = keys.ImageRef(3, "10f0e0d0c0b0")


def test_sealed_passphrase_opens_only_with_its_node_key() -> None:
    node_key, other = os.urandom(64), os.urandom(64)
    phrase = keys.new_passphrase()
    sealed = keys.wrap(phrase, node_key, A, by="/k/node.key")
    assert phrase not in sealed.encode() and len(phrase) == 64
    got = keys.unwrap(sealed, node_key, "rbd/v", A)
    assert got.passphrase == phrase and got.bound == A and not got.reseal_due(A)
    with pytest.raises(keys.KeyProblem, match="does not open"):
        keys.unwrap(sealed, other, "rbd/v", A)
    rec = json.loads(sealed)
    tampered = json.dumps({**rec, "sealed": rec["nonce"] + rec["sealed"][16:]})
    with pytest.raises(keys.KeyProblem):
        keys.unwrap(tampered, node_key, "rbd/v", A)
    costly = json.dumps({**rec, "n": 1 << 22})  # image-meta may not choose the cost
    with pytest.raises(keys.KeyProblem, match="not ours"):
        keys.unwrap(costly, node_key, "rbd/v", A)
    with pytest.raises(keys.KeyProblem, match="unreadable"):
        keys.unwrap("{not json", node_key, "rbd/v", A)


def test_a_seal_opens_only_for_its_image_or_a_clone_of_it() -> None:
    node_key, phrase = os.urandom(64), keys.new_passphrase()
    sealed = keys.wrap(phrase, node_key, A)
    # Copied into B: refused, naming B, before any scrypt work.
    with pytest.raises(keys.KeyProblem, match=r"^rbd/b \(node key /k\): .*sealed for another "
                                              r"image \(pool id 3, image id 10a2b3c4d5e6\)"):
        keys.unwrap(sealed, node_key, "rbd/b (node key /k)", B)
    # A record that claims a parent B does not have: Ceph's lineage decides.
    with pytest.raises(keys.KeyProblem, match="nor for a parent"):
        keys.unwrap(sealed, node_key, "rbd/b", B, lambda: [keys.ImageRef(3, "99")])
    # B is a clone of A (Ceph's parent link): it opens, and is due a re-seal.
    got = keys.unwrap(sealed, node_key, "rbd/b", B, lambda: [keys.ImageRef(3, "99"), A])
    assert got.passphrase == phrase and got.reseal_due(B)
    # The binding is authenticated: rewriting it to name B breaks the seal.
    forged = json.dumps({**json.loads(sealed), "image": B.image})
    with pytest.raises(keys.KeyProblem, match="does not open"):
        keys.unwrap(forged, node_key, "rbd/b", B)
    forged = json.dumps({**json.loads(sealed), "pool": 4})
    with pytest.raises(keys.KeyProblem, match="does not open"):
        keys.unwrap(forged, node_key, "rbd/a", keys.ImageRef(4, A.image))
    # The hint is only a hint: changing it changes nothing that opens.
    hinted = json.dumps({**json.loads(sealed), "by": "/elsewhere"})
    assert keys.unwrap(hinted, node_key, "rbd/a", A).passphrase == phrase
    assert keys.parse(hinted).by == "/elsewhere"


def test_version_1_records_open_for_upgrades_unless_refused() -> None:
    node_key, phrase = os.urandom(64), keys.new_passphrase()
    old = wrap_v1(phrase, node_key)
    got = keys.unwrap(old, node_key, "rbd/a", A)
    assert got.passphrase == phrase and got.bound is None and got.reseal_due(A)
    with pytest.raises(keys.KeyProblem, match=r"version-1 record.*acceptUnbound"):
        keys.unwrap(old, node_key, "rbd/a", A, accept_unbound=False)
    # A version-2 record cannot be passed off as version 1 (its AD is gone).
    v2 = json.loads(keys.wrap(phrase, node_key, A))
    downgraded = json.dumps({k: v for k, v in v2.items() if k not in ("pool", "image")}
                            | {"v": 1})
    with pytest.raises(keys.KeyProblem, match="does not open"):
        keys.unwrap(downgraded, node_key, "rbd/b", B)


@needs_cryptsetup
def test_luks2_format_keyslots_and_header_on_a_file(tmp_path: Path) -> None:
    img = tmp_path / "img"
    with open(img, "wb") as f:
        f.truncate(32 << 20)
    runner = Runner(timeout=60)
    c = Cryptsetup(runner, FAST)
    old, new = keys.new_passphrase(), keys.new_passphrase()
    assert not c.is_luks(str(img))
    c.format(str(img), old)
    assert c.is_luks(str(img)) and c.opens(str(img), old) and not c.opens(str(img), new)
    c.add_key(str(img), old, new)
    assert c.opens(str(img), new) and keyslots(c.dump(str(img))) == ["0", "1"]
    c.remove_key(str(img), old)
    assert not c.opens(str(img), old) and keyslots(c.dump(str(img))) == ["1"]
    assert describe(c.dump(str(img))).startswith("LUKS2 aes-xts-plain64")
    head = img.read_bytes()[:65536]
    assert luks.data_offset(head) == 16 << 20
    # No key on any command line, ever.
    assert not any(old.decode() in " ".join(a) or new.decode() in " ".join(a)
                   for a in runner.history)


def test_crypt_names_are_safe_and_stable() -> None:
    assert luks.crypt_name("pgdata") == "rbdr-pgdata"
    assert luks.crypt_name("csi-4f/../x") == "rbdr-csi-4f_.._x"
    assert len(luks.crypt_name("v" * 300)) == 127
    assert luks.data_offset(b"\0" * 8192) is None
