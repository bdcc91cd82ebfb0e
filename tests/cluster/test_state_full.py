"""A full state directory (issue 30): the daemon says which directory and why
in one line (no `pass failed` traceback), keeps serving what is up, holds
back what it cannot record (not converged, never reported absent), raises
rbd_reconciler_state_dir_writable to 0 for the alert, and converges by
itself once there is space again. `status` says the same and exits 1.

The state directory is a small tmpfs of its own, filled up."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import NodeUnderTest
from test_daemon import Daemon, set_resync, spec, start, wait_for  # noqa: F401  (start: fixture)
from test_metrics import free_port, metrics_config, scrape, value

pytestmark = pytest.mark.ceph


@pytest.fixture
def small_state(node: NodeUnderTest) -> Iterator[Path]:
    """node.state on a 4 MiB tmpfs; released and unmounted afterwards."""
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "rbdr-test-state",
                    str(node.state)], check=True, timeout=30)
    try:
        yield node.state
    finally:
        with contextlib.suppress(FileNotFoundError):
            (node.state / "filler").unlink()
        if any(node.desired.iterdir()):
            node.cli("release")
        subprocess.run(["umount", str(node.state)], check=True, timeout=30)


def fill(directory: Path) -> Path:
    """Write a file until the filesystem has no byte left."""
    path = directory / "filler"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for size in (1 << 16, 1 << 12, 1):
            while True:
                try:
                    os.write(fd, bytes(size))
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC, exc
                    break
    finally:
        os.close(fd)
    assert os.statvfs(directory).f_bfree == 0
    return path


def test_a_full_state_dir_is_named_held_and_recovered(
        node: NodeUnderTest, small_state: Path,
        start: Callable[..., Daemon]) -> None:  # noqa: F811
    a, b = node.name("up"), node.name("new")
    set_resync(node, 1)
    port = free_port()
    metrics_config(node, port)
    node.write(a, spec(node, target="a"))
    d = start()
    d.wait_phase(a, "Published")
    assert value(wait_for(lambda: scrape(port), "metrics"),  # type: ignore[arg-type]
                 "rbd_reconciler_state_dir_writable") == 1

    filler = fill(small_state)
    node.write(b, spec(node, target="b"))
    said = f"stateDir {small_state} cannot be written"
    wait_for(lambda: said in d.log.read_text(), "the log to name the state dir")
    d.wait_passes(3)
    log = d.log.read_text()
    [line] = [x for x in log.splitlines() if said in x]
    # Whichever write came first names itself: the records (managed.json)
    # for the new volume, or a status file a resync pass rewrote.
    assert "No space left on device" in line and \
        re.search(r"cannot write \S+/(managed\.json|status/\S+\.json)", line), line
    assert "pass failed" not in log and "Traceback" not in log, log[-4000:]
    s = wait_for(lambda: scrape(port), "metrics")
    assert value(s, "rbd_reconciler_state_dir_writable") == 0  # type: ignore[arg-type]
    assert value(s, "rbd_reconciler_volume_phase", volume=b,  # type: ignore[arg-type]
                 phase="Pending") == 1
    assert value(s, "rbd_reconciler_volume_phase", volume=a,  # type: ignore[arg-type]
                 phase="Published") == 1
    assert str(node.srv / "a") in node.mounts()  # what is up stays up
    assert not node.image_exists(b)  # held back: nothing done that is not recorded

    rc, out = node.cli("status")
    rows = {line.split()[0]: line for line in out.splitlines() if line.split()}
    assert rc == 1, out
    assert rows[b].split()[1] == "PENDING" and rows[a].split()[1] == "PUBLISHED", out
    assert f"not converged (ABSENT now): stateDir {small_state}" in out, out
    rc, doc = node.cli_json("status")
    [row] = [r for r in doc["volumes"] if r["name"] == b]
    assert row["phase"] == "PENDING" and row["observedPhase"] == "ABSENT", row

    filler.unlink()  # space again: it converges by itself
    d.wait_phase(b, "Published")
    wait_for(lambda: value(scrape(port) or {}, "rbd_reconciler_state_dir_writable") == 1,
             "the state dir to be writable again")
    assert f"no longer: {said}" in d.log.read_text()
    rc, _ = node.cli("status")
    assert rc == 0
    assert d.stop() == 0
