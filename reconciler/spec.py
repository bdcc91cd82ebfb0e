"""Typed desired volumes: what the loader produces and the planner consumes."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from enum import IntEnum
from pathlib import Path

API_VERSION = "rbd-reconciler/v1"
DEFAULT_FEATURES = ("layering", "exclusive-lock", "object-map", "fast-diff", "deep-flatten")
XFS_MIN_BYTES = 300 * 2**20


class Phase(IntEnum):
    """How far along the lifecycle a volume is (or is wanted). Ordered."""

    ABSENT = 0
    CREATED = 1
    MAPPED = 2
    STAGED = 3
    PUBLISHED = 4


@dataclass(frozen=True)
class ImageSpec:
    pool: str
    name: str
    size: int | None  # None: adopt an existing image, never create or resize it
    features: tuple[str, ...]
    reclaim_policy: str  # Retain | Delete

    @property
    def spec(self) -> str:
        return f"{self.pool}/{self.name}"


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


@dataclass(frozen=True)
class Source:
    """Where a volume was declared, for messages and for freezing on errors."""

    file: Path
    line: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"


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

    @property
    def spec_hash(self) -> str:
        """A stable digest of what is wanted (not where it was written)."""
        data = asdict(self)
        del data["source"]
        blob = json.dumps(data, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def volume_to_dict(v: Volume) -> dict[str, object]:
    d = asdict(v)
    d["source"] = {"file": str(v.source.file), "line": v.source.line}
    return d


def volume_from_dict(d: dict) -> Volume:
    """Inverse of ``volume_to_dict`` (the daemon's record of managed volumes)."""
    img, mp, st = d["image"], d.get("map"), d.get("stage")
    return Volume(
        name=d["name"], state=d["state"],
        image=ImageSpec(img["pool"], img["name"], img["size"], tuple(img["features"]),
                        img["reclaim_policy"]),
        map=MapSpec(mp["mapper"], tuple(mp["options"])) if mp else None,
        stage=StageSpec(st["mode"], st["fs_type"], tuple(st["mkfs_options"]),
                        tuple(st["mount_options"]), st["path"]) if st else None,
        publish=tuple(PublishSpec(p["path"], p["read_only"], tuple(p["mount_options"]))
                      for p in d["publish"]),
        on_remove=d.get("on_remove"),
        source=Source(Path(d["source"]["file"]), d["source"]["line"]),
    )
