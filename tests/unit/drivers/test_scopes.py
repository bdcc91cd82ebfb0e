"""rbd-nbd and rbd-fuse in transient systemd scopes of their own (drivers/scopes.py):
the detection, the unit names, and the command lines with the wrapper on and off."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from reconciler.drivers import fusemapper, scopes
from reconciler.drivers.fusemapper import FuseMapper
from reconciler.drivers.kernelmapper import KernelMapper
from reconciler.drivers.run import CommandError, Result, Runner
from reconciler.facts.observed import Mapping
from reconciler.facts.parsers import MapError, explain_map_failure
from reconciler.observe.node import Node
from reconciler.spec.config import CephConfig, ConfigError, default_config, load_config

CEPH = CephConfig(conf="/etc/ceph/ceph.conf", user="admin", keyring="/k")
CEPH_ARGS = ["--conf=/etc/ceph/ceph.conf", "--id=admin", "--keyring=/k"]
# systemd's unit_name_is_valid() for a plain (non-template) name: these
# characters, at most 255 of them, a known suffix.
VALID_UNIT = re.compile(r"^[A-Za-z0-9:_.\\-]+\.scope$")


@dataclass
class Capture(Runner):
    stdout: str = ""
    stderr: str = ""
    returncode: int = 0

    def run(self, argv: Sequence[str], **_kw: object) -> Result:  # type: ignore[override]
        argv = [str(a) for a in argv]
        self.history.append(argv)
        if self.returncode:
            raise CommandError(argv, self.returncode, self.stderr)
        return Result(0, self.stdout, "")


# --- detection -----------------------------------------------------------------------


def test_systemd_manages_needs_the_run_directory_and_systemd_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "systemd" / "system"
    found = lambda _name: "/usr/bin/systemd-run"  # noqa: E731
    missing = lambda _name: None  # noqa: E731
    assert not scopes.systemd_manages(run_dir, found)  # not booted with systemd
    run_dir.parent.mkdir()
    run_dir.write_text("")  # a file is not sd_booted()'s directory
    assert not scopes.systemd_manages(run_dir, found)
    run_dir.unlink()
    run_dir.mkdir()
    assert scopes.systemd_manages(run_dir, found)
    assert not scopes.systemd_manages(run_dir, missing)  # no systemd-run on PATH


def test_wanted_follows_the_setting_and_the_detection() -> None:
    asked: list[bool] = []

    def detect(answer: bool) -> bool:
        asked.append(answer)
        return answer

    assert scopes.wanted("auto", lambda: detect(True))
    assert not scopes.wanted("auto", lambda: detect(False))
    assert not scopes.wanted("never", lambda: detect(True))
    assert asked == [True, False]  # never: not even detected


def test_node_from_config_decides_once(monkeypatch: pytest.MonkeyPatch) -> None:
    for systemd, setting, want in ((True, "auto", True), (False, "auto", False),
                                   (True, "never", False)):
        monkeypatch.setattr(scopes, "systemd_manages", lambda s=systemd: s)
        node = Node.from_config(replace(default_config(), helper_scopes=setting), Capture())
        assert (node.nbd.scopes, node.fuse.scopes, node.krbd.scopes) == (want, want, False)


def test_this_host_without_systemd_keeps_the_old_path() -> None:
    """The suite and the kernel tests run without systemd as PID 1: helpers
    are started exactly as before there."""
    if Path("/run/systemd/system").is_dir():
        pytest.skip("systemd is the service manager here")
    assert not scopes.systemd_manages()
    assert not Node.from_config(default_config(), Capture()).nbd.scopes


# --- the config key ------------------------------------------------------------------


def test_helper_scopes_key(tmp_path: Path) -> None:
    assert default_config().helper_scopes == "auto"
    cfg = tmp_path / "config.yaml"
    cfg.write_text("helperScopes: never\n")
    assert load_config(cfg).helper_scopes == "never"
    cfg.write_text("helperScopes: always\n")
    with pytest.raises(ConfigError) as err:
        load_config(cfg)
    assert "helperScopes" in str(err.value)


# --- unit names ----------------------------------------------------------------------


def test_unit_name_is_readable() -> None:
    assert scopes.unit_name("nbd", "rbd", "pgdata", "1a2b3c") == \
        "rbd-reconciler-helper-nbd-rbd-pgdata-1a2b3c.scope"
    assert scopes.unit_name("fuse", "rbd.ssd", "pg_data-2", "ffffff") == \
        "rbd-reconciler-helper-fuse-rbd.ssd-pg_data-2-ffffff.scope"


@pytest.mark.parametrize(("pool", "image"), [
    ("-Hpool", "-Himage"), ("a/b", "c@d"), ("sp ace", "tab\there"), ("x\\x2d", "é\u202e"),
    ("p" * 128, "i" * 128), ("", ""), ("../..", "$(reboot)"), ("a\nb", "%n%i")])
def test_unit_name_is_always_valid(pool: str, image: str) -> None:
    name = scopes.unit_name("nbd", pool, image)
    assert VALID_UNIT.match(name), name
    assert "\\" not in name and "@" not in name and "/" not in name
    assert len(name) <= scopes.UNIT_NAME_MAX
    assert name.startswith("rbd-reconciler-helper-nbd-")


def test_unit_names_differ_for_one_image() -> None:
    names = {scopes.unit_name("nbd", "rbd", "pgdata") for _ in range(50)}
    assert len(names) == 50
    assert all(re.fullmatch(r"rbd-reconciler-helper-nbd-rbd-pgdata-[0-9a-f]{6}\.scope", n)
               for n in names)


def test_wrap() -> None:
    argv = ["rbd-fuse", "--poolname=rbd", "/var/lib/rbd-reconciler/fuse/rbd@pg", "-f"]
    assert scopes.wrap(argv, "fuse", "rbd", "pg", "abcdef") == [
        "systemd-run", "--scope", "--quiet", "--collect", "--no-ask-password",
        "--unit=rbd-reconciler-helper-fuse-rbd-pg-abcdef.scope",
        "--description=rbd-reconciler helper: rbd-fuse for rbd/pg",
        "--property=Before=rbd-reconciler-shutdown.service", "--", *argv]


# --- the mappers, wrapper on and off -------------------------------------------------


def nbd_map_argv(options: str = ("--options=try-netlink,reattach-timeout=300,io-timeout=0,"
                                 "rbd_cache_policy=writethrough")) -> list[str]:
    return ["rbd", "device", "map", "-t", "nbd", "--pool=rbd", "--image=pgdata", *CEPH_ARGS,
            "--show-cookie", options]


def test_nbd_map_in_a_scope(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scopes, "_token", lambda: "0a0b0c")
    runner = Capture(stdout="/dev/nbd0\n")
    m = KernelMapper("nbd", CEPH, runner, udev=lambda: True, scopes=True)
    assert m.map("rbd", "pgdata", ()) == "/dev/nbd0"
    assert runner.history == [[
        "systemd-run", "--scope", "--quiet", "--collect", "--no-ask-password",
        "--unit=rbd-reconciler-helper-nbd-rbd-pgdata-0a0b0c.scope",
        "--description=rbd-reconciler helper: rbd-nbd for rbd/pgdata",
        "--property=Before=rbd-reconciler-shutdown.service", "--", *nbd_map_argv()]]


def test_without_scopes_the_command_lines_are_as_before(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    runner = Capture(stdout="/dev/nbd0\n")
    KernelMapper("nbd", CEPH, runner, udev=lambda: True).map("rbd", "pgdata", ())
    assert runner.history == [nbd_map_argv()]
    fuse = FuseMapper(CEPH, tmp_path / "fuse", Capture())
    mnt = fuse.mount_point("rbd", "pgdata")
    assert fuse.start_command("rbd", "pgdata", mnt) == fuse.fuse_command("rbd", "pgdata", mnt)


def test_krbd_has_no_helper_to_scope() -> None:
    runner = Capture(stdout="/dev/rbd0\n")
    KernelMapper("krbd", CEPH, runner, udev=lambda: True, scopes=True).map("rbd", "pgdata", ())
    assert runner.history[0][:3] == ["rbd", "device", "map"]


def test_unmap_and_list_are_never_wrapped(tmp_path: Path) -> None:
    runner = Capture(stdout="[]")
    (tmp_path / "block" / "nbd0").mkdir(parents=True)  # list asks only with one connected
    (tmp_path / "block" / "nbd0" / "pid").write_text("1\n")
    m = KernelMapper("nbd", CEPH, runner, udev=lambda: True, connected=lambda _d: True,
                     scopes=True, sys_root=tmp_path)
    m.unmap(Mapping("nbd", "rbd", "pgdata", "/dev/nbd0"))
    m.list()
    assert [argv[:3] for argv in runner.history] == [["rbd", "device", "unmap"],
                                                     ["rbd", "device", "list"]]


class _FakeProcess:
    def __init__(self, argv: list[str], **_kw: object) -> None:
        self.argv, self.pid, self.returncode = argv, 4343, None

    def poll(self) -> int | None:
        return self.returncode


def test_fuse_helper_started_in_a_scope(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scopes, "_token", lambda: "d00d00")
    mounted: set[str] = set()
    started: list[_FakeProcess] = []

    def popen(argv: list[str], **kw: object) -> _FakeProcess:
        started.append(_FakeProcess(argv, **kw))
        mounted.add(argv[-2])  # the mount point, the wrapped command's last but one word
        return started[-1]

    monkeypatch.setattr(fusemapper, "_is_mounted", lambda p: p in mounted)
    monkeypatch.setattr(fusemapper.subprocess, "Popen", popen)
    runner = Capture(stdout="/dev/loop3\n")
    m = FuseMapper(CEPH, tmp_path / "fuse", runner, scopes=True)
    mnt = m.mount_point("rbd", "pgdata")
    try:
        assert m.map("rbd", "pgdata", ()) == "/dev/loop3"
        [proc] = started
        assert proc.argv == [
            "systemd-run", "--scope", "--quiet", "--collect", "--no-ask-password",
            "--unit=rbd-reconciler-helper-fuse-rbd-pgdata-d00d00.scope",
            "--description=rbd-reconciler helper: rbd-fuse for rbd/pgdata",
            "--property=Before=rbd-reconciler-shutdown.service", "--",
            *m.fuse_command("rbd", "pgdata", mnt)]
        assert runner.history[0] == proc.argv  # the history says what ran
        # systemd-run execs rbd-fuse: the child's pid is the helper's
        assert fusemapper.fuse_pids() == {str(mnt): 4343}
    finally:
        fusemapper._fuse_children.pop(str(mnt), None)


def test_fuse_scope_failure_is_said(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """systemd-run failed before rbd-fuse ran: its own words, from the log."""
    def popen(argv: list[str], stdout: object = None, **_kw: object) -> _FakeProcess:
        proc = _FakeProcess(argv)
        stdout.write(b"Failed to start transient scope unit: Access denied\n")  # type: ignore[attr-defined]
        proc.returncode = 1
        return proc

    monkeypatch.setattr(fusemapper, "_is_mounted", lambda _p: False)
    monkeypatch.setattr(fusemapper.subprocess, "Popen", popen)
    m = FuseMapper(CEPH, tmp_path / "fuse", Capture(), scopes=True)
    with pytest.raises(CommandError) as err:
        m.map("rbd", "pgdata", ())
    assert err.value.argv[0] == "systemd-run"
    assert "Failed to start transient scope unit: Access denied" in str(err.value)


@pytest.mark.parametrize("stderr", [
    "Failed to start transient scope unit: Unit x.scope already exists.\n",
    "System has not been booted with systemd as init system (PID 1). Can't operate.\n"
    "Failed to connect to bus: Host is down\n"])
def test_nbd_scope_failure_is_explained(stderr: str) -> None:
    m = KernelMapper("nbd", CEPH, Capture(returncode=1, stderr=stderr), udev=lambda: True,
                     scopes=True)
    with pytest.raises(MapError) as err:
        m.map("rbd", "pgdata", ())
    assert "systemd-run could not start the helper's scope" in str(err.value)
    assert "helperScopes: never" in str(err.value)
    assert explain_map_failure("nbd", 1, stderr).reason.startswith("systemd-run")
