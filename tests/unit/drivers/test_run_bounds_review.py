"""Review of issue 36, item 3 (every command's output bounded): callers
whose stdout is not parsed, and what the bound then costs them.

``e2fsck -f -p`` (the offline grow of ext4, before mounting) prints one
line per problem it fixes or ignores, on stdout, which nothing reads: only
its exit code counts. On a filesystem with a few hundred thousand such
problems it says more than ``DEFAULT_MAX_STDOUT`` and is SIGKILLed in the
middle of its repair; what it ignores (preen mode) it says again at every
attempt, so the volume never grows and never mounts. Such a stdout nobody
parses is run with ``max_stdout=None``: kept as head and tail, as stderr is.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from reconciler.drivers.fs import Filesystems
from reconciler.drivers.run import DEFAULT_MAX_STDOUT, Runner


def fake(bin_dir: Path, name: str, script: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_a_chatty_e2fsck_is_not_killed_in_the_middle_of_its_repair(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    lines = DEFAULT_MAX_STDOUT // 60 + 1000  # each line 60 bytes: past the bound
    fake(bin_dir, "e2fsck", f"yes '/dev/x: Inode 12345 extent tree could be narrower.  "
                            f"IGNORED.' | head -n {lines}; exit 1")
    fake(bin_dir, "resize2fs", "echo 'resize2fs: grown'")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    runner = Runner()
    Filesystems(runner).grow_offline("/dev/x", "ext4")
    assert [argv[0] for argv in runner.history] == ["e2fsck", "resize2fs"]


def test_an_unparsed_stdout_keeps_its_head_and_tail() -> None:
    out = Runner().run(["sh", "-c", "echo first; yes middle | head -c 50000000; echo; "
                        "echo last"], max_stdout=None)
    assert out.stdout.startswith("first\n") and out.stdout.rstrip().endswith("last")
    assert "bytes dropped" in out.stdout and len(out.stdout) < 200_000
