"""LUKS2 at rest on the real cluster, on this host: luksFormat under the mkfs
proofs with a passphrase sealed in image-meta, a second apply that never
formats again, rotate-key (with a kill between its steps), and no key in any
output. Opening needs dm-crypt: where the kernel has none (these machines),
the open fails cleanly, undoes the map and says why; tests/kernel opens,
stages, grows and closes it for real in the VM."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import NodeUnderTest

from reconciler.apply import rotate
from reconciler.drivers import ceph, keys
from reconciler.facts import meta
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
    node_key = (n.root / "keys" / "node.key").read_bytes()
    phrase = keys.unwrap(m[meta.LUKS_KEY], node_key, name)
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
    n.write(name, f"  image: {{pool: {n.cluster.pool}, size: 64Mi}}\n  map: {{}}\n"
                  f"  encryption: {{type: luks2, key: {{wrappedBy: "
                  f"{n.root / 'keys' / 'node.key'}}}}}\n"
                  f"  stage: {{fsType: ext4, path: {n.srv / 'data'}}}\n")
    n.apply()  # formats LUKS2 (the open needs dm-crypt: not required here)
    # Map it (the raw device) for the rotation: a map-only spec.
    n.write(name, f"  image: {{pool: {n.cluster.pool}, size: 64Mi}}\n  map: {{}}\n"
                  f"  encryption: {{type: luks2, key: {{wrappedBy: "
                  f"{n.root / 'keys' / 'node.key'}}}}}\n")
    assert n.apply()["rc"] == 0
    node_key = (n.root / "keys" / "node.key").read_bytes()
    before = keys.unwrap(image_meta(n, name)[meta.LUKS_KEY], node_key, name)
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
    assert keys.unwrap(m[meta.LUKS_KEY], node_key, name) == before  # still the old one
    assert rotate.NEXT in m
    rc, out = n.cli("rotate-key", name)
    assert rc == 0, out
    assert "rotated" in out and before.decode() not in out
    m = image_meta(n, name)
    after = keys.unwrap(m[meta.LUKS_KEY], node_key, name)
    assert after != before and rotate.NEXT not in m and rotate.PREV not in m
    cfg = load_config(n.config)
    from reconciler.observe.node import Node
    crypt = Node.from_config(cfg).crypt
    device = next(iter(n.cli_json("status")[1]["volumes"]))["device"]
    assert crypt.opens(device, after) and not crypt.opens(device, before)


def test_a_clone_opens_with_its_parents_sealed_passphrase(enc_node: NodeUnderTest) -> None:
    """A clone's image-meta is copied from its parent: the LUKS2 container
    and the sealed passphrase come with it, so the clone is opened (never
    formatted) with the passphrase the parent's node key unseals."""
    n = enc_node
    parent, clone = n.name("luks-parent"), n.name("luks-clone")
    key = n.root / "keys" / "node.key"
    enc = f"  encryption: {{type: luks2, key: {{wrappedBy: {key}}}}}\n"
    n.write(parent, f"  image: {{pool: {n.cluster.pool}, size: 64Mi}}\n  map: {{}}\n{enc}"
                    f"  stage: {{fsType: ext4, path: {n.srv / 'p'}}}\n")
    n.apply()  # luksFormat (the open needs dm-crypt: not required here)
    n.write(parent, f"  image: {{pool: {n.cluster.pool}, size: 64Mi}}\n")  # back to the image
    assert n.apply()["rc"] == 0
    n.write(clone, f"  image:\n    pool: {n.cluster.pool}\n    source: {{volume: {parent}}}\n"
                   f"  map: {{}}\n{enc}")
    doc = n.apply()
    assert doc["rc"] == 0, doc
    m_parent, m_clone = image_meta(n, parent), image_meta(n, clone)
    assert m_clone[meta.CRYPT_FORMATTED] == "luks2"
    assert m_clone[meta.LUKS_KEY] == m_parent[meta.LUKS_KEY]
    phrase = keys.unwrap(m_clone[meta.LUKS_KEY], key.read_bytes(), clone)
    device = next(v for v in n.cli_json("status")[1]["volumes"] if v["name"] == clone)["device"]
    from reconciler.observe.node import Node
    crypt = Node.from_config(load_config(n.config)).crypt
    assert crypt.opens(device, phrase)  # the clone's own LUKS2 header, the parent's key
    # Staging it plans an open, never a luksFormat.
    n.write(clone, f"  image:\n    pool: {n.cluster.pool}\n    source: {{volume: {parent}}}\n"
                   f"  map: {{}}\n{enc}  stage: {{fsType: ext4, path: {n.srv / 'c'}}}\n")
    _, plan = n.plan()
    steps = [s["action"] for v in plan["volumes"] if v["name"] == clone for s in v["steps"]]
    assert "open LUKS2" in steps and "format LUKS2" not in steps
    # mkfs inside only when the parent never got a filesystem (no dm-crypt here).
    assert ("format" in steps) == (meta.FORMATTED not in m_clone)
