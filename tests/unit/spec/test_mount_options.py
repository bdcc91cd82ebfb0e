"""mountOptions: an allow-list per filesystem; suid and dev only where the node allows."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_spec_invalid import with_lines

from reconciler.spec import mountopts
from reconciler.spec.config import ConfigError, MountPrivileges, default_config, load_config
from reconciler.spec.loader import load
from reconciler.spec.mountopts import check_mount_options

NONE = MountPrivileges()


def stage(options: tuple[str, ...], fs: str = "ext4", path: str = "/srv/s",
          privileges: MountPrivileges = NONE) -> list[tuple[int, str]]:
    return check_mount_options(options, fs_type=fs, publish=False, block=False, path=path,
                               privileges=privileges)


def publish(options: tuple[str, ...], block: bool = False, path: str = "/srv/p",
            privileges: MountPrivileges = NONE) -> list[tuple[int, str]]:
    return check_mount_options(options, fs_type=None, publish=True, block=block, path=path,
                               privileges=privileges)


@pytest.mark.parametrize(("fs", "options"), [
    ("ext4", ("noatime", "nodiratime", "nosuid", "nodev", "noexec", "discard", "lazytime",
              "data=journal", "data_err=abort", "commit=30", "errors=remount-ro",
              "barrier=0", "noauto_da_alloc", "inode_readahead_blks=64", "stripe=16",
              "dioread_nolock", "nodelalloc", "noinit_itable", "max_batch_time=30000",
              "min_batch_time=0", "journal_ioprio=7", "nojournal_checksum", "usrquota",
              "grpquota")),
    ("ext4", ("ro", "sync", "dirsync", "strictatime", "errors=continue", "commit=0")),
    ("xfs", ("noatime", "inode64", "largeio", "nouuid", "allocsize=64k", "logbufs=4",
             "logbsize=256k", "swalloc", "wsync", "discard", "uquota", "gqnoenforce",
             "pquota")),
    ("xfs", ("relatime", "inode32", "noquota", "allocsize=1g", "logbsize=16k", "nolargeio")),
])
def test_allowed_on_a_stage(fs: str, options: tuple[str, ...]) -> None:
    assert stage(options, fs) == []


@pytest.mark.parametrize(("fs", "option", "word"), [
    ("xfs", "logdev=/dev/sdb", "names another device"),
    ("xfs", "rtdev=/dev/sdb", "names another device"),
    ("ext4", "journal_path=/dev/disk/by-id/x", "names another device"),
    ("ext4", "journal_dev=2049", "names another device"),
    ("ext4", "errors=panic", "panic the node"),
    ("ext4", "usrjquota=aquota.user", "names a file"),
    ("ext4", "suid", "mountPrivileges.suidRoots (none set)"),
    ("ext4", "dev", "mountPrivileges.devRoots (none set)"),
    ("xfs", "defaults", "suid, dev and exec"),
    ("ext4", "bind", "mount(8) do something else"),
    ("ext4", "remount", "the planner remounts"),
    ("ext4", "loop", "loop device"),
    ("ext4", "offset=4096", "loop device"),
    ("ext4", "X-mount.mkdir=0755", "userspace option"),
    ("ext4", "x-systemd.automount", "userspace option"),
    ("ext4", "context=system_u:object_r:tmp_t", "SELinux"),
    ("ext4", "helper=foo", "helper program"),
    ("ext4", "make-shared", "propagation"),
    ("ext4", "noload", "skips the journal"),
    ("xfs", "norecovery", "skips the journal"),
    ("ext4", "nofail", "fstab"),
    ("ext4", "users", "fstab"),
    ("ext4", "commit=99999", "not a valid value for commit="),
    ("ext4", "commit=-1", "not a valid value"),
    ("ext4", "commit=", "not a valid value"),
    ("ext4", "data=unordered", "not a valid value for data="),
    ("ext4", "inode_readahead_blks=48", "not a valid value"),
    ("ext4", "journal_ioprio=8", "not a valid value"),
    ("xfs", "logbufs=9", "not a valid value"),
    ("xfs", "logbsize=48k", "not a valid value"),
    ("xfs", "allocsize=3k", "not a valid value"),
    ("xfs", "data=journal", "not an allowed xfs mount option"),  # ext4's, not xfs's
    ("ext4", "inode64", "not an allowed ext4 mount option"),
    ("ext4", "dax", "not an allowed ext4 mount option"),
    ("ext4", "NOATIME", "not an allowed"),
    ("ext4", "noatime\x00", "not an allowed"),
])
def test_refused_on_a_stage(fs: str, option: str, word: str) -> None:
    [(index, message)] = stage(("noexec", option), fs)
    assert index == 1 and word in message, message


def test_an_unknown_option_lists_what_is_allowed() -> None:
    [(_, message)] = stage(("bogus",), "xfs")
    assert "allowed: nosuid, suid, nodev" in message and "logbsize=VALUE" in message
    assert "commit=" not in message  # ext4's


@pytest.mark.parametrize(("options", "word"), [
    (("noatime", "relatime"), "'relatime' contradicts 'noatime' (item 0)"),
    (("nosuid", "suid"), "mountPrivileges"),  # refused before it could contradict
    (("commit=5", "commit=30"), "contradicts"),
    (("barrier", "barrier=0"), "contradicts"),
    (("sync", "async"), "contradicts"),
])
def test_contradictions_are_refused(options: tuple[str, ...], word: str) -> None:
    [(index, message)] = stage(options)
    assert index == 1 and word in message, message


def test_the_same_option_twice_is_no_contradiction() -> None:
    assert stage(("noatime", "noatime")) == []


def test_a_publish_takes_per_mount_options_only() -> None:
    assert publish(("noexec", "nosuid", "nodev", "noatime", "nodiratime")) == []
    assert [m for _, m in publish(("ro", "discard", "data=journal", "bogus"))] == [
        "mount option 'ro' is not allowed here: readOnly says whether a publish is read-only",
        *(f"mount option {o!r} is the filesystem's: a publish is a bind and takes per-mount "
          f"options only ({mountopts.describe(None, True)}); put it in stage.mountOptions"
          for o in ("discard", "data=journal")),
        "'bogus' is not an allowed publish mount option; allowed: "
        + mountopts.describe(None, True)]


def test_block_mode_binds_never_take_nodev() -> None:
    [(index, message)] = publish(("nodev",), block=True)
    assert index == 0 and "must open as a device" in message
    assert publish(("noexec", "nosuid"), block=True) == []


@pytest.mark.parametrize(("path", "ok"), [
    ("/srv/apps", True), ("/srv/apps/one", True), ("/srv/appsx", False), ("/srv", False)])
def test_suid_only_at_or_under_a_suid_root(path: str, ok: bool) -> None:
    privileges = MountPrivileges(suid_roots=("/srv/apps",))
    assert (stage(("suid",), path=path, privileges=privileges) == []) is ok
    assert (publish(("suid",), path=path, privileges=privileges) == []) is ok
    # suid is not dev.
    assert stage(("dev",), path=path, privileges=privileges) != []


# A few hundred hostile strings: nothing outside the tables passes, whatever it holds.
ALLOWED_WORDS = {k for t in (mountopts.MOUNT, mountopts.SUPER, mountopts.EXT4, mountopts.XFS)
                 for k in t if not k.endswith("=")}
hostile = st.one_of(
    st.text(min_size=1, max_size=40),
    st.builds(lambda a, b: a + b, st.sampled_from(sorted(ALLOWED_WORDS)),
              st.sampled_from([",suid", " dev", "\x00", "\n", "=", "=1", ",", "\u202e", " "])),
    st.builds(lambda k, v: f"{k}={v}", st.sampled_from(
        ["logdev", "rtdev", "journal_path", "journal_dev", "errors", "commit", "data",
         "allocsize", "logbsize", "X-mount.mkdir", "context", "offset"]),
        st.text(max_size=20)),
)


@settings(max_examples=300, deadline=None, database=None)
@given(option=hostile)
def test_hostile_options_are_refused_or_plainly_allowed(option: str) -> None:
    problems = stage((option,), "ext4") + stage((option,), "xfs") + publish((option,))
    refused_everywhere = len(problems) == 3
    if not refused_everywhere:
        # Passed somewhere: then it is a word of the tables, or name=VALUE with a
        # plain value (no separator, space, NUL or path that mount could misread).
        _name, eq, value = option.partition("=")
        assert option in ALLOWED_WORDS or (eq and value and value.isascii() and
                                           value.replace("-", "").isalnum()), option
    for _, message in problems:
        assert "\x00" not in message and "\n" not in message


# --- the loader: the error at the option's own line ------------------------------


def test_loader_names_a_stage_option_at_its_line(tmp_path: Path) -> None:
    (tmp_path / "v.yaml").write_text(with_lines({
        "fsType: ext4": "fsType: ext4\n    mountOptions:\n      - noatime\n      - errors=panic"}))
    result = load([tmp_path], default_config())
    [d] = result.diagnostics
    assert (d.field, d.line, d.column) == ("spec.stage.mountOptions[1]", 14, 9)
    assert "panic the node" in d.message and not result.volumes
    assert str(d).startswith(f"{tmp_path / 'v.yaml'}:14:9: spec.stage.mountOptions[1]: ")


def test_loader_names_a_publish_option_at_its_line(tmp_path: Path) -> None:
    (tmp_path / "v.yaml").write_text(with_lines({
        "path: /srv/vol": "path: /srv/vol\n      mountOptions: [noexec, suid]"}))
    result = load([tmp_path], default_config())
    [d] = result.diagnostics
    assert (d.field, d.line, d.column) == ("spec.publish[0].mountOptions[1]", 14, 30)
    assert "mountPrivileges.suidRoots" in d.message and not result.volumes


def test_loader_lets_a_file_ask_suid_where_the_node_allows(tmp_path: Path) -> None:
    (tmp_path / "v.yaml").write_text(with_lines({
        "path: /srv/vol": "path: /srv/vol\n      mountOptions: [suid]"}))
    config = replace(default_config(),
                     mount_privileges=MountPrivileges(suid_roots=("/srv/vol",)))
    result = load([tmp_path], config)
    assert result.ok, result.diagnostics
    assert result.volumes[0].publish[0].mount_options == ("suid",)
    # Another root does not do.
    config = replace(default_config(),
                     mount_privileges=MountPrivileges(suid_roots=("/srv/other",)))
    assert not load([tmp_path], config).ok


def test_loader_refuses_nodev_on_a_block_publish(tmp_path: Path) -> None:
    (tmp_path / "v.yaml").write_text(with_lines({
        "fsType: ext4": "mode: block",
        "path: /srv/vol": "path: /srv/vol\n      mountOptions: [nodev]"}))
    [d] = load([tmp_path], default_config()).diagnostics
    assert d.field == "spec.publish[0].mountOptions[0]" and "device" in d.message


# --- the node config: mountPrivileges ----------------------------------------------


def test_config_mount_privileges(tmp_path: Path) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text("allowedRoots: [/srv]\nmountPrivileges:\n  suidRoots: [/srv/apps]\n"
                   "  devRoots: [/srv/devs, /srv/more]\n")
    config = load_config(cfg)
    assert config.mount_privileges == MountPrivileges(("/srv/apps",), ("/srv/devs", "/srv/more"))
    assert default_config().mount_privileges == MountPrivileges((), ())


@pytest.mark.parametrize(("text", "where", "word"), [
    ("mountPrivileges:\n  suidRoots: [/]\n", (2, 15), "other than /"),
    ("mountPrivileges:\n  devRoots:\n    - /srv/a/../b\n", (3, 7), "normalised"),
    ("mountPrivileges:\n  suidRoots: [srv]\n", (2, 15), "srv"),
    ("mountPrivileges:\n  everything: true\n", (2, 3), "suidRoots"),
])
def test_config_mount_privileges_refused(tmp_path: Path, text: str, where: tuple[int, int],
                                         word: str) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text(text)
    with pytest.raises(ConfigError) as exc:
        load_config(cfg)
    [d] = exc.value.diagnostics
    assert (d.line, d.column) == where and word in d.message, d
