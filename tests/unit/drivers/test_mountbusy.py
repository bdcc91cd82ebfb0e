"""The kernel's count of a mount's users (drivers/mountbusy.py), on a real
tmpfs: busy while a process holds it, free otherwise, and never unmounted
by asking, however often."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from reconciler.drivers.mountbusy import busy
from reconciler.facts.parsers import parse_mountinfo


def mounted_at(point: Path) -> bool:
    return any(m.mount_point == str(point)
               for m in parse_mountinfo(Path("/proc/self/mountinfo").read_text()))


@pytest.fixture
def point(tmp_path: Path) -> Iterator[Path]:
    p = tmp_path / "mnt"
    p.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "busy", str(p)], check=True)
    try:
        yield p
    finally:
        if mounted_at(p):
            subprocess.run(["umount", "-l", str(p)], check=True)


def test_free_and_never_unmounted_by_asking(point: Path) -> None:
    for _ in range(3):  # a second MNT_EXPIRE would unmount a mount left marked
        assert busy(str(point)) is False
        assert mounted_at(point)


@pytest.mark.parametrize("how", ["open", "cwd"])
def test_busy_while_a_process_holds_it(point: Path, how: str) -> None:
    (point / "f").write_text("x")
    code = f"f = open({str(point / 'f')!r})" if how == "open" else "pass"
    proc = subprocess.Popen([sys.executable, "-c", code + "\nprint('ready', flush=True)\n"
                             "import time; time.sleep(600)"], text=True,
                            stdout=subprocess.PIPE, cwd=point if how == "cwd" else None)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        assert busy(str(point)) is True
    finally:
        proc.kill()
        proc.wait()
    assert busy(str(point)) is False and mounted_at(point)


def test_a_mount_inside_makes_it_busy(point: Path) -> None:
    inner = point / "in"
    inner.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "inner", str(inner)], check=True)
    try:
        assert busy(str(point)) is True
    finally:
        subprocess.run(["umount", str(inner)], check=True)


def test_not_a_mount_point_is_no_answer(tmp_path: Path) -> None:
    assert busy(str(tmp_path)) is None  # EINVAL: not the root of a mount


def test_a_symlink_to_a_mount_is_no_answer_and_not_followed(point: Path, tmp_path: Path) -> None:
    link = tmp_path / "link"
    link.symlink_to(point)
    for _ in range(3):
        assert busy(str(link)) is None
    assert mounted_at(point)
    assert busy(str(point)) is False and mounted_at(point)


def test_one_question_at_a_time(point: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two questions at once could make the second one the unmounting call:
    while another holds the lock, there is no answer (unsure: a user), and
    the mount stays."""
    import fcntl
    import os

    from reconciler.drivers import mountbusy

    monkeypatch.setattr(mountbusy, "LOCK_WAIT_S", 0.2)
    fd = os.open(mountbusy.LOCK_PATH, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert busy(str(point)) is None
    finally:
        os.close(fd)
    assert mounted_at(point)
    assert busy(str(point)) is False and mounted_at(point)
