"""A publish bind is remounted only when the bind does not already show the
flags the remount would set (issue 29: each mount command is ~0.3 s in the
VM of the kernel tests). Real tmpfs mounts as the staging mount; the flags
in force are read back from mountinfo, whichever way they came."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from reconciler.drivers import procfs
from reconciler.drivers.fs import Filesystems, remount_shows
from reconciler.drivers.run import Runner

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (real mounts)")


def shown(path: Path) -> frozenset[str]:
    return next(m.options for m in reversed(procfs.mounts()) if m.mount_point == str(path))


@pytest.fixture
def staging(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Path]:
    where = tmp_path / "stage"
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size=64k,{request.param}", "rbdr-bind",
                    "--", str(where)], check=True, timeout=30)
    try:
        yield where
    finally:
        for target in (tmp_path / "app", where):
            subprocess.run(["umount", "--", str(target)], check=False, timeout=30,
                           capture_output=True)


@pytest.mark.parametrize(("staging", "read_only", "options", "remounted", "want"), [
    # The usual publish: the bind of a nosuid,nodev staging mount is already it.
    ("nosuid,nodev", False, ("nosuid", "nodev"), False, {"rw", "nosuid", "nodev", "relatime"}),
    # Read-only, a flag the staging mount lacks, one it has that the publish
    # does not: remounted, and the flags are exactly the publish's.
    ("nosuid,nodev", True, ("nosuid", "nodev"), True, {"ro", "nosuid", "nodev", "relatime"}),
    ("nosuid", False, ("nosuid", "nodev"), True, {"rw", "nosuid", "nodev", "relatime"}),
    ("nosuid,nodev,noexec", False, ("nosuid", "nodev"), True,
     {"rw", "nosuid", "nodev", "relatime"}),
    # An atime option: what mountinfo shows is not certain, so always remounted.
    ("nosuid,nodev,noatime", False, ("nosuid", "nodev", "noatime"), True,
     {"rw", "nosuid", "nodev", "noatime"}),
], indirect=["staging"])
def test_a_bind_is_remounted_only_when_its_flags_differ(
        tmp_path: Path, staging: Path, read_only: bool, options: tuple[str, ...],
        remounted: bool, want: set[str]) -> None:
    runner = Runner()
    target = tmp_path / "app"
    Filesystems(runner).bind(str(staging), str(target), False, read_only, options)
    assert any("remount,bind" in " ".join(a) for a in runner.history) == remounted
    assert shown(target) == want


def test_what_a_remount_shows_is_known_only_for_plain_flags() -> None:
    assert remount_shows(False, ("nosuid", "nodev")) == {"rw", "relatime", "nosuid", "nodev"}
    assert remount_shows(True, ()) == {"ro", "relatime"}
    assert remount_shows(False, ("nosuid", "noatime")) is None
    assert remount_shows(False, ("suid",)) is None
