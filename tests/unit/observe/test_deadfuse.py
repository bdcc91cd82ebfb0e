"""Who uses a dead fuse-loop volume (observe/deadfuse.py), on a fake /proc:
open files by mount id, working and root directories by path, mapped files
by device number, the loop device open, a mount stacked inside, and a
process whose entries cannot be read (a user: when unsure, refuse)."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from reconciler.facts.observed import Mapping, Mount
from reconciler.observe.deadfuse import dead_fuse_mappings, dead_fuse_users

FUSE = "/var/lib/rbd-reconciler/fuse/rbd@vol"
STG = "/var/lib/rbd-reconciler/staging/vol"
APP = "/srv/app"
LOOP = (7, 3)
MAPPING = Mapping("fuse", "rbd", "vol", "/dev/loop3", FUSE, problem="helper is gone")


def mount(mid: int, parent: int, rdev: tuple[int, int], point: str, fs: str = "ext4"
          ) -> Mount:
    return Mount(mid, parent, *rdev, "/", point, frozenset({"rw"}), fs, "src",
                 frozenset({"rw"}))


MOUNTS = (mount(1, 0, (8, 1), "/"), mount(40, 1, (0, 55), FUSE, "fuse.rbd-fuse"),
          mount(41, 1, LOOP, STG), mount(42, 1, LOOP, APP), mount(43, 1, (8, 1), "/other"))


class FakeProc:
    def __init__(self, root: Path) -> None:
        self.root = root

    def process(self, pid: int, comm: str = "app", *, cwd: str = "/",
                fds: dict[int, tuple[str, int]] | None = None, maps: str = "") -> Path:
        d = self.root / str(pid)
        (d / "fd").mkdir(parents=True)
        (d / "fdinfo").mkdir()
        (d / "comm").write_text(comm + "\n")
        os.symlink(cwd, d / "cwd")
        os.symlink("/", d / "root")
        (d / "maps").write_text(maps)
        for fd, (target, mnt_id) in (fds or {}).items():
            os.symlink(target, d / "fd" / str(fd))
            (d / "fdinfo" / str(fd)).write_text(f"pos:\t0\nflags:\t02\nmnt_id:\t{mnt_id}\n")
        return d


@pytest.fixture
def proc(tmp_path: Path) -> FakeProc:
    return FakeProc(tmp_path)


def never_asked(path: str) -> bool | None:
    raise AssertionError(f"the kernel was asked about {path}: /proc alone decides here")


def scan(proc: FakeProc, mounts: tuple[Mount, ...] = MOUNTS,
         busy: Callable[[str], bool | None] = never_asked) -> list[str]:
    return [u.what for u in dead_fuse_users(MAPPING, mounts, [LOOP], proc.root, busy=busy)]


def test_nobody(proc: FakeProc) -> None:
    proc.process(10, fds={0: ("/dev/null", 20), 3: ("/other/f", 43)}, cwd="/other",
                 maps="7f00-7f01 r--p 00000000 08:01 12 /usr/lib/libc.so\n")
    assert scan(proc) == []


@pytest.mark.parametrize(("mnt_id", "target"), [(41, f"{STG}/f"), (42, f"{APP}/f"),
                                                (40, f"{FUSE}/vol")])
def test_an_open_file_on_any_of_its_mounts(proc: FakeProc, mnt_id: int, target: str) -> None:
    proc.process(11, "postgres", fds={4: (target, mnt_id)})
    [user] = dead_fuse_users(MAPPING, MOUNTS, [LOOP], proc.root)
    assert user.pid == 11 and user.what == "pid 11 (postgres): open file"


def test_a_working_directory_below_a_publish(proc: FakeProc) -> None:
    proc.process(12, "sh", cwd=f"{APP}/sub")
    assert scan(proc) == ["pid 12 (sh): working directory"]


def test_a_mapped_file(proc: FakeProc) -> None:
    proc.process(13, "db", maps=f"7f00-7f01 r--s 00000000 07:03 99 {APP}/data\n")
    assert scan(proc) == ["pid 13 (db): mapped file"]


def test_the_loop_device_open(proc: FakeProc) -> None:
    """An open device is recognised by its node's rdev (a stat of the node on
    devtmpfs): a real block device node of this host stands for the loop."""
    node = next((p for p in sorted(Path("/dev").glob("loop[0-9]*"))
                 if stat.S_ISBLK(p.stat().st_mode)), None)
    if node is None:
        pytest.skip("no loop device node on this host")
    rdev = node.stat().st_rdev
    proc.process(14, "dd", fds={0: (str(node), 20)})
    found = dead_fuse_users(MAPPING, MOUNTS, [(os.major(rdev), os.minor(rdev))], proc.root,
                            busy=never_asked)
    assert [u.what for u in found] == ["pid 14 (dd): open device"]


def test_a_mount_stacked_inside_or_under(proc: FakeProc) -> None:
    inside = mount(50, 42, (0, 60), f"{APP}/cache", "tmpfs")
    under = mount(51, 1, (0, 61), STG, "tmpfs")
    found = scan(proc, (*MOUNTS, inside, under))
    assert found == [f"a mount at {APP}/cache (tmpfs src) inside {APP}",
                     f"another mount at {STG} (tmpfs src)"]


def unreadable(proc: FakeProc, pid: int) -> None:
    d = proc.process(pid, "secret")
    (d / "fd").rmdir()
    (d / "fd").write_text("")  # listing it fails, and not because it exited


@pytest.mark.parametrize(("kernel", "why"), [(None, "the kernel did not say"),
                                             (True, "the kernel counts a user")])
def test_an_unreadable_process_is_a_user_unless_the_kernel_counts_none(
        proc: FakeProc, kernel: bool | None, why: str) -> None:
    unreadable(proc, 15)
    asked: list[str] = []

    def busy(path: str) -> bool | None:
        asked.append(path)
        return kernel

    [what] = scan(proc, busy=busy)
    assert what.startswith("pid 15 (secret): unreadable (fd:") and why in what
    assert FUSE not in asked  # the dead FUSE mount: its loop device holds it always


def test_the_kernel_counting_nobody_settles_an_unreadable_process(proc: FakeProc) -> None:
    unreadable(proc, 15)
    asked: list[str] = []
    assert scan(proc, busy=lambda p: asked.append(p) or False) == []  # type: ignore[func-returns-value]
    assert sorted(asked) == [APP, STG]


def test_a_named_user_is_reported_with_the_unreadable_ones(proc: FakeProc) -> None:
    unreadable(proc, 15)
    proc.process(16, "sh", cwd=APP)
    assert scan(proc) == ["pid 16 (sh): working directory",
                          "pid 15 (secret): unreadable (fd: Not a directory): taken as a user"]


def test_a_process_gone_mid_scan_is_no_user(proc: FakeProc) -> None:
    d = proc.process(16)
    for sub in ("fd", "fdinfo"):
        (d / sub).rmdir()
    for f in ("cwd", "root", "maps", "comm"):
        (d / f).unlink()
    assert scan(proc) == []


def test_ignored_pids(proc: FakeProc) -> None:
    proc.process(17, "rbd-fuse", fds={3: (f"{FUSE}/vol", 40)})
    assert dead_fuse_users(MAPPING, MOUNTS, [LOOP], proc.root, ignore_pids=[17],
                           busy=never_asked) == ()


def test_only_dead_fuse_mappings_of_wanted_images() -> None:
    alive = Mapping("fuse", "rbd", "ok", "/dev/loop4", FUSE)
    half = Mapping("fuse", "rbd", "half", None, FUSE, problem="gone")
    krbd = Mapping("krbd", "rbd", "k", "/dev/rbd0", problem="gone")
    other = Mapping("fuse", "rbd", "theirs", "/dev/loop5", FUSE, problem="gone")
    wanted = {("rbd", n) for n in ("vol", "ok", "half", "k")}
    assert dead_fuse_mappings([MAPPING, alive, half, krbd, other], wanted) == [MAPPING]


def test_an_ignored_pid_reused_by_a_user_is_a_user(proc: FakeProc) -> None:
    """Review: the helper pids to ignore come partly from our own record of
    the rbd-fuse we started (fusemapper.fuse_pids), which keeps the pid of a
    helper that died and was reaped (reap_zombies) until the repair unmaps
    it; while its volume is in use that may be days. A process that reuses
    that pid and uses the volume is a user, not the helper."""
    proc.process(17, "postgres", fds={4: (f"{STG}/f", 41)})
    [user] = dead_fuse_users(MAPPING, MOUNTS, [LOOP], proc.root, ignore_pids=[17],
                             busy=never_asked)
    assert user.pid == 17


def test_a_process_table_that_cannot_be_listed_is_not_nobody(tmp_path: Path) -> None:
    """Review: /proc that cannot be listed (EMFILE, ENOMEM, a missing
    mount) is unknown, never "nobody uses it" (safety rule 7): the repair
    would unmount the volume on that answer."""
    with pytest.raises(OSError):
        got = dead_fuse_users(MAPPING, MOUNTS, [LOOP], tmp_path / "no-proc", busy=never_asked)
        pytest.fail(f"answered {got!r}")
