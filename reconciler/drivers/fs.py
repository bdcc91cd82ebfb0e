"""Filesystems and mounts: probe, mkfs, mount, bind, grow, unmount."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from ..parsers import Probe, parse_blkid_export, parse_dumpe2fs_size, parse_xfs_info_size
from .run import CommandError, Runner

# -m0: no root reserve on a data volume; nodiscard/lazy init: mkfs does not
# touch every block of a thin RBD image (fast, and stays thin).
MKFS_DEFAULTS = {
    "ext4": ["-q", "-m0", "-E", "nodiscard,lazy_itable_init=1,lazy_journal_init=1"],
    "xfs": ["-q", "-K"],
}


ONLINE_EXT4_GROW_TIMEOUT = 30.0


class OnlineGrowRefused(Exception):
    """The kernel refused an online grow (ext4 without CAP_SYS_RESOURCE here)."""


@dataclass
class Filesystems:
    runner: Runner

    def probe(self, device: str) -> Probe:
        res = self.runner.run(["blkid", "-p", "-o", "export", device], ok_codes=(0, 2))
        return parse_blkid_export(res.stdout, res.returncode)

    def fs_size(self, device: str, fs_type: str, mount_point: str | None = None) -> int | None:
        """Bytes the filesystem spans; for a mounted xfs pass its mount point
        (the live geometry; the on-disk superblock may lag an online grow)."""
        try:
            if fs_type == "ext4":
                return parse_dumpe2fs_size(self.runner.run(["dumpe2fs", "-h", device]).stdout)
            if fs_type == "xfs":
                out = self.runner.run(["xfs_info", mount_point or device]).stdout
                return parse_xfs_info_size(out)
        except CommandError:
            return None
        return None

    def mkfs(self, device: str, fs_type: str, options: tuple[str, ...],
             force: bool = False) -> None:
        """``force`` overwrites an existing signature: only for redoing our own
        interrupted mkfs (the caller decides, from image-meta)."""
        flag = ["-F" if fs_type == "ext4" else "-f"] if force else []
        self.runner.run([f"mkfs.{fs_type}", *MKFS_DEFAULTS[fs_type], *flag, *options, device],
                        timeout=600)

    def mount(self, device: str, path: str, fs_type: str, options: tuple[str, ...]) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        argv = ["mount", "-t", fs_type]
        if options:
            argv += ["-o", ",".join(options)]
        self.runner.run([*argv, device, path])

    def expose_device(self, device: str, path: str) -> None:
        """Block mode: bind the device node onto a file at ``path``."""
        _ensure_file(path)
        self.runner.run(["mount", "--bind", device, path])

    def bind(self, source: str, path: str, block: bool, read_only: bool,
             options: tuple[str, ...]) -> None:
        if block:
            _ensure_file(path)
        else:
            Path(path).mkdir(parents=True, exist_ok=True)
        self.runner.run(["mount", "--bind", source, path])
        # A bind inherits the source's flags; ro (and options) need a remount.
        # If that fails the target must not stay mounted with the wrong mode.
        if read_only or options:
            try:
                self.remount_bind(path, read_only, options)
            except CommandError:
                self.runner.run(["umount", path])
                raise

    def remount_bind(self, path: str, read_only: bool, options: tuple[str, ...]) -> None:
        opts = ["remount", "bind", "ro" if read_only else "rw", *options]
        self.runner.run(["mount", "-o", ",".join(opts), path])

    def remount(self, path: str, options: tuple[str, ...]) -> None:
        self.runner.run(["mount", "-o", ",".join(["remount", *options]), path])

    def unmount(self, path: str, remove: bool = True) -> None:
        """Unmount ``path``; then remove it if it is an empty directory or file
        that we made as a mount point. Never removes anything with content."""
        self.runner.run(["umount", path])
        if remove:
            p = Path(path)
            with contextlib.suppress(OSError):
                if p.is_dir():
                    p.rmdir()
                elif p.is_file() and p.stat().st_size == 0:
                    p.unlink()

    def grow_online(self, device: str, path: str, fs_type: str) -> None:
        if fs_type == "xfs":
            self.runner.run(["xfs_growfs", path])
            return
        try:
            # Online ext4 growth is quick or refused; seen hanging in a sandbox
            # without CAP_SYS_RESOURCE, so a short deadline counts as refused.
            self.runner.run(["resize2fs", device], timeout=ONLINE_EXT4_GROW_TIMEOUT)
        except CommandError as exc:
            err = exc.stderr.lower()
            if exc.returncode == 124 or "permission denied" in err or "not permitted" in err:
                raise OnlineGrowRefused(str(exc)) from None
            raise

    def grow_offline(self, device: str, fs_type: str) -> None:
        """ext4 before mounting: e2fsck must pass first (resize2fs insists)."""
        assert fs_type == "ext4"
        # e2fsck -p exits 1 when it fixed something: still fine to resize.
        self.runner.run(["e2fsck", "-f", "-p", device], ok_codes=(0, 1), timeout=600)
        self.runner.run(["resize2fs", device], timeout=600)


def block_device_size(path: str) -> int:
    """Bytes, from sysfs (the loop/rbd/nbd driver's current idea of the size)."""
    name = os.path.basename(os.path.realpath(path))
    return int(Path(f"/sys/class/block/{name}/size").read_text()) * 512


def _ensure_file(path: str) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    if not p.exists():
        fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o600)
        os.close(fd)
