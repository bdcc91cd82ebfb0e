"""Wrapped-passphrase records as older releases wrote them (for upgrade tests)."""

from __future__ import annotations

import base64
import json
import os

from reconciler.drivers import keys


def wrap_v1(passphrase: bytes, node_key: bytes) -> str:
    """A record as rbd-reconciler wrote it before the binding to the image
    (version 1: AES-GCM without associated data)."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    salt, nonce = os.urandom(16), os.urandom(12)
    sealed = AESGCM(keys._kek(node_key, salt)).encrypt(nonce, passphrase, None)
    b64 = lambda b: base64.b64encode(b).decode()  # noqa: E731
    return json.dumps({"v": 1, "kdf": "scrypt", "n": keys.SCRYPT_N, "r": keys.SCRYPT_R,
                       "p": keys.SCRYPT_P, "salt": b64(salt), "nonce": b64(nonce),
                       "sealed": b64(sealed)}, sort_keys=True, separators=(",", ":"))
