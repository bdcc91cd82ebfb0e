"""Rotate a volume's LUKS2 passphrase: add the new keyslot, prove it opens,
then remove the old one; safe to kill at any step and run again.

``wrappedBy``: a new random passphrase is sealed under the node key and kept
in image-meta as ``luks-key-next`` before any keyslot changes; once it opens
the container, the old sealed passphrase is kept as ``luks-key-prev``, the
new one becomes ``luks-key``, the old keyslot goes, then both extra records.
Every state in between names a passphrase that opens the container, and a
rerun reads from image-meta where it stopped.

``file``: the operator names the new key file (``--new-key-file``), and
points the spec at it after the rotation; a rerun with the same files sees
what is done already (the new key opens, the old one no longer does).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import rados

from reconciler.apply.sealing import ImageSeals
from reconciler.drivers import ceph, keys
from reconciler.drivers.crypt import Cryptsetup, keyslots
from reconciler.facts import meta
from reconciler.spec.model import Volume

NEXT = meta.LUKS_KEY_NEXT
PREV = meta.LUKS_KEY_PREV


class RotateRefused(Exception):
    pass


@dataclass
class Rotation:
    vol: Volume
    device: str  # the mapped (raw) device carrying the LUKS2 header
    crypt: Cryptsetup
    cluster: rados.Rados
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
            old = self._read(enc.key_path)
            new = self._read(new_key_file)
            self._swap(old, new)
            self.say(f"{self.vol.name}: rotated; now set spec.encryption.key.file to "
                     f"{new_key_file}")
            return
        if new_key_file is not None:
            raise RotateRefused("key: wrappedBy makes its own new passphrase; "
                                "--new-key-file is for key: file")
        node_key = self._read(enc.key_path)
        pool, image = self.vol.image.pool, self.vol.image.name
        seals = ImageSeals(self.cluster, pool, image, self.accept_unbound)
        m = ceph.get_meta(self.cluster, pool, image)
        if PREV in m:  # killed after the switch: finish removing the old slot
            old = seals.unwrap(m[PREV], node_key, enc.key_path).passphrase
            new = seals.unwrap(m[meta.LUKS_KEY], node_key, enc.key_path).passphrase
        else:
            if meta.LUKS_KEY not in m:
                raise RotateRefused(f"{pool}/{image} has no sealed passphrase in image-meta")
            old = seals.unwrap(m[meta.LUKS_KEY], node_key, enc.key_path).passphrase
            sealed = ceph.set_meta_once(self.cluster, pool, image, NEXT,
                                        seals.wrap(keys.new_passphrase(), node_key,
                                                   enc.key_path))
            new = seals.unwrap(sealed, node_key, enc.key_path).passphrase
            self._add(old, new)
            ceph.set_meta(self.cluster, pool, image, PREV, m[meta.LUKS_KEY])
            ceph.set_meta(self.cluster, pool, image, meta.LUKS_KEY, sealed)
        self._remove(old, new)
        ceph.remove_meta(self.cluster, pool, image, PREV)
        ceph.remove_meta(self.cluster, pool, image, NEXT)
        self.say(f"{self.vol.name}: rotated (keyslots now "
                 f"{','.join(keyslots(self.crypt.dump(self.device)))})")

    def _read(self, path: str) -> bytes:
        try:
            return keys.read_key_file(path, self.key_root)
        except keys.KeyProblem as exc:
            raise RotateRefused(str(exc)) from None

    def _swap(self, old: bytes, new: bytes) -> None:
        if self.crypt.opens(self.device, new) and not self.crypt.opens(self.device, old):
            self.say(f"{self.vol.name}: already rotated (the new key opens, the old does not)")
            return
        self._add(old, new)
        self._remove(old, new)

    def _add(self, old: bytes, new: bytes) -> None:
        if not self.crypt.opens(self.device, new):
            if not self.crypt.opens(self.device, old):
                raise RotateRefused(f"neither the current nor the new key opens {self.device}")
            self.crypt.add_key(self.device, old, new)
            self.say(f"{self.vol.name}: new keyslot added")
        if not self.crypt.opens(self.device, new):
            raise RotateRefused(f"the new key does not open {self.device} after it was added")

    def _remove(self, old: bytes, new: bytes) -> None:
        # Never the last keyslot: the new one must open before the old goes.
        if not self.crypt.opens(self.device, new):
            raise RotateRefused(f"the new key does not open {self.device}; the old keyslot "
                                "is kept")
        if old != new and self.crypt.opens(self.device, old):
            self.crypt.remove_key(self.device, old)
            self.say(f"{self.vol.name}: old keyslot removed")
