"""Who uses a mount or a device (drivers/holders.py), found with real
processes and a real tmpfs mount: recover refuses while any does."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from reconciler.drivers.holders import users
from reconciler.facts.parsers import parse_mountinfo


@pytest.fixture
def mounted(tmp_path: Path) -> Iterator[tuple[Path, int, int]]:
    """A tmpfs of its own: (mount point, mount id, st_dev of its files)."""
    point = tmp_path / "mnt"
    point.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "holders", str(point)], check=True)
    try:
        m = next(m for m in parse_mountinfo(Path("/proc/self/mountinfo").read_text())
                 if m.mount_point == str(point))
        yield point, m.mount_id, os.stat(point).st_dev
    finally:
        subprocess.run(["umount", "-l", str(point)], check=True)


def spawn(code: str, cwd: Path | None = None) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", code + "\nprint('ready', flush=True)\n"
                             "import time; time.sleep(600)"], cwd=cwd, text=True,
                            stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


@pytest.mark.parametrize(("how", "what"), [
    ("open", "open file"), ("cwd", "working directory"), ("mmap", "mapped file")])
def test_a_process_using_the_mount_is_found(mounted: tuple[Path, int, int], how: str,
                                            what: str) -> None:
    point, mount_id, dev = mounted
    (point / "f").write_bytes(b"x" * 4096)
    code = {"open": f"f = open({str(point / 'f')!r})",
            "cwd": "pass",
            # mapped, its descriptor closed (Python's mmap keeps a dup: libc's own)
            "mmap": "import ctypes, os; libc = ctypes.CDLL(None); libc.mmap.restype = "
                    "ctypes.c_void_p; libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, "
                    "ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]; "
                    f"fd = os.open({str(point / 'f')!r}, os.O_RDONLY); "
                    "assert libc.mmap(None, 4096, 1, 1, fd, 0) not in (None, 2**64 - 1); "
                    "os.close(fd)"}[how]
    proc = spawn(code, cwd=point if how == "cwd" else None)
    try:
        found = users([str(point)], [mount_id], [dev])
        assert [(u.pid, u.what) for u in found if u.pid == proc.pid] == [(proc.pid, what)]
        assert str(found[0]).startswith(f"pid {found[0].pid} (")
    finally:
        proc.kill()
        proc.wait()
    assert not [u for u in users([str(point)], [mount_id], [dev]) if u.pid == proc.pid]


def test_an_open_block_device_is_found(tmp_path: Path) -> None:
    backing = tmp_path / "img"
    backing.write_bytes(b"\0" * (1 << 20))
    dev = subprocess.run(["losetup", "--find", "--show", str(backing)], check=True,
                         capture_output=True, text=True).stdout.strip()
    try:
        proc = spawn(f"f = open({dev!r}, 'rb')")
        try:
            rdev = os.stat(dev).st_rdev
            assert [u.what for u in users([], [], [rdev]) if u.pid == proc.pid] == \
                ["open device"]
        finally:
            proc.kill()
            proc.wait()
    finally:
        subprocess.run(["losetup", "-d", dev], check=True)


def test_nobody_elsewhere_and_never_ourselves(mounted: tuple[Path, int, int]) -> None:
    point, mount_id, dev = mounted
    with open(point / "mine", "w"):
        # A process whose /proc cannot be read (here: the sandbox's pid 1) is
        # reported as such; nobody else is.
        assert [u for u in users([str(point)], [mount_id], [dev]) if not u.unreadable] == []
