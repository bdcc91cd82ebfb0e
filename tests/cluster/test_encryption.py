"""LUKS2 at rest on the real cluster, on this host: luksFormat under the mkfs
proofs with a passphrase sealed in image-meta (bound to the image), a second
apply that never formats again, rotate-key (with a kill between its
steps), clones, copies and flattens that keep their key, records
copied from another image refused, and no key in any output. Opening needs
dm-crypt: where the kernel has none (these machines), the open fails
cleanly, undoes the map and says why; tests/kernel opens, stages, grows and
closes it for real in the VM. The passphrase is used (and a record sealed
again) before that open, so the binding is proven here either way."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import rbd
from conftest import NodeUnderTest
from keyrecords import wrap_v1
from test_groups import group_doc, groups_in_pool
from test_snapshots import snapshot

from reconciler.apply import rotate
from reconciler.apply.sealing import ImageSeals
from reconciler.drivers import ceph, keys
from reconciler.drivers.crypt import Cryptsetup
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



def test_rotate_key_survives_a_kill_between_steps(enc_node: NodeUnderTest,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    n = enc_node
    name = n.name("rot")
    formatted(n, name)
    # Map it (the raw device) for the rotation: a map-only spec.
    n.write(name, f"  image: {{pool: {n.cluster.pool}, size: 64Mi}}\n  map: {{}}\n"
                  f"  encryption: {{type: luks2, key: {{wrappedBy: {node_key_path(n)}}}}}\n")
    assert n.apply()["rc"] == 0
    before = unseal(n, name).passphrase
    # Killed right after the new keyslot was added: nothing switched yet.
    real_set = ceph.set_meta

    def dies_at_switch(cluster: object, pool: str, image: str, key: str, value: str) -> None:
        if key == rotate.PREV:
            raise KeyboardInterrupt("killed")
        real_set(cluster, pool, image, key, value)  # type: ignore[arg-type]

    monkeypatch.setattr(ceph, "set_meta", dies_at_switch)
    rc, _ = n.cli("rotate-key", name)  # the CLI reports the interrupt (exit != 0)
    assert rc != 0
    monkeypatch.setattr(ceph, "set_meta", real_set)
    m = image_meta(n, name)
    assert unseal(n, name).passphrase == before  # still the old one
    assert rotate.NEXT in m
    rc, out = n.cli("rotate-key", name)
    assert rc == 0, out
    assert "rotated" in out and before.decode() not in out
    m = image_meta(n, name)
    after = unseal(n, name).passphrase
    assert after != before and rotate.NEXT not in m and rotate.PREV not in m
    crypt = crypt_of(n)
    device = device_of(n, name)
    assert crypt.opens(device, after) and not crypt.opens(device, before)
    assert keys.parse(m[meta.LUKS_KEY]).bound == image_ref(n, name)


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
