"""Kernel log records and the devices they name; the mount a path really
reaches (a publish with a mount on top, or over a directory above it); a
filesystem that refuses writes whatever its mounts' own flags say."""

from __future__ import annotations

import pytest

from reconciler.facts.kmsg import devices_named, names_for_message, parse_kmsg
from reconciler.facts.observed import Mount, visible_mounts
from reconciler.facts.parsers import parse_mountinfo

# PRI,SEQ,USEC,FLAGS;TEXT. The first three recorded on this host (6.18, ext4's
# trigger_fs_error); the others as the kernel (6.1, 6.18) words them.
RECORDS = [
    (b"3,8901,11439861321,-;EXT4-fs error (device loop0): trigger_test_error:129: comm sh: 1\n",
     {"loop0"}),
    (b"3,8902,11439862295,-;Aborting journal on device loop0-8.\n", {"loop0-8", "loop0"}),
    (b"2,8903,11439863503,-;EXT4-fs (loop0): Remounting filesystem read-only\n", {"loop0"}),
    (b"3,9001,1,-;I/O error, dev loop3, sector 2048 op 0x1:(WRITE) flags 0x800 phys_seg 1 "
     b"prio class 2\n SUBSYSTEM=block\n DEVICE=b7:3\n", {"loop3"}),
    (b"3,9002,2,-;Buffer I/O error on dev loop3, logical block 0, lost async page write\n",
     {"loop3"}),
    (b"4,9003,3,-;EXT4-fs warning (device dm-2): ext4_end_bio:343: I/O error 10 writing to "
     b"inode 12\n", {"dm-2"}),
    (b"1,9004,4,-;XFS (rbd0): log I/O error -5\n", {"rbd0"}),
    (b"3,9005,5,-;block nbd0: Receive control failed (result -32)\n", {"nbd0"}),
    (b"3,9006,6,-;rbd: rbd1: encountered watch error: -107\n", {"rbd1"}),
]


@pytest.mark.parametrize(("record", "named"), RECORDS)
def test_devices_a_kernel_warning_names(record: bytes, named: set[str]) -> None:
    msg = parse_kmsg(record)
    assert msg is not None and msg.trouble
    assert named <= devices_named(msg.text)
    devices = dict.fromkeys(named, "vol") | {"loop9": "other"}
    assert names_for_message(msg, devices) == {"vol"}


def test_information_and_messages_from_processes_wake_nothing() -> None:
    info = parse_kmsg(b"6,8895,10564999263,-;loop0: detected capacity change from 0 to 131072\n")
    assert info is not None and not info.trouble
    assert names_for_message(info, {"loop0": "v"}) == set()
    # Facility 1 (user): written into /dev/kmsg by a process, not by the kernel.
    user = parse_kmsg(b"11,8896,1,-;EXT4-fs error (device loop0): forged\n")
    assert user is not None and user.level == 3 and not user.trouble
    assert names_for_message(user, {"loop0": "v"}) == set()


@pytest.mark.parametrize("record", [b"", b"no separator", b"x,1,2,-;text", b"\xff;\xfe"])
def test_garbage_is_no_record(record: bytes) -> None:
    msg = parse_kmsg(record)
    assert msg is None or not names_for_message(msg, {"loop0": "v"})


ROOT = "27 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n"
STAGE = "40 27 7:0 / /var/lib/r/staging/v rw,nosuid,nodev - ext4 /dev/loop0 rw\n"
BIND = "41 27 7:0 / /srv/app rw,nosuid,nodev - ext4 /dev/loop0 rw\n"


def lookup(text: str) -> dict[str, Mount | None]:
    find = visible_mounts(parse_mountinfo(text))
    return {p: find(p) for p in ("/srv/app", "/srv/app/sub", "/var/lib/r/staging/v", "/")}


def test_a_bind_alone_is_what_its_path_reaches() -> None:
    seen = lookup(ROOT + STAGE + BIND)
    assert seen["/srv/app"] is not None and seen["/srv/app"].mount_id == 41
    assert seen["/srv/app/sub"] is not None and seen["/srv/app/sub"].mount_id == 41
    assert seen["/var/lib/r/staging/v"].mount_id == 40  # type: ignore[union-attr]
    assert seen["/"].mount_id == 27  # type: ignore[union-attr]


def test_a_mount_on_top_hides_the_bind() -> None:
    seen = lookup(ROOT + STAGE + BIND + "50 41 0:60 / /srv/app rw - tmpfs squatter rw\n")
    assert seen["/srv/app"].source == "squatter"  # type: ignore[union-attr]
    # taken off again: the bind is what the path reaches
    assert lookup(ROOT + STAGE + BIND)["/srv/app"].mount_id == 41  # type: ignore[union-attr]


def test_a_mount_over_a_directory_above_hides_the_bind() -> None:
    seen = lookup(ROOT + STAGE + BIND + "51 27 0:61 / /srv rw - tmpfs above rw\n")
    assert seen["/srv/app"].source == "above"  # type: ignore[union-attr]
    assert seen["/var/lib/r/staging/v"].mount_id == 40  # type: ignore[union-attr]


def test_a_mount_below_the_bind_hides_only_what_is_below() -> None:
    seen = lookup(ROOT + STAGE + BIND + "52 41 0:62 / /srv/app/sub rw - tmpfs inside rw\n")
    assert seen["/srv/app"].mount_id == 41  # type: ignore[union-attr]
    assert seen["/srv/app/sub"].source == "inside"  # type: ignore[union-attr]


def test_no_root_mount_seen_is_not_known() -> None:
    assert lookup(BIND)["/srv/app"] is None


def test_this_node_resolves() -> None:
    from pathlib import Path

    find = visible_mounts(parse_mountinfo(Path("/proc/self/mountinfo").read_text()))
    root = find("/")
    assert root is not None and root.mount_point == "/"
    proc = find("/proc/self")
    assert proc is not None and proc.fs_type == "proc"


@pytest.mark.parametrize(("per_mount", "fs", "read_only", "fs_read_only"), [
    ("rw", "rw", False, False),
    ("ro", "rw", True, False),  # remount,bind,ro: this mount only
    ("rw", "ro", False, True),  # the superblock: every mount of it (6.1's errors=remount-ro)
    ("rw", "rw,errors=remount-ro,emergency_ro", False, True),  # 6.x after an error
    ("rw", "rw,shutdown", False, True),
])
def test_read_only_this_mount_or_the_filesystem(per_mount: str, fs: str, read_only: bool,
                                                fs_read_only: bool) -> None:
    [m] = parse_mountinfo(f"41 27 7:0 / /srv/app {per_mount},nosuid - ext4 /dev/loop0 {fs}\n")
    assert (m.read_only, m.fs_read_only) == (read_only, fs_read_only)
