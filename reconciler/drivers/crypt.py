"""LUKS2 through cryptsetup: format, open, close, resize, add and remove keys.

Every passphrase goes to cryptsetup on its stdin (``--key-file -``); the new
one of a rotation through a pipe it reads as ``/proc/self/fd/N``. None is
ever on a command line, in a log line or in an error message (cryptsetup
never echoes a key back). Device-mapper works without udev too: with
``DM_DISABLE_UDEV=1`` libdevmapper makes ``/dev/mapper/NAME`` itself.

Imported by apply/rotate.py; observe/node.py.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from reconciler.drivers.run import CommandError, Runner


@dataclass(frozen=True)
class Pbkdf:
    """How a keyslot's passphrase is stretched. By default cryptsetup
    benchmarks the machine for ``iter_time_ms`` (about 3 s a format here);
    fixed ``iterations`` (and ``memory_kib`` for argon2id) skip that."""

    kind: str = "argon2id"  # argon2id | pbkdf2
    iter_time_ms: int = 2000
    iterations: int | None = None
    memory_kib: int | None = None

    def args(self) -> list[str]:
        out = ["--pbkdf", self.kind]
        if self.iterations is None:
            return [*out, "--iter-time", str(self.iter_time_ms)]
        out += ["--pbkdf-force-iterations", str(self.iterations)]
        if self.kind != "pbkdf2" and self.memory_kib is not None:
            out += ["--pbkdf-memory", str(self.memory_kib)]
        return out


def _env() -> dict[str, str]:
    """Without a udev daemon, libdevmapper must make the device node itself."""
    env = dict(os.environ)
    if not Path("/run/udev/control").exists():
        env["DM_DISABLE_UDEV"] = "1"
    return env


@contextlib.contextmanager
def _key_pipe(key: bytes) -> Iterator[int]:
    """A pipe holding ``key``, its read end for the child (keys are far below
    a pipe's 64 KiB, so the write never blocks)."""
    r, w = os.pipe()
    try:
        os.write(w, key)
        os.close(w)
        w = -1
        yield r
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


class Cryptsetup:
    """cryptsetup (popt): every device and mapping name after "--", so none is
    ever read as an option (measured: ``close -- -x`` names a device -x)."""

    def __init__(self, runner: Runner, pbkdf: Pbkdf | None = None) -> None:
        self.runner = runner
        self.pbkdf = pbkdf or Pbkdf()

    def format(self, device: str, key: bytes) -> None:
        """luksFormat: the caller has proven the device blank (safety rule 1)."""
        self.runner.run(["cryptsetup", "luksFormat", "--batch-mode", "--type", "luks2",
                         *self.pbkdf.args(), "--key-file", "-", "--", device],
                        stdin=key, timeout=self.runner.long_timeout, env=_env())

    def is_luks(self, device: str) -> bool:
        return self.runner.run(["cryptsetup", "isLuks", "--type", "luks2", "--", device],
                               ok_codes=(0, 1), env=_env()).returncode == 0

    def opens(self, device: str, key: bytes, slot: int | None = None) -> bool:
        """Whether ``key`` opens a keyslot (that one: ``slot``); no device is created."""
        only = [] if slot is None else ["--key-slot", str(slot)]
        out = self.runner.run(["cryptsetup", "open", "--test-passphrase", "--type", "luks2",
                               *only, "--key-file", "-", "--", device], stdin=key,
                              ok_codes=(0, 1, 2), env=_env())
        return out.returncode == 0

    def open(self, device: str, name: str, key: bytes) -> None:
        self.runner.run(["cryptsetup", "open", "--type", "luks2", "--key-file", "-",
                         "--", device, name], stdin=key, timeout=self.runner.long_timeout,
                        env=_env())

    def close(self, name: str) -> None:
        self.runner.run(["cryptsetup", "close", "--", name], env=_env())

    def resize(self, name: str, key: bytes) -> None:
        """Grow the open device to its backing device (the key: LUKS2 may keep
        the volume key in the kernel keyring, where resize needs it again)."""
        self.runner.run(["cryptsetup", "resize", "--key-file", "-", "--", name], stdin=key,
                        env=_env())

    def add_key(self, device: str, key: bytes, new: bytes, slot: int | None = None) -> None:
        """A keyslot for ``new`` (at ``slot``), unlocked with ``key``."""
        at = [] if slot is None else ["--key-slot", str(slot)]  # the new key's slot
        with _key_pipe(new) as fd:
            self.runner.run(["cryptsetup", "luksAddKey", "--batch-mode", *self.pbkdf.args(),
                             *at, "--key-file", "-", "--", device, f"/proc/self/fd/{fd}"],
                            stdin=key, pass_fds=(fd,), timeout=self.runner.long_timeout,
                            env=_env())

    def remove_key(self, device: str, key: bytes) -> None:
        """Remove the keyslot ``key`` opens (never the last one: cryptsetup
        asks, and in batch mode refuses... so the caller checks first)."""
        self.runner.run(["cryptsetup", "luksRemoveKey", "--batch-mode", "--key-file", "-",
                         "--", device], stdin=key, env=_env())

    def kill_slot(self, device: str, slot: int, key: bytes) -> None:
        """Remove keyslot ``slot``, proving with ``key`` (which opens another
        one) that this is no blind wipe; cryptsetup refuses when it does not."""
        self.runner.run(["cryptsetup", "luksKillSlot", "--batch-mode", "--key-file", "-",
                         "--", device, str(slot)], stdin=key, env=_env())

    def dump(self, device: str) -> dict:
        """The LUKS2 header's JSON metadata (keyslots, segments); no secret."""
        out = self.runner.run(["cryptsetup", "luksDump", "--dump-json-metadata", "--", device],
                              env=_env())
        try:
            return json.loads(out.stdout)
        except ValueError as exc:
            raise CommandError(["cryptsetup", "luksDump", device], 0,
                               f"unreadable JSON metadata: {exc}") from None


def keyslots(header: dict) -> list[str]:
    return sorted(header.get("keyslots", {}), key=int)


def describe(header: dict) -> str:
    """One line for status and explain: cipher, sector size, keyslots."""
    seg = next(iter(header.get("segments", {}).values()), {})
    return (f"LUKS2 {seg.get('encryption', '?')}, {seg.get('sector_size', '?')}-byte "
            f"sectors, keyslots {','.join(keyslots(header)) or 'none'}")
