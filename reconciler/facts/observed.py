"""What actually exists on the node and in Ceph: the planner's second input.

Plain frozen data. Built by ``observe`` from one pass over Ceph and the node,
or in memory by tests and benchmarks. Indexes make every planner lookup O(1).

Imported by apply/ (4 modules); csi/node.py; daemon/interest.py,
daemon/passes.py; drivers/ (10 modules); engine/ (4 modules);
facts/leftovers.py, facts/parsers.py, facts/stall.py; observe/ (5 modules);
plan/ (10 modules); views.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cached_property


@dataclass(frozen=True)
class SnapState:
    name: str
    size: int
    created: float  # seconds since the epoch
    protected: bool
    children: tuple[str, ...] = ()  # "pool/image" of its clones


@dataclass(frozen=True)
class ImageState:
    pool: str
    name: str
    size: int
    features: frozenset[str]
    meta: dict[str, str] = field(default_factory=dict, hash=False, compare=True)
    watchers: tuple[str, ...] = ()
    snaps: tuple[SnapState, ...] = ()
    parent: str | None = None  # "pool/image@snap" while it is an unflattened clone
    depth: int = 0  # clone depth: how many ancestors it still reads through
    # Image-meta keys whose value is not UTF-8 text (not in ``meta``): key -> why.
    unreadable: dict[str, str] = field(default_factory=dict, hash=False, compare=True)

    def snap(self, name: str) -> SnapState | None:
        return next((s for s in self.snaps if s.name == name), None)


@dataclass(frozen=True)
class GroupSnapState:
    name: str
    complete: bool  # False: a create cut short (librbd leaves it incomplete)


@dataclass(frozen=True)
class GroupState:
    """An RBD group and what this reconciler recorded of it (``owner``: the
    node that created the group; ``snap_owner``: the node that took the group
    snapshot named like the group; None: not recorded, not ours)."""

    pool: str
    name: str
    images: tuple[tuple[str, str], ...]  # (pool, image) of its members
    snaps: tuple[GroupSnapState, ...] = ()
    owner: str | None = None
    snap_owner: str | None = None

    def snap(self, name: str) -> GroupSnapState | None:
        return next((s for s in self.snaps if s.name == name), None)


@dataclass(frozen=True)
class NbdHelper:
    """The rbd-nbd serving a live nbd mapping of ours (one we recorded)."""

    pid: int
    version: str | None  # ``rbd-nbd --version`` of the binary it runs; None: not known
    # Its binary was replaced on disk since it started (a package upgrade):
    # /proc/PID/exe is no longer the file rbd would run. None: not known.
    stale: bool | None
    cookie: str | None  # the device's, recorded when we mapped it (a roll attaches with it)


@dataclass(frozen=True)
class Mapping:
    """An image exposed as a local block device."""

    kind: str  # krbd | nbd | fuse
    pool: str
    image: str
    device: str | None  # None: a fuse mount whose loop device is missing (half mapped)
    fuse_mount: str | None = None  # fuse only: the private rbd-fuse mount point
    problem: str | None = None  # set: the mapping is dead (its helper is gone)
    # nbd: its rbd-nbd is gone but the kernel keeps the device, whose cookie
    # (recorded when we mapped it, this boot) this is: re-attachable.
    reattach: str | None = None
    helper: NbdHelper | None = None  # nbd, alive and recorded as ours: who serves it


@dataclass(frozen=True)
class MountUser:
    """Something that uses a dead mapping's filesystem: a process (its pid,
    which the daemon watches for its exit) or a mount stacked in it (None)."""

    pid: int | None
    what: str  # "pid 42 (sleep): open file", "a mount at /srv/a/x (tmpfs ...) inside /srv/a"

    def __str__(self) -> str:
        return self.what


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
    problem: str | None = None  # set: the probe failed or the device did not read
    # Set when the probe did not answer in time: the content is unknown,
    # which stops anything destructive (safety rule 7); the reason.
    unknown: str | None = None
    luks_offset: int | None = None  # a LUKS2 header: where its data starts


@dataclass(frozen=True)
class IoStall:
    """A mapped device with I/O in flight that has completed none for a while
    (observe/iowatch.py): stuck, typically on a Ceph that does not answer."""

    device: str
    in_flight: int  # requests issued and not completed
    seconds: float  # nothing completed for at least this long
    since: float  # unix time: from then on nothing completed (or watching began)
    last_completed: float | None  # unix time a completion was last seen; None: none seen


@dataclass(frozen=True)
class CryptDevice:
    """An open LUKS2 (dm-crypt) device over one of our mapped devices."""

    name: str  # device-mapper name
    path: str  # /dev/mapper/NAME
    major: int
    minor: int
    size: int  # bytes of plaintext it exposes
    raw: str  # the mapped device under it


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
        """This mount's own flag (a bind remount changes it), not the filesystem's."""
        return "ro" in self.options

    @property
    def fs_read_only(self) -> bool:
        """The filesystem itself refuses writes, through every mount of it,
        whatever their own flag says: remounted read-only (by hand, or by
        ext4 after an error on kernels before 6.x's ``emergency_ro``), read-only
        after an error, or shut down."""
        return not self.super_options.isdisjoint(FS_WRITES_REFUSED)


# Superblock options (mountinfo's last field) under which no write succeeds.
FS_WRITES_REFUSED = frozenset({"ro", "emergency_ro", "shutdown"})


def top_mounts(mounts: Iterable[Mount]) -> dict[str, Mount]:
    """The visible mount at each mount point: the one nothing else at that
    point is mounted on (mountinfo order alone can mislead after moves)."""
    by_point: dict[str, list[Mount]] = {}
    for m in mounts:
        by_point.setdefault(m.mount_point, []).append(m)
    out = {}
    for point, ms in by_point.items():
        parents = {m.parent_id for m in ms}
        tops = [m for m in ms if m.mount_id not in parents]
        out[point] = tops[-1] if tops else ms[-1]
    return out


def visible_mounts(mounts: Iterable[Mount]) -> Callable[[str], Mount | None]:
    """A lookup of the mount a process reaches at an absolute path, as path
    resolution walks the mount tree: from the root, into whatever is mounted
    at each component (the last one stacked there). A mount at the path with
    another on top of it, or under a directory something else was mounted
    over since, is not what the path reaches. None: no root mount seen."""
    mounts = tuple(mounts)
    children: dict[tuple[int, str], Mount] = {}
    for m in mounts:  # later lines are later mounts: the last one stacked wins
        children[(m.parent_id, m.mount_point)] = m
    ids = {m.mount_id for m in mounts}
    roots = [m for m in mounts if m.mount_point == "/"
             and (m.parent_id not in ids or m.parent_id == m.mount_id)]

    def follow(m: Mount, point: str) -> Mount:
        seen = {m.mount_id}
        while (up := children.get((m.mount_id, point))) is not None and up.mount_id not in seen:
            seen.add(up.mount_id)
            m = up
        return m

    def lookup(path: str) -> Mount | None:
        if not roots or not path.startswith("/"):
            return None
        m = follow(roots[0], "/")
        prefix = ""
        for part in path.strip("/").split("/"):
            if part:
                prefix += "/" + part
                if (under := children.get((m.mount_id, prefix))) is not None:
                    m = follow(under, prefix)
        return m
    return lookup


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
    # wanted paths with a symlink in them: path -> the first symlink component
    symlinks: dict[str, str] = field(default_factory=dict)
    # images whose state did not come in time (their pool was listed): unknown
    image_errors: dict[tuple[str, str], str] = field(default_factory=dict)
    # images whose create we started (stateDir/intents.json): ours even before
    # their owner record is written
    intents: frozenset[tuple[str, str]] = frozenset()
    # mount points we froze (stateDir/freezes.json): a crash between fsfreeze
    # and the thaw left them frozen; the next pass thaws them
    freezes: frozenset[str] = frozenset()
    # Open LUKS2 devices over our mapped devices, by the mapped device's path.
    crypts: dict[str, CryptDevice] = field(default_factory=dict)
    # io.max in force, by target (a systemd unit or a cgroup directory) and
    # "MAJ:MIN"; a target that could not be read is in io_errors instead.
    io_limits: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)
    io_errors: dict[str, str] = field(default_factory=dict)
    # RBD groups looked for (SnapshotGroups, restores from a group snapshot):
    # those that exist, and those that did not answer in time (unknown).
    groups: dict[tuple[str, str], GroupState] = field(default_factory=dict)
    group_errors: dict[tuple[str, str], str] = field(default_factory=dict)
    # Mapped devices whose I/O does not complete, by device path: nothing that
    # touches them is planned (a probe, an unmount, an unmap would hang too).
    stalled: dict[str, IoStall] = field(default_factory=dict)
    # Ceph's blocklist (client address -> until), when it was asked for (an
    # image of ours is mapped here); None: not asked, or no answer.
    blocklist: dict[str, str] | None = None
    # A dead fuse-loop mapping's device -> who uses its mounts (its staging
    # mount, its publish binds, the dead FUSE mount) or its devices: "pid N
    # (comm): open file", a process whose /proc could not be read, a mount
    # stacked inside one of them. Empty: nobody, so it may be unmounted and
    # mapped again. Missing: not looked at (then it is never unmounted).
    mount_users: dict[str, tuple[MountUser, ...]] = field(default_factory=dict)
    # Mapper kinds ("krbd", "nbd") whose listing of mappings failed, with why:
    # a volume not found mapped may be mapped by one; unknown, not unmapped.
    mappings_unlisted: dict[str, str] = field(default_factory=dict)

    @cached_property
    def top_mounts(self) -> dict[str, Mount]:
        return top_mounts(self.mounts)

    @cached_property
    def visible_mount(self) -> Callable[[str], Mount | None]:
        """The mount an application at a path reaches (None: not known)."""
        return visible_mounts(self.mounts)

    @cached_property
    def mounts_by_point(self) -> dict[str, Mount]:
        """The visible (top) mount at each mount point."""
        return self.top_mounts

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
