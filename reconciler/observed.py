"""What actually exists on the node and in Ceph: the planner's second input.

Plain frozen data. Built by ``observe`` from one pass over Ceph and the node,
or in memory by tests and benchmarks. Indexes make every planner lookup O(1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property


@dataclass(frozen=True)
class ImageState:
    pool: str
    name: str
    size: int
    features: frozenset[str]
    meta: dict[str, str] = field(default_factory=dict, hash=False, compare=True)
    watchers: tuple[str, ...] = ()


@dataclass(frozen=True)
class Mapping:
    """An image exposed as a local block device."""

    kind: str  # krbd | nbd | fuse
    pool: str
    image: str
    device: str | None  # None: a fuse mount whose loop device is missing (half mapped)
    fuse_mount: str | None = None  # fuse only: the private rbd-fuse mount point


@dataclass(frozen=True)
class Device:
    path: str
    major: int
    minor: int
    size: int
    fs_type: str | None  # TYPE from blkid -p
    fs_uuid: str | None
    signature: str | None  # any signature (filesystem, partition table, raid...)
    fs_size: int | None = None  # bytes the filesystem spans, when known
    # Set when the probe failed or did not answer: the content is unknown,
    # which stops anything destructive (DESIGN rule 7); the reason.
    unknown: str | None = None


@dataclass(frozen=True)
class Mount:
    mount_id: int
    parent_id: int
    major: int
    minor: int
    root: str
    mount_point: str
    options: frozenset[str]  # per-mount options (ro/rw, nosuid, ...)
    fs_type: str
    source: str
    super_options: frozenset[str]

    @property
    def read_only(self) -> bool:
        return "ro" in self.options


@dataclass(frozen=True)
class Observed:
    images: dict[tuple[str, str], ImageState]
    # Pools we could list. An image missing from a pool we could not list is
    # unknown, not absent: the planner must not create or delete it.
    pools_listed: frozenset[str]
    pool_errors: dict[str, str]
    mappings: tuple[Mapping, ...]
    devices: dict[str, Device]
    mounts: tuple[Mount, ...]
    # rdev of block-device nodes exposed at staging/publish paths (block mode)
    path_rdev: dict[str, tuple[int, int]] = field(default_factory=dict)

    @cached_property
    def mounts_by_point(self) -> dict[str, Mount]:
        # Later mounts stack on earlier ones; the last one at a path is visible.
        return {m.mount_point: m for m in self.mounts}

    @cached_property
    def mappings_by_image(self) -> dict[tuple[str, str], list[Mapping]]:
        out: dict[tuple[str, str], list[Mapping]] = {}
        for m in self.mappings:
            out.setdefault((m.pool, m.image), []).append(m)
        return out

    @cached_property
    def mounts_by_dev(self) -> dict[tuple[int, int], list[Mount]]:
        out: dict[tuple[int, int], list[Mount]] = {}
        for m in self.mounts:
            out.setdefault((m.major, m.minor), []).append(m)
        return out

    @cached_property
    def paths_by_rdev(self) -> dict[tuple[int, int], list[str]]:
        out: dict[tuple[int, int], list[str]] = {}
        for path, rdev in self.path_rdev.items():
            out.setdefault(rdev, []).append(path)
        return out
