"""Rotate a volume's LUKS2 passphrase: add the new keyslot, prove it opens,
switch, remove the old one. Killed at any step, the next run recognises
where it stopped from image-meta and the keyslots, and finishes.

``wrappedBy`` (records in image-meta, apply/sealing.py for the binding):

====================  =========================================  ==========
state                 image-meta                                  keyslots
====================  =========================================  ==========
at rest               ``luks-key`` = C                            C
begun                 ``luks-key`` = C, ``luks-key-next`` = N     C (and N)
switched              ``luks-key`` = N, ``luks-key-prev`` = C     N (and C)
at rest               ``luks-key`` = N                            N
====================  =========================================  ==========

Each arrow is one RADOS write op on the header object (every key compared
and changed together, atomic in the OSD), or one cryptsetup call whose
effect the next run sees (``N`` opens / ``C`` opens). A state is told by
the passphrases the records unseal, never by which keys exist alone: a
record left by an older rotate-key that wrote its keys one at a time (the
old passphrase as ``-prev`` with ``luks-key`` not yet switched) is "begun",
not "switched". "rotated" is said only once the old passphrase no longer
opens the container and the new one does.

``file``: the operator names the new key file. ``luks-rotation`` records it
and the keyslot chosen for it before that keyslot is added, until the old
one is gone: a rerun must name the same file, and a slot added with other
contents of it (the file was rewritten in between) is found and replaced,
never left behind.

Imported by daemon/commands.py; engine/operator.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import rados
import rbd

from reconciler.drivers import ceph, keys, rbdbase
from reconciler.drivers.crypt import Cryptsetup, keyslots
from reconciler.drivers.run import CommandError
from reconciler.facts import meta
from reconciler.facts.observed import Observed
from reconciler.spec.config import Config
from reconciler.spec.model import Volume

NEXT = meta.LUKS_KEY_NEXT
PREV = meta.LUKS_KEY_PREV
JOURNAL = meta.LUKS_ROTATION
LUKS2_SLOTS = 32


class RotateRefused(Exception):
    pass


class Store(Protocol):
    """The image-meta of the volume's image, as a rotation needs it."""

    @property
    def ref(self) -> keys.ImageRef: ...

    def lineage(self) -> list[keys.ImageRef]: ...

    def read(self) -> dict[str, str]: ...

    def update(self, expect: dict[str, str | None], changes: dict[str, str | None]) -> bool: ...


@dataclass
class CephStore:
    cluster: rados.Rados
    pool: str
    image: str

    @cached_property
    def ref(self) -> keys.ImageRef:
        return ceph.image_ref(self.cluster, self.pool, self.image)

    def lineage(self) -> list[keys.ImageRef]:
        return ceph.lineage(self.cluster, self.pool, self.image)

    def read(self) -> dict[str, str]:
        return ceph.get_meta(self.cluster, self.pool, self.image)

    def update(self, expect: dict[str, str | None], changes: dict[str, str | None]) -> bool:
        return ceph.update_meta(self.cluster, self.pool, self.image, expect, changes)


@dataclass(frozen=True)
class _Wrapped:
    """Where a wrappedBy rotation stands, from the records' passphrases."""

    old: bytes
    new: bytes
    switched: bool  # the new passphrase is the one in force (luks-key)


@dataclass
class Rotation:
    vol: Volume
    device: str  # the mapped (raw) device carrying the LUKS2 header
    crypt: Cryptsetup
    store: Store
    key_root: str
    say: Callable[[str], None]
    accept_unbound: bool = True

    def run(self, new_key_file: str | None) -> None:
        enc = self.vol.encryption
        if enc is None:
            raise RotateRefused(f"{self.vol.name} has no encryption section")
        if not self.crypt.is_luks(self.device):
            raise RotateRefused(f"{self.device} carries no LUKS2 header")
        if enc.key_kind == "file":
            if new_key_file is None:
                raise RotateRefused("key: file: name the new key file with --new-key-file "
                                    "(then point spec.encryption.key.file at it)")
            self._file(enc.key_path, new_key_file)
            return
        if new_key_file is not None:
            raise RotateRefused("key: wrappedBy makes its own new passphrase; "
                                "--new-key-file is for key: file")
        self._wrapped(enc.key_path)

    # -- wrappedBy ----------------------------------------------------------------
    def _wrapped(self, key_path: str) -> None:
        node_key = self._read(key_path)
        m = self.store.read()
        state = self._where(m, node_key, key_path)
        if state is None:
            # At rest: begin. Copies of the passphrase in force left under
            # -next/-prev (an older rotate-key's last step cut short) go in
            # the same write.
            sealed = keys.wrap(keys.new_passphrase(), node_key, self.store.ref, by=key_path)
            self._write(m, (meta.LUKS_KEY, NEXT, PREV), {NEXT: sealed, PREV: None}, "begin")
            m = self.store.read()
            state = self._where(m, node_key, key_path)
            if state is None or state.switched:
                raise RotateRefused("image-meta changed as the rotation began; run it again")
        if not state.switched:
            self._add(state.old, state.new)
            self._write(m, (meta.LUKS_KEY, NEXT, PREV),
                        {meta.LUKS_KEY: m[NEXT], PREV: m[meta.LUKS_KEY], NEXT: None}, "switch")
            m = {**m, meta.LUKS_KEY: m[NEXT], PREV: m[meta.LUKS_KEY]}
            m.pop(NEXT)
        self._remove(state.old, state.new)
        self._write(m, (meta.LUKS_KEY, NEXT, PREV), {PREV: None, NEXT: None}, "finish")
        self._done(state.old, state.new)

    def _where(self, m: dict[str, str], node_key: bytes, key_path: str) -> _Wrapped | None:
        """None: no rotation in progress (records equal to the one in force
        are leftovers)."""
        if meta.LUKS_KEY not in m:
            raise RotateRefused(f"{self._image} has no sealed passphrase in image-meta")
        what = f"{self._image} (node key {key_path})"

        def unseal(key: str) -> bytes | None:
            if key not in m:
                return None
            try:
                return keys.unwrap(m[key], node_key, what, self.store.ref, self.store.lineage,
                                   self.accept_unbound).passphrase
            except keys.KeyProblem as exc:
                raise RotateRefused(f"{exc} (image-meta {key}); see docs/encryption.md, "
                                    "Rotation") from None

        cur, nxt, prv = unseal(meta.LUKS_KEY), unseal(NEXT), unseal(PREV)
        assert cur is not None
        if nxt is not None and nxt != cur:
            if prv is not None and prv != cur:
                raise RotateRefused(f"{self._image}: {NEXT}, {PREV} and {meta.LUKS_KEY} hold "
                                    "three different passphrases: not a state rotate-key "
                                    "leaves; see docs/encryption.md, Rotation")
            return _Wrapped(old=cur, new=nxt, switched=False)
        if prv is not None and prv != cur:
            return _Wrapped(old=prv, new=cur, switched=True)
        return None

    def _write(self, m: dict[str, str], compared: tuple[str, ...],
               changes: dict[str, str | None], step: str) -> None:
        """One write op: ``compared`` keys still as read in ``m``, then ``changes``."""
        if not self.store.update({k: m.get(k) for k in compared}, changes):
            raise RotateRefused(f"image-meta of {self._image} changed during the rotation "
                                f"({step}; another rotate-key?): nothing is lost, run it again")

    # -- file ---------------------------------------------------------------------
    def _file(self, key_path: str, new_key_file: str) -> None:
        old, new = self._read(key_path), self._read(new_key_file)
        m = self.store.read()
        journal = m.get(JOURNAL)
        if journal is None:
            if old == new:
                raise RotateRefused(f"{new_key_file} holds the key in force ({key_path}): "
                                    "nothing to rotate to")
            if self.crypt.opens(self.device, new) and not self.crypt.opens(self.device, old):
                self.say(f"{self.vol.name}: already rotated ({new_key_file} opens, "
                         f"{key_path} does not)")
                return
            used = {int(s) for s in keyslots(self.crypt.dump(self.device))}
            slot = next((s for s in range(LUKS2_SLOTS) if s not in used), None)
            if slot is None:
                raise RotateRefused(f"{self.device} has no free keyslot")
            journal = json.dumps({"file": new_key_file, "slot": slot}, sort_keys=True)
            self._write(m, (JOURNAL,), {JOURNAL: journal}, "begin")
            m = {**m, JOURNAL: journal}
        file, slot = self._journal(journal)
        if file != new_key_file:
            raise RotateRefused(f"a rotation of {self.vol.name} to {file} was interrupted: "
                                f"finish it first (rotate-key {self.vol.name} --new-key-file "
                                f"{file})")
        if not self.crypt.opens(self.device, new, slot):
            if str(slot) in keyslots(self.crypt.dump(self.device)):
                # Added by an earlier run from other contents of the file.
                if not self.crypt.opens(self.device, old):
                    raise RotateRefused(f"neither the current nor the new key opens "
                                        f"{self.device}")
                self.crypt.kill_slot(self.device, slot, old)
                self.say(f"{self.vol.name}: keyslot {slot} (an earlier attempt, with other "
                         f"contents of {file}) removed")
            self._add(old, new, slot)
        if old != new:
            self._remove(old, new)
        elif keyslots(self.crypt.dump(self.device)) != [str(slot)]:
            # The spec was pointed at the new file before the rotation
            # finished: the key it replaced is not known here.
            raise RotateRefused(f"the spec already names {new_key_file}, but the keyslot of "
                                "the key it replaced is still there: point "
                                "spec.encryption.key.file back at the old key file and run "
                                "rotate-key again")
        self._write(m, (JOURNAL,), {JOURNAL: None}, "finish")
        if old == new:
            self.say(f"{self.vol.name}: rotated (keyslot {slot} only: {new_key_file})")
            return
        self._done(old, new, f"; now set spec.encryption.key.file to {new_key_file}")

    def _journal(self, text: str) -> tuple[str, int]:
        try:
            rec = json.loads(text)
            file, slot = rec["file"], rec["slot"]
            if not isinstance(file, str) or type(slot) is not int or \
                    not 0 <= slot < LUKS2_SLOTS:
                raise ValueError(text[:80])
        except (ValueError, TypeError, KeyError, RecursionError):
            raise RotateRefused(f"{self._image}: image-meta {JOURNAL} is damaged; see "
                                "docs/encryption.md, Rotation") from None
        return file, slot

    # -- keyslots -----------------------------------------------------------------
    @property
    def _image(self) -> str:
        return self.vol.image.spec

    def _read(self, path: str) -> bytes:
        try:
            return keys.read_key_file(path, self.key_root)
        except keys.KeyProblem as exc:
            raise RotateRefused(str(exc)) from None

    def _add(self, old: bytes, new: bytes, slot: int | None = None) -> None:
        if not self.crypt.opens(self.device, new, slot):
            if not self.crypt.opens(self.device, old):
                raise RotateRefused(f"neither the current nor the new key opens {self.device}")
            self.crypt.add_key(self.device, old, new, slot)
            self.say(f"{self.vol.name}: new keyslot added")
        if not self.crypt.opens(self.device, new, slot):
            raise RotateRefused(f"the new key does not open {self.device} after it was added")

    def _remove(self, old: bytes, new: bytes) -> None:
        # Never the last keyslot: the new one must open before the old goes.
        if not self.crypt.opens(self.device, new):
            raise RotateRefused(f"the new key does not open {self.device}; the old keyslot "
                                "is kept")
        for _ in range(LUKS2_SLOTS):  # the old passphrase may sit in more than one slot
            if not self.crypt.opens(self.device, old):
                return
            self.crypt.remove_key(self.device, old)
            self.say(f"{self.vol.name}: old keyslot removed")
        raise RotateRefused(f"the old key still opens {self.device}")

    def _done(self, old: bytes, new: bytes, then: str = "") -> None:
        """Proven, not assumed: "rotated" only when the old key is out."""
        if self.crypt.opens(self.device, old) or not self.crypt.opens(self.device, new):
            raise RotateRefused(f"{self.device}: the rotation did not take (the old key "
                                "still opens, or the new one does not); run it again")
        self.say(f"{self.vol.name}: rotated (keyslots now "
                 f"{','.join(keyslots(self.crypt.dump(self.device)))}){then}")


def mapped_device(vol: Volume, observed: Observed) -> str | None:
    """The device ``vol``'s image is mapped at here, as ``observed``."""
    maps = observed.mappings_by_image.get((vol.image.pool, vol.image.name), [])
    return maps[0].device if maps else None


def rotate_key(config: Config, vol: Volume, device: str, crypt: Cryptsetup,
               new_key_file: str | None, say: Callable[[str, bool], None]) -> bool:
    """``rbd-reconciler rotate-key NAME`` on the mapped ``device``: True when
    rotated (or already); else False, the reason said as an error."""
    try:
        with ceph.connect(config.ceph) as cluster:
            store = CephStore(cluster, vol.image.pool, vol.image.name)
            Rotation(vol, device, crypt, store, config.encryption.key_root,
                     lambda text: say(text, False),
                     config.encryption.accept_unbound).run(new_key_file)
    except (RotateRefused, keys.KeyProblem, CommandError, rbdbase.CephError, rados.Error,
            rbd.Error) as exc:
        say(f"rbd-reconciler: rotate-key {vol.name}: {exc}", True)
        return False
    return True
