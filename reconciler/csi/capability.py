"""CSI volume capabilities: what we support and what each one asks of a stage.

Imported by csi/adopt.py, csi/controller.py, csi/node.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from reconciler.csi import csi_pb2 as pb
from reconciler.csi.errors import invalid, quoted

Mode = pb.VolumeCapability.AccessMode
# One node at a time, or many nodes reading: an RBD image with a local
# filesystem cannot be written from two nodes. Many writers on one node (pods
# sharing the node's one mount) is fine; SINGLE_NODE_SINGLE_WRITER allows one
# publish at a time.
SUPPORTED_MODES = frozenset({Mode.SINGLE_NODE_WRITER, Mode.SINGLE_NODE_READER_ONLY,
                             Mode.SINGLE_NODE_SINGLE_WRITER, Mode.SINGLE_NODE_MULTI_WRITER,
                             Mode.MULTI_NODE_READER_ONLY})
READ_ONLY_MODES = frozenset({Mode.SINGLE_NODE_READER_ONLY, Mode.MULTI_NODE_READER_ONLY})
FS_TYPES = ("ext4", "xfs")
_OPTION = re.compile(r"[^\s,]+")


@dataclass(frozen=True)
class Access:
    block: bool
    fs_type: str | None  # None: not said (mount) or block
    mount_options: tuple[str, ...]
    read_only: bool  # the access mode allows reading only
    single_writer: bool = False  # SINGLE_NODE_SINGLE_WRITER: one publish at a time


def parse(cap: pb.VolumeCapability, what: str = "volume_capability") -> Access:
    kind = cap.WhichOneof("access_type")
    if kind is None:
        raise invalid(f"{what}: access_type (mount or block) is required")
    mode = cap.access_mode.mode
    if not cap.HasField("access_mode") or mode == Mode.UNKNOWN:
        raise invalid(f"{what}: access_mode is required")
    if mode not in SUPPORTED_MODES:
        raise invalid(f"{what}: access mode {Mode.Mode.Name(mode)} is not supported: an RBD image "
                      "is written from one node at a time (multi-node is read-only)")
    single = mode == Mode.SINGLE_NODE_SINGLE_WRITER
    if kind == "block":
        return Access(True, None, (), mode in READ_ONLY_MODES, single)
    fs_type = cap.mount.fs_type or None
    if fs_type is not None and fs_type not in FS_TYPES:
        raise invalid(f"{what}: fs_type {quoted(fs_type)} is not supported (ext4 or xfs)")
    options: list[str] = []
    for flag in cap.mount.mount_flags:
        for opt in flag.split(","):
            if opt and not _OPTION.fullmatch(opt):
                raise invalid(f"{what}: mount flag {quoted(opt)} is not a mount option")
            if opt:
                options.append(opt)
    return Access(False, fs_type, tuple(options), mode in READ_ONLY_MODES, single)


def parse_all(caps: list[pb.VolumeCapability], what: str = "volume_capabilities") -> list[Access]:
    if not caps:
        raise invalid(f"{what} is required")
    return [parse(c, f"{what}[{i}]") for i, c in enumerate(caps)]
