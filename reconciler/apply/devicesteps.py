"""The chain's steps on the mapped device: LUKS2 (the passphrase unsealed
once per chain, luksFormat, open, close, records sealed again for a flatten
or a copy), mkfs, the staging mount (ext4 grown offline first when it must),
and the check before a publish that the staging path is our device. mkfs and
luksFormat only over a device proven blank (safety rule 1).

Mixed into the chain by apply/runner.py; imported by it only.
"""

from __future__ import annotations

import contextlib
import os
import stat

import rados

from reconciler.apply.chainstate import ChainState
from reconciler.apply.outcomes import StepRefused
from reconciler.drivers import ceph, keys, procfs, safepath
from reconciler.drivers.fs import block_device_size, is_ours
from reconciler.facts import meta
from reconciler.facts.parsers import parse_mountinfo
from reconciler.observe.node import open_crypts
from reconciler.plan.staging import GROW_SLACK
from reconciler.plan.steps import (
    CloseCrypt,
    FlattenImage,
    FormatCrypt,
    FormatDevice,
    MountStaging,
    OpenCrypt,
)

# Imported where a step needs them, not at start-up: the sealed passphrases
# (apply.sealing).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from reconciler.apply.sealing import ImageSeals


class DeviceSteps(ChainState):
    def format(self, step: FormatDevice) -> tuple[str, str]:
        """mkfs only over a device proven readable and blank (safety rule 1).

        Blank means: the start of the device reads back (a dead helper's EIO
        is *unknown*, never blank), blkid finds no signature, and Ceph has no
        block of the image allocated (an adopted image with data no signature
        explains is not blank either). The only exception is the remains of
        our own interrupted mkfs: FORMATTING set (only ever set on a device so
        proven), FORMATTED not.
        """
        dev = self.data_dev(step.device)
        # blkid says "nothing found" for a path that is no device at all too.
        if not stat.S_ISBLK(os.stat(dev).st_mode):
            raise StepRefused(f"{dev} is not a block device")
        probe = self.node.fs.probe(dev)  # raises when the device does not read
        cluster = self.need_cluster()
        image_meta = ceph.get_meta(cluster, step.pool, step.image)
        formatted = image_meta.get(meta.FORMATTED)
        interrupted = bool(image_meta.get(meta.FORMATTING)) and not formatted
        if step.encrypted and not image_meta.get(meta.CRYPT_FORMATTED):
            raise StepRefused(f"{dev} is a LUKS2 container this reconciler did not format "
                              "(no luks-formatted record): refusing to mkfs inside it")
        if not interrupted:
            if probe.fs_type == step.fs_type:
                return "ok", f"{dev} already carries {step.fs_type}; not formatted"
            if probe.signature:
                raise StepRefused(f"{dev} carries {probe.signature}, not {step.fs_type}; "
                                  "refusing to format over it")
            if formatted:
                raise StepRefused(f"image-meta says it was formatted {formatted} but {dev} "
                                  "is blank; refusing to mkfs over possible data")
            # Encrypted: the container was formatted by us over an image proven
            # blank (format_crypt), and nothing but our mkfs writes inside it
            # before FORMATTED; its header is the only data on the image.
            if not step.encrypted and ceph.has_data(cluster, step.pool, step.image):
                raise StepRefused(
                    f"{step.pool}/{step.image} has data written to it but no signature blkid "
                    f"knows; refusing to format it (to reuse it, zero it by hand first)")
        ceph.set_meta(cluster, step.pool, step.image, meta.FORMATTING, step.fs_type)
        try:
            self.node.fs.mkfs(dev, step.fs_type, step.mkfs_options, force=bool(probe.signature))
        except Exception:
            # Nothing reached the image (mkfs failed before writing, or the device
            # died under it): the marker would claim a mkfs that never happened.
            with contextlib.suppress(Exception):
                if not interrupted and (step.encrypted or not ceph.has_data(
                        cluster, step.pool, step.image)) and not self.node.fs.probe(
                        dev).signature:
                    ceph.remove_meta(cluster, step.pool, step.image, meta.FORMATTING)
            raise
        _mark_done(cluster, step.pool, step.image, meta.FORMATTED, meta.FORMATTING, step.fs_type)
        redo = " (redoing an interrupted mkfs)" if interrupted else ""
        return "changed", f"mkfs.{step.fs_type} {dev}{redo}"

    # -- LUKS2 ------------------------------------------------------------------
    def key(self, kind: str, path: str, pool: str, image: str, seal: bool = False) -> bytes:
        """The volume's LUKS2 passphrase. ``wrappedBy``: unsealed from image-meta
        with the node key (the record bound to this image, or to a parent Ceph
        lists for it: then sealed again for this image); ``seal``: made and
        sealed first when there is none (only ever before our own luksFormat)."""
        enc = self.node.config.encryption
        if (known := self._passphrases.get((kind, path, pool, image))) is not None:
            return known
        try:
            key = keys.read_key_file(path, enc.key_root)
            if kind == "file":
                return key
            cluster = self.need_cluster()
            seals = _seals(cluster, pool, image, enc.accept_unbound)
            sealed = ceph.get_meta(cluster, pool, image).get(meta.LUKS_KEY)
            if sealed is None:
                if not seal:
                    raise StepRefused(
                        f"{pool}/{image} has no sealed passphrase (image-meta {meta.LUKS_KEY}): "
                        "it was not formatted with key wrappedBy; see docs/encryption.md, "
                        "Recovery")
                passphrase = keys.new_passphrase()
                ours = seals.wrap(passphrase, key, path)
                sealed = ceph.set_meta_once(cluster, pool, image, meta.LUKS_KEY, ours)
                if sealed == ours:  # ours stands, sealed for this image: nothing to unseal
                    self._passphrases[(kind, path, pool, image)] = passphrase
                    return passphrase
            got = seals.unwrap(sealed, key, path)
            seals.reseal(sealed, got, key, path)
            self._passphrases[(kind, path, pool, image)] = got.passphrase
            return got.passphrase
        except keys.KeyProblem as exc:
            raise StepRefused(str(exc)) from None

    def seal_candidates(self) -> list[str]:
        """Node key files that may open a clone's inherited record: the
        volume's own (wrappedBy); the records name theirs too."""
        enc = self.volume.encryption if self.volume else None
        return [enc.key_path] if enc is not None and enc.key_kind == "wrappedBy" else []

    def flatten(self, step: FlattenImage) -> tuple[str, str]:
        """A flatten drops the parent link a clone's inherited passphrase
        record opens through: sealed again for the clone first, or refused."""
        cluster, enc = self.need_cluster(), self.node.config.encryption
        try:
            note = _seals(cluster, step.pool, step.image, enc.accept_unbound).bind_all(
                self.seal_candidates(), enc.key_root)
        except keys.KeyProblem as exc:
            raise StepRefused(f"not flattened: {exc}") from None
        if not ceph.flatten_image(cluster, step.pool, step.image):
            return "ok", note or "already independent"
        return "changed", note or ""

    def seal_copy(self, pool: str, image: str, source: tuple[str, str]) -> None:
        """A group-snapshot copy (no parent link): its records, sealed for
        its source (``source``: pool, image), sealed for the copy before it
        gets its name. KeyProblem: no node key here opens them."""
        from reconciler.apply.sealing import ImageSeals

        cluster, enc = self.need_cluster(), self.node.config.encryption
        if not any(k in ImageSeals.RECORDS for k in ceph.get_meta(cluster, pool, image)):
            return
        also = [ceph.image_ref(cluster, *source), *ceph.lineage(cluster, *source)]
        ImageSeals(cluster, pool, image, enc.accept_unbound, also=also).bind_all(
            self.seal_candidates(), enc.key_root)

    def format_crypt(self, step: FormatCrypt) -> tuple[str, str]:
        """luksFormat under the same proofs as mkfs (safety rule 1): the device
        reads, carries no signature, and Ceph has no block of it allocated;
        or it is the remains of our own interrupted luksFormat."""
        dev = self.dev(step.device)
        if not stat.S_ISBLK(os.stat(dev).st_mode):
            raise StepRefused(f"{dev} is not a block device")
        probe = self.node.fs.probe(dev)
        cluster = self.need_cluster()
        image_meta = ceph.get_meta(cluster, step.pool, step.image)
        done = image_meta.get(meta.CRYPT_FORMATTED)
        interrupted = bool(image_meta.get(meta.CRYPT_FORMATTING)) and not done
        if not interrupted:
            if probe.fs_type == "crypto_LUKS":
                return "ok", f"{dev} already carries LUKS; not formatted"
            if probe.signature:
                raise StepRefused(f"{dev} carries {probe.signature}, not LUKS2; refusing to "
                                  "format over it")
            if done or image_meta.get(meta.FORMATTED):
                raise StepRefused(f"image-meta says it was formatted "
                                  f"{done or image_meta.get(meta.FORMATTED)} but {dev} is "
                                  "blank; refusing to luksFormat over possible data")
            if ceph.has_data(cluster, step.pool, step.image):
                raise StepRefused(
                    f"{step.pool}/{step.image} has data written to it but no signature blkid "
                    "knows; refusing to luksFormat it (to reuse it, zero it by hand first)")
        key = self.key(step.key_kind, step.key_path, step.pool, step.image, seal=True)
        ceph.set_meta(cluster, step.pool, step.image, meta.CRYPT_FORMATTING, "luks2")
        try:
            self.node.crypt.format(dev, key)
        except Exception:
            with contextlib.suppress(Exception):
                if not interrupted and not ceph.has_data(cluster, step.pool, step.image):
                    ceph.remove_meta(cluster, step.pool, step.image, meta.CRYPT_FORMATTING)
            raise
        _mark_done(cluster, step.pool, step.image, meta.CRYPT_FORMATTED, meta.CRYPT_FORMATTING,
                   "luks2")
        redo = " (redoing an interrupted luksFormat)" if interrupted else ""
        return "changed", f"luksFormat {dev}{redo}"

    def open_crypt(self, step: OpenCrypt) -> tuple[str, str]:
        dev = self.dev(step.device)
        path = f"/dev/mapper/{step.name}"
        found = open_crypts([dev]).get(dev)
        if found is not None:
            if found.name != step.name:
                raise StepRefused(f"{found.path} (LUKS2, not ours) is open over {dev}")
            self.crypt_device = found.path
            return "ok", f"{path} already open"
        if os.path.lexists(path):
            raise StepRefused(f"{path} exists but is not open over {dev}: another device "
                              "holds this volume's name; refusing to open it twice")
        self.node.crypt.open(dev, step.name,
                             self.key(step.key_kind, step.key_path, step.pool, step.image))
        self.crypt_device = path
        self.acquired.append((f"close {path}", lambda: self.node.crypt.close(step.name)))
        return "changed", f"opened {dev} as {path}"

    def close_crypt(self, step: CloseCrypt) -> tuple[str, str]:
        path = f"/dev/mapper/{step.name}"
        try:
            rdev = os.stat(path).st_rdev
        except FileNotFoundError:
            return "ok", "already closed"
        if (os.major(rdev), os.minor(rdev)) != step.rdev:
            raise StepRefused(f"{path} is {os.major(rdev)}:{os.minor(rdev)}, not the device "
                              f"{step.rdev[0]}:{step.rdev[1]} planned; refusing to close it")
        self.node.crypt.close(step.name)
        self.crypt_device = None
        return "changed", ""

    def stage(self, step: MountStaging) -> tuple[str, str]:
        dev = self.data_dev(step.device)
        fs = self.node.fs
        if step.mode == "block":
            fs.expose_device(dev, step.path, step.options)
        else:
            assert step.fs_type is not None
            message = ""
            # Decided here, not only in the plan: an unmapped device's size was
            # unknown at plan time. ext4 cannot always grow online (it needs
            # CAP_SYS_RESOURCE), but it always can before it is mounted.
            fs_size = fs.fs_size(dev, "ext4") if step.fs_type == "ext4" else None
            if step.grow_offline or (
                    fs_size is not None and block_device_size(dev) - fs_size > GROW_SLACK):
                fs.grow_offline(dev, step.fs_type)
                if self.volume is not None and self.cluster is not None:
                    with contextlib.suppress(rados.Error):
                        ceph.remove_meta(self.cluster, self.volume.image.pool,
                                         self.volume.image.name, meta.GROW_PENDING)
                message = "grew ext4 offline before mounting"
            fs.mount(dev, step.path, step.fs_type, step.options)
        self.acquired.append((f"unstage {step.path}", lambda: fs.unmount(step.path, None)))
        return "changed", message if step.mode != "block" else ""

    def check_staged(self, staging: str, mode: str) -> tuple[int, int]:
        """Safety rule 2: publish only from a staging path whose top mount is
        our device (or, in block mode, a bind of its node). An empty staging
        directory bound into an app writes to the root disk. Returns the rdev."""
        dev = self.data_dev(None)
        rdev = os.stat(dev).st_rdev
        want = (os.major(rdev), os.minor(rdev))
        with safepath.opened(staging) as fd:
            st, mid = os.fstat(fd), safepath.mount_id(fd)
        top = {m.mount_id: m for m in parse_mountinfo(
            procfs.mountinfo())}.get(mid)
        if mode == "block":
            if not stat.S_ISBLK(st.st_mode) or (os.major(st.st_rdev),
                                                os.minor(st.st_rdev)) != want:
                raise StepRefused(f"staging path {staging} is not the device node of {dev}")
            return want
        if top is None or top.mount_point != staging or not is_ours(top, st, want):
            raise StepRefused(f"staging path {staging} is not a mount of {dev}; refusing to "
                              "publish it (it would expose the node's own disk)")
        return want

def _mark_done(cluster: rados.Rados, pool: str, image: str, done: str, doing: str,
               value: str) -> None:
    """After a format: ``done`` set and ``doing`` removed in one write on the
    header (no moment with both or neither, one round trip instead of six);
    as two writes where that cannot be (no header object, or ``doing`` was
    changed meanwhile: then as before, done first)."""
    try:
        if ceph.update_meta(cluster, pool, image, {doing: value}, {done: value, doing: None}):
            return
    except ceph.CephError:
        pass
    ceph.set_meta(cluster, pool, image, done, value)
    ceph.remove_meta(cluster, pool, image, doing)


def _seals(cluster: rados.Rados, pool: str, image: str, accept_unbound: bool) -> ImageSeals:
    from reconciler.apply.sealing import ImageSeals

    return ImageSeals(cluster, pool, image, accept_unbound)

