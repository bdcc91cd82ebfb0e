"""LUKS2 passphrases: where they come from, and how a per-volume one is kept.

Two sources (``spec.encryption.key``):

- ``file``: a key file on the node, used as the passphrase as it is;
- ``wrappedBy``: a node-level key file that wraps a random per-volume
  passphrase kept in the image's metadata (the way ceph-csi's "metadata"
  key store works): the volume moves to any node that holds the same
  wrapping key.

A wrapped passphrase is AES-256-GCM under a key derived from the node key
with scrypt and a random salt, both stored beside it. Version 2 binds the
seal to the image it is for, as Ceph names it for good (pool id, image id:
a rename keeps both), as AES-GCM associated data: a record copied into
another image does not open there. A clone's record is its parent's (librbd
copies image-meta), so a record sealed for an image Ceph lists as the
clone's parent (or its parent's, ...) is accepted too, and then sealed
again for the clone itself. Version 1 (no binding) is read for upgrades
(``encryption.acceptUnbound``) and sealed again as version 2 when used.

Every record is checked field by field before anything is derived from it:
image-meta is writable by any client of the pool, so a damaged or hostile
record is a :class:`KeyProblem` naming the image, never another error, and
never chooses how much memory or time an unwrap costs.

Key files are read from one descriptor that was checked (root's, no access
for group or others, a regular file) and opened below the key root's own
descriptor (no ``..``, no symlink). Key bytes go to cryptsetup on its stdin,
never on a command line, and are never logged or written to status.

Imported by apply/devicesteps.py, apply/rotate.py, apply/sealing.py;
drivers/ceph.py.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import re
import secrets
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from reconciler.drivers import safepath
from reconciler.spec.security import key_path_problem

WRAP_VERSION = 2
UNBOUND_VERSION = 1  # sealed before the binding to the image existed
# scrypt as ceph-csi uses it (N=2^15, r=8, p=1): ~32 MiB and ~0.1 s an unwrap.
SCRYPT_N, SCRYPT_R, SCRYPT_P = 1 << 15, 8, 1
PASSPHRASE_BYTES = 48  # random bytes; base64 -> a 64-character passphrase
MAX_KEY_FILE = 8192  # cryptsetup's own key file limit is 8 MiB; ours are small
# A record is ~400 characters; anything far longer is not one of ours (and is
# never handed to the JSON parser whole).
MAX_RECORD = 8192
SALT_BYTES, NONCE_BYTES, TAG_BYTES = 16, 12, 16
MAX_SEALED = 1024  # a 64-byte passphrase seals to 80 bytes
_IMAGE_ID = re.compile(r"[0-9a-z]{1,64}")  # librbd's image ids are short hex strings


class KeyProblem(Exception):
    """A key that cannot be used: the message says which and why (never the key)."""


@dataclass(frozen=True, order=True)
class ImageRef:
    """An image as Ceph names it for good: its pool's id and its image id."""

    pool: int
    image: str

    def __str__(self) -> str:
        return f"pool id {self.pool}, image id {self.image}"


@dataclass(frozen=True)
class Unwrapped:
    passphrase: bytes
    bound: ImageRef | None  # the image it was sealed for; None: version 1, for none

    def reseal_due(self, image: ImageRef) -> bool:
        """Sealed for another image (a parent) or for none: seal it again for
        ``image`` (the same passphrase), so it no longer depends on that."""
        return self.bound != image


@dataclass(frozen=True)
class Record:
    """A wrapped-passphrase record, parsed and checked (nothing decrypted)."""

    version: int
    salt: bytes
    nonce: bytes
    sealed: bytes
    bound: ImageRef | None
    by: str | None  # the node key file that sealed it: a hint, never trusted


def read_key_file(path: str, root: str) -> bytes:
    """The bytes of a key file under ``root``: opened below the root's
    descriptor without following any symlink, and refused unless it is a
    regular file of root's that group and others cannot read or write (the
    same rule as ssh's private keys)."""
    if (why := key_path_problem(path, root)) is not None:
        raise KeyProblem(f"key file {path} {why} (encryption.keyRoot)")
    rel = path[len(root.rstrip("/")) + 1:]
    try:
        fd = safepath.open_beneath(root.rstrip("/") or "/", rel, os.O_RDONLY)
    except safepath.UnsafePath as exc:
        raise KeyProblem(f"key file {path}: {exc}") from None
    except OSError as exc:
        raise KeyProblem(f"key file {path}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise KeyProblem(f"key file {path} is not a regular file")
        if st.st_uid != 0:
            raise KeyProblem(f"key file {path} is owned by uid {st.st_uid}, not root")
        if st.st_mode & 0o077:
            raise KeyProblem(f"key file {path} is open to group or others (mode "
                            f"{stat.filemode(st.st_mode)}); chmod 600 it")
        if st.st_size == 0:
            raise KeyProblem(f"key file {path} is empty")
        if st.st_size > MAX_KEY_FILE:
            raise KeyProblem(f"key file {path} is larger than {MAX_KEY_FILE} bytes")
        return os.read(fd, MAX_KEY_FILE + 1)
    except OSError as exc:
        raise KeyProblem(f"key file {path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def new_passphrase() -> bytes:
    return base64.b64encode(secrets.token_bytes(PASSPHRASE_BYTES))


def _kek(node_key: bytes, salt: bytes) -> bytes:
    return hashlib.scrypt(node_key, salt=salt, n=SCRYPT_N, r=SCRYPT_R, p=SCRYPT_P,
                          maxmem=64 << 20, dklen=32)


def _ad(image: ImageRef) -> bytes:
    """What a version-2 seal is bound to: AES-GCM authenticates it, so a
    record opens only for the image named here."""
    return f"rbd-reconciler luks-key v2 pool={image.pool} image={image.image}".encode()


def wrap(passphrase: bytes, node_key: bytes, image: ImageRef, by: str | None = None) -> str:
    """The passphrase sealed under the node key for ``image``, as image-meta
    text (JSON). ``by`` names the node key file (a hint for re-sealing a
    clone before it loses its parent; it grants nothing)."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM  # only when used

    salt, nonce = secrets.token_bytes(SALT_BYTES), secrets.token_bytes(NONCE_BYTES)
    sealed = AESGCM(_kek(node_key, salt)).encrypt(nonce, passphrase, _ad(image))
    b64 = lambda b: base64.b64encode(b).decode()  # noqa: E731
    rec: dict[str, Any] = {"v": WRAP_VERSION, "kdf": "scrypt", "n": SCRYPT_N, "r": SCRYPT_R,
                           "p": SCRYPT_P, "salt": b64(salt), "nonce": b64(nonce),
                           "sealed": b64(sealed), "pool": image.pool, "image": image.image}
    if by is not None:
        rec["by"] = by
    return json.dumps(rec, sort_keys=True, separators=(",", ":"))


def _brief(value: object) -> str:
    """A hostile record's value, quoted short (its text is not ours to echo)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _int(rec: dict[str, Any], key: str) -> int:
    v = rec.get(key)
    # Exactly an int: JSON's true is 1 to Python, 1e400 is inf, "1" is a string.
    if type(v) is not int:
        raise ValueError(f"{key} is {_brief(v)}, not an integer")
    return v


def _bytes(rec: dict[str, Any], key: str, low: int, high: int) -> bytes:
    v = rec.get(key)
    if not isinstance(v, str) or len(v) > 4 * high:
        raise ValueError(f"{key} is {_brief(v)}, not base64")
    try:
        raw = base64.b64decode(v, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{key} is not base64") from None
    if not low <= len(raw) <= high:
        raise ValueError(f"{key} is {len(raw)} bytes, not {low}"
                         + (f"-{high}" if high != low else ""))
    return raw


def parse(text: object) -> Record:
    """A record checked field by field; KeyProblem (without a name: the
    caller adds it) for anything that is not exactly one of ours."""
    try:
        if not isinstance(text, str):
            raise ValueError(f"not text but {type(text).__name__}")
        if len(text) > MAX_RECORD:
            raise ValueError(f"{len(text)} characters long")
        try:
            rec = json.loads(text)
        except RecursionError:
            raise ValueError("nested too deeply") from None
        if not isinstance(rec, dict):
            raise ValueError(f"not a JSON object but {_brief(rec)}")
        version = rec.get("v")
        if type(version) is not int or version not in (UNBOUND_VERSION, WRAP_VERSION) or \
                rec.get("kdf") != "scrypt":
            raise ValueError(f"format {_brief(version)}/{_brief(rec.get('kdf'))} is not "
                             "known here")
        n, r, p = _int(rec, "n"), _int(rec, "r"), _int(rec, "p")
        if (n, r, p) != (SCRYPT_N, SCRYPT_R, SCRYPT_P):
            # Never let image-meta (writable by any Ceph client of the pool)
            # choose how much memory and time an unwrap costs.
            raise ValueError(f"scrypt parameters {n}/{r}/{p} are not ours")
        salt = _bytes(rec, "salt", SALT_BYTES, SALT_BYTES)
        nonce = _bytes(rec, "nonce", NONCE_BYTES, NONCE_BYTES)
        sealed = _bytes(rec, "sealed", TAG_BYTES + 1, MAX_SEALED)
        bound, by = None, None
        if version == WRAP_VERSION:
            pool, image = _int(rec, "pool"), rec.get("image")
            if not 0 <= pool < 1 << 63:
                raise ValueError(f"pool id {pool} is out of range")
            if not isinstance(image, str) or not _IMAGE_ID.fullmatch(image):
                raise ValueError(f"image id {_brief(image)} is not an RBD image id")
            bound = ImageRef(pool, image)
            hint = rec.get("by")
            by = hint if isinstance(hint, str) and hint.startswith("/") and \
                len(hint) <= 4096 and "\0" not in hint else None
    except (ValueError, TypeError) as exc:
        raise KeyProblem(f"the wrapped passphrase in image-meta is unreadable ({exc})") from None
    return Record(version, salt, nonce, sealed, bound, by)


def unwrap(text: object, node_key: bytes, what: str, image: ImageRef,
           lineage: Callable[[], Iterable[ImageRef]] | None = None,
           accept_unbound: bool = True) -> Unwrapped:
    """The passphrase sealed by :func:`wrap` for ``image``, or for one of
    the images ``lineage`` gives (Ceph's parent chain of ``image``, asked only
    when the record names another image). ``what`` names the image and the
    key file for the error. A wrong node key and an altered record cannot be
    told apart (AES-GCM fails to open both)."""
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    try:
        rec = parse(text)
    except KeyProblem as exc:
        raise KeyProblem(f"{what}: {exc}") from None
    if rec.bound is None and not accept_unbound:
        raise KeyProblem(f"{what}: the wrapped passphrase is a version-1 record, bound to no "
                         "image, and encryption.acceptUnbound is false: refusing it (see "
                         "docs/encryption.md, Upgrades)")
    if rec.bound is not None and rec.bound != image and \
            rec.bound not in (lineage() if lineage is not None else ()):
        raise KeyProblem(f"{what}: the wrapped passphrase is sealed for another image "
                         f"({rec.bound}), not for this one ({image}) nor for a parent Ceph "
                         "lists for it: refusing it (a record copied from another image "
                         "opens only there)")
    try:
        passphrase = AESGCM(_kek(node_key, rec.salt)).decrypt(
            rec.nonce, rec.sealed, None if rec.bound is None else _ad(rec.bound))
    except InvalidTag:
        raise KeyProblem(f"{what}: the node key does not open the wrapped passphrase "
                        "(another node key, or the record was altered)") from None
    if not passphrase:
        raise KeyProblem(f"{what}: the wrapped passphrase is empty")
    return Unwrapped(passphrase, rec.bound)
