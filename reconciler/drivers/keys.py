"""LUKS2 passphrases: where they come from, and how a per-volume one is kept.

Two sources (``spec.encryption.key``):

- ``file``: a key file on the node, used as the passphrase as it is;
- ``wrappedBy``: a node-level key file that wraps a random per-volume
  passphrase kept in the image's metadata (the way ceph-csi's "metadata"
  key store works): the volume moves to any node that holds the same
  wrapping key, and a clone, whose metadata is copied from its parent,
  opens with its parent's passphrase.

A wrapped passphrase is AES-256-GCM under a key derived from the node key
with scrypt and a random salt, both stored beside it: nothing names the
image, so a clone's copy unwraps too. Key files are read from one
descriptor that was checked (root's, no access for group or others, a
regular file) and opened below the key root's own descriptor (no ``..``,
no symlink).
Key bytes go to cryptsetup on its stdin, never on a command line, and are
never logged or written to status.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import secrets
import stat

from reconciler.drivers import safepath
from reconciler.spec.security import key_path_problem

WRAP_VERSION = 1
# scrypt as ceph-csi uses it (N=2^15, r=8, p=1): ~32 MiB and ~0.1 s an unwrap.
SCRYPT_N, SCRYPT_R, SCRYPT_P = 1 << 15, 8, 1
PASSPHRASE_BYTES = 48  # random bytes; base64 -> a 64-character passphrase
MAX_KEY_FILE = 8192  # cryptsetup's own key file limit is 8 MiB; ours are small


class KeyProblem(Exception):
    """A key that cannot be used: the message says which and why (never the key)."""


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


def wrap(passphrase: bytes, node_key: bytes) -> str:
    """The passphrase sealed under the node key, as image-meta text (JSON)."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM  # only when used

    salt, nonce = secrets.token_bytes(16), secrets.token_bytes(12)
    sealed = AESGCM(_kek(node_key, salt)).encrypt(nonce, passphrase, None)
    b64 = lambda b: base64.b64encode(b).decode()  # noqa: E731
    return json.dumps({"v": WRAP_VERSION, "kdf": "scrypt", "n": SCRYPT_N, "r": SCRYPT_R,
                       "p": SCRYPT_P, "salt": b64(salt), "nonce": b64(nonce),
                       "sealed": b64(sealed)}, sort_keys=True, separators=(",", ":"))


def unwrap(text: str, node_key: bytes, what: str) -> bytes:
    """The passphrase sealed by :func:`wrap`. ``what`` names the image and
    the key file for the error: a wrong node key and a damaged record are
    told apart as well as AES-GCM allows (it cannot: both fail to open)."""
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    try:
        rec = json.loads(text)
        if rec.get("v") != WRAP_VERSION or rec.get("kdf") != "scrypt":
            raise ValueError(f"format {rec.get('v')!r}/{rec.get('kdf')!r} is not known here")
        salt, nonce, sealed = (base64.b64decode(rec[k], validate=True)
                               for k in ("salt", "nonce", "sealed"))
        n, r, p = int(rec["n"]), int(rec["r"]), int(rec["p"])
        if (n, r, p) != (SCRYPT_N, SCRYPT_R, SCRYPT_P):
            # Never let image-meta (writable by any Ceph client of the pool)
            # choose how much memory and time an unwrap costs.
            raise ValueError(f"scrypt parameters {n}/{r}/{p} are not ours")
    except (ValueError, KeyError, TypeError) as exc:
        raise KeyProblem(f"{what}: the wrapped passphrase in image-meta is unreadable "
                        f"({exc})") from None
    kek = hashlib.scrypt(node_key, salt=salt, n=n, r=r, p=p, maxmem=64 << 20, dklen=32)
    try:
        return AESGCM(kek).decrypt(nonce, sealed, None)
    except InvalidTag:
        raise KeyProblem(f"{what}: the node key does not open the wrapped passphrase "
                        "(another node key, or the record was altered)") from None
