"""The pure parsers on recorded command output (tests/data/README.md says how)."""

from __future__ import annotations

from pathlib import Path

import pytest

from reconciler.facts.parsers import (
    LoopDevice,
    MapError,
    Probe,
    RbdDevice,
    explain_map_failure,
    parse_blkid_export,
    parse_dumpe2fs_size,
    parse_losetup_json,
    parse_mountinfo,
    parse_rbd_device_list,
    parse_xfs_db_size,
    unescape_mount_path,
)

DATA = Path(__file__).resolve().parents[2] / "data"
NODE = "/tmp/rec.PL1R/node"  # where the recordings were made
FUSE_ROOT = f"{NODE}/state dir/fuse"
STAGING = f"{NODE}/state dir/staging/pgdata"


def data(name: str) -> str:
    return (DATA / name).read_text()


# --- /proc/self/mountinfo ----------------------------------------------------------


@pytest.fixture(scope="module")
def mounts():
    ms = parse_mountinfo(data("mountinfo.txt"))
    return {m.mount_point: m for m in ms}


def test_mountinfo_every_recorded_line_parses() -> None:
    text = data("mountinfo.txt")
    assert len(parse_mountinfo(text)) == len(text.splitlines()) == 26


def test_mountinfo_root_fields(mounts) -> None:
    root = mounts["/"]
    assert (root.mount_id, root.parent_id, root.major, root.minor) == (27, 1, 254, 0)
    assert root.root == "/"
    assert root.fs_type == "ext4" and root.source == "/dev/vda"
    assert root.options == {"rw", "relatime"}
    assert root.super_options == {"rw", "discard", "resv_strict", "resuid=65534",
                                  "resgid=65534"}
    assert not root.read_only


def test_mountinfo_unescapes_space_in_mount_point(mounts) -> None:
    assert f"{NODE}/web data" in mounts
    assert f"{STAGING}" in mounts
    assert not any("\\040" in p for p in mounts)


def test_mountinfo_optional_fields_are_skipped(mounts) -> None:
    # "47 27 0:41 / .../web\040data rw,relatime shared:1 - tmpfs tmpfs rw,size=1024k"
    web = mounts[f"{NODE}/web data"]
    assert web.fs_type == "tmpfs" and web.source == "tmpfs"
    assert web.options == {"rw", "relatime"}
    assert web.super_options == {"rw", "size=1024k"}
    assert (web.major, web.minor) == (0, 41)


def test_mountinfo_fuse_rbd_mounts(mounts) -> None:
    fuse = {p: m for p, m in mounts.items() if m.fs_type == "fuse.rbd-fuse"}
    assert sorted(fuse) == [f"{FUSE_ROOT}/rbd@orphan", f"{FUSE_ROOT}/rbd@pgdata"]
    m = fuse[f"{FUSE_ROOT}/rbd@pgdata"]
    assert m.source == "rbd-fuse" and m.major == 0
    assert m.options == {"rw", "nosuid", "nodev", "relatime"}
    assert "user_id=0" in m.super_options


def test_mountinfo_staging_and_binds_share_the_device(mounts) -> None:
    staging = mounts[STAGING]
    rw = mounts[f"{NODE}/srv/pgdata"]
    ro = mounts[f"{NODE}/srv/pgdata-ro"]
    assert {(m.major, m.minor) for m in (staging, rw, ro)} == {(7, 0)}
    assert all(m.source == "/dev/loop0" and m.fs_type == "ext4" for m in (staging, rw, ro))
    assert staging.options == {"rw", "noatime"}
    assert not rw.read_only
    assert ro.read_only and ro.options == {"ro", "noatime"}
    # A ro bind of a rw filesystem: the superblock stays rw.
    assert ro.super_options == {"rw"}


def test_mountinfo_order_is_kept() -> None:
    ids = [m.mount_id for m in parse_mountinfo(data("mountinfo.txt"))]
    assert ids == list(range(22, 48))


def test_mountinfo_several_optional_fields_and_escapes() -> None:
    line = (r"101 27 8:1 /sub\134dir /mnt/a\011b\012c rw shared:4 master:1 propagate_from:1"
            r" unbindable - ext4 /dev/my\040disk rw,errors=remount-ro")
    [m] = parse_mountinfo(line)
    assert m.root == "/sub\\dir"
    assert m.mount_point == "/mnt/a\tb\nc"
    assert m.fs_type == "ext4" and m.source == "/dev/my disk"
    assert m.super_options == {"rw", "errors=remount-ro"}


def test_mountinfo_without_super_options() -> None:
    [m] = parse_mountinfo("5 1 0:3 / /x rw - tmpfs none")
    assert m.super_options == frozenset() and m.source == "none"


@pytest.mark.parametrize("bad", [
    "",
    "garbage",
    "22 27 0:21 / /proc rw,relatime proc proc rw",  # no separator
    "x 27 0:21 / /proc rw,relatime - proc proc rw",  # mount id not a number
    "22 27 021 / /proc rw,relatime - proc proc rw",  # no major:minor
    "22 27 a:b / /proc rw,relatime - proc proc rw",
    "22 27 0:21 / /proc rw - proc",  # truncated after the separator
    "22 27 0:21 -",  # separator before the mandatory fields
])
def test_mountinfo_malformed_lines_are_skipped(bad: str) -> None:
    good = "23 27 0:22 / /sys rw,relatime - sysfs sysfs rw"
    ms = parse_mountinfo(f"{bad}\n{good}\n")
    assert [m.mount_point for m in ms] == ["/sys"]


def test_mountinfo_empty() -> None:
    assert parse_mountinfo("") == ()


def test_unescape_leaves_other_backslashes() -> None:
    assert unescape_mount_path(r"/a\040b\\x\9") == "/a b\\\\x\\9"


# --- losetup --json --list ---------------------------------------------------------


def test_losetup_fuse_and_deleted() -> None:
    loops = parse_losetup_json(data("losetup_fuse_and_deleted.json"))
    assert loops == (
        LoopDevice("/dev/loop1", f"{NODE}/gone.img"),
        LoopDevice("/dev/loop0", f"{FUSE_ROOT}/rbd@pgdata/pgdata"),
    )


def test_losetup_none_set_up() -> None:
    assert parse_losetup_json(data("losetup_none.json")) == ()


@pytest.mark.parametrize("text", ["", "\n", "  \n"])
def test_losetup_empty_output(text: str) -> None:
    assert parse_losetup_json(text) == ()


def test_losetup_sizelimit_and_missing_back_file() -> None:
    text = ('{"loopdevices": [{"name": "/dev/loop3", "sizelimit": "1048576", "back-file": null},'
            ' {"name": "/dev/loop4", "sizelimit": "0", "back-file": "/x (deleted)"}]}')
    assert parse_losetup_json(text) == (LoopDevice("/dev/loop3", None, 1048576),
                                        LoopDevice("/dev/loop4", "/x", None))


def test_losetup_only_a_trailing_deleted_is_removed() -> None:
    text = '{"loopdevices": [{"name": "/dev/loop5", "back-file": "/a (deleted)/b"}]}'
    assert parse_losetup_json(text)[0].back_file == "/a (deleted)/b"


# --- rbd device list --format json -------------------------------------------------


def test_rbd_device_list_krbd() -> None:
    assert parse_rbd_device_list(data("rbd_device_list_krbd.json")) == (
        RbdDevice("rbd", "", "pgdata", None, "/dev/rbd0"),
        RbdDevice("rbd", "", "pgdata", "before-upgrade", "/dev/rbd1"),
        RbdDevice("rbd", "tenant-a", "web", None, "/dev/rbd2"),
        RbdDevice("fast", "", "metrics-xfs", None, "/dev/rbd3"),
    )


def test_rbd_device_list_nbd() -> None:
    # rbd-nbd names the image "image" (krbd: "name") and the head snap "" (krbd: "-").
    assert parse_rbd_device_list(data("rbd_device_list_nbd.json")) == (
        RbdDevice("rbd", "", "pgdata", None, "/dev/nbd0"),
        RbdDevice("rbd", "", "pgdata", "before-upgrade", "/dev/nbd1"),
        RbdDevice("fast", "", "metrics-xfs", None, "/dev/nbd2"),
    )


@pytest.mark.parametrize("name", ["rbd_device_list_krbd_empty.json",
                                  "rbd_device_list_nbd_empty.json"])
def test_rbd_device_list_recorded_empty(name: str) -> None:
    assert parse_rbd_device_list(data(name)) == ()


def test_rbd_device_list_no_output() -> None:
    assert parse_rbd_device_list("") == ()


def test_rbd_device_list_missing_namespace_and_snap() -> None:
    text = '[{"id": "0", "pool": "rbd", "name": "old", "device": "/dev/rbd0"}]'
    assert parse_rbd_device_list(text) == (RbdDevice("rbd", "", "old", None, "/dev/rbd0"),)


# --- blkid -p -o export ------------------------------------------------------------


def test_blkid_ext4() -> None:
    assert parse_blkid_export(data("blkid_ext4.txt"), 0) == Probe(
        "ext4", "1992072c-81e2-4436-ad8b-8ce8b1505020", "ext4")


def test_blkid_xfs() -> None:
    assert parse_blkid_export(data("blkid_xfs.txt"), 0) == Probe(
        "xfs", "18c3f389-53fe-4b89-9ed4-dee732eda835", "xfs")


def test_blkid_partition_table_is_a_signature_not_a_filesystem() -> None:
    assert parse_blkid_export(data("blkid_gpt.txt"), 0) == Probe(None, None, "gpt")


def test_blkid_exit_2_is_blank() -> None:
    assert parse_blkid_export(data("blkid_blank.txt"), 2) == Probe(None, None, None)


@pytest.mark.parametrize("rc", [1, 4, 8, 124, 127])
def test_blkid_failure_is_never_blank(rc: int) -> None:
    with pytest.raises(ValueError, match=f"exit status {rc}"):
        parse_blkid_export("", rc)


def test_blkid_value_with_equals_sign() -> None:
    probe = parse_blkid_export("LABEL=a=b\nTYPE=ext4\nUUID=u\n", 0)
    assert probe == Probe("ext4", "u", "ext4")


# --- filesystem sizes --------------------------------------------------------------


def test_dumpe2fs_size() -> None:
    # Block count 65536 x block size 1024: the whole 64 MiB loop device.
    assert parse_dumpe2fs_size(data("dumpe2fs_h.txt")) == 64 * 2**20


@pytest.mark.parametrize("text", ["", "Block count: 10\n", "Block count: x\nBlock size: 4096\n"])
def test_dumpe2fs_size_unknown(text: str) -> None:
    assert parse_dumpe2fs_size(text) is None


def test_xfs_db_size() -> None:
    # dblocks 81920 x blocksize 4096: the whole 320 MiB loop device.
    assert parse_xfs_db_size(data("xfs_db_size.txt")) == 320 * 2**20


@pytest.mark.parametrize("text", ["", "dblocks = 10\n", "dblocks = 10\nblocksize = ?\n"])
def test_xfs_db_size_unknown(text: str) -> None:
    assert parse_xfs_db_size(text) is None


# --- rbd device map failures -------------------------------------------------------


def test_explain_krbd_without_module_recorded() -> None:
    err = explain_map_failure("krbd", 2, data("krbd_map_no_module.stderr"))
    assert isinstance(err, MapError)
    assert err.reason == "the kernel has no rbd module (krbd unavailable)"
    assert err.detail == "rbd: map failed: (2) No such file or directory"
    assert str(err) == f"{err.reason}: {err.detail}"


def test_explain_krbd_without_module_last_line_only() -> None:
    # What `rbd device map` prints without the module: the last line alone is enough.
    err = explain_map_failure("krbd", 2, "rbd: map failed: (2) No such file or directory\n")
    assert err.reason == "the kernel has no rbd module (krbd unavailable)"


def test_explain_krbd_enoent_from_a_loaded_module_is_not_a_missing_module() -> None:
    # With the module loaded, the kernel itself answers ENOENT for a missing image or
    # pool: "sysfs write failed" shows the write to /sys/bus/rbd reached the kernel.
    stderr = "rbd: sysfs write failed\nrbd: map failed: (2) No such file or directory\n"
    err = explain_map_failure("krbd", 2, stderr)
    assert err.reason == "krbd map failed (exit 2)"
    assert err.detail == "rbd: map failed: (2) No such file or directory"


def test_explain_krbd_no_module_even_after_a_sysfs_write() -> None:
    stderr = ("modprobe: FATAL: Module rbd not found in directory /lib/modules/6.1.0\n"
              "rbd: failed to load rbd kernel module (1)\n"
              "rbd: sysfs write failed\n"
              "rbd: map failed: (2) No such file or directory\n")
    err = explain_map_failure("krbd", 2, stderr)
    assert err.reason == "the kernel has no rbd module (krbd unavailable)"


def test_explain_nbd_exit_22_recorded() -> None:
    err = explain_map_failure("nbd", 22, data("nbd_map_no_module.stderr"))
    assert err.reason == "rbd-nbd could not attach (no nbd kernel module?)"
    assert err.detail == "rbd: rbd-nbd failed with error: /usr/bin/rbd-nbd: exit status: 1"


def test_explain_nbd_exit_22_without_stderr() -> None:
    err = explain_map_failure("nbd", 22, "")
    assert err.reason == "rbd-nbd could not attach (no nbd kernel module?)"
    assert err.detail == "exit status 22"


def test_explain_permission_denied() -> None:
    err = explain_map_failure("krbd", 13, data("krbd_map_permission_denied.stderr"))
    assert err.reason == "permission denied by Ceph (check the cephx user's caps)"
    assert err.detail == "rbd: map failed: (13) Permission denied"


def test_explain_operation_not_permitted_nbd() -> None:
    err = explain_map_failure("nbd", 1, "rbd-nbd: failed to open image: (1) Operation not "
                                        "permitted\n")
    assert err.reason == "permission denied by Ceph (check the cephx user's caps)"


@pytest.mark.parametrize(("stderr", "reason"), [
    ("rbd: sysfs write failed\nrbd: map failed: (6) No such device or address\n",
     "the kernel refused the image (unsupported features?)"),
    ("rbd: map failed: (110) Connection timed out\n", "Ceph did not answer in time"),
])
def test_explain_known_kernel_errors(stderr: str, reason: str) -> None:
    assert explain_map_failure("krbd", 1, stderr).reason == reason


def test_explain_generic_recorded() -> None:
    err = explain_map_failure("krbd", 13, data("map_no_auth.stderr"))
    assert err.reason == "krbd map failed (exit 13)"
    assert err.detail == "rbd: couldn't connect to the cluster!"


def test_explain_generic_no_stderr() -> None:
    err = explain_map_failure("krbd", 1, "\n\n")
    assert err.reason == "krbd map failed (exit 1)"
    assert err.detail == "exit status 1"
    assert str(err) == "krbd map failed (exit 1): exit status 1"
