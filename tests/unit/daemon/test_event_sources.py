"""The daemon's event sources: parsers and the hub on the real kernel
(a tmpfs mount, a real child process, a real netlink socket)."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import pytest

from reconciler.daemon.events import (
    EventHub,
    Interest,
    changed_points,
    mount_keys,
    names_for_points,
    names_for_uevent,
)
from reconciler.facts.uevent import parse_uevent

DATA = Path(__file__).resolve().parents[2] / "data"
DEADLINE = 10.0


class Marks:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.seen: list[tuple[frozenset[str] | None, str]] = []

    def __call__(self, names: Iterable[str] | None, why: str) -> None:
        with self.cond:
            self.seen.append((None if names is None else frozenset(names), why))
            self.cond.notify_all()

    def wait_for(self, name: str) -> str:
        end = time.monotonic() + DEADLINE
        with self.cond:
            while True:
                for names, why in self.seen:
                    if names is not None and name in names:
                        return why
                left = end - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no event for {name} in {DEADLINE} s: {self.seen}")
                self.cond.wait(left)


def test_a_recorded_kernel_uevent() -> None:
    ev = parse_uevent((DATA / "uevent_loop_change.bin").read_bytes())
    assert ev is not None
    assert (ev.action, ev.subsystem, ev.devname) == ("change", "block", "loop0")
    assert names_for_uevent(ev, {"loop0": "v"}) == {"v"}
    assert names_for_uevent(ev, {"loop1": "v"}) == set()


def test_udev_rebroadcasts_and_garbage_are_ignored() -> None:
    assert parse_uevent(b"libudev\0\xfe\xed") is None
    assert parse_uevent(b"") is None
    assert parse_uevent(b"no-at-sign\0A=B") is None


MOUNTINFO = """\
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw
20 27 7:0 / /srv/a rw,nosuid,nodev - ext4 /dev/loop0 rw
21 27 7:0 / /srv/b rw,nosuid,nodev shared:3 - ext4 /dev/loop0 rw
"""


def test_mount_diff_names_only_the_points_that_changed() -> None:
    before = mount_keys(MOUNTINFO)
    gone = "20 27 7:0 / /srv/a rw,nosuid,nodev - ext4 /dev/loop0 rw\n"
    came = "30 27 0:50 / /srv/c rw - tmpfs t rw\n31 21 0:51 / /srv/b rw - tmpfs t rw\n"
    after = mount_keys(MOUNTINFO.replace(gone, "") + came)
    points = changed_points(before, after)
    assert points == {"/srv/a", "/srv/c", "/srv/b"}
    assert names_for_points(points, {"/srv/a": "a", "/srv/x": "x"}) == {"a"}


B = "21 27 7:0 / /srv/b rw,nosuid,nodev shared:3 - ext4 /dev/loop0 rw"


@pytest.mark.parametrize("now", [
    # remount,bind,ro of a publish: same mount id, same point (issue 26.1)
    "21 27 7:0 / /srv/b ro,nosuid,nodev shared:3 - ext4 /dev/loop0 rw",
    # the filesystem gone read-only: its superblock options (issue 26.3)
    "21 27 7:0 / /srv/b rw,nosuid,nodev shared:3 - ext4 /dev/loop0 ro",
    "21 27 7:0 / /srv/b rw,nosuid,nodev shared:3 - ext4 /dev/loop0 rw,emergency_ro",
    "21 27 7:0 / /srv/b rw,nosuid shared:3 - ext4 /dev/loop0 rw",  # nodev taken away
])
def test_a_remount_in_place_is_a_change(now: str) -> None:
    assert B in MOUNTINFO
    changed = MOUNTINFO.replace(B, now)
    assert changed_points(mount_keys(MOUNTINFO), mount_keys(changed)) == {"/srv/b"}


def test_propagation_alone_is_no_change() -> None:
    """mountinfo's optional fields change with mounts elsewhere in a peer group."""
    moved = MOUNTINFO.replace("shared:3", "shared:3 master:1")
    assert changed_points(mount_keys(MOUNTINFO), mount_keys(moved)) == set()


def test_a_mount_above_a_path_names_its_volume() -> None:
    paths = {"/srv/app/data": "a", "/srv/app2": "b", "/srv/apple": "c", "/var/x": "d"}
    assert names_for_points({"/srv/app"}, paths) == {"a"}
    assert names_for_points({"/srv"}, paths) == {"a", "b", "c"}
    assert names_for_points({"/"}, paths) == {"a", "b", "c", "d"}
    assert names_for_points({"/srv/app/data/sub"}, paths) == set()


def test_mount_keys_of_this_node() -> None:
    keys = mount_keys(Path("/proc/self/mountinfo").read_text())
    assert any(state[0] == "/" for state in keys.values())


@pytest.fixture
def hub_and_marks() -> Iterable[tuple[EventHub, Marks]]:
    marks = Marks()
    hub = EventHub(marks)
    hub.start()
    yield hub, marks
    hub.stop(timeout=5)


def test_a_mount_at_a_watched_path_marks_its_volume(tmp_path: Path,
                                                    hub_and_marks: tuple[EventHub, Marks]) -> None:
    hub, marks = hub_and_marks
    target = tmp_path / "target"
    target.mkdir()
    hub.update(Interest(paths={str(target): "vol-a"}))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "evtest", str(target)], check=True)
    try:
        assert "mounts changed" in marks.wait_for("vol-a")
    finally:
        subprocess.run(["umount", str(target)], check=True)


def test_a_helper_that_exits_marks_its_volume(hub_and_marks: tuple[EventHub, Marks]) -> None:
    hub, marks = hub_and_marks
    proc = subprocess.Popen(["sleep", "60"])
    try:
        hub.update(Interest(pids={proc.pid: "vol-h"}))
        proc.kill()
        assert f"helper pid {proc.pid}" in marks.wait_for("vol-h")
    finally:
        proc.kill()
        proc.wait()


def test_a_loop_device_change_marks_its_volume(tmp_path: Path,
                                               hub_and_marks: tuple[EventHub, Marks]) -> None:
    hub, marks = hub_and_marks
    backing = tmp_path / "img"
    backing.write_bytes(b"\0" * (1 << 20))
    dev = subprocess.run(["losetup", "--find", "--show", str(backing)], check=True,
                         capture_output=True, text=True).stdout.strip()
    try:
        hub.update(Interest(devices={os.path.basename(dev): "vol-d"}))
        backing.write_bytes(b"\0" * (2 << 20))
        subprocess.run(["losetup", "-c", dev], check=True)  # a resize: "change"
        assert marks.wait_for("vol-d") == "block device uevent"
    finally:
        subprocess.run(["losetup", "-d", dev], check=True)


def test_the_image_poll_marks_a_resized_image() -> None:
    marks = Marks()
    sizes = {("rbd", "img"): 64}
    hub = EventHub(marks, read_sizes=lambda keys: {k: sizes[k] for k in keys},
                   image_poll_seconds=0.05)
    hub.start()
    try:
        hub.update(Interest(images={("rbd", "img"): ("vol-r", 64)}))
        sizes[("rbd", "img")] = 96
        assert marks.wait_for("vol-r") == "image resized elsewhere"
    finally:
        hub.stop(timeout=5)


def test_stop_is_prompt_and_closes_the_sources() -> None:
    hub = EventHub(Marks())
    hub.start()
    hub.stop(timeout=5)
    assert not any(t.is_alive() for t in hub._threads)


def test_a_dead_helper_is_reported_once(hub_and_marks: tuple[EventHub, Marks]) -> None:
    """The interest keeps naming a dead helper until its volume is looked at
    again: every update must not mark it again (that was a pass loop)."""
    hub, marks = hub_and_marks
    proc = subprocess.Popen(["sleep", "60"])
    proc.kill()
    proc.wait()
    hub.update(Interest(pids={proc.pid: "vol-g"}))
    marks.wait_for("vol-g")
    # As the daemon does after the pass the mark caused: the same interest.
    hub.update(Interest(pids={proc.pid: "vol-g", 12345678: "vol-z"}))  # beyond pid_max
    marks.wait_for("vol-z")
    assert sum(1 for names, _ in marks.seen if names and "vol-g" in names) == 1


def test_a_bind_remounted_read_only_marks_its_volume(
        tmp_path: Path, hub_and_marks: tuple[EventHub, Marks]) -> None:
    """`mount -o remount,bind,ro` keeps the mount id and point: only its
    options say it changed (issue 26.1: missed until the resync)."""
    hub, marks = hub_and_marks
    src, target = tmp_path / "src", tmp_path / "target"
    src.mkdir()
    target.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "evsrc", str(src)], check=True)
    try:
        subprocess.run(["mount", "--bind", str(src), str(target)], check=True)
        try:
            hub.update(Interest(paths={str(target): "vol-ro"}))
            subprocess.run(["mount", "-o", "remount,bind,ro", str(target)], check=True)
            assert str(target) in marks.wait_for("vol-ro")
        finally:
            subprocess.run(["umount", str(target)], check=True)
    finally:
        subprocess.run(["umount", str(src)], check=True)


def test_a_mount_over_a_parent_directory_marks_the_volume_below(
        tmp_path: Path, hub_and_marks: tuple[EventHub, Marks]) -> None:
    hub, marks = hub_and_marks
    parent = tmp_path / "srv"
    (parent / "app").mkdir(parents=True)
    hub.update(Interest(paths={str(parent / "app"): "vol-p"}))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "evparent", str(parent)],
                   check=True)
    try:
        assert str(parent) in marks.wait_for("vol-p")
    finally:
        subprocess.run(["umount", str(parent)], check=True)


@pytest.fixture
def ext4_on_loop(tmp_path: Path) -> Iterable[tuple[str, Path]]:
    """A real ext4 on a loop device, mounted: (device name, mount point)."""
    backing, mnt = tmp_path / "img", tmp_path / "mnt"
    mnt.mkdir()
    with open(backing, "wb") as f:
        f.truncate(32 << 20)
    subprocess.run(["mkfs.ext4", "-q", str(backing)], check=True)
    dev = subprocess.run(["losetup", "--find", "--show", str(backing)], check=True,
                         capture_output=True, text=True).stdout.strip()
    try:
        subprocess.run(["mount", "-o", "errors=remount-ro", dev, str(mnt)], check=True)
        try:
            yield os.path.basename(dev), mnt
        finally:
            subprocess.run(["umount", str(mnt)], check=True)
    finally:
        subprocess.run(["losetup", "-d", dev], check=True)


def test_a_filesystem_error_marks_its_volume_and_again_later(
        ext4_on_loop: tuple[str, Path], hub_and_marks: tuple[EventHub, Marks]) -> None:
    """ext4 gone read-only after an error changes no mount: no mountinfo
    event, only the kernel's message (issue 26.3)."""
    hub, marks = hub_and_marks
    try:
        os.close(os.open("/dev/kmsg", os.O_RDONLY))
    except OSError as exc:
        pytest.fail(f"/dev/kmsg cannot be read here ({exc}): root with CAP_SYSLOG needed")
    dev, _ = ext4_on_loop
    trigger = Path(f"/sys/fs/ext4/{dev}/trigger_fs_error")
    if not trigger.exists():
        pytest.skip(f"{trigger}: this kernel's ext4 cannot inject an error")
    hub.update(Interest(devices={dev: "vol-k", "loop-not-ours": "vol-x"}))
    trigger.write_text("1")
    assert marks.wait_for("vol-k").startswith(f"kernel: EXT4-fs error (device {dev})")
    end = time.monotonic() + DEADLINE
    while not any(names and "vol-k" in names and "again" in why for names, why in marks.seen):
        assert time.monotonic() < end, marks.seen
        with marks.cond:
            marks.cond.wait(0.1)
    assert not any(names and "vol-x" in names for names, _ in marks.seen)


def test_the_io_poll_marks_a_volume_when_its_io_stops_and_when_it_completes_again() -> None:
    """No event comes when I/O stops completing: the poll reads the devices'
    counters (here a fake sysfs) and marks the volume on each transition."""
    from reconciler.facts.iostat import IoCounters
    from reconciler.observe.iowatch import IoWatch

    counters = {"/dev/rbd0": IoCounters(10, 0)}
    watch = IoWatch(0.2, read=lambda d: (0xFC00, counters[d]) if d in counters else None)
    marks = Marks()
    hub = EventHub(marks, io_watch=lambda: watch, io_poll_seconds=0.02)
    hub.start()
    try:
        hub.update(Interest(devices={"rbd0": "vol-io"}))
        counters["/dev/rbd0"] = IoCounters(10, 2)  # two requests that never complete
        assert marks.wait_for("vol-io") == "I/O not completing"
        marks.seen.clear()
        counters["/dev/rbd0"] = IoCounters(12, 0)
        assert marks.wait_for("vol-io") == "I/O completing again"
    finally:
        hub.stop(timeout=5)
