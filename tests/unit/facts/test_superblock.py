"""Superblock parsers on real images (mkfs on sparse files), checked against
dumpe2fs / xfs_info / blkid; no Ceph needed."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from reconciler.drivers.fs import Filesystems
from reconciler.drivers.run import Runner
from reconciler.facts.parsers import (
    parse_blkid_export,
    parse_dumpe2fs_size,
    parse_superblock,
    parse_xfs_info_size,
)

MiB = 1 << 20


def sh(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout


def image(tmp_path: Path, size: int, mkfs: list[str], name: str = "fs.img") -> Path:
    p = tmp_path / name
    with open(p, "wb") as f:
        f.truncate(size)
    sh(*mkfs, str(p))
    return p


def head(p: Path) -> bytes:
    return p.read_bytes()[:65536]


@pytest.mark.parametrize("opts", [[], ["-b", "1024"], ["-O", "64bit"], ["-O", "^64bit"]])
def test_ext4_size_and_uuid_match_dumpe2fs(tmp_path: Path, opts: list[str]) -> None:
    p = image(tmp_path, 72 * MiB, ["mkfs.ext4", "-q", "-F", *opts])
    sb = parse_superblock(head(p), "ext4")
    assert sb is not None and sb.fs_type == "ext4"
    assert sb.size == parse_dumpe2fs_size(sh("dumpe2fs", "-h", str(p)))
    assert sb.uuid == parse_blkid_export(sh("blkid", "-p", "-o", "export", str(p)), 0).uuid


@pytest.mark.parametrize("kind", ["ext2", "ext3"])
def test_ext2_ext3_are_named_as_blkid_names_them(tmp_path: Path, kind: str) -> None:
    p = image(tmp_path, 32 * MiB, [f"mkfs.{kind}", "-q", "-F"])
    sb = parse_superblock(head(p), "ext4")
    assert sb is not None and sb.fs_type == kind
    assert parse_blkid_export(sh("blkid", "-p", "-o", "export", str(p)), 0).fs_type == kind


def test_xfs_size_and_uuid_match_xfs_info(tmp_path: Path) -> None:
    p = image(tmp_path, 320 * MiB, ["mkfs.xfs", "-q", "-f"])
    sb = parse_superblock(head(p), "xfs")
    assert sb is not None and sb.fs_type == "xfs" and sb.log_blocks > 0
    assert sb.size == parse_xfs_info_size(sh("xfs_info", str(p)))
    assert sb.uuid == parse_blkid_export(sh("blkid", "-p", "-o", "export", str(p)), 0).uuid


def test_no_superblock(tmp_path: Path) -> None:
    blank = bytes(65536)
    assert parse_superblock(blank, "ext4") is None
    assert parse_superblock(blank, "xfs") is None
    assert parse_superblock(b"XFSB", "xfs") is None  # truncated
    assert parse_superblock(blank, "btrfs") is None
    p = image(tmp_path, 320 * MiB, ["mkfs.xfs", "-q", "-f"])
    assert parse_superblock(head(p), "ext4") is None


@contextlib.contextmanager
def loop(path: Path) -> Iterator[str]:
    dev = sh("losetup", "--find", "--show", str(path)).strip()
    try:
        yield dev
    finally:
        subprocess.run(["losetup", "-d", dev], check=False)


@contextlib.contextmanager
def mounted(dev: str, at: Path) -> Iterator[None]:
    at.mkdir()
    sh("mount", dev, str(at))
    try:
        yield
    finally:
        subprocess.run(["umount", str(at)], check=False)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for loop devices and mounts")
def test_fs_size_of_mounted_xfs_follows_an_online_grow(tmp_path: Path) -> None:
    p = image(tmp_path, 320 * MiB, ["mkfs.xfs", "-q", "-f"])
    fs = Filesystems(Runner())
    with loop(p) as dev, mounted(dev, tmp_path / "mnt"):
        mnt = str(tmp_path / "mnt")
        assert fs.fs_size(dev, "xfs", mnt) == parse_xfs_info_size(sh("xfs_info", mnt))
        with open(p, "r+b") as f:
            f.truncate(400 * MiB)
        sh("losetup", "-c", dev)
        sh("xfs_growfs", mnt)
        live = parse_xfs_info_size(sh("xfs_info", mnt))
        assert live is not None and live > 320 * MiB
        assert fs.fs_size(dev, "xfs", mnt) == live
        assert fs.fs_size(dev, "ext4", mnt) is None  # not that filesystem


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for loop devices and mounts")
def test_fs_size_of_mounted_ext4_matches_dumpe2fs(tmp_path: Path) -> None:
    p = image(tmp_path, 64 * MiB, ["mkfs.ext4", "-q", "-F"])
    fs = Filesystems(Runner())
    with loop(p) as dev, mounted(dev, tmp_path / "mnt"):
        # Read by a child (a read here could wait on Ceph), which leaves the
        # superblock in the page cache while the mount holds the device open.
        assert fs.fs_size(dev, "ext4") == parse_dumpe2fs_size(sh("dumpe2fs", "-h", dev))
        assert [a[0] for a in fs.runner.history] == ["dd"]
        # Mounted, and cached: read here, with no fork.
        fs.runner.history.clear()
        assert fs.fs_size(dev, "ext4", str(tmp_path / "mnt")) == parse_dumpe2fs_size(
            sh("dumpe2fs", "-h", dev))
        assert fs.runner.history == []
