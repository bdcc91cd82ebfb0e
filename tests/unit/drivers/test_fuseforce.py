"""The pieces that end a FUSE connection nobody answers for (issue 26, item 6):
fusectl's connection names and files, a kill that checks whose process it
hits through a pidfd, a killed child reaped off the caller's thread, and
what counts as a release that ran into a deadline. The whole, on a real
wedged rbd-fuse helper: tests/cluster/test_wedged_release.py."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from reconciler.apply.outcomes import StepOutcome, VolumeOutcome
from reconciler.drivers import fuseforce, reaper
from reconciler.engine.unwedge import stuck_threads
from reconciler.facts.observed import Mount
from reconciler.plan.release import ran_into_deadline
from reconciler.plan.steps import Unmap, Unstage
from reconciler.spec.model import ImageSpec, MapSpec, Source, Volume


def mount(major: int, minor: int) -> Mount:
    return Mount(7, 1, major, minor, "/", "/x", frozenset(), "fuse.rbd-fuse", "rbd-fuse",
                 frozenset())


def test_a_connection_is_named_by_the_kernels_device_number() -> None:
    assert fuseforce.connection_id(mount(0, 41)) == 41  # FUSE: anonymous, major 0
    assert fuseforce.connection_id(mount(1, 2)) == (1 << 20) | 2


def test_waiting_and_abort_read_and_write_the_connections_files(tmp_path: Path) -> None:
    (tmp_path / "41").mkdir()
    (tmp_path / "41" / "waiting").write_text("3\n")
    (tmp_path / "41" / "abort").write_text("")
    assert fuseforce.waiting(tmp_path, 41) == 3
    assert fuseforce.abort(tmp_path, 41)
    assert (tmp_path / "41" / "abort").read_text() == "1"
    assert fuseforce.waiting(tmp_path, 42) is None  # gone: nothing to abort
    assert not fuseforce.abort(tmp_path, 42)
    (tmp_path / "43").mkdir()
    (tmp_path / "43" / "abort").symlink_to(tmp_path / "41" / "abort")
    assert not fuseforce.abort(tmp_path, 43)  # never written through a link


def test_a_kill_hits_only_a_process_the_check_calls_ours() -> None:
    child = subprocess.Popen(["sleep", "60"])
    try:
        seen: list[int] = []

        def not_ours(pid: int) -> bool:
            seen.append(pid)
            return False

        assert not fuseforce.kill_verified(child.pid, not_ours)
        assert seen == [child.pid] and child.poll() is None  # checked, then spared
        assert fuseforce.kill_verified(child.pid, lambda pid: True)
        assert child.wait(timeout=10) == -9
        assert not fuseforce.kill_verified(child.pid, lambda pid: True)  # reaped: gone
    finally:
        child.kill()
        child.wait(timeout=10)


def test_a_killed_child_that_does_not_go_is_reaped_off_the_callers_thread() -> None:
    """Standing in for a child stuck in D state: one that outlives the wait."""
    child = subprocess.Popen(["sleep", "0.3"])
    assert not reaper.reap_later(child, 0.0)  # not gone yet: handed to a thread
    deadline = time.monotonic() + 10
    while child.returncode is None:  # the thread's wait sets it
        assert time.monotonic() < deadline, "the reaper thread never reaped it"
        time.sleep(0.01)
    assert child.returncode == 0
    quick = subprocess.Popen(["true"])
    assert reaper.reap_later(quick, 10.0) and quick.returncode == 0


def test_stuck_threads_are_those_in_uninterruptible_sleep(tmp_path: Path) -> None:
    for tid, state in ((1, "S"), (2, "D"), (3, "R"), (4, "D")):
        (tmp_path / str(tid)).mkdir()
        (tmp_path / str(tid) / "stat").write_text(f"{tid} (python (x) y) {state} 1 2 3\n")
    assert sorted(stuck_threads(tmp_path)) == [2, 4]
    assert stuck_threads(Path("/proc/self/task")) == []  # this test's own threads run


def test_ran_into_deadline_means_aborted_or_a_step_as_long_as_a_command_deadline() -> None:
    def vol(name: str) -> Volume:
        return Volume(name=name, state="present", image=ImageSpec("rbd", name, None, (),
                                                                   "Retain"),
                      map=MapSpec("fuse", ()), stage=None, publish=(), on_remove=None,
                      source=Source(Path("/x.yaml"), 1))

    unmap, unstage = Unmap("a", "rbd", "a", "fuse", None, None), Unstage("b", "/s", (7, 0))
    outcomes = [
        VolumeOutcome("a", "failed", [StepOutcome(unmap, "failed", "timed out", 5.2)]),
        VolumeOutcome("b", "failed", [StepOutcome(unstage, "failed", "target is busy", 0.01)]),
        VolumeOutcome("c", "aborted", []),
        VolumeOutcome("d", "changed", [StepOutcome(unmap, "changed", "", 9.0)]),
    ]
    volumes = {n: vol(n) for n in "abcd"}
    assert ran_into_deadline(outcomes, volumes, 5.0) == {("rbd", "a"), ("rbd", "c")}
    # A busy umount fails at once; on a device whose I/O does not complete
    # (a writer stuck in D state holds the mount) it counts too.
    assert ran_into_deadline(outcomes, volumes, 5.0, frozenset({"b", "d"})) == {
        ("rbd", "a"), ("rbd", "b"), ("rbd", "c")}
