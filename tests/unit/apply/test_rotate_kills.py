"""rotate-key killed at every boundary (before each image-meta write and
each cryptsetup call), then run again: it finishes, exactly the new
passphrase opens the container, the old one does not, no keyslot is left
behind, no -next/-prev/rotation record is left, and "rotated" is never said
while the old passphrase still opens it.

The container is a LUKS2 header on a file (cryptsetup needs no device-mapper
for luksFormat, luksAddKey, luksRemoveKey, luksKillSlot and
--test-passphrase); image-meta is a dict with the compare-and-set semantics
of ceph.update_meta (tests/cluster/test_encryption.py does the same against
the real header object)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from keyrecords import wrap_v1

from reconciler.apply.rotate import JOURNAL, NEXT, PREV, RotateRefused, Rotation
from reconciler.drivers import keys
from reconciler.drivers.crypt import Cryptsetup, Pbkdf, keyslots
from reconciler.drivers.run import Runner
from reconciler.facts import meta

pytestmark = pytest.mark.skipif(shutil.which("cryptsetup") is None,
                                reason="cryptsetup not installed (scripts/setup.sh)")
FAST = Pbkdf("pbkdf2", iterations=1000)
ME = keys.ImageRef(2, "abc123")


@pytest.fixture(autouse=True)
def cheap_scrypt(monkeypatch: pytest.MonkeyPatch) -> None:
    """Records sealed and read here with N=2^10 (wrap and parse agree on it):
    the sweep unseals hundreds of them, and their cost is not under test."""
    monkeypatch.setattr(keys, "SCRYPT_N", 1 << 10)


class Killed(BaseException):
    """The process dies here: nothing after it runs (not even except Exception)."""


class Clock:
    """Counts boundaries; kills before the one numbered ``kill_at``."""

    def __init__(self, kill_at: int | None = None) -> None:
        self.kill_at, self.n, self.seen = kill_at, 0, []

    def tick(self, what: str) -> None:
        if self.n == self.kill_at:
            raise Killed(what)
        self.seen.append(what)
        self.n += 1


class TickingRunner(Runner):
    clock: Clock | None = None

    def run(self, argv: Any, **kw: Any) -> Any:  # type: ignore[override]
        if self.clock is not None:
            self.clock.tick(" ".join(str(a) for a in argv[:2]))
        return super().run(argv, **kw)


class FakeStore:
    """Image-meta with ceph.update_meta's all-or-nothing compare-and-set."""

    def __init__(self, data: dict[str, str]) -> None:
        self.data, self.ref = dict(data), ME
        self.clock: Clock | None = None

    def lineage(self) -> list[keys.ImageRef]:
        return []

    def read(self) -> dict[str, str]:
        return dict(self.data)

    def update(self, expect: dict[str, str | None], changes: dict[str, str | None]) -> bool:
        if self.clock is not None:
            self.clock.tick("image-meta " + ",".join(sorted(changes)))
        if any(self.data.get(k) != v for k, v in expect.items()):
            return False
        for k, v in changes.items():
            if v is None:
                self.data.pop(k, None)
            else:
                self.data[k] = v
        return True


class Rig:
    def __init__(self, tmp: Path, kind: str) -> None:
        self.root = tmp / "keys"
        self.root.mkdir(mode=0o700, exist_ok=True)
        self.node_key = self.key_file("node.key", os.urandom(64))
        self.device = str(tmp / "luks.img")
        with open(self.device, "wb") as f:
            f.truncate(20 << 20)
        self.plain = Cryptsetup(Runner(timeout=60), FAST)
        self.runner = TickingRunner(timeout=60)
        self.crypt = Cryptsetup(self.runner, FAST)
        self.said: list[str] = []
        if kind == "wrappedBy":
            self.old = keys.new_passphrase()
            self.store = FakeStore({meta.LUKS_KEY: keys.wrap(self.old, self.node_key_bytes,
                                                             ME)})
            key_path = str(self.root / "node.key")
        else:
            self.old = os.urandom(32)
            key_path = self.key_file("old.key", self.old)
            self.store = FakeStore({})
        self.plain.format(self.device, self.old)
        enc = SimpleNamespace(type="luks2", key_kind=kind, key_path=key_path)
        self.vol = SimpleNamespace(name="vault", encryption=enc,
                                   image=SimpleNamespace(pool="rbd", name="vault",
                                                         spec="rbd/vault"))

    @property
    def node_key_bytes(self) -> bytes:
        return Path(self.node_key).read_bytes()

    def key_file(self, name: str, data: bytes) -> str:
        p = self.root / name
        p.write_bytes(data)
        p.chmod(0o600)
        return str(p)

    def say(self, line: str) -> None:
        if "rotated" in line:  # never while the old passphrase still opens it
            assert not self.plain.opens(self.device, self.old), line
        self.said.append(line)

    def rotation(self, clock: Clock | None) -> Rotation:
        self.runner.clock = self.store.clock = clock
        return Rotation(self.vol, self.device, self.crypt, self.store,  # type: ignore[arg-type]
                        str(self.root), self.say)

    def slots(self) -> list[str]:
        return keyslots(self.plain.dump(self.device))

    def in_force(self) -> bytes:
        return keys.unwrap(self.store.data[meta.LUKS_KEY], self.node_key_bytes, "t",
                           ME).passphrase


def sweep(tmp_path: Path, kind: str, run: Callable[[Rig, Clock | None], None],
          new_key: Callable[[Rig], bytes]) -> int:
    """Kill before boundary k for every k of an uninterrupted rotation."""
    (tmp_path / "count").mkdir()
    counting, clock = Rig(tmp_path / "count", kind), Clock()
    run(counting, clock)
    assert any("rotated" in s for s in counting.said), counting.said
    total = clock.n
    assert total >= 8, clock.seen
    for k in range(total):
        d = tmp_path / f"k{k}"
        d.mkdir()
        rig = Rig(d, kind)
        with pytest.raises(Killed):
            run(rig, Clock(kill_at=k))
        said_before = len(rig.said)
        run(rig, None)  # the rerun, uninterrupted
        where = f"killed before {clock.seen[k]!r} (boundary {k} of {total})"
        assert any("rotated" in s for s in rig.said[said_before:]), (where, rig.said)
        new = new_key(rig)
        assert new != rig.old, where
        assert rig.plain.opens(rig.device, new), where
        assert not rig.plain.opens(rig.device, rig.old), where
        assert len(rig.slots()) == 1, (where, rig.slots())  # nothing orphaned
        assert not {NEXT, PREV, JOURNAL} & set(rig.store.data), (where, rig.store.data)
    return total


def test_wrapped_rotation_killed_at_every_boundary(tmp_path: Path) -> None:
    total = sweep(tmp_path, "wrappedBy", lambda rig, c: rig.rotation(c).run(None),
                  Rig.in_force)
    assert total >= 10  # 3 image-meta writes and the cryptsetup calls between them


def test_file_rotation_killed_at_every_boundary(tmp_path: Path) -> None:
    def run(rig: Rig, clock: Clock | None) -> None:
        new_file = rig.root / "new.key"
        if not new_file.exists():
            rig.key_file("new.key", os.urandom(32))
        rig.rotation(clock).run(str(new_file))

    sweep(tmp_path, "file", run, lambda rig: (rig.root / "new.key").read_bytes())


def test_the_state_issue_25_names_finishes(tmp_path: Path) -> None:
    """An older rotate-key killed after writing -prev and before switching
    luks-key: -prev holds the passphrase in force, -next the new one whose
    keyslot was added. Read as "switched" it said "rotated" with the old
    passphrase in force and the new keyslot orphaned; it is "begun"."""
    rig = Rig(tmp_path, "wrappedBy")
    new = keys.new_passphrase()
    rig.plain.add_key(rig.device, rig.old, new)
    cur = rig.store.data[meta.LUKS_KEY]
    rig.store.data[NEXT] = keys.wrap(new, rig.node_key_bytes, ME)
    rig.store.data[PREV] = cur
    rig.rotation(None).run(None)
    assert rig.in_force() == new
    assert rig.plain.opens(rig.device, new) and not rig.plain.opens(rig.device, rig.old)
    assert rig.slots() == ["1"] and not {NEXT, PREV} & set(rig.store.data)


def test_an_older_rotate_key_killed_after_its_switch_finishes(tmp_path: Path) -> None:
    rig = Rig(tmp_path, "wrappedBy")
    new = keys.new_passphrase()
    rig.plain.add_key(rig.device, rig.old, new)
    sealed_new = keys.wrap(new, rig.node_key_bytes, ME)
    rig.store.data.update({PREV: rig.store.data[meta.LUKS_KEY], meta.LUKS_KEY: sealed_new,
                           NEXT: sealed_new})
    rig.rotation(None).run(None)
    assert rig.in_force() == new and not rig.plain.opens(rig.device, rig.old)
    assert rig.slots() == ["1"] and not {NEXT, PREV} & set(rig.store.data)


def test_a_version_1_record_rotates_to_a_bound_one(tmp_path: Path) -> None:
    rig = Rig(tmp_path, "wrappedBy")
    rig.store.data[meta.LUKS_KEY] = wrap_v1(rig.old, rig.node_key_bytes)
    rig.rotation(None).run(None)
    assert keys.parse(rig.store.data[meta.LUKS_KEY]).bound == ME
    assert not rig.plain.opens(rig.device, rig.old) and len(rig.slots()) == 1


def test_a_rerun_names_the_interrupted_file_and_replaces_its_stale_slot(tmp_path: Path) -> None:
    (tmp_path / "count").mkdir()
    rig = Rig(tmp_path / "count", "file")
    clock = Clock()
    rig.rotation(clock).run(rig.key_file("new.key", os.urandom(32)))  # count the boundaries
    add = next(i for i, s in enumerate(clock.seen) if s.startswith("cryptsetup luksAddKey"))

    rig = Rig(tmp_path, "file")
    new_file = rig.key_file("new.key", os.urandom(32))
    other = rig.key_file("other.key", os.urandom(32))
    with pytest.raises(Killed):
        rig.rotation(Clock(kill_at=add + 1)).run(new_file)  # right after luksAddKey
    assert len(rig.slots()) == 2 and json.loads(rig.store.data[JOURNAL])["file"] == new_file
    with pytest.raises(RotateRefused, match=f"--new-key-file {new_file}"):
        rig.rotation(None).run(other)
    # The file was rewritten in between: the slot added from its old contents
    # is found (the journal names it) and replaced, never left behind.
    rewritten = os.urandom(32)
    rig.key_file("new.key", rewritten)
    rig.rotation(None).run(new_file)
    assert rig.plain.opens(rig.device, rewritten) and not rig.plain.opens(rig.device, rig.old)
    assert len(rig.slots()) == 1 and JOURNAL not in rig.store.data
    assert any("an earlier attempt" in s for s in rig.said)
    # Run again with the same files: nothing to do, said so.
    rig.rotation(None).run(new_file)
    assert rig.said[-1].endswith("already rotated (" + new_file + " opens, "
                                 + rig.vol.encryption.key_path + " does not)")
