"""I/O that does not complete, told from a device's counters over time
(observe/iowatch.py), with a fake sysfs and a fake clock."""

from __future__ import annotations

from pathlib import Path

from reconciler.facts.iostat import IoCounters
from reconciler.observe.iowatch import WINDOW_S, IoWatch

DEV = "/dev/rbd0"
EPOCH = 1_800_000_000.0


class Fake:
    def __init__(self) -> None:
        self.t = 0.0
        self.counters: dict[str, tuple[int, IoCounters]] = {}

    def read(self, dev: str) -> tuple[int, IoCounters] | None:
        return self.counters.get(dev)

    def set(self, completed: int, in_flight: int, dev: str = DEV, rdev: int = 0xFC00) -> None:
        self.counters[dev] = (rdev, IoCounters(completed, in_flight))

    def watch(self, stall: float = 10.0) -> IoWatch:
        return IoWatch(stall, read=self.read, clock=lambda: self.t, wall=lambda: EPOCH + self.t)


def test_io_that_keeps_completing_is_never_stalled() -> None:
    f = Fake()
    w = f.watch()
    for i in range(30):
        f.set(100 + i, 4)  # always something in flight, always something done
        w.sample([DEV])
        f.t += 1
    assert w.stall(DEV) is None


def test_nothing_completing_for_the_stall_time_is_stalled_since_the_last_completion() -> None:
    f = Fake()
    w = f.watch(stall=10)
    f.set(100, 1)
    w.sample([DEV])
    f.t = 5
    f.set(120, 2)  # the last completions, seen at t=5
    w.sample([DEV])
    for t in range(6, 15):
        f.t = t
        w.sample([DEV])
        assert w.stall(DEV) is None, t  # not 10 s yet
    f.t = 15
    w.sample([DEV])
    s = w.stall(DEV)
    assert s is not None and s.in_flight == 2 and s.seconds == 10
    assert s.since == EPOCH + 5 and s.last_completed == EPOCH + 5
    f.t = 16
    f.set(121, 1)  # it moves again
    w.sample([DEV])
    assert w.stall(DEV) is None


def test_an_idle_device_is_never_stalled_and_a_stall_counts_from_its_last_idle_sample() -> None:
    f = Fake()
    w = f.watch(stall=10)
    for t in range(0, 100, 10):
        f.t = t
        f.set(50, 0)  # idle for a long time: nothing in flight, nothing stuck
        w.sample([DEV])
        assert w.stall(DEV) is None
    f.t = 92
    f.set(50, 1)  # a write issued after the idle sample at t=90 that never completes
    w.sample([DEV])
    f.t = 95
    w.sample([DEV])
    assert w.stall(DEV) is None
    f.t = 100
    w.sample([DEV])
    s = w.stall(DEV)  # counted from the last sample that saw it idle
    assert s is not None and s.seconds == 10 and s.since == EPOCH + 90
    assert s.last_completed is None  # none seen while watched


def test_a_cli_watches_for_one_window_and_calls_what_did_not_move_stalled() -> None:
    """A fresh watch (a CLI) has no history: what is in flight is watched for
    WINDOW_S; nothing completing in it is a stall of at least that long."""
    f = Fake()
    w = f.watch(stall=10)
    f.set(7, 3)
    f.set(9, 0, dev="/dev/nbd0", rdev=0x2B00)
    w.sample([DEV, "/dev/nbd0"])
    assert w.wait_needed([DEV, "/dev/nbd0"]) == WINDOW_S  # only the busy one is waited for
    assert w.stall(DEV) is None  # not watched long enough to say
    f.t = WINDOW_S
    assert w.wait_needed([DEV]) == 0
    w.sample([DEV, "/dev/nbd0"])
    s = w.stall(DEV)
    assert s is not None and s.seconds == WINDOW_S and s.since == EPOCH
    assert w.stall("/dev/nbd0") is None


def test_a_reused_device_number_or_a_vanished_device_starts_over() -> None:
    f = Fake()
    w = f.watch(stall=2)
    f.set(1, 1)
    w.sample([DEV])
    f.t = 5
    w.sample([DEV])
    assert w.stall(DEV) is not None
    f.set(1, 1, rdev=0xFC10)  # unmapped, and the name mapped again for another image
    w.sample([DEV])
    assert w.stall(DEV) is None
    del f.counters[DEV]
    w.sample([DEV])
    assert w.stall(DEV) is None and w.wait_needed([DEV]) == 0


def test_forget_drops_what_the_sampler_no_longer_names() -> None:
    f = Fake()
    w = f.watch(stall=1)
    f.set(1, 1)
    w.sample([DEV])
    w.sample(["/dev/other"])  # a pass looking at another volume forgets nothing
    f.t = 3
    assert w.stall(DEV) is not None
    w.sample([], forget=True)
    assert w.stall(DEV) is None


def test_read_counters_adds_what_blk_mq_debugfs_says_the_driver_holds(tmp_path: Path) -> None:
    """The stat line says nothing in flight (a flush is not counted there);
    debugfs lists the flush rbd-nbd has not answered. /dev/null stands for
    the device node (only its number is used)."""
    import os

    from reconciler.observe.iowatch import read_counters

    rdev = os.stat("/dev/null").st_rdev
    disk = tmp_path / "devices" / "virtual" / "block" / "nbd0"
    disk.mkdir(parents=True)
    (disk / "stat").write_text("10 0 80 1 20 0 160 2 0 3 3 0 0 0 0 7 1\n")
    (tmp_path / "dev" / "block").mkdir(parents=True)
    (tmp_path / "dev" / "block" / f"{os.major(rdev)}:{os.minor(rdev)}").symlink_to(disk)
    assert read_counters("/dev/null", str(tmp_path)) == (rdev, IoCounters(37, 0))  # no debugfs
    hctx = tmp_path / "kernel" / "debug" / "block" / "nbd0" / "hctx0"
    hctx.mkdir(parents=True)
    (hctx / "busy").write_text("00000000b5a1e2c4 {.op=FLUSH, .cmd_flags=, .rq_flags=FLUSH_SEQ, "
                               ".state=in_flight, .tag=5, .internal_tag=-1}\n")
    assert read_counters("/dev/null", str(tmp_path)) == (rdev, IoCounters(37, 1))


def test_the_daemon_judges_a_stall_for_the_command_line_as_the_command_alone_does() -> None:
    # The daemon holds a volume after ioStallSeconds; its answers to status,
    # plan and explain say what a command alone says after its 1 s watch
    # (issue 37: the same verdict either way), on the daemon's own record.
    f = Fake()
    daemon = f.watch(stall=15)
    f.set(100, 0)
    daemon.sample([DEV])
    f.t = 30.0
    daemon.sample([DEV])  # its sampler: nothing in flight at 30 s
    f.t = 30.25
    f.set(100, 3)  # a write that does not complete; a status asked now
    judged = daemon.as_a_command_judges()
    judged.sample([DEV])
    assert judged.wait_needed([DEV]) == WINDOW_S - 0.25  # quiet for a second first
    f.t = 30.0 + WINDOW_S
    judged.sample([DEV])  # the same record: the daemon's own sees it too
    assert daemon.stall(DEV) is None  # not 15 s yet for the daemon's passes
    s = judged.stall(DEV)
    assert s is not None and s.in_flight == 3 and s.seconds == WINDOW_S
    # A device whose I/O completes is not judged stalled by either.
    f.set(140, 3)
    f.t += WINDOW_S
    judged.sample([DEV])
    assert judged.stall(DEV) is None and judged.wait_needed([DEV]) == WINDOW_S
