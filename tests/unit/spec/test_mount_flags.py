"""What each mount is made with (nosuid,nodev unless asked otherwise) and how
mountinfo shows an option in force: the planner's view of mount options."""

from __future__ import annotations

import pytest

from reconciler.spec import mountflags


def test_defaults_are_added_unless_asked_otherwise() -> None:
    assert mountflags.stage_options(("noatime",)) == ("noatime", "nosuid", "nodev")
    assert mountflags.stage_options(("suid", "noexec")) == ("suid", "noexec", "nodev")
    assert mountflags.stage_options(("dev",)) == ("dev", "nosuid")
    assert mountflags.stage_options(("nosuid",)) == ("nosuid", "nodev")


def test_a_bind_states_the_stagings_per_mount_flags() -> None:
    # A bind remount clears every per-mount flag it does not name.
    assert mountflags.bind_options(("noexec", "noatime", "discard", "suid"), (), False) == (
        "noexec", "noatime", "nosuid", "nodev")
    # The publish's own win over the staging's.
    assert mountflags.bind_options(("noexec", "noatime"), ("exec", "relatime"), False) == (
        "exec", "relatime", "nosuid", "nodev")


@pytest.mark.parametrize(("option", "shown", "fs", "expected"), [
    ("nosuid", {"rw", "nosuid"}, "ext4", True),
    ("nosuid", {"rw"}, "ext4", False),
    ("suid", {"rw", "nosuid"}, "ext4", False),
    ("suid", {"rw"}, "ext4", True),
    ("barrier=0", {"nobarrier"}, "ext4", True),
    ("barrier", {"nobarrier"}, "ext4", False),
    ("commit=5", set(), "ext4", True),  # hidden default
    ("commit=0", set(), "ext4", True),  # 0 means the default
    ("commit=30", set(), "ext4", False),
    ("commit=30", {"commit=30"}, "ext4", True),
    ("errors=remount-ro", set(), "ext4", None),  # the superblock's default: cannot tell
    ("errors=remount-ro", {"errors=remount-ro"}, "ext4", True),
    ("data=journal", {"data=ordered"}, "ext4", False),
    ("allocsize=1m", {"allocsize=1024k"}, "xfs", True),
    ("logbsize=32k", {"logbsize=32k"}, "xfs", True),
    ("logbsize=64k", {"logbsize=32k"}, "xfs", False),
    ("strictatime", {"relatime"}, "ext4", False),
    ("strictatime", set(), "ext4", True),
    ("rw", {"ro"}, "ext4", None),  # never forced back (errors=remount-ro)
    ("somethingold", {"somethingold"}, "ext4", True),  # not in the tables: as written
    ("somethingold", set(), "ext4", False),
])
def test_in_force_reads_mountinfo_as_the_kernel_writes_it(
        option: str, shown: set[str], fs: str, expected: bool | None) -> None:
    assert mountflags.in_force(option, frozenset(shown), fs) is expected


def test_what_a_remount_cannot_change() -> None:
    assert not mountflags.remountable("data=journal", "ext4")
    assert mountflags.remountable("commit=30", "ext4")
    assert not mountflags.remountable("discard", "xfs")
    assert mountflags.remountable("discard", "ext4")
    assert mountflags.remountable("nosuid", "xfs")


def test_block_mode_gets_nosuid_never_nodev() -> None:
    assert mountflags.bind_options((), (), block=True) == ("nosuid",)
    assert mountflags.stage_options((), block=True) == ("nosuid",)
