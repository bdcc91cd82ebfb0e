"""Steps: one change each, with what it changes (``before -> after``).

The planner emits them; ``apply`` executes them through drivers. A step
holds only data; nothing here knows how a command is spelled.

Imported by apply/ (6 modules); csi/recorded.py; daemon/metrics.py; engine/,
engine/operator.py; plan/ (11 modules).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from reconciler.spec.qos import QOS_PREFIX
from reconciler.spec.units import format_size


@dataclass(frozen=True)
class Step:
    volume: str
    # destructive: may lose data if wrong (mkfs, delete). disruptive: takes
    # a volume away from its users (unpublish, unstage, unmap).
    destructive: ClassVar[bool] = False
    disruptive: ClassVar[bool] = False
    action: ClassVar[str] = "step"

    @property
    def target(self) -> str:
        raise NotImplementedError

    @property
    def before(self) -> str:
        raise NotImplementedError

    @property
    def after(self) -> str:
        raise NotImplementedError

    def as_dict(self) -> dict[str, object]:
        return {"volume": self.volume, "action": self.action, "target": self.target,
                "from": self.before, "to": self.after, "destructive": self.destructive,
                "disruptive": self.disruptive}


@dataclass(frozen=True)
class CreateImage(Step):
    pool: str
    image: str
    size: int
    features: tuple[str, ...]
    action: ClassVar[str] = "create image"

    target = property(lambda self: f"{self.pool}/{self.image}")
    before = property(lambda self: "absent")
    after = property(lambda self: f"{format_size(self.size)} [{','.join(self.features)}]")


@dataclass(frozen=True)
class ResizeImage(Step):
    pool: str
    image: str
    old_size: int
    new_size: int
    action: ClassVar[str] = "resize image"

    target = property(lambda self: f"{self.pool}/{self.image}")
    before = property(lambda self: format_size(self.old_size))
    after = property(lambda self: format_size(self.new_size))


@dataclass(frozen=True)
class SetImageMeta(Step):
    pool: str
    image: str
    key: str
    old: str | None
    new: str
    action: ClassVar[str] = "set image-meta"

    target = property(lambda self: f"{self.pool}/{self.image} {self.key}")
    before = property(lambda self: self.old if self.old is not None else "(unset)")
    after = property(lambda self: self.new)


def _limits(pairs: tuple[tuple[str, object], ...]) -> str:
    return " ".join(f"{k.removeprefix(QOS_PREFIX)}={v}" for k, v in pairs) or "no limits"


@dataclass(frozen=True)
class SetQos(Step):
    """librbd's QoS keys in the image's metadata: librbd clients apply them
    live, so a change is never a remap (not disruptive)."""

    pool: str
    image: str
    old: tuple[tuple[str, str], ...]  # the QoS keys there now
    new: tuple[tuple[str, str], ...]  # the QoS keys wanted (absent: removed)
    action: ClassVar[str] = "set qos"

    target = property(lambda self: f"{self.pool}/{self.image}")
    before = property(lambda self: _limits(self.old))
    after = property(lambda self: _limits(self.new))


@dataclass(frozen=True)
class LimitDeviceIo(Step):
    """io.max for the mapped device on a systemd unit's cgroup or a cgroup
    directory (krbd: the kernel does the I/O, which librbd's limits never see)."""

    target_name: str  # a systemd unit, or a cgroup v2 directory
    device: str | None  # None: the device this run maps
    old: tuple[tuple[str, int], ...]  # riops/wiops/rbps/wbps in force now
    new: tuple[tuple[str, int], ...]
    # False for a publish's user (a pod): failing to limit it is reported,
    # never a reason to stop the volume's next steps.
    required: bool = True
    action: ClassVar[str] = "limit device io"

    target = property(lambda self: f"{self.target_name} {self.device or '(mapped device)'}")
    before = property(lambda self: _limits(self.old))
    after = property(lambda self: _limits(self.new))


@dataclass(frozen=True)
class MapImage(Step):
    pool: str
    image: str
    mapper: str  # resolved: krbd | nbd | fuse
    options: tuple[str, ...]
    action: ClassVar[str] = "map"

    target = property(lambda self: f"{self.pool}/{self.image}")
    before = property(lambda self: "unmapped")
    after = property(lambda self: f"mapped ({self.mapper})")


@dataclass(frozen=True)
class ReattachNbd(Step):
    """A new rbd-nbd for an nbd device whose rbd-nbd died: the kernel kept the
    device (netlink, re-attach timeout), so its mounts and I/O carry on."""

    pool: str
    image: str
    device: str
    cookie: str  # the device's, recorded when we mapped it
    options: tuple[str, ...]
    action: ClassVar[str] = "reattach"

    target = property(lambda self: f"{self.pool}/{self.image} {self.device}")
    before = property(lambda self: "rbd-nbd gone (device kept by the kernel)")
    after = property(lambda self: "served by a new rbd-nbd")


@dataclass(frozen=True)
class RollNbd(Step):
    """The rbd-nbd serving a healthy nbd device replaced by one of the binary
    now on disk (a package upgrade replaced it): detach, then attach with
    the device's cookie; the kernel keeps the device in between."""

    pool: str
    image: str
    device: str
    cookie: str  # the device's, recorded when we mapped it
    pid: int  # the rbd-nbd the plan saw serving it (the step re-checks it)
    version: str | None  # what it runs, as recorded; None: not known
    options: tuple[str, ...]
    action: ClassVar[str] = "roll"

    target = property(lambda self: f"{self.pool}/{self.image} {self.device}")
    before = property(lambda self: f"rbd-nbd {self.pid} ({self.version or 'version unknown'}; "
                                    "its binary replaced on disk)")
    after = property(lambda self: "served by an rbd-nbd of the binary on disk")


@dataclass(frozen=True)
class RefreshDevice(Step):
    """Make a mapped device see the image's new size (losetup -c for fuse)."""

    device: str | None
    mapper: str
    new_size: int
    action: ClassVar[str] = "refresh device"

    target = property(lambda self: self.device or "(mapped device)")
    before = property(lambda self: "old size")
    after = property(lambda self: format_size(self.new_size))


@dataclass(frozen=True)
class FormatDevice(Step):
    """mkfs, only after probing at apply time that the device is blank."""

    device: str | None  # None: the device this run maps
    fs_type: str
    mkfs_options: tuple[str, ...]
    pool: str
    image: str
    # Over our own LUKS2 container: its header is data on the image, so the
    # proof is the container's (we formatted it over a blank image), not
    # "no block allocated".
    encrypted: bool = False
    destructive: ClassVar[bool] = True
    action: ClassVar[str] = "format"

    target = property(lambda self: self.device or f"{self.pool}/{self.image} (once mapped)")
    before = property(lambda self: "blank" if self.device else "blank (probed before mkfs)")
    after = property(lambda self: self.fs_type)


# -- LUKS2 encryption at rest -----------------------------------------------------
@dataclass(frozen=True)
class FormatCrypt(Step):
    """luksFormat the mapped device, only after proving it blank at apply time
    (the same proofs as mkfs: safety rule 1)."""

    device: str | None  # None: the device this run maps
    pool: str
    image: str
    key_kind: str  # file | wrappedBy
    key_path: str
    destructive: ClassVar[bool] = True
    action: ClassVar[str] = "format LUKS2"

    target = property(lambda self: self.device or f"{self.pool}/{self.image} (once mapped)")
    before = property(lambda self: "blank" if self.device else "blank (probed before luksFormat)")
    after = property(lambda self: f"LUKS2 (key: {self.key_kind} {self.key_path})")


@dataclass(frozen=True)
class OpenCrypt(Step):
    device: str | None  # the mapped device; None: the one this run maps
    name: str  # device-mapper name: /dev/mapper/NAME
    pool: str
    image: str
    key_kind: str
    key_path: str
    action: ClassVar[str] = "open LUKS2"

    target = property(lambda self: f"/dev/mapper/{self.name}")
    before = property(lambda self: f"closed ({self.device or 'mapped device'})")
    after = property(lambda self: "open")


@dataclass(frozen=True)
class ResizeCrypt(Step):
    name: str
    old_size: int
    new_size: int
    key_kind: str
    key_path: str
    pool: str
    image: str
    action: ClassVar[str] = "resize LUKS2"

    target = property(lambda self: f"/dev/mapper/{self.name}")
    before = property(lambda self: format_size(self.old_size))
    after = property(lambda self: format_size(self.new_size))


@dataclass(frozen=True)
class CloseCrypt(Step):
    name: str
    rdev: tuple[int, int]  # the open device: only that one is closed
    disruptive: ClassVar[bool] = True
    action: ClassVar[str] = "close LUKS2"

    target = property(lambda self: f"/dev/mapper/{self.name}")
    before = property(lambda self: "open")
    after = property(lambda self: "closed")


@dataclass(frozen=True)
class MountStaging(Step):
    device: str | None
    path: str
    mode: str  # filesystem | block
    fs_type: str | None
    options: tuple[str, ...]
    grow_offline: bool  # ext4 smaller than its device: e2fsck + resize2fs first
    action: ClassVar[str] = "stage"

    target = property(lambda self: self.path)
    before = property(lambda self: "not staged")
    after = property(lambda self: (f"device node of {self.device or 'mapped device'}"
                                   if self.mode == "block" else
                                   f"{self.fs_type} mounted"
                                   + (" (grown offline first)" if self.grow_offline else "")))


@dataclass(frozen=True)
class Remount(Step):
    path: str
    old_options: tuple[str, ...]
    options: tuple[str, ...]
    bind: bool
    action: ClassVar[str] = "remount"

    target = property(lambda self: self.path)
    before = property(lambda self: ",".join(self.old_options))
    after = property(lambda self: ",".join(self.options))


@dataclass(frozen=True)
class GrowFilesystem(Step):
    device: str | None
    path: str
    fs_type: str
    old_size: int | None
    new_size: int
    action: ClassVar[str] = "grow filesystem"

    target = property(lambda self: self.path)
    before = property(lambda self: format_size(self.old_size) if self.old_size else "smaller")
    after = property(lambda self: format_size(self.new_size))


@dataclass(frozen=True)
class Publish(Step):
    staging: str
    path: str
    mode: str
    read_only: bool
    options: tuple[str, ...]
    action: ClassVar[str] = "publish"

    target = property(lambda self: self.path)
    before = property(lambda self: "not published")
    after = property(lambda self: f"bind of {self.staging} ({'ro' if self.read_only else 'rw'})")


@dataclass(frozen=True)
class Unpublish(Step):
    path: str
    rdev: tuple[int, int]  # our device: only a mount of it (or of its node) is removed
    disruptive: ClassVar[bool] = True
    action: ClassVar[str] = "unpublish"

    target = property(lambda self: self.path)
    before = property(lambda self: "published")
    after = property(lambda self: "not published")


@dataclass(frozen=True)
class Unstage(Step):
    path: str
    rdev: tuple[int, int]
    disruptive: ClassVar[bool] = True
    action: ClassVar[str] = "unstage"

    target = property(lambda self: self.path)
    before = property(lambda self: "staged")
    after = property(lambda self: "not staged")


@dataclass(frozen=True)
class ClaimImage(Step):
    """Record this node's claim on an image it already has mapped (one mapped
    before claims existed, or whose claim was removed by hand)."""

    pool: str
    image: str
    node: str
    action: ClassVar[str] = "claim"

    target = property(lambda self: f"{self.pool}/{self.image}")
    before = property(lambda self: "unclaimed")
    after = property(lambda self: f"claimed by {self.node}")


@dataclass(frozen=True)
class ReleaseClaim(Step):
    """Our claim on an image no longer mapped here (an unmap that could not
    reach Ceph left it): released so that another node may map it."""

    pool: str
    image: str
    node: str
    action: ClassVar[str] = "release claim"

    target = property(lambda self: f"{self.pool}/{self.image}")
    before = property(lambda self: f"claimed by {self.node}")
    after = property(lambda self: "unclaimed")


@dataclass(frozen=True)
class Unmap(Step):
    pool: str
    image: str
    mapper: str
    device: str | None
    fuse_mount: str | None
    # False: it is mapped again in the same chain (a remap): the claim stays.
    release_claim: bool = True
    # krbd: `unmap -o force` (recover: a fenced device, its users gone).
    force: bool = False
    disruptive: ClassVar[bool] = True
    action: ClassVar[str] = "unmap"

    target = property(lambda self: f"{self.pool}/{self.image}")
    before = property(lambda self: f"mapped ({self.mapper} {self.device or 'no device'})")
    after = property(lambda self: "unmapped")


@dataclass(frozen=True)
class DeleteImage(Step):
    pool: str
    image: str
    destructive: ClassVar[bool] = True
    action: ClassVar[str] = "delete image"

    target = property(lambda self: f"{self.pool}/{self.image}")
    before = property(lambda self: "exists")
    after = property(lambda self: "deleted")


# -- snapshots and clones ----------------------------------------------------------
@dataclass(frozen=True)
class CreateSnapshot(Step):
    pool: str
    image: str
    snap: str
    freeze: str | None  # a read-write mount of the image: frozen around the snapshot
    freeze_rdev: tuple[int, int] | None = None  # its device: checked before freezing
    action: ClassVar[str] = "snapshot"

    target = property(lambda self: f"{self.pool}/{self.image}@{self.snap}")
    before = property(lambda self: "absent")
    after = property(lambda self: f"taken (fsfreeze {self.freeze})" if self.freeze else "taken")


@dataclass(frozen=True)
class CloneImage(Step):
    pool: str
    image: str
    parent_pool: str
    parent_image: str
    parent_snap: str
    features: tuple[str, ...]
    size: int | None  # None: the snapshot's size
    action: ClassVar[str] = "clone"

    target = property(lambda self: f"{self.pool}/{self.image}")
    before = property(lambda self: "absent")
    after = property(lambda self: f"clone of {self.parent_pool}/{self.parent_image}@"
                                  f"{self.parent_snap}"
                                  + (f" ({format_size(self.size)})" if self.size else ""))


@dataclass(frozen=True)
class FlattenImage(Step):
    pool: str
    image: str
    why: str
    action: ClassVar[str] = "flatten"

    target = property(lambda self: f"{self.pool}/{self.image}")
    before = property(lambda self: "clone")
    after = property(lambda self: f"independent ({self.why})")


@dataclass(frozen=True)
class DeleteSnapshot(Step):
    pool: str
    image: str
    snap: str
    destructive: ClassVar[bool] = True
    action: ClassVar[str] = "delete snapshot"

    target = property(lambda self: f"{self.pool}/{self.image}@{self.snap}")
    before = property(lambda self: "exists")
    after = property(lambda self: "deleted")


@dataclass(frozen=True)
class Thaw(Step):
    """A filesystem we froze for a snapshot and did not thaw (a crash between)."""

    path: str
    action: ClassVar[str] = "thaw"

    target = property(lambda self: self.path)
    before = property(lambda self: "frozen (by an interrupted snapshot)")
    after = property(lambda self: "thawed")
