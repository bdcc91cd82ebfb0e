"""reap_zombies finds our zombie children from the children lists (not a scan
of every process) and reaps those with the names given, and only those."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

from reconciler.drivers import reaper


def _state(pid: int) -> str:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2]


def _until_zombie(pid: int, deadline_s: float = 10.0) -> None:
    deadline = time.monotonic() + deadline_s
    while _state(pid) != "Z":
        if time.monotonic() > deadline:
            raise AssertionError(f"child {pid} did not exit within {deadline_s} s")
        time.sleep(0.005)


def test_reaps_only_named_zombie_children(tmp_path: Path) -> None:
    # The test session is a subreaper: an earlier test's orphaned ``sleep``
    # may be a zombie child of ours too, so the reaped one has a name of its
    # own (a process's name is the basename it was executed by).
    unique = tmp_path / "rr-reap-probe"
    unique.symlink_to(shutil.which("sleep") or "/bin/sleep")
    named = subprocess.Popen(["true"])
    other_named = subprocess.Popen([str(unique), "0"])
    for p in (named, other_named):
        _until_zombie(p.pid)
    stats = {int(p.parent.name) for p in reaper._children_stats()}
    assert {named.pid, other_named.pid} <= stats
    reaped = reaper.reap_zombies(("rr-reap-probe",))
    assert reaped == [other_named.pid]
    assert _state(named.pid) == "Z"  # not named: left to its Popen
    for p in (named, other_named):
        p.wait(timeout=10)
