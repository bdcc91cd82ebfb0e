"""The in-process superblock read asks the page cache first (mincore) and
never starts a read of the device itself: a miss is None, with the device's
read counter unchanged (sysfs: nothing was submitted from this process)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from reconciler.drivers import pagecache

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a loop device)")


@pytest.fixture
def loop(tmp_path: Path) -> Iterator[str]:
    img = tmp_path / "disk.img"
    with open(img, "wb") as f:
        f.truncate(16 << 20)
        f.write(b"superblock!" * 100)
    dev = subprocess.run(["losetup", "--find", "--show", "--", str(img)], check=True,
                         capture_output=True, text=True, timeout=30).stdout.strip()
    try:
        yield dev
    finally:
        subprocess.run(["losetup", f"--detach={dev}"], check=False, timeout=30)


def reads(dev: str) -> int:
    """Reads completed plus requests in flight: a read submitted (readahead,
    asynchronous) counts from its submission, before it completes."""
    rdev = os.stat(dev).st_rdev
    fields = Path(f"/sys/dev/block/{os.major(rdev)}:{os.minor(rdev)}/stat").read_text().split()
    return int(fields[0]) + int(fields[8])


def test_a_miss_submits_nothing(loop: str) -> None:
    fd = os.open(loop, os.O_RDONLY)  # held open: our reads stay cached between calls
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        before = reads(loop)
        assert pagecache.read_if_resident(loop, 2048) is None
        assert reads(loop) == before, "a miss started a read of the device"
        os.pread(fd, 2048, 0)  # now it is cached
        after = reads(loop)
        got = pagecache.read_if_resident(loop, 2048)
        assert got is not None and got.startswith(b"superblock!")
        assert reads(loop) == after, "a hit read the device"
    finally:
        os.close(fd)


def test_rwf_nowait_alone_would_have_read_the_device(loop: str) -> None:
    """Why mincore comes first: a bare RWF_NOWAIT miss starts readahead."""
    fd = os.open(loop, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        before = reads(loop)
        with pytest.raises(BlockingIOError):
            os.preadv(fd, [bytearray(2048)], 0, os.RWF_NOWAIT)
        assert reads(loop) > before
    finally:
        os.close(fd)
