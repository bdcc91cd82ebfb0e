"""Small records under stateDir that outlive a crash: what we created.

- ``created.json``: mount points we made, so teardown removes only those
  (kubelet's staging directory, an operator's /srv/app or a symlink's target
  are never removed), and only while still the same inode.
- ``intents.json``: images we are about to create. librbd cannot create an
  image and its owner record in one step; a crash in between would leave an
  image nobody owns. With the intent written first, the next pass recognises
  the image as ours and records the owner.

Atomic writes (statefiles); guarded for the daemon's worker threads.

Imported by apply/groups.py, apply/imagesteps.py, apply/runner.py;
daemon/commands.py; drivers/freeze.py, drivers/fs.py,
drivers/kernelmapper.py; engine/frozen.py, engine/orphans.py;
observe/leftovers.py, observe/node.py.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from typing import Any

from reconciler.state import boot
from reconciler.state.files import read_json, write_json

# Filesystems frozen for a snapshot (drivers/freeze.py keeps the records).
FREEZES = "freezes.json"

_locks: dict[Path, threading.Lock] = {}
_locks_guard = threading.Lock()


def freezes_recorded(state_dir: Path) -> bool:
    """Whether any freeze was ever recorded here: without the file there is
    nothing to thaw or report, and the freeze driver need not be loaded."""
    return (state_dir / FREEZES).exists()


def _lock_for(path: Path) -> threading.Lock:
    """One lock per file, shared by every Registry of it (apply's threads)."""
    with _locks_guard:
        return _locks.setdefault(path, threading.Lock())


class Registry:
    def __init__(self, path: Path, writes: bool = True) -> None:
        self.path = path
        self._lock = _lock_for(path)
        # False: read only (a look that takes no lock beside a running
        # daemon: its read-modify-write could write the daemon's away).
        self.writes = writes

    def all(self) -> dict[str, Any]:
        data = read_json(self.path, {})
        return data if isinstance(data, dict) else {}

    def get(self, key: str) -> Any:
        return self.all().get(key)

    def record(self, key: str, value: Any) -> None:
        if not self.writes:
            return
        with self._lock:
            data = self.all()
            data[key] = value
            write_json(self.path, data)

    def forget(self, key: str) -> None:
        if not self.writes:
            return
        with self._lock:
            data = self.all()
            if data.pop(key, None) is not None:
                write_json(self.path, data)


class CreatedPaths(Registry):
    def record_path(self, path: str, kind: str, ident: tuple[int, int] | None) -> None:
        if ident is not None:
            self.record(path, {"kind": kind, "dev": ident[0], "ino": ident[1]})

    def lookup(self, path: str) -> tuple[str, tuple[int, int]] | None:
        rec = self.get(path)
        if not isinstance(rec, dict):
            return None
        return str(rec.get("kind", "dir")), (int(rec["dev"]), int(rec["ino"]))


def intent_key(pool: str, image: str) -> str:
    return f"{pool}/{image}"


class Intents(Registry):
    """``stateDir/intents.json``: images (and clones) whose create has begun."""

    def __init__(self, state_dir: Path) -> None:
        super().__init__(state_dir / "intents.json")

    def images(self) -> frozenset[tuple[str, str]]:
        return frozenset((k.partition("/")[0], k.partition("/")[2]) for k in self.all())


class NbdMappings(Registry):
    """``stateDir/nbd.json``: the nbd devices we mapped, device -> pool/image.

    When rbd-nbd dies, ``rbd device list -t nbd`` no longer shows its device
    (it finds mappings through their live process), but a filesystem may
    still be mounted from it: without this record the mapping would look
    gone, and the volume unmapped. With it, the mapping is dead (DEGRADED).

    A mapping lasts until the next reboot, and so does its record: each
    carries the boot's id, and one of an earlier boot means "not mapped"
    (the reboot unmapped it) and is dropped, never a dead mapping. A record
    written before there were ids is an earlier boot's when the file was
    last written before this boot began.
    """

    def __init__(self, state_dir: Path, boot_id_path: Path = boot.BOOT_ID,
                 writes: bool = True) -> None:
        super().__init__(state_dir / "nbd.json", writes)
        self.boot = boot.boot_id(boot_id_path)

    def record(self, key: str, value: Any) -> None:
        super().record(key, {**value, "boot": self.boot} if isinstance(value, dict) else value)

    def amend(self, key: str, fields: dict[str, Any]) -> None:
        """Fields added to an existing record (a new rbd-nbd attached to the
        same device: its binary and version); nothing when there is none."""
        if not self.writes:
            return
        with self._lock:
            data = self.all()
            if isinstance(data.get(key), dict):
                data[key] = {**data[key], **fields}
                write_json(self.path, data)

    def record_of(self, key: str) -> dict[str, Any]:
        """This boot's record of a device; {} when there is none."""
        rec = self.get(key)
        if not isinstance(rec, dict) or self._earlier_boot(rec.get("boot")):
            return {}
        return rec

    def images(self) -> dict[str, tuple[str, str]]:
        """device -> (pool, image) of this boot's records; the others dropped."""
        out, stale = {}, []
        for dev, rec in self.all().items():
            if not isinstance(rec, dict) or "pool" not in rec or "image" not in rec:
                continue
            if self._earlier_boot(rec.get("boot")):
                stale.append(dev)
            else:
                out[dev] = (str(rec["pool"]), str(rec["image"]))
        for dev in stale:
            # Best effort: a stateDir that cannot take a write still reads right.
            with contextlib.suppress(OSError):
                self.forget(dev)
        return out

    def cookies(self) -> dict[str, str]:
        """device -> the cookie rbd-nbd gave it (records of this boot that have one)."""
        return {dev: str(rec["cookie"]) for dev, rec in self.all().items()
                if isinstance(rec, dict) and isinstance(rec.get("cookie"), str)
                and not self._earlier_boot(rec.get("boot"))}

    def _earlier_boot(self, recorded: object) -> bool:
        if recorded is None and self.boot is not None:
            try:
                return self.path.stat().st_mtime < boot.started()
            except OSError:
                return False
        return boot.of_another_boot(recorded, self.boot)
