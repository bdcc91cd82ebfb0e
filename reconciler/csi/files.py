"""The adapter's volume files in ``csi.dir``: the only state it keeps.

Written atomically (temp file, fsync, rename, fsync of the directory), so a
crash leaves the old file or the new one; a restarted daemon carries on from
whichever it finds.

Imported by csi/ (8 modules).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import yaml

from reconciler.csi.errors import precondition
from reconciler.spec.model import API_VERSION
from reconciler.state.files import commit, durable_temp, ensure_dir, opened_dir, remove

LABEL = "csi.rbd-reconciler/"
L_REQUEST = LABEL + "request-name"  # the CO's name for it (CreateVolume)
L_ORIGIN = LABEL + "origin"  # controller: CreateVolume made it; node: staged by id only
L_ACCESS = LABEL + "access-type"  # mount | block, as created
L_FSTYPE = LABEL + "fs-type"
L_MAPPER = LABEL + "mapper"  # the StorageClass mapper parameter
# LUKS2 key source "KIND:PATH" (file or wrappedBy) of an encrypted volume; the
# node puts it into spec.encryption when it stages (encryption needs a map).
L_ENCRYPTION = LABEL + "encryption"
L_SOURCE = LABEL + "source-volume-id"  # a snapshot's CSI source volume
# The controller record's revision a file was built from (csi.statePool): the
# engine acts on the file only while the record still has it.
L_RECORD_REV = LABEL + "record-rev"


class VolumeFiles:
    def __init__(self, directory: Path) -> None:
        self.dir = directory

    def ensure_dir(self) -> None:
        ensure_dir(self.dir)

    def path(self, name: str) -> Path:
        return self.dir / f"{name}.yaml"

    def read(self, name: str) -> dict[str, Any] | None:
        """The file's document; None when there is none. A file someone broke
        by hand is an error to report, never a volume to write over."""
        try:
            doc = yaml.safe_load(self._read(name).decode())
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            raise precondition(f"volume file {self.path(name)} cannot be read: {exc}") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("spec"), dict) or \
                not isinstance(doc.get("metadata"), dict):
            raise precondition(f"volume file {self.path(name)} is not a Volume document; "
                               "fix or remove it by hand")
        return doc

    def _read(self, name: str) -> bytes:
        """The file's bytes; a symlink is not followed (ELOOP): only this
        adapter writes here, and it never makes one."""
        with opened_dir(self.dir) as dfd:
            fd = os.open(f"{name}.yaml", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        with os.fdopen(fd, "rb") as f:
            return f.read()

    def names(self) -> list[str]:
        try:
            return sorted(p.stem for p in self.dir.glob("*.yaml") if not p.name.startswith("."))
        except FileNotFoundError:
            return []

    def write_temp(self, name: str, doc: dict[str, Any]) -> Path:
        """The new content next to the file (a dotfile: the loader ignores it),
        durable on disk, ready to be validated and then renamed into place."""
        self.ensure_dir()
        text = ("# Written by the rbd-reconciler CSI adapter; edited by CSI calls.\n"
                + yaml.safe_dump(doc, sort_keys=False))
        return durable_temp(self.dir / name, text.encode())  # .NAME.*.tmp beside NAME.yaml

    def raw(self, name: str) -> bytes | None:
        """The file's bytes as they are (None: there is none), to put back."""
        try:
            return self._read(name)
        except FileNotFoundError:
            return None

    def put_back(self, name: str, raw: bytes | None) -> None:
        """The file exactly as ``raw`` (from ``raw``), atomically; removed
        when there was none."""
        if raw is None:
            self.remove(name)
        else:
            commit(durable_temp(self.dir / name, raw), self.path(name))

    def commit(self, name: str, tmp: Path) -> None:
        commit(tmp, self.path(name))

    def discard(self, tmp: Path) -> None:
        with contextlib.suppress(OSError):
            remove(tmp)

    def remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            remove(self.path(name))


def new_document(name: str, labels: dict[str, str], image: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": "Volume",
            "metadata": {"name": name, "labels": labels},
            "spec": {"state": "present", "image": image}}


def new_snapshot_document(name: str, labels: dict[str, str], pool: str,
                          image: str) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": "Snapshot",
            "metadata": {"name": name, "labels": labels},
            "spec": {"state": "present", "source": {"image": {"pool": pool, "name": image}}}}


def encryption_spec(source: str) -> dict[str, Any]:
    """spec.encryption from an L_ENCRYPTION label ("KIND:PATH")."""
    kind, _, path = source.partition(":")
    return {"type": "luks2", "key": {kind: path}}
