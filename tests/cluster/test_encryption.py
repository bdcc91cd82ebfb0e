"""LUKS2 at rest on the real cluster, on this host: luksFormat under the mkfs
proofs with a passphrase sealed in image-meta (bound to the image), a second
apply that never formats again, rotate-key (killed at every boundary, under
the node's lock), clones, copies and flattens that keep their key, records
copied from another image refused, and no key in any output. Opening needs
dm-crypt: where the kernel has none (these machines), the open fails
cleanly, undoes the map and says why; tests/kernel opens, stages, grows and
closes it for real in the VM. The passphrase is used (and a record sealed
again) before that open, so the binding is proven here either way."""

from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import rbd
from conftest import NodeUnderTest
from keyrecords import wrap_v1
from test_groups import group_doc, groups_in_pool
from test_snapshots import snapshot

from reconciler.apply import rotate
from reconciler.apply.sealing import ImageSeals
from reconciler.cli import main as cli
from reconciler.drivers import ceph, keys
from reconciler.drivers.crypt import Cryptsetup, keyslots
from reconciler.drivers.run import Runner
from reconciler.engine import state_lock
from reconciler.facts import meta
from reconciler.observe.node import Node
from reconciler.spec.config import load_config

pytestmark = pytest.mark.ceph


def have_dm_crypt() -> bool:
    return Path("/sys/module/dm_crypt").exists()


@pytest.fixture
def enc_node(node: NodeUnderTest) -> NodeUnderTest:
    keyroot = node.root / "keys"
    keyroot.mkdir(mode=0o700)
    (keyroot / "node.key").write_bytes(os.urandom(64))
    (keyroot / "node.key").chmod(0o600)
    with node.config.open("a") as f:
        f.write(f"encryption:\n  keyRoot: {keyroot}\n  pbkdf: pbkdf2\n  iterations: 1000\n")
    return node


def spec(n: NodeUnderTest, keyfile: str = "node.key", kind: str = "wrappedBy") -> str:
    return (f"  image: {{pool: {n.cluster.pool}, size: 64Mi}}\n  map: {{}}\n"
            f"  encryption: {{type: luks2, key: {{{kind}: {n.root / 'keys' / keyfile}}}}}\n"
            f"  stage: {{fsType: ext4, path: {n.srv / 'data'}}}\n")


def image_meta(n: NodeUnderTest, image: str) -> dict[str, str]:
    with n.cluster.client() as c:
        return ceph.get_meta(c, n.cluster.pool, image)


def image_ref(n: NodeUnderTest, image: str) -> keys.ImageRef:
    with n.cluster.client() as c:
        return ceph.image_ref(c, n.cluster.pool, image)


def node_key_path(n: NodeUnderTest) -> Path:
    return n.root / "keys" / "node.key"


def node_key(n: NodeUnderTest) -> bytes:
    return node_key_path(n).read_bytes()


def unseal(n: NodeUnderTest, image: str, record: str | None = None) -> keys.Unwrapped:
    """The passphrase of ``image`` as this node reads it (Ceph's lineage included)."""
    with n.cluster.client() as c:
        seals = ImageSeals(c, n.cluster.pool, image, True)
        text = record or ceph.get_meta(c, n.cluster.pool, image)[meta.LUKS_KEY]
        return seals.unwrap(text, node_key(n), str(n.root / "keys" / "node.key"))


def crypt_of(n: NodeUnderTest) -> Cryptsetup:
    return Node.from_config(load_config(n.config)).crypt


def device_of(n: NodeUnderTest, name: str) -> str:
    return next(v for v in n.cli_json("status")[1]["volumes"] if v["name"] == name)["device"]


def formatted(n: NodeUnderTest, name: str, key: str = "wrappedBy: node.key") -> None:
    """``name`` made and luksFormatted (staging it: the open after needs dm-crypt,
    which these machines lack), then taken back to the bare image."""
    kind, _, file = key.partition(": ")
    n.write(name, spec(n, file, kind))
    n.apply()
    n.write(name, f"  image: {{pool: {n.cluster.pool}, size: 64Mi}}\n")
    assert n.apply()["rc"] == 0
    assert image_meta(n, name)[meta.CRYPT_FORMATTED] == "luks2"


def test_luks_format_seals_once_and_never_formats_again(enc_node: NodeUnderTest) -> None:
    n = enc_node
    name = n.name("sec")
    n.write(name, spec(n))
    doc = n.apply()
    out = json.dumps(doc)
    [vol] = doc["volumes"]
    steps = {s["action"]: s for s in vol["steps"]}
    assert steps["format LUKS2"]["status"] == "changed"
    m = image_meta(n, name)
    assert m[meta.CRYPT_FORMATTED] == "luks2" and meta.CRYPT_FORMATTING not in m
    phrase = unseal(n, name).passphrase
    assert keys.parse(m[meta.LUKS_KEY]).bound == image_ref(n, name)  # sealed for this image
    assert phrase.decode() not in out  # never in output, logs or status
    _, explained = n.cli("explain", name)
    assert f"encryption: luks2, key wrappedBy {n.root / 'keys' / 'node.key'}" in explained
    assert phrase.decode() not in explained
    assert not any(phrase in p.read_bytes() for p in n.state.rglob("*") if p.is_file())
    if have_dm_crypt():
        assert doc["rc"] == 0 and vol["status"] == "changed"
        return
    # No dm-crypt in this kernel: the open fails with cryptsetup's reason; the
    # map is undone; nothing is left mapped; the image keeps its LUKS2 header.
    assert doc["rc"] != 0 and steps["open LUKS2"]["status"] == "failed"
    assert "device-mapper" in vol["error"] or "dm_mod" in vol["error"]
    assert any("unmap" in u for u in vol["undone"])
    _, plan = n.plan()
    actions = [s["action"] for s in plan["volumes"][0]["steps"]]
    assert "open LUKS2" in actions and "format LUKS2" not in actions and "format" in actions



# --- rotate-key ----------------------------------------------------------------


class Killed(BaseException):
    """rotate-key dies here: nothing after it runs, as under SIGKILL."""


class Boundaries:
    """Counts every image-meta write and cryptsetup call of a rotate-key run;
    armed with ``kill``, dies right before that one."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.armed, self.kill, self.n, self.seen = False, None, 0, []
        real_run, real_update = Runner.run, ceph.update_meta

        def run(runner: Runner, argv: Any, **kw: Any) -> Any:
            if self.armed and argv and str(argv[0]) == "cryptsetup":
                self.tick(" ".join(map(str, argv[:2])))
            return real_run(runner, argv, **kw)

        def update(*args: Any, **kw: Any) -> bool:
            if self.armed:
                self.tick("image-meta write")
            return real_update(*args, **kw)

        monkeypatch.setattr(Runner, "run", run)
        monkeypatch.setattr(ceph, "update_meta", update)

    def tick(self, what: str) -> None:
        if self.n == self.kill:
            raise Killed(what)
        self.seen.append(what)
        self.n += 1

    def cli(self, n: NodeUnderTest, *args: str, kill: int | None = None) -> tuple[int | None, str]:
        """The CLI in-process; rc None: killed."""
        out, old = io.StringIO(), sys.stdout
        self.armed, self.kill, self.n, self.seen = True, kill, 0, []
        sys.stdout = out
        try:
            rc: int | None = cli.main(["--config", str(n.config), *args])
        except Killed:
            rc = None
        finally:
            sys.stdout, self.armed = old, False
        return rc, out.getvalue()


@pytest.mark.parametrize("kind", ["wrappedBy", "file"])
def test_rotate_key_killed_at_every_boundary(enc_node: NodeUnderTest,
                                             monkeypatch: pytest.MonkeyPatch,
                                             kind: str) -> None:
    """Killed before each image-meta write and each cryptsetup call, then run
    again: finished, exactly the new passphrase opens, the old does not, one
    keyslot, no -next/-prev/rotation record; "rotated" is never printed while
    the old passphrase opens. The image-meta writes are the real RADOS ops."""
    n = enc_node
    name = n.name("rot" + kind[0])
    keyroot = n.root / "keys"
    current = keyroot / "node.key"
    if kind == "file":
        current = keyroot / "k0.key"
        current.write_bytes(os.urandom(32))
        current.chmod(0o600)
    formatted(n, name, f"{kind}: {current.name}")

    def map_with(key: Path) -> None:  # the mapped (raw) device is what rotates
        n.write(name, f"  image: {{pool: {n.cluster.pool}, size: 64Mi}}\n  map: {{}}\n"
                      f"  encryption: {{type: luks2, key: {{{kind}: {key}}}}}\n")

    map_with(current)
    assert n.apply()["rc"] == 0
    device, crypt = device_of(n, name), crypt_of(n)
    b = Boundaries(monkeypatch)
    rounds = [0]

    def in_force() -> bytes:
        if kind == "file":
            return current.read_bytes()
        return unseal(n, name).passphrase

    def rotate_key(kill: int | None = None) -> tuple[int | None, str]:
        args = ["rotate-key", name]
        if kind == "file":
            new = keyroot / f"k{rounds[0] + 1}.key"
            if not new.exists():
                new.write_bytes(os.urandom(32))
                new.chmod(0o600)
            args += ["--new-key-file", str(new)]
        return b.cli(n, *args, kill=kill)

    def finished(old: bytes, out: str, where: str) -> None:
        nonlocal current
        assert "rotated" in out, (where, out)
        if kind == "file":  # the operator's step: point the spec at the new file
            rounds[0] += 1
            current = keyroot / f"k{rounds[0]}.key"
            map_with(current)
        new = in_force()
        assert new != old, where
        assert crypt.opens(device, new) and not crypt.opens(device, old), where
        assert len(keyslots(crypt.dump(device))) == 1, (where, crypt.dump(device)["keyslots"])
        left = {rotate.NEXT, rotate.PREV, rotate.JOURNAL} & set(image_meta(n, name))
        assert not left, (where, left)

    old = in_force()
    rc, out = rotate_key()
    assert rc == 0, out
    seen = list(b.seen)
    assert sum(s == "image-meta write" for s in seen) == (3 if kind == "wrappedBy" else 2)
    finished(old, out, "uninterrupted")
    for k in range(len(seen)):
        where = f"killed before {seen[k]!r} (boundary {k} of {len(seen)})"
        old = in_force()
        rc, out = rotate_key(kill=k)
        assert rc is None, (where, out)
        if "rotated" in out:
            assert not crypt.opens(device, old), where
        if {rotate.NEXT, rotate.PREV, rotate.JOURNAL} & set(image_meta(n, name)):
            assert "rotation: interrupted" in n.cli("explain", name)[1], where
        rc, out = rotate_key()
        assert rc == 0, (where, out)
        finished(old, out, where)
    assert old.decode("latin-1") not in out


def test_rotate_key_takes_the_node_lock(enc_node: NodeUnderTest) -> None:
    """One actor per node: with the daemon (or an apply) holding the state
    lock, rotate-key changes nothing and says who holds it."""
    n = enc_node
    name = n.name("rotlock")
    formatted(n, name)
    n.write(name, f"  image: {{pool: {n.cluster.pool}, size: 64Mi}}\n  map: {{}}\n"
                  f"  encryption: {{type: luks2, key: {{wrappedBy: {node_key_path(n)}}}}}\n")
    assert n.apply()["rc"] == 0
    before = image_meta(n, name)
    err = io.StringIO()
    with state_lock(load_config(n.config)), pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "stderr", err)
        rc, out = n.cli("rotate-key", name)
    assert rc == 1 and "in use by another rbd-reconciler" in err.getvalue(), err.getvalue()
    assert image_meta(n, name) == before
    rc, out = n.cli("rotate-key", name)
    assert rc == 0 and "rotated" in out


# --- the seal is bound to its image ----------------------------------------------


def copy_head(n: NodeUnderTest, src: str, dst: str, length: int = 17 << 20) -> None:
    """What someone with write access to the pool does by hand: the LUKS2
    header and the start of the ciphertext of ``src`` written over ``dst``."""
    with n.cluster.client() as c, c.open_ioctx(n.cluster.pool) as io_, \
            rbd.Image(io_, src, read_only=True) as s, rbd.Image(io_, dst) as d:
        for off in range(0, length, 4 << 20):
            d.write(s.read(off, min(4 << 20, length - off)), off)


def test_a_record_copied_from_another_image_is_refused(enc_node: NodeUnderTest) -> None:
    """A's LUKS2 header, ciphertext and sealed passphrase copied into B, a
    volume this node stages: B's open is refused, naming B; nothing of A's
    passphrase is used. The same record in a clone of another image (a parent
    it does not have) is refused too: only Ceph's parent link counts."""
    n = enc_node
    a, b, other, c = (n.name(x) for x in ("ka", "kb", "kother", "kc"))
    formatted(n, a)
    n.write(b, f"  image: {{pool: {n.cluster.pool}, size: 64Mi}}\n")
    assert n.apply()["rc"] == 0
    copy_head(n, a, b)
    stolen = {k: v for k, v in image_meta(n, a).items()
              if k in (meta.LUKS_KEY, meta.CRYPT_FORMATTED)}
    with n.cluster.client() as cl:
        for k, v in stolen.items():
            ceph.set_meta(cl, n.cluster.pool, b, k, v)
    n.write(b, spec(n))
    doc = n.apply()
    [vol] = [v for v in doc["volumes"] if v["name"] == b]
    assert doc["rc"] == 1 and vol["status"] == "failed", vol
    assert f"{n.cluster.pool}/{b} (node key" in vol["error"], vol["error"]
    assert "sealed for another image" in vol["error"], vol["error"]
    assert str(image_ref(n, a)) in vol["error"] and "device-mapper" not in vol["error"]
    assert image_meta(n, b)[meta.LUKS_KEY] == stolen[meta.LUKS_KEY]  # never "repaired"
    # A clone of another image claims nothing: its lineage is Ceph's.
    n.images.update({other, c})
    with n.cluster.client() as cl, cl.open_ioctx(n.cluster.pool) as io_:
        rbd.RBD().create(io_, other, 64 << 20, old_format=False,
                         features=rbd.RBD_FEATURE_LAYERING)
        with rbd.Image(io_, other) as img:
            img.create_snap("s")
            img.protect_snap("s")
        rbd.RBD().clone(io_, other, "s", io_, c, features=rbd.RBD_FEATURE_LAYERING)
        ceph.set_meta(cl, n.cluster.pool, c, meta.LUKS_KEY, stolen[meta.LUKS_KEY])
        assert ceph.lineage(cl, n.cluster.pool, c) == [image_ref(n, other)]
    with pytest.raises(keys.KeyProblem, match=f"{c} .*nor for a parent Ceph lists"):
        unseal(n, c)


def test_clones_open_with_their_parents_passphrase_then_their_own_seal(
        enc_node: NodeUnderTest) -> None:
    """A clone's image-meta is its parent's: the sealed passphrase opens
    through Ceph's parent link, and is then sealed for the clone itself (the
    same passphrase): before the flatten a clone of a volume gets at once,
    and at the first use of an unflattened clone of a snapshot."""
    n = enc_node
    parent, vclone, snap, sclone = (n.name(x) for x in ("lp", "lvc", "lsnap", "lsc"))
    key = n.root / "keys" / "node.key"
    enc = f"  encryption: {{type: luks2, key: {{wrappedBy: {key}}}}}\n"
    formatted(n, parent)
    phrase = unseal(n, parent).passphrase
    # A clone of a volume: through a temporary snapshot, flattened at once.
    n.write(vclone, f"  image:\n    pool: {n.cluster.pool}\n    source: {{volume: {parent}}}\n"
                    f"  map: {{}}\n{enc}")
    doc = n.apply()
    assert doc["rc"] == 0, doc
    flat = [s for v in doc["volumes"] if v["name"] == vclone for s in v["steps"]
            if s["action"] == "flatten"]
    assert flat and "sealed for" in flat[0]["message"], flat
    m_clone = image_meta(n, vclone)
    assert m_clone[meta.CRYPT_FORMATTED] == "luks2"
    assert keys.parse(m_clone[meta.LUKS_KEY]).bound == image_ref(n, vclone)
    assert unseal(n, vclone).passphrase == phrase  # flattened: no parent left to lean on
    device = device_of(n, vclone)
    assert crypt_of(n).opens(device, phrase)  # the clone's own LUKS2 header, the parent's key
    n.write(vclone, f"  image:\n    pool: {n.cluster.pool}\n    source: {{volume: {parent}}}\n"
                    f"  map: {{}}\n{enc}  stage: {{fsType: ext4, path: {n.srv / 'c'}}}\n")
    _, plan = n.plan()
    steps = [s["action"] for v in plan["volumes"] if v["name"] == vclone for s in v["steps"]]
    assert "open LUKS2" in steps and "format LUKS2" not in steps
    # A clone of a snapshot (not flattened): the parent's record opens through
    # the link, and its first use seals it for the clone.
    snapshot(n, snap, parent)
    n.write(sclone, f"  image:\n    pool: {n.cluster.pool}\n    source: {{snapshot: {snap}}}\n"
                    f"  map: {{}}\n{enc}  stage: {{fsType: ext4, path: {n.srv / 's'}}}\n")
    n.apply()
    with n.cluster.client() as cl:
        assert ceph.lineage(cl, n.cluster.pool, sclone) == [image_ref(n, parent)]
    m = image_meta(n, sclone)
    assert keys.parse(m[meta.LUKS_KEY]).bound == image_ref(n, sclone)
    assert unseal(n, sclone).passphrase == phrase


def test_a_flatten_that_would_lose_the_key_is_refused(enc_node: NodeUnderTest) -> None:
    """A clone whose spec names no key (a CSI clone before its first stage)
    is sealed for itself before the flatten with the node key its record
    names; with that key gone from this node the flatten is refused (the
    record would open nowhere without the parent link), and done once it is
    back."""
    n = enc_node
    parent, clone = n.name("fp"), n.name("fc")
    formatted(n, parent)
    phrase = unseal(n, parent).passphrase
    key = n.root / "keys" / "node.key"
    away = n.root / "node.key.away"
    key.rename(away)
    n.write(clone, f"  image:\n    pool: {n.cluster.pool}\n    source: {{volume: {parent}}}\n")
    doc = n.apply()
    [vol] = [v for v in doc["volumes"] if v["name"] == clone]
    assert doc["rc"] == 1 and "not flattened" in vol["error"], vol
    assert str(key) in vol["error"] and "open nowhere" in vol["error"], vol["error"]
    with n.cluster.client() as cl:
        assert ceph.lineage(cl, n.cluster.pool, clone) == [image_ref(n, parent)]
    away.rename(key)
    doc = n.apply()
    assert doc["rc"] == 0, doc
    with n.cluster.client() as cl:
        assert ceph.lineage(cl, n.cluster.pool, clone) == []
    assert keys.parse(image_meta(n, clone)[meta.LUKS_KEY]).bound == image_ref(n, clone)
    assert unseal(n, clone).passphrase == phrase


def test_version_1_records_are_read_and_sealed_again(enc_node: NodeUnderTest) -> None:
    """An upgrade locks nobody out: a record sealed before the binding opens,
    and its first use seals it for its image; encryption.acceptUnbound:
    false refuses it instead."""
    n = enc_node
    name = n.name("v1")
    formatted(n, name)
    phrase = unseal(n, name).passphrase
    with n.cluster.client() as cl:
        ceph.set_meta(cl, n.cluster.pool, name, meta.LUKS_KEY, wrap_v1(phrase, node_key(n)))
    config = n.config.read_text()
    n.config.write_text(config + "  acceptUnbound: false\n")
    n.write(name, spec(n))
    doc = n.apply()
    assert doc["rc"] == 1 and "version-1 record" in doc["volumes"][0]["error"], doc
    assert keys.parse(image_meta(n, name)[meta.LUKS_KEY]).bound is None
    n.config.write_text(config)
    doc = n.apply()
    assert "version-1" not in str(doc["volumes"][0]["error"]), doc
    record = image_meta(n, name)[meta.LUKS_KEY]
    assert keys.parse(record).bound == image_ref(n, name)
    assert unseal(n, name).passphrase == phrase


def test_a_group_snapshot_restore_is_sealed_for_the_copy(enc_node: NodeUnderTest) -> None:
    """A copy from a group snapshot has no parent link: its record, sealed
    for the member it was copied from, is sealed for the copy before the copy
    gets its name."""
    n = enc_node
    a, g, r = n.name("gm"), n.name("gk"), n.name("gr")
    formatted(n, a)
    phrase = unseal(n, a).passphrase
    group_doc(n, g, [a])
    assert n.apply()["rc"] == 0
    n.write(r, f"  image:\n    pool: {n.cluster.pool}\n    source: {{groupSnapshot: "
               f"{{pool: {n.cluster.pool}, group: {g}, image: {a}}}}}\n  map: {{}}\n"
               f"  encryption: {{type: luks2, key: {{wrappedBy: {node_key_path(n)}}}}}\n")
    doc = n.apply()
    assert doc["rc"] == 0, doc
    assert keys.parse(image_meta(n, r)[meta.LUKS_KEY]).bound == image_ref(n, r)
    assert unseal(n, r).passphrase == phrase
    assert crypt_of(n).opens(device_of(n, r), phrase)
    n.write(r, f"  image: {{pool: {n.cluster.pool}, size: 64Mi}}\n")
    group_doc(n, g, [a], state="absent")
    assert n.apply()["rc"] == 0
    assert g not in groups_in_pool(n)
