"""An rbd-nbd whose binary was replaced on disk (issue 41, item 2): how it is
seen (/proc/PID/exe against the file on PATH, the version recorded with
the binary it was started from), what a map and an attach record, and the
roll's commands (detach, attach; the attach tried again; never a device
whose cookie is not ours)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
from test_mappers_cmdline import CEPH, COOKIE, Fail, RecordingRunner, kept, nbd_sysfs, ok

from reconciler.drivers import nbdhelper
from reconciler.drivers.kernelmapper import KernelMapper
from reconciler.drivers.run import CommandError
from reconciler.state.registry import NbdMappings


def proc_of(root: Path, pid: int, exe: Path, comm: str = "rbd-nbd") -> Path:
    """A /proc with process ``pid`` running ``exe`` (its exe link)."""
    (root / str(pid)).mkdir(parents=True)
    (root / str(pid) / "exe").symlink_to(exe)
    (root / str(pid) / "comm").write_text(comm + "\n")
    return root


def test_a_helper_of_the_file_on_path_is_current_else_stale(tmp_path: Path) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    old.write_text("v1")
    new.write_text("v2")
    proc = proc_of(tmp_path / "proc", 4242, old)
    rec = {"exe": list(nbdhelper.binary_ident(str(old)) or ()), "version": "16.2.11"}
    h = nbdhelper.helper(4242, rec, COOKIE, proc, binary=nbdhelper.binary_ident(str(old)))
    assert (h.pid, h.version, h.stale, h.cookie) == (4242, "16.2.11", False, COOKIE)
    # The package upgrade: another file on the path; the process still runs the old one.
    h = nbdhelper.helper(4242, rec, COOKIE, proc, binary=nbdhelper.binary_ident(str(new)))
    assert h.stale is True and h.version == "16.2.11"
    # A record of another file (or none): the version is not known.
    h = nbdhelper.helper(4242, {"exe": [0, 0], "version": "16.2.11"}, None, proc,
                         binary=nbdhelper.binary_ident(str(new)))
    assert h.version is None and h.stale is True
    # Gone, or no rbd-nbd on PATH: not compared, never "stale".
    assert nbdhelper.helper(99, rec, None, proc, binary=(1, 2)).stale is None
    assert nbdhelper.helper(4242, rec, None, proc, binary=None).stale is None


def test_the_binary_is_the_one_beside_rbd_not_the_one_on_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """rbd runs dirname(/proc/self/exe)/rbd-nbd (measured in the VM: a copy
    first on PATH was not the one started)."""
    sbin, onpath = tmp_path / "ceph-bin", tmp_path / "path"
    sbin.mkdir()
    onpath.mkdir()
    (sbin / "rbd").write_text("#!/bin/sh\n")
    (sbin / "rbd").chmod(0o755)
    (onpath / "rbd").symlink_to(sbin / "rbd")
    (onpath / "rbd-nbd").write_text("#!/bin/sh\n")
    (onpath / "rbd-nbd").chmod(0o755)
    monkeypatch.setenv("PATH", str(onpath))
    assert nbdhelper.binary_path() == str(sbin / "rbd-nbd")
    assert nbdhelper.binary_ident() is None  # not there: nothing to compare with
    (onpath / "rbd").unlink()
    assert nbdhelper.binary_path() == str(onpath / "rbd-nbd")  # no rbd: PATH's


def test_the_version_is_asked_once_per_file(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    count = tmp_path / "count"
    script = bindir / "rbd-nbd"
    script.write_text(f"#!/bin/sh\necho x >> {count}\n"
                      "echo 'ceph version 16.2.15 (618f4408) pacific (stable)'\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", str(bindir))
    st = script.stat()
    assert nbdhelper.started() == {"exe": [st.st_dev, st.st_ino], "version": "16.2.15"}
    assert nbdhelper.started()["version"] == "16.2.15"
    assert count.read_text().count("x") == 1


def test_is_rbd_nbd_reads_comm(tmp_path: Path) -> None:
    proc = proc_of(tmp_path / "proc", 7, tmp_path, comm="rbd-nbd")
    proc_of(proc, 8, tmp_path, comm="bash")
    assert nbdhelper.is_rbd_nbd(7, proc) and not nbdhelper.is_rbd_nbd(8, proc)
    assert not nbdhelper.is_rbd_nbd(9, proc)


def test_a_live_mapping_of_ours_lists_its_helper(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The pid is rbd's list's "id"; this process stands for the rbd-nbd
    (its exe is the interpreter), and PATH's rbd-nbd is that file, then
    another one (the upgrade)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "rbd-nbd").symlink_to(os.path.realpath(sys.executable))
    monkeypatch.setenv("PATH", str(bindir))
    me = os.getpid()
    records = NbdMappings(tmp_path)
    records.record("/dev/nbd0", {"pool": "rbd", "image": "pgdata", "cookie": COOKIE,
                                 "exe": list(nbdhelper.exe_ident(me) or ()),
                                 "version": "16.2.11"})
    listing = (f'[{{"id":{me},"pool":"rbd","namespace":"","image":"pgdata","snap":"",'
               f'"device":"/dev/nbd0","cookie":"{COOKIE}"}}]')
    m = KernelMapper("nbd", CEPH, RecordingRunner(replies=[ok(listing), ok(listing)]),
                     udev=lambda: True, records=records,
                     sys_root=nbd_sysfs(tmp_path / "sys", (0,)))
    [mp] = m.list()
    assert mp.helper is not None
    assert (mp.helper.pid, mp.helper.version, mp.helper.stale, mp.helper.cookie) == (
        me, "16.2.11", False, COOKIE)
    (bindir / "rbd-nbd").unlink()
    shutil.copy(sys.executable, bindir / "rbd-nbd")  # a new inode at the path
    [mp] = m.list()
    assert mp.helper is not None and mp.helper.stale is True


def test_map_and_attach_record_the_binary_and_its_version(tmp_path: Path) -> None:
    records = NbdMappings(tmp_path)
    sysroot = nbd_sysfs(tmp_path / "sys", ())
    kept(sysroot, 3, COOKIE)
    started = {"exe": [1, 2], "version": "16.2.11"}
    m = KernelMapper("nbd", CEPH, RecordingRunner(replies=[ok(f"/dev/nbd3 {COOKIE}\n")]),
                     udev=lambda: True, records=records, sys_root=sysroot,
                     binary=lambda: started)
    m.map("rbd", "web", ())
    assert records.record_of("/dev/nbd3") | {"boot": None} == {
        "pool": "rbd", "image": "web", "cookie": COOKIE, "exe": [1, 2], "version": "16.2.11",
        "boot": None}
    started = {"exe": [1, 3], "version": "17.2.7"}
    m.attach("rbd", "web", "/dev/nbd3", COOKIE, ())
    rec = records.record_of("/dev/nbd3")
    assert (rec["exe"], rec["version"], rec["cookie"]) == ([1, 3], "17.2.7", COOKIE)


def roller(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *replies: object,
           stale: bool = True) -> tuple[KernelMapper, RecordingRunner]:
    sysroot = nbd_sysfs(tmp_path / "sys", ())
    kept(sysroot, 5, COOKIE)
    monkeypatch.setattr(nbdhelper, "is_rbd_nbd", lambda pid, *_: pid == 4242)
    monkeypatch.setattr(nbdhelper, "exe_ident", lambda pid, *_: (1, 2))
    monkeypatch.setattr(nbdhelper, "binary_ident", lambda *_: (1, 3) if stale else (1, 2))
    runner = RecordingRunner(replies=list(replies))  # type: ignore[arg-type]
    return KernelMapper("nbd", CEPH, runner, udev=lambda: True, sys_root=sysroot,
                        binary=lambda: {}), runner


def test_roll_detaches_then_attaches_with_our_cookie(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    m, runner = roller(tmp_path, monkeypatch)
    assert m.roll("rbd", "web", "/dev/nbd5", COOKIE, 4242, ()) is True
    assert [a[:3] for a in runner.history] == [["rbd", "device", "detach"],
                                               ["rbd", "device", "attach"]]
    assert runner.history[0][3:5] == ["-t", "nbd"] and "/dev/nbd5" in runner.history[0]
    assert f"--cookie={COOKIE}" in runner.history[1]


def test_an_attach_refused_right_after_the_detach_is_tried_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel takes a new connection only in place of one it saw die."""
    m, runner = roller(tmp_path, monkeypatch, ok(), Fail(1, "rbd-nbd: failed to attach"), ok())
    assert m.roll("rbd", "web", "/dev/nbd5", COOKIE, 4242, ())
    assert [a[2] for a in runner.history] == ["detach", "attach", "attach"]


def test_a_roll_whose_attaches_all_fail_raises_and_leaves_the_device_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its error is the step's; the device stays kept by the kernel with our
    cookie, which the next observation lists as re-attachable."""
    fail = Fail(1, "rbd-nbd: failed")
    m, runner = roller(tmp_path, monkeypatch, ok(), fail, fail, fail, ok("[]"))
    records = NbdMappings(tmp_path)
    records.record("/dev/nbd5", {"pool": "rbd", "image": "web", "cookie": COOKIE})
    m.records = records
    with pytest.raises(Exception, match="failed"):
        m.roll("rbd", "web", "/dev/nbd5", COOKIE, 4242, ())
    assert [a[2] for a in runner.history] == ["detach", "attach", "attach", "attach"]
    # The next observation: no rbd-nbd serves it, the kernel keeps it with
    # our cookie: re-attachable (plan: reattach), as after a kill.
    [mp] = m.list()
    assert mp.device == "/dev/nbd5" and mp.reattach == COOKIE and mp.helper is None


def test_a_roll_is_never_of_a_device_that_is_not_ours(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    m, runner = roller(tmp_path, monkeypatch)
    with pytest.raises(CommandError, match="no longer the device we mapped"):
        m.roll("rbd", "web", "/dev/nbd5", "another-cookie", 4242, ())
    with pytest.raises(CommandError, match="no longer serves"):
        m.roll("rbd", "web", "/dev/nbd5", COOKIE, 4343, ())
    assert runner.history == []


def test_a_helper_already_current_is_not_rolled(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    m, runner = roller(tmp_path, monkeypatch, stale=False)
    assert m.roll("rbd", "web", "/dev/nbd5", COOKIE, 4242, ()) is False
    assert runner.history == []


def test_the_roll_lock_is_one_holder_at_a_time(tmp_path: Path) -> None:
    path = tmp_path / "roll.lock"
    with nbdhelper.roll_lock(path) as first:
        assert first
        with nbdhelper.roll_lock(path, wait=0.1) as second:
            assert not second
    with nbdhelper.roll_lock(path, wait=0.1) as again:
        assert again
