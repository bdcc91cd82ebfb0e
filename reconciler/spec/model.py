"""Typed desired volumes: what the loader produces and the planner consumes.

Imported by apply/ (4 modules); cli/recover.py; csi/ (4 modules); daemon/ (8
modules); engine/, engine/release.py; observe/node.py; plan/ (9 modules);
spec/ (6 modules); views.py.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from enum import IntEnum
from functools import cached_property
from pathlib import Path

from reconciler.spec.qos import QosSpec

API_VERSION = "rbd-reconciler/v1"
DEFAULT_FEATURES = ("layering", "exclusive-lock", "object-map", "fast-diff", "deep-flatten")
XFS_MIN_BYTES = 300 * 2**20
MAPPER_PREFERENCE = ("krbd", "nbd", "fuse")


class Phase(IntEnum):
    """How far along the lifecycle a volume is (or is wanted). Ordered."""

    ABSENT = 0
    CREATED = 1
    MAPPED = 2
    STAGED = 3
    PUBLISHED = 4


@dataclass(frozen=True)
class CloneSource:
    """Where a cloned image starts from. ``kind``/``ref`` are what the file
    said (a desired Snapshot or Volume by name, or an image); pool, image and
    snap are resolved by the loader. ``snap`` None: clone a volume through a
    temporary snapshot (then flattened, so the source keeps no snapshot)."""

    kind: str  # snapshot | volume | image | group
    ref: str  # the Snapshot's or Volume's metadata.name, or "pool/image[@snap]"
    pool: str = ""
    image: str = ""
    snap: str | None = None
    # kind group: a member image of this RBD group's snapshot (of the same
    # name), restored as a full copy (Pacific cannot clone a group snapshot).
    group: str | None = None

    @property
    def spec(self) -> str:
        if self.group:
            return f"{self.pool}/{self.image} in group snapshot {self.pool}/{self.group}"
        return f"{self.pool}/{self.image}" + (f"@{self.snap}" if self.snap else "")


@dataclass(frozen=True)
class ImageSpec:
    pool: str
    name: str
    size: int | None  # None: adopt an existing image, never create or resize it
    features: tuple[str, ...]
    reclaim_policy: str  # Retain | Delete
    source: CloneSource | None = None  # set: created as an RBD clone

    @property
    def spec(self) -> str:
        return f"{self.pool}/{self.name}"


def resolve_mapper(wanted: str, available: frozenset[str]) -> str:
    """What ``mapper: auto`` (or a named mapper) means on a node with ``available``."""
    if wanted != "auto":
        return wanted
    for m in MAPPER_PREFERENCE:
        if m in available:
            return m
    return "fuse"


@dataclass(frozen=True)
class MapSpec:
    mapper: str  # auto | krbd | nbd | fuse
    options: tuple[str, ...]


@dataclass(frozen=True)
class StageSpec:
    mode: str  # filesystem | block
    fs_type: str | None  # None in block mode
    mkfs_options: tuple[str, ...]
    mount_options: tuple[str, ...]
    path: str


@dataclass(frozen=True)
class PublishSpec:
    path: str
    read_only: bool
    mount_options: tuple[str, ...]
    # The user's cgroup v2 directory (the CSI adapter: the pod's): its io.max
    # mirrors the volume's limits for the mapped device.
    io_cgroup: str | None = None


@dataclass(frozen=True)
class EncryptionSpec:
    """LUKS2 between the mapped image and what is staged. ``key_kind``:
    file (the passphrase is that file) or wrappedBy (that file wraps a random
    per-volume passphrase kept in the image's metadata)."""

    type: str  # luks2
    key_kind: str  # file | wrappedBy
    key_path: str


@dataclass(frozen=True)
class Source:
    """Where a volume was declared, for messages and for freezing on errors."""

    file: Path
    line: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"


@dataclass(frozen=True)
class SnapshotSpec:
    """A ``kind: Snapshot`` document: an RBD snapshot of ``image`` (the
    Volume's ``image`` field holds the source image, never created by it)."""

    snap: str  # the RBD snapshot name (= metadata.name)
    source_volume: str | None  # the desired Volume it was named by, if any


@dataclass(frozen=True)
class GroupSpec:
    """A ``kind: SnapshotGroup`` document: an RBD group in ``pool`` (the
    Volume's ``image.pool``) and one group snapshot, both named ``group``."""

    group: str  # = metadata.name
    members: tuple[tuple[str, str], ...]  # (pool, image), resolved by the loader
    volumes: tuple[str, ...] = ()  # the desired Volumes it named, if it named volumes


@dataclass(frozen=True)
class Volume:
    name: str
    state: str  # present | absent
    image: ImageSpec
    map: MapSpec | None
    stage: StageSpec | None
    publish: tuple[PublishSpec, ...]
    on_remove: str | None  # release | keep | None (node default)
    source: Source
    # Set for a ``kind: Snapshot`` document. Snapshots travel through the same
    # files, records, daemon and status as volumes; only the planner tells them apart.
    snapshot: SnapshotSpec | None = None
    encryption: EncryptionSpec | None = None
    qos: QosSpec | None = None  # None: the image's QoS settings are not ours to change
    # Set for a ``kind: SnapshotGroup`` document (travels like a Snapshot).
    group: GroupSpec | None = None

    @property
    def kind(self) -> str:
        if self.group is not None:
            return "SnapshotGroup"
        return "Snapshot" if self.snapshot is not None else "Volume"

    @property
    def wanted_phase(self) -> Phase:
        if self.state == "absent":
            return Phase.ABSENT
        if self.publish:
            return Phase.PUBLISHED
        if self.stage:
            return Phase.STAGED
        if self.map:
            return Phase.MAPPED
        return Phase.CREATED

    @cached_property  # frozen: computed once per Volume (the daemon asks often)
    def spec_hash(self) -> str:
        """A stable digest of what is wanted (not where it was written)."""
        data = asdict(self)
        del data["source"]
        # Left out when unset, so a plain volume's digest is what it always was.
        if data["snapshot"] is None:
            del data["snapshot"]
        if data["encryption"] is None:
            del data["encryption"]
        if data["qos"] is None:
            del data["qos"]
        if data["group"] is None:
            del data["group"]
        if data["image"]["source"] is None:
            del data["image"]["source"]
        elif data["image"]["source"]["kind"] == "group":
            # Its ref names the desired SnapshotGroup only when that file is
            # loaded too (the CSI adapter checks one file alone): not the spec.
            del data["image"]["source"]["ref"]
        elif data["image"]["source"]["group"] is None:
            del data["image"]["source"]["group"]
        blob = json.dumps(data, sort_keys=True, separators=(",", ":"))
        import hashlib  # only here: `validate` never hashes

        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def volume_to_dict(v: Volume) -> dict[str, object]:
    d = asdict(v)
    d["source"] = {"file": str(v.source.file), "line": v.source.line}
    return d


def volume_from_dict(d: dict) -> Volume:
    """Inverse of ``volume_to_dict`` (the daemon's record of managed volumes)."""
    img, mp, st = d["image"], d.get("map"), d.get("stage")
    src, snap, enc = img.get("source"), d.get("snapshot"), d.get("encryption")
    grp = d.get("group")
    return Volume(
        name=d["name"], state=d["state"],
        image=ImageSpec(img["pool"], img["name"], img["size"], tuple(img["features"]),
                        img["reclaim_policy"], CloneSource(**src) if src else None),
        map=MapSpec(mp["mapper"], tuple(mp["options"])) if mp else None,
        stage=StageSpec(st["mode"], st["fs_type"], tuple(st["mkfs_options"]),
                        tuple(st["mount_options"]), st["path"]) if st else None,
        publish=tuple(PublishSpec(p["path"], p["read_only"], tuple(p["mount_options"]))
                      for p in d["publish"]),
        on_remove=d.get("on_remove"),
        source=Source(Path(d["source"]["file"]), d["source"]["line"]),
        snapshot=SnapshotSpec(**snap) if snap else None,
        encryption=EncryptionSpec(**enc) if enc else None,
        group=GroupSpec(grp["group"], tuple((m[0], m[1]) for m in grp["members"]),
                        tuple(grp.get("volumes", ()))) if grp else None,
    )
