"""blkid reads a blank device in ~45 small reads (on krbd and rbd-nbd each a
round trip to the OSDs); the probe asks the kernel for those regions first,
in a few large reads, and blkid finds them in the page cache (issue 29). The
answer is blkid's either way. A real loop device over a sparse file; the
reads that reach it are counted in its sysfs stat."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from reconciler.drivers.fs import Filesystems
from reconciler.drivers.run import Runner

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a loop device)")


@pytest.fixture
def loop(tmp_path: Path) -> Iterator[str]:
    """A fresh 64 MiB loop device (nothing of it in the page cache)."""
    img = tmp_path / "blank.img"
    with open(img, "wb") as f:
        f.truncate(64 << 20)
    dev = subprocess.run(["losetup", "--find", "--show", "--", str(img)], check=True,
                         capture_output=True, text=True, timeout=30).stdout.strip()
    try:
        yield dev
    finally:
        subprocess.run(["losetup", f"--detach={dev}"], check=False, timeout=30)


def reads(dev: str) -> int:
    return int(Path(f"/sys/block/{os.path.basename(dev)}/stat").read_text().split()[0])


def test_blkid_finds_what_it_reads_in_the_page_cache(loop: str) -> None:
    fs = Filesystems(Runner())
    before = reads(loop)
    probe = fs.probe_read(loop)
    ours = reads(loop) - before
    assert probe.signature is None and probe.fs_type is None
    assert ours <= 16, f"{ours} reads reached the device"
    subprocess.run(["mkfs.ext4", "-q", "--", loop], check=True, timeout=60)
    assert fs.probe_read(loop).fs_type == "ext4"  # the answer is blkid's


def test_blkid_alone_reads_the_device_in_many_small_reads(loop: str) -> None:
    """What the readahead saves: without it, each of blkid's reads reaches the device."""
    before = reads(loop)
    subprocess.run(["blkid", "-p", "-o", "export", "--", loop], check=False, timeout=60)
    assert reads(loop) - before > 30
