"""Review: blkid's exit 2 means "blank" (drivers/fs.probe_read, ok_codes
(0, 2)), so the shell around it (readahead_then) must never exit 2 by
itself. dash (Debian's /bin/sh) exits a non-interactive shell with 2 when
the redirection of the special built-in ``exec`` fails, before any
``|| exit 126`` runs: a device that no longer opens read as blank."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from reconciler.drivers.fs import Filesystems, readahead_then
from reconciler.drivers.run import CommandError, Runner


def test_a_device_the_shell_cannot_open_is_not_exit_2(tmp_path: Path) -> None:
    gone = str(tmp_path / "nbd-gone")
    # `true` stands for blkid: the shell must stop before it, and not with 2.
    argv = readahead_then(gone, 0, ["true", "--", gone])
    rc = subprocess.run(argv, capture_output=True, timeout=30).returncode
    assert rc not in (0, 2)


def test_the_shell_runs_the_command_on_a_device_it_opens(tmp_path: Path) -> None:
    dev = tmp_path / "dev"
    dev.write_bytes(b"\0" * 8192)
    argv = readahead_then(str(dev), 8192, ["echo", "--", str(dev)])
    out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert (out.returncode, out.stdout) == (0, f"-- {dev}\n")


class _ShellOnly(Runner):
    """Runs the real shell, with `true` in place of blkid (blkid -p on a
    missing path exits 2 by itself; that is read_head's to catch)."""

    def run(self, argv, **kw):  # type: ignore[no-untyped-def, override]
        argv = [("true" if a == "blkid" else a) for a in argv]
        return super().run(argv, **kw)


def test_probe_read_of_a_device_that_does_not_open_is_an_error(tmp_path: Path) -> None:
    gone = str(tmp_path / "nbd-gone")
    with pytest.raises(CommandError):
        got = Filesystems(_ShellOnly()).probe_read(gone)
        pytest.fail(f"read as {got}")
