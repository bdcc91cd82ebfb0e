"""Mappers without a kernel client: the exact command lines, and recorded replies.

krbd and rbd-nbd cannot run here (no kernel modules), so a recording Runner
stands in for the node and answers with output recorded on a real machine
(tests/data/README.md). The fuse-loop listing runs on recorded mountinfo and
``losetup --json`` taken with two real rbd-fuse mounts.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from reconciler.drivers import fusemapper
from reconciler.drivers.fusemapper import FuseMapper
from reconciler.drivers.kernelmapper import KernelMapper
from reconciler.drivers.run import CommandError, Result, Runner
from reconciler.facts.observed import Mapping
from reconciler.facts.parsers import LoopDevice, MapError, parse_rbd_device_list
from reconciler.spec.config import CephConfig

DATA = Path(__file__).resolve().parents[2] / "data"
CEPH = CephConfig(conf="/etc/ceph/ceph.conf", user="admin", keyring="/k")
CEPH_ARGS = ["--conf=/etc/ceph/ceph.conf", "--id=admin", "--keyring=/k"]
# rbd-nbd through netlink, kept 300 s for a re-attach, no request timeout.
# librbd inside it writes through (a dead rbd-nbd takes no acknowledged write along).
NBD_DEFAULTS = ("--options=try-netlink,reattach-timeout=300,io-timeout=0,"
                "rbd_cache_policy=writethrough")
RECORDED_FUSE_ROOT = "/tmp/rec.PL1R/node/state dir/fuse"


def data(name: str) -> str:
    return (DATA / name).read_text()


@dataclass(frozen=True)
class Fail:
    """A canned failure: the runner raises CommandError with this exit and stderr."""

    returncode: int
    stderr: str


@dataclass
class RecordingRunner(Runner):
    """Records every argv; answers from ``replies`` in order (default: success, no output)."""

    replies: list[Result | Fail] = field(default_factory=list)

    def run(self, argv: Sequence[str], *, ok_codes: Sequence[int] = (0,),
            timeout: float | None = None, env: dict[str, str] | None = None) -> Result:
        argv = [str(a) for a in argv]
        self.history.append(argv)
        reply = self.replies.pop(0) if self.replies else Result(0, "", "")
        if isinstance(reply, Fail):
            raise CommandError(argv, reply.returncode, reply.stderr)
        return reply


def ok(stdout: str = "") -> Result:
    return Result(0, stdout, "")


def kernel(kind: str, *replies: Result | Fail, udev: bool = True, sys_root: Path | None = None
           ) -> tuple[KernelMapper, RecordingRunner]:
    runner = RecordingRunner(replies=list(replies))
    return KernelMapper(kind, CEPH, runner, udev=lambda: udev, connected=lambda _d: True,
                        **({"sys_root": sys_root} if sys_root else {})), runner


def krbd_sysfs(root: Path, listing: str) -> Path:
    """A /sys holding, as the rbd module lays it out (one directory per device
    on the rbd bus, each attribute a line), the mappings a recorded
    ``rbd device list --format json`` shows (rbd reads them from there)."""
    bus = root / "bus" / "rbd" / "devices"
    bus.mkdir(parents=True)
    for d in json.loads(listing or "[]"):
        dev = bus / d["id"]
        dev.mkdir()
        for attr, key in (("pool", "pool"), ("pool_ns", "namespace"), ("name", "name"),
                          ("current_snap", "snap")):
            (dev / attr).write_text(d[key] + "\n")
        (dev / "major").write_text("254\n")
    return root


def nbd_sysfs(root: Path, connected: Sequence[int] = (0,), devices: int = 16) -> Path:
    """A /sys with nbd0..nbdN-1, those in ``connected`` with a pid file."""
    for i in range(devices):
        (root / "block" / f"nbd{i}").mkdir(parents=True)
        if i in connected:
            (root / "block" / f"nbd{i}" / "pid").write_text("3177\n")
    return root


# --- krbd / nbd: map ---------------------------------------------------------------


def test_krbd_map_command_line() -> None:
    m, runner = kernel("krbd", ok(data("krbd_map_ok.stdout")))
    assert m.map("rbd", "pgdata", ()) == "/dev/rbd0"
    assert runner.history == [["rbd", "device", "map", "--pool=rbd", "--image=pgdata",
                               *CEPH_ARGS]]


def test_krbd_map_with_options() -> None:
    m, runner = kernel("krbd", ok("/dev/rbd3\n"))
    assert m.map("fast", "metrics-xfs", ("noshare", "queue_depth=128")) == "/dev/rbd3"
    assert runner.history == [["rbd", "device", "map", "--pool=fast", "--image=metrics-xfs",
                               *CEPH_ARGS, "--options=noshare,queue_depth=128"]]


def test_nbd_map_command_line() -> None:
    m, runner = kernel("nbd", ok(data("nbd_map_ok.stdout")))
    assert m.map("rbd", "pgdata", ()) == "/dev/nbd0"
    assert runner.history == [["rbd", "device", "map", "-t", "nbd", "--pool=rbd",
                               "--image=pgdata", *CEPH_ARGS, "--show-cookie", NBD_DEFAULTS]]


@pytest.mark.parametrize("given", ["io-timeout=60", "timeout=60"])
def test_nbd_io_timeout_is_none_unless_the_spec_sets_one(given: str) -> None:
    """rbd-nbd's kernel timeout: none, on purpose (a partition longer than it
    fails the requests and loses the device); a spec's own value stands alone."""
    m, _ = kernel("nbd")
    assert m.map_command("rbd", "pgdata", ())[-1] == NBD_DEFAULTS
    assert m.map_command("rbd", "pgdata", ("exclusive", given))[-1] == (
        f"--options=exclusive,{given},try-netlink,reattach-timeout=300,"
        "rbd_cache_policy=writethrough")
    krbd, _ = kernel("krbd")
    assert "io-timeout" not in " ".join(krbd.map_command("rbd", "pgdata", ()))


def test_nbd_map_with_options() -> None:
    m, runner = kernel("nbd", ok("/dev/nbd2\n"))
    assert m.map("rbd", "pgdata", ("try-netlink", "timeout=120")) == "/dev/nbd2"
    assert runner.history == [["rbd", "device", "map", "-t", "nbd", "--pool=rbd",
                               "--image=pgdata", *CEPH_ARGS, "--show-cookie",
                               "--options=try-netlink,timeout=120,reattach-timeout=300,"
                               "rbd_cache_policy=writethrough"]]


def test_map_command_without_keyring_leaves_it_to_ceph_conf() -> None:
    m = KernelMapper("krbd", CephConfig("/etc/ceph/ceph.conf", "client-a", None),
                     RecordingRunner(), udev=lambda: True)
    assert m.map_command("rbd", "x", ()) == ["rbd", "device", "map", "--pool=rbd",
                                             "--image=x", "--conf=/etc/ceph/ceph.conf",
                                             "--id=client-a"]


def test_map_command_matches_what_map_runs() -> None:
    m, runner = kernel("nbd", ok("/dev/nbd0\n"))
    m.map("rbd", "pgdata", ("exclusive",))
    assert runner.history == [m.map_command("rbd", "pgdata", ("exclusive",))]


def test_map_takes_the_last_line_of_stdout() -> None:
    m, _ = kernel("nbd", ok("some warning\n/dev/nbd5\n"))
    assert m.map("rbd", "pgdata", ()) == "/dev/nbd5"


@pytest.mark.parametrize("stdout", ["", "\n", "rbd: mapped\n"])
def test_map_without_a_device_in_stdout_is_an_error(stdout: str) -> None:
    m, _ = kernel("krbd", ok(stdout))
    with pytest.raises(MapError) as info:
        m.map("rbd", "pgdata", ())
    assert info.value.reason == "krbd map failed (exit 0)"
    assert info.value.detail == f"unexpected output {stdout!r}"


def test_krbd_map_failure_without_module() -> None:
    m, runner = kernel("krbd", Fail(2, data("krbd_map_no_module.stderr")))
    with pytest.raises(MapError) as info:
        m.map("rbd", "pgdata", ())
    assert info.value.reason == "the kernel has no rbd module (krbd unavailable)"
    assert info.value.detail == "rbd: map failed: (2) No such file or directory"
    assert str(info.value) == ("the kernel has no rbd module (krbd unavailable): "
                               "rbd: map failed: (2) No such file or directory")
    assert len(runner.history) == 1  # no retry, no fallback behind the operator's back


def test_nbd_map_failure_exit_22() -> None:
    m, _ = kernel("nbd", Fail(22, data("nbd_map_no_module.stderr")))
    with pytest.raises(MapError) as info:
        m.map("rbd", "pgdata", ())
    assert info.value.reason == "rbd-nbd could not attach (no nbd kernel module?)"
    assert info.value.detail == "rbd: rbd-nbd failed with error: /usr/bin/rbd-nbd: exit status: 1"


def test_krbd_map_failure_permission_denied() -> None:
    m, _ = kernel("krbd", Fail(13, data("krbd_map_permission_denied.stderr")))
    with pytest.raises(MapError, match="permission denied by Ceph"):
        m.map("rbd", "pgdata", ())


def test_map_failure_generic_keeps_the_last_stderr_line() -> None:
    m, _ = kernel("krbd", Fail(13, data("map_no_auth.stderr")))
    with pytest.raises(MapError) as info:
        m.map("rbd", "pgdata", ())
    assert info.value.reason == "krbd map failed (exit 13)"
    assert info.value.detail == "rbd: couldn't connect to the cluster!"


def test_map_error_is_not_a_command_error() -> None:
    # apply reports MapError.reason; a bare CommandError would leak the raw command.
    m, _ = kernel("krbd", Fail(2, data("krbd_map_no_module.stderr")))
    with pytest.raises(MapError) as info:
        m.map("rbd", "pgdata", ())
    assert not isinstance(info.value, CommandError)
    assert info.value.__cause__ is None and info.value.__suppress_context__


# --- krbd / nbd: unmap, refresh, list ----------------------------------------------


@pytest.mark.parametrize(("kind", "mapping", "argv"), [
    ("krbd", Mapping("krbd", "rbd", "pgdata", "/dev/rbd0"),
     ["rbd", "device", "unmap", "/dev/rbd0", *CEPH_ARGS]),
    ("krbd", Mapping("krbd", "rbd", "pgdata", None),
     ["rbd", "device", "unmap", "--pool=rbd", "--image=pgdata", *CEPH_ARGS]),
    ("nbd", Mapping("nbd", "rbd", "pgdata", "/dev/nbd0"),
     ["rbd", "device", "unmap", "-t", "nbd", "/dev/nbd0", *CEPH_ARGS]),
    ("nbd", Mapping("nbd", "fast", "metrics-xfs", None),
     ["rbd", "device", "unmap", "-t", "nbd", "--pool=fast", "--image=metrics-xfs",
      *CEPH_ARGS]),
])
def test_unmap_command_line(kind: str, mapping: Mapping, argv: list[str]) -> None:
    m, runner = kernel(kind)
    m.unmap(mapping)
    assert runner.history == [argv]


def test_krbd_without_udev_maps_and_unmaps_with_noudev() -> None:
    """No udevd: rbd would wait forever for its event. nbd never waits for it."""
    m, runner = kernel("krbd", ok("/dev/rbd0\n"), ok(""), udev=False)
    m.map("rbd", "pgdata", ("exclusive",))
    m.unmap(Mapping("krbd", "rbd", "pgdata", "/dev/rbd0"))
    assert runner.history == [
        ["rbd", "device", "map", "--pool=rbd", "--image=pgdata", *CEPH_ARGS,
         "--options=exclusive,noudev"],
        ["rbd", "device", "unmap", "--options=noudev", "/dev/rbd0", *CEPH_ARGS]]
    n, runner = kernel("nbd", ok("/dev/nbd0\n"), udev=False)
    n.map("rbd", "pgdata", ())
    assert "noudev" not in " ".join(runner.history[0])


def test_force_unmap_is_krbd_only() -> None:
    """recover unmaps a fenced krbd device with -o force; rbd-nbd has no such option."""
    m, runner = kernel("krbd", ok(""), udev=False)
    m.unmap(Mapping("krbd", "rbd", "pgdata", "/dev/rbd0"), force=True)
    assert runner.history == [["rbd", "device", "unmap", "--options=force,noudev",
                               "/dev/rbd0", *CEPH_ARGS]]
    n, runner = kernel("nbd", ok(""))
    n.unmap(Mapping("nbd", "rbd", "pgdata", "/dev/nbd0"), force=True)
    assert runner.history == [["rbd", "device", "unmap", "-t", "nbd", "/dev/nbd0", *CEPH_ARGS]]


def test_unmap_failure_propagates() -> None:
    m, _ = kernel("krbd", Fail(16, "rbd: sysfs write failed\nrbd: unmap failed: (16) Device "
                                   "or resource busy\n"))
    with pytest.raises(CommandError) as info:
        m.unmap(Mapping("krbd", "rbd", "pgdata", "/dev/rbd0"))
    assert info.value.returncode == 16


@pytest.fixture
def loop8m(tmp_path: Path) -> Iterator[str]:
    """A real 8 MiB loop device (stands for a krbd/nbd device: same sysfs size)."""
    back = tmp_path / "back"
    back.write_bytes(b"\0" * (8 << 20))
    dev = subprocess.run(["losetup", "--find", "--show", str(back)], capture_output=True,
                         text=True, check=True, timeout=30).stdout.strip()
    try:
        yield dev
    finally:
        subprocess.run(["losetup", "-d", dev], check=False, timeout=30)


@pytest.mark.parametrize("kind", ["krbd", "nbd"])
def test_kernel_refresh_waits_for_the_device_and_runs_nothing(kind: str, loop8m: str) -> None:
    m, runner = kernel(kind)
    m.refresh(loop8m, 8 << 20)  # already that size: returns at once
    with pytest.raises(CommandError, match=f"still shows {8 << 20} bytes 0.2 s after"):
        m.refresh(loop8m, 16 << 20, wait=0.2)
    assert runner.history == []


def test_krbd_list_reads_sysfs_as_rbd_does(tmp_path: Path) -> None:
    """krbd's mappings are read from the rbd bus in sysfs, where `rbd device
    list` reads them: the same devices, and no process started."""
    listing = data("rbd_device_list_krbd.json")
    m, runner = kernel("krbd", sys_root=krbd_sysfs(tmp_path, listing))
    assert m.listed() == parse_rbd_device_list(listing)
    # Snapshot and namespace mappings are not volumes this reconciler manages.
    assert m.list() == [Mapping("krbd", "rbd", "pgdata", "/dev/rbd0"),
                        Mapping("krbd", "fast", "metrics-xfs", "/dev/rbd3")]
    assert runner.history == []


def test_krbd_list_skips_what_rbd_skips(tmp_path: Path) -> None:
    """A device without pool, name or current_snap (rbd lists none such); a
    kernel without pool_ns; devices in rbd's (udev's) order; no rbd bus at
    all: nothing mapped by krbd."""
    root = krbd_sysfs(tmp_path, json.dumps([
        {"id": str(i), "pool": "rbd", "namespace": "", "name": f"v{i}", "snap": "-"}
        for i in (2, 10, 3)]))
    bus = root / "bus" / "rbd" / "devices"
    (bus / "3" / "current_snap").unlink()
    (bus / "10" / "pool_ns").unlink()
    m, _ = kernel("krbd", sys_root=root)
    assert [(d.image, d.namespace, d.device) for d in m.listed()] == [
        ("v10", "", "/dev/rbd10"), ("v2", "", "/dev/rbd2")]
    assert kernel("krbd", sys_root=tmp_path / "none")[0].list() == []


def test_nbd_list(tmp_path: Path) -> None:
    m, runner = kernel("nbd", ok(data("rbd_device_list_nbd.json")),
                       sys_root=nbd_sysfs(tmp_path, (0, 2)))
    assert m.list() == [Mapping("nbd", "rbd", "pgdata", "/dev/nbd0"),
                        Mapping("nbd", "fast", "metrics-xfs", "/dev/nbd2")]
    assert runner.history == [["rbd", "device", "list", "-t", "nbd", "--format", "json",
                               *CEPH_ARGS]]


def test_nbd_list_without_a_connected_device_starts_nothing(tmp_path: Path) -> None:
    """rbd-nbd lists only devices with a pid file: with none (or no nbd
    module), its list is empty, and rbd and rbd-nbd are not started."""
    for root in (nbd_sysfs(tmp_path / "idle", ()), tmp_path / "no-module"):
        m, runner = kernel("nbd", ok(data("rbd_device_list_nbd.json")), sys_root=root)
        assert m.list() == [] and runner.history == []


@pytest.mark.parametrize(("kind", "name", "image", "device"), [
    ("krbd", "rbd_device_list_krbd_vm.json", "list-krbd-e3bdd1", "/dev/rbd0"),
    ("nbd", "rbd_device_list_nbd_vm.json", "list-nbd-18ef7a", "/dev/nbd0"),
])
def test_lists_recorded_in_the_vm(kind: str, name: str, image: str, device: str,
                                  tmp_path: Path) -> None:
    root = krbd_sysfs(tmp_path, data(name)) if kind == "krbd" else nbd_sysfs(tmp_path)
    m, _ = kernel(kind, ok(data(name)), sys_root=root)
    assert m.list() == [Mapping(kind, "rbd", image, device)]


@pytest.mark.parametrize(("kind", "name"), [("krbd", "rbd_device_list_krbd_empty.json"),
                                            ("nbd", "rbd_device_list_nbd_empty.json")])
def test_list_recorded_empty(kind: str, name: str, tmp_path: Path) -> None:
    root = krbd_sysfs(tmp_path, data(name)) if kind == "krbd" else nbd_sysfs(tmp_path)
    m, _ = kernel(kind, ok(data(name)), sys_root=root)
    assert m.list() == []


# --- fuse-loop ---------------------------------------------------------------------


def fuse(root: str | Path = RECORDED_FUSE_ROOT, *replies: Result | Fail
         ) -> tuple[FuseMapper, RecordingRunner]:
    runner = RecordingRunner(replies=list(replies))
    return FuseMapper(CEPH, Path(root), runner), runner


def test_fuse_list_on_recorded_mounts() -> None:
    m, runner = fuse()
    served = {f"{RECORDED_FUSE_ROOT}/rbd@orphan", f"{RECORDED_FUSE_ROOT}/rbd@pgdata"}
    found = m.list(data("mountinfo.txt"), data("losetup_fuse_and_deleted.json"), served)
    assert found == [
        # rbd-fuse is mounted but no loop device reads its file: half mapped.
        Mapping("fuse", "rbd", "orphan", None,
                fuse_mount=f"{RECORDED_FUSE_ROOT}/rbd@orphan"),
        Mapping("fuse", "rbd", "pgdata", "/dev/loop0",
                fuse_mount=f"{RECORDED_FUSE_ROOT}/rbd@pgdata"),
    ]
    assert runner.history == []  # both inputs given: nothing is run


def test_fuse_list_reports_a_mapping_whose_helper_is_gone() -> None:
    m, _ = fuse()
    served = {f"{RECORDED_FUSE_ROOT}/rbd@orphan"}
    found = m.list(data("mountinfo.txt"), data("losetup_fuse_and_deleted.json"), served)
    by_image = {x.image: x for x in found}
    assert by_image["orphan"].problem is None
    assert "helper is gone" in (by_image["pgdata"].problem or "")


def test_helper_mounts_reads_the_process_table(tmp_path: Path) -> None:
    def proc(pid: int, argv: list[str], state: str = "S") -> None:
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv))
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (rbd-fuse) {state} 1 2 3")

    proc(10, ["/usr/bin/rbd-fuse", "-c", "/etc/ceph/c.conf", "-p", "rbd", "-r", "a",
              "/st/fuse/rbd@a", "-f"])
    proc(11, ["rbd-fuse", "-p", "rbd", "-r", "b", "/st/fuse/rbd@b", "-f"], state="Z")
    proc(12, ["sleep", "/st/fuse/rbd@c"])
    m, _ = fuse()
    m.scan_helpers(tmp_path)
    served = m.helper_mounts(tmp_path)
    assert "/st/fuse/rbd@a" in served
    assert "/st/fuse/rbd@b" not in served and "/st/fuse/rbd@c" not in served
    # Later passes re-check the pids on record: a helper that died is noticed.
    (tmp_path / "10" / "stat").write_text("10 (rbd-fuse) Z 1 2 3")
    assert m.helper_mounts(tmp_path) == set()


def test_fuse_list_without_loop_devices() -> None:
    m, _ = fuse()
    found = m.list(data("mountinfo.txt"), data("losetup_none.json"))
    assert [(x.image, x.device) for x in found] == [("orphan", None), ("pgdata", None)]


def fake_sys_block(root: Path, backing: dict[str, str | None]) -> Path:
    """A /sys/block with loop devices; None: a loop device with nothing attached."""
    for name, path in backing.items():
        (root / name).mkdir(parents=True)
        if path is not None:
            (root / name / "loop").mkdir()
            (root / name / "loop" / "backing_file").write_text(path + "\n")
    (root / "vda").mkdir()
    return root


def test_loop_devices_from_sysfs(tmp_path: Path) -> None:
    sys_block = fake_sys_block(tmp_path, {
        "loop0": f"{RECORDED_FUSE_ROOT}/rbd@pgdata/pgdata",
        "loop1": "/tmp/rec.PL1R/node/gone.img (deleted)",
        "loop2": None,
    })
    assert fusemapper.loop_devices(sys_block) == (
        LoopDevice("/dev/loop0", f"{RECORDED_FUSE_ROOT}/rbd@pgdata/pgdata"),
        LoopDevice("/dev/loop1", "/tmp/rec.PL1R/node/gone.img"),
    )


def test_fuse_list_reads_sysfs_not_losetup_when_not_given(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # losetup --list stats backing files: on a hung rbd-fuse mount it would hang too.
    sys_block = fake_sys_block(tmp_path, {"loop0": f"{RECORDED_FUSE_ROOT}/rbd@pgdata/pgdata"})
    real = fusemapper.loop_devices
    monkeypatch.setattr(fusemapper, "loop_devices", lambda: real(sys_block))
    m, runner = fuse()
    found = m.list(data("mountinfo.txt"))
    assert runner.history == []
    assert [x.device for x in found] == [None, "/dev/loop0"]


def test_fuse_list_other_root_sees_nothing() -> None:
    m, _ = fuse("/var/lib/rbd-reconciler/fuse")
    assert m.list(data("mountinfo.txt"), data("losetup_fuse_and_deleted.json")) == []


def test_fuse_list_root_prefix_is_a_directory_boundary() -> None:
    # ".../fuse2/rbd@x" is not under ".../fuse".
    text = ("60 27 0:50 / /var/lib/r/fuse2/rbd@x rw,nosuid,nodev,relatime - fuse.rbd-fuse "
            "rbd-fuse rw,user_id=0,group_id=0\n")
    m, _ = fuse("/var/lib/r/fuse")
    assert m.list(text, "") == []


def test_fuse_list_ignores_foreign_and_odd_mounts() -> None:
    root = "/var/lib/r/fuse"
    text = "\n".join([
        # not rbd-fuse, though under the root
        f"60 27 0:50 / {root}/rbd@a rw - tmpfs tmpfs rw",
        # rbd-fuse without the pool@image naming
        f"61 27 0:51 / {root}/scratch rw - fuse.rbd-fuse rbd-fuse rw",
        # nested deeper than one level
        f"62 27 0:52 / {root}/rbd@b/c rw - fuse.rbd-fuse rbd-fuse rw",
        # rbd-fuse somewhere else entirely
        "63 27 0:53 / /mnt/rbd@c rw - fuse.rbd-fuse rbd-fuse rw",
        f"64 27 0:54 / {root}/fast@metrics-xfs rw - fuse.rbd-fuse rbd-fuse rw",
    ])
    losetup = ('{"loopdevices": [{"name": "/dev/loop7", "back-file": '
               f'"{root}/fast@metrics-xfs/metrics-xfs"'
               '}, {"name": "/dev/loop8", "back-file": "/mnt/rbd@c/c"}]}')
    m, _ = fuse(root)
    assert m.list(text, losetup, {f"{root}/fast@metrics-xfs"}) == [
        Mapping("fuse", "fast", "metrics-xfs", "/dev/loop7", fuse_mount=f"{root}/fast@metrics-xfs"),
    ]


def test_fuse_list_loop_over_a_deleted_image_file_still_matches() -> None:
    root = "/var/lib/r/fuse"
    text = f"60 27 0:50 / {root}/rbd@a rw - fuse.rbd-fuse rbd-fuse rw\n"
    losetup = ('{"loopdevices": [{"name": "/dev/loop2", '
               f'"back-file": "{root}/rbd@a/a (deleted)"'
               '}]}')
    m, _ = fuse(root)
    assert [x.device for x in m.list(text, losetup)] == ["/dev/loop2"]


def test_fuse_refresh_command_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fusemapper, "block_device_size", lambda dev: 512 * 2**20)
    m, runner = fuse()
    m.refresh("/dev/loop0", 512 * 2**20)
    assert runner.history == [["losetup", "--set-capacity=/dev/loop0"]]


def test_fuse_refresh_repeats_until_the_loop_device_has_grown(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The kernel caches the FUSE file's size for a moment: the first -c can see the old one.
    sizes = iter([256 * 2**20, 256 * 2**20, 512 * 2**20])
    monkeypatch.setattr(fusemapper, "block_device_size", lambda dev: next(sizes))
    monkeypatch.setattr(fusemapper.time, "sleep", lambda s: None)
    m, runner = fuse()
    m.refresh("/dev/loop0", 512 * 2**20)
    assert runner.history == [["losetup", "--set-capacity=/dev/loop0"]] * 3


def test_fuse_mount_point() -> None:
    m, _ = fuse("/var/lib/rbd-reconciler/fuse")
    assert m.mount_point("rbd", "pgdata") == Path("/var/lib/rbd-reconciler/fuse/rbd@pgdata")


class _FakeFuseProcess:
    """Stands in for a running ``rbd-fuse -f``."""

    def __init__(self, argv: list[str], **_kwargs: object) -> None:
        self.argv = argv
        self.pid = 4242
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self.returncode = 0
        return 0

    def kill(self) -> None:
        self.returncode = -9


def test_fuse_map_command_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[_FakeFuseProcess] = []
    mounted: set[str] = set()

    def popen(argv: list[str], **kwargs: object) -> _FakeFuseProcess:
        proc = _FakeFuseProcess(argv, **kwargs)
        started.append(proc)
        mounted.add(argv[-2])  # the mount point: rbd-fuse "mounts" at once
        return proc

    monkeypatch.setattr(fusemapper, "_is_mounted", lambda p: p in mounted)
    monkeypatch.setattr(fusemapper.subprocess, "Popen", popen)
    m, runner = fuse(tmp_path / "fuse", ok("/dev/loop3\n"))
    mnt = tmp_path / "fuse" / "rbd@pgdata"
    try:
        assert m.map("rbd", "pgdata", ()) == "/dev/loop3"
        assert runner.history == [
            ["rbd-fuse", *CEPH_ARGS, "--poolname=rbd", "--image=pgdata", "-o", "attr_timeout=0",
             str(mnt), "-f"],
            ["losetup", "--find", "--show", "--direct-io=on", "--", str(mnt / "pgdata")],
        ]
        assert [p.argv for p in started] == [runner.history[0]]
        assert fusemapper.fuse_pids() == {str(mnt): 4242}
        # Mapping again reuses the FUSE mount: only a new loop device.
        runner.replies.append(ok("/dev/loop4\n"))
        assert m.map("rbd", "pgdata", ()) == "/dev/loop4"
        assert len(started) == 1 and runner.history[-1][0] == "losetup"
    finally:
        fusemapper._fuse_children.pop(str(mnt), None)


def test_fuse_map_undoes_the_fuse_mount_when_losetup_fails(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mnt = tmp_path / "fuse" / "rbd@pgdata"
    mounted = {str(mnt)}
    monkeypatch.setattr(fusemapper, "_is_mounted", lambda p: p in mounted)
    m, runner = fuse(tmp_path / "fuse", Fail(1, "losetup: cannot find an unused loop device"))

    with pytest.raises(CommandError):
        m.map("rbd", "pgdata", ())
    assert runner.history == [
        ["losetup", "--find", "--show", "--direct-io=on", "--", str(mnt / "pgdata")],
        ["umount", "--", str(mnt)],
    ]
    assert not mnt.exists()


def test_fuse_unmap_order_loop_then_fuse(tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    mnt = tmp_path / "fuse" / "rbd@pgdata"
    mnt.mkdir(parents=True)
    mounted = {str(mnt)}
    monkeypatch.setattr(fusemapper, "_is_mounted", lambda p: p in mounted)
    m, runner = fuse(tmp_path / "fuse")
    m.unmap(Mapping("fuse", "rbd", "pgdata", "/dev/loop0", fuse_mount=str(mnt)))
    assert runner.history == [["losetup", "--detach=/dev/loop0"], ["umount", "--", str(mnt)]]
    assert not mnt.exists()


def test_fuse_unmap_half_mapped_only_unmounts(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    mnt = tmp_path / "fuse" / "rbd@orphan"
    mnt.mkdir(parents=True)
    monkeypatch.setattr(fusemapper, "_is_mounted", lambda p: p == str(mnt))
    m, runner = fuse(tmp_path / "fuse")
    m.unmap(Mapping("fuse", "rbd", "orphan", None, fuse_mount=None))
    assert runner.history == [["umount", "--", str(mnt)]]


def test_fuse_unmount_retries_while_busy(tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    mnt = tmp_path / "fuse" / "rbd@pgdata"
    monkeypatch.setattr(fusemapper, "_is_mounted", lambda p: p == str(mnt))
    busy = Fail(32, f"umount: {mnt}: target is busy.")
    m, runner = fuse(tmp_path / "fuse", ok(), busy, ok())
    m.unmap(Mapping("fuse", "rbd", "pgdata", "/dev/loop0", fuse_mount=str(mnt)))
    assert runner.history == [["losetup", "--detach=/dev/loop0"],
                              ["umount", "--", str(mnt)], ["umount", "--", str(mnt)]]


def test_nbd_mapping_whose_rbd_nbd_died_is_listed_dead(tmp_path: Path) -> None:
    """rbd-nbd's own list shows only devices with a live process: the one we
    mapped and recorded, no longer shown, is dead (never merely gone); a
    recorded device mapped since for another image is that image's."""
    from reconciler.state.registry import NbdMappings

    records = NbdMappings(tmp_path)
    runner = RecordingRunner(replies=[ok("/dev/nbd5\n"), ok(data("rbd_device_list_nbd.json")),
                                      ok("")])
    m = KernelMapper("nbd", CEPH, runner, udev=lambda: True, records=records,
                     connected=lambda _d: False, sys_root=nbd_sysfs(tmp_path / "sys", (0, 2)))
    assert m.map("rbd", "web", ()) == "/dev/nbd5"
    records.record("/dev/nbd0", {"pool": "rbd", "image": "old-tenant"})  # nbd0 is pgdata's now
    listed = m.list()
    assert Mapping("nbd", "rbd", "web", "/dev/nbd5",
                   problem="rbd-nbd serving /dev/nbd5 is gone") in listed
    assert Mapping("nbd", "rbd", "pgdata", "/dev/nbd0") in listed
    assert "/dev/nbd0" not in records.images()
    m.unmap(Mapping("nbd", "rbd", "web", "/dev/nbd5"))  # no connection: nothing to run
    assert len(runner.history) == 2 and "/dev/nbd5" not in records.images()


COOKIE = "db9ff88e-e64e-4c27-b5b7-265e68debddb"


def test_nbd_map_records_the_cookie_rbd_prints(tmp_path: Path) -> None:
    """`--show-cookie` (measured in the VM): "/dev/nbd0 COOKIE"."""
    from reconciler.state.registry import NbdMappings

    records = NbdMappings(tmp_path)
    m = KernelMapper("nbd", CEPH, RecordingRunner(replies=[ok(f"/dev/nbd3 {COOKIE}\n")]),
                     udev=lambda: True, records=records)
    assert m.map("rbd", "web", ()) == "/dev/nbd3"
    assert records.images() == {"/dev/nbd3": ("rbd", "web")}
    assert records.cookies() == {"/dev/nbd3": COOKIE}


def kept(root: Path, index: int, cookie: str) -> None:
    """An nbd device the kernel keeps after its rbd-nbd died: the pid file
    (the dead pid) and the backend (cookie) stay."""
    (root / "block" / f"nbd{index}" / "pid").write_text("176\n")
    (root / "block" / f"nbd{index}" / "backend").write_text(cookie + "\n")


def test_a_kept_nbd_device_with_our_cookie_is_reattachable(tmp_path: Path) -> None:
    from reconciler.state.registry import NbdMappings

    sysroot = nbd_sysfs(tmp_path / "sys", ())
    kept(sysroot, 5, COOKIE)
    kept(sysroot, 6, "someone-elses")
    records = NbdMappings(tmp_path)
    records.record("/dev/nbd5", {"pool": "rbd", "image": "web", "cookie": COOKIE})
    records.record("/dev/nbd6", {"pool": "rbd", "image": "db", "cookie": COOKIE})
    records.record("/dev/nbd7", {"pool": "rbd", "image": "old"})  # no cookie: mapped before
    m = KernelMapper("nbd", CEPH, RecordingRunner(replies=[ok("[]")]), udev=lambda: True,
                     records=records, sys_root=sysroot)
    by_device = {mp.device: mp for mp in m.list()}
    assert by_device["/dev/nbd5"].reattach == COOKIE
    assert "re-attach" in (by_device["/dev/nbd5"].problem or "")
    # Another cookie: mapped again since, by someone else; no cookie recorded: dead.
    for dev in ("/dev/nbd6", "/dev/nbd7"):
        assert by_device[dev].reattach is None
        assert by_device[dev].problem == f"rbd-nbd serving {dev} is gone"


def test_attach_runs_rbd_device_attach_only_on_our_cookie(tmp_path: Path) -> None:
    sysroot = nbd_sysfs(tmp_path / "sys", ())
    kept(sysroot, 5, COOKIE)
    runner = RecordingRunner(replies=[ok("/dev/nbd5\n")])
    m = KernelMapper("nbd", CEPH, runner, udev=lambda: True, sys_root=sysroot)
    m.attach("rbd", "web", "/dev/nbd5", COOKIE, ("exclusive",))
    assert runner.history == [["rbd", "device", "attach", "-t", "nbd", "--device=/dev/nbd5",
                               f"--cookie={COOKIE}", "--pool=rbd", "--image=web", *CEPH_ARGS,
                               "--options=exclusive,try-netlink,reattach-timeout=300,"
                               "io-timeout=0,rbd_cache_policy=writethrough"]]
    with pytest.raises(CommandError, match="no longer the device we mapped"):
        m.attach("rbd", "web", "/dev/nbd5", "another-cookie", ())
    with pytest.raises(CommandError, match="cookie none"):
        m.attach("rbd", "web", "/dev/nbd9", COOKIE, ())
    assert len(runner.history) == 1


def test_detach_stops_rbd_nbd_and_keeps_the_device() -> None:
    runner = RecordingRunner(replies=[ok()])
    KernelMapper("nbd", CEPH, runner, udev=lambda: True).detach("/dev/nbd5")
    assert runner.history == [["rbd", "device", "detach", "-t", "nbd", "/dev/nbd5", *CEPH_ARGS]]
    with pytest.raises(ValueError):
        KernelMapper("nbd", CEPH, runner, udev=lambda: True).detach("--evil")
