"""observe/leftovers.py's list of rbd-fuse and rbd-nbd processes, on a fake
/proc (review): it must never read what another process's memory backs."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from reconciler.observe.leftovers import helpers


def _proc(root: Path, pid: int, comm: str, cmdline: bytes | None) -> Path:
    d = root / str(pid)
    d.mkdir(parents=True)
    (d / "comm").write_text(comm + "\n")
    (d / "stat").write_text(f"{pid} ({comm}) S 1 {pid} {pid} 0 -1\n")
    if cmdline is None:
        os.mkfifo(d / "cmdline")  # a read that never answers
    else:
        (d / "cmdline").write_bytes(cmdline)
    return d


def test_only_a_helpers_cmdline_is_read(tmp_path: Path) -> None:
    # /proc/PID/cmdline is read from the process's memory under its mm lock:
    # a process stuck in a page fault on a stalled device (with a writer of
    # its mm queued) makes that read wait for as long. ``status`` lists
    # leftovers: it reads the command line of our helpers only (their comm
    # says which), never every process's.
    proc, sys_root = tmp_path / "proc", tmp_path / "sys"
    (sys_root / "block").mkdir(parents=True)
    stuck = _proc(proc, 10, "postgres", None)
    _proc(proc, 11, "rbd-fuse", b"rbd-fuse\0-c\0/etc/ceph/x\0/var/lib/r/fuse/rbd@z\0")
    _proc(proc, 12, "bash", b"bash\0")
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(helpers(sys_root, proc)), daemon=True)
    t.start()
    t.join(5)
    try:
        assert not t.is_alive(), "helpers() waited on another process's command line"
        [found] = out
        assert [(h.pid, h.kind, h.serves) for h in found] == [  # type: ignore[attr-defined]
            (11, "rbd-fuse", "/var/lib/r/fuse/rbd@z")]
    finally:
        if t.is_alive():  # let the stuck open go
            fd = os.open(stuck / "cmdline", os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
            t.join(5)


def test_a_process_in_another_mount_namespace_uses_our_leftover_mount(tmp_path: Path) -> None:
    # Our rbd-fuse mount propagated into a container's mount namespace, where
    # a process holds a file of it open: there its mount id and point differ,
    # so it is matched by the mount's device (that namespace's mounts of it).
    # Missed, release --orphans unmounted it; on a stalled helper the umount
    # ran into its deadline and the connection was aborted under that user.
    from reconciler.facts.leftovers import Leftovers
    from reconciler.facts.observed import Mount
    from reconciler.observe.leftovers import mount_users

    proc = tmp_path / "proc"
    (proc / "self" / "ns").mkdir(parents=True)
    os.symlink("mnt:[4026531841]", proc / "self" / "ns" / "mnt")
    d = _proc(proc, 20, "app", b"app\0")
    (d / "ns").mkdir()
    os.symlink("mnt:[4026532999]", d / "ns" / "mnt")
    (d / "mountinfo").write_text(
        "900 800 0:60 / /host/var/lib/r/fuse/rbd@z rw,nosuid,nodev - fuse.rbd-fuse "
        "rbd-fuse rw\n")
    (d / "fd").mkdir()
    (d / "fdinfo").mkdir()
    os.symlink("/host/var/lib/r/fuse/rbd@z/z", d / "fd" / "3")
    (d / "fdinfo" / "3").write_text("pos:\t0\nflags:\t02\nmnt_id:\t900\n")
    (d / "maps").write_text("")
    for link in ("cwd", "root"):
        os.symlink("/", d / link)
    point = "/var/lib/r/fuse/rbd@z"
    ours = Mount(60, 1, 0, 60, "/", point, frozenset({"rw"}), "fuse.rbd-fuse", "rbd-fuse",
                 frozenset({"rw"}))
    seen = Leftovers((), {}, (), (), (), (ours,), {})
    found = mount_users(point, seen, proc, ask_kernel=False)
    assert found and "pid 20 (app): open file" in found[0]


def test_the_fuse_mapper_scan_reads_only_an_rbd_fuse_cmdline(tmp_path: Path) -> None:
    # The same hazard in drivers/fusemapper.py's table scan (every listing of
    # fuse mappings, status and the leftovers' look among them).
    from reconciler.drivers.fusemapper import helpers_serving

    proc = tmp_path / "proc"
    stuck = _proc(proc, 10, "postgres", None)
    _proc(proc, 11, "rbd-fuse", b"/usr/bin/rbd-fuse\0/var/lib/r/fuse/rbd@z\0-f\0")
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(
        helpers_serving("/var/lib/r/fuse/rbd@z", proc)), daemon=True)
    t.start()
    t.join(5)
    try:
        assert not t.is_alive(), "the scan waited on another process's command line"
        assert out == [[11]]
    finally:
        if t.is_alive():
            os.close(os.open(stuck / "cmdline", os.O_WRONLY | os.O_NONBLOCK))
            t.join(5)


def test_the_rbd_nbd_serving_a_leftover_mounts_device_is_not_its_user(tmp_path: Path) -> None:
    # rbd-nbd holds its nbd device open: matched by the mount's device
    # numbers it looked like a user, and release --orphans left every mount
    # of an nbd leftover "in use by rbd-nbd" (found by the VM's kernel test).
    # A block device node of this machine stands in for the nbd device (a real
    # node: its number is read by stat, never the device).
    import stat

    node = next((str(p) for p in sorted(Path("/dev").glob("loop[0-9]*"))
                 if stat.S_ISBLK(p.stat().st_mode)), None)
    if node is None:
        pytest.skip("no block device node in /dev")
    from reconciler.facts.leftovers import Helper, Leftovers
    from reconciler.facts.observed import Mount
    from reconciler.observe.leftovers import mount_users

    proc = tmp_path / "proc"
    (proc / "self" / "ns").mkdir(parents=True)
    os.symlink("mnt:[4026531841]", proc / "self" / "ns" / "mnt")
    d = _proc(proc, 21, "rbd-nbd", b"rbd-nbd\0attach\0")
    (d / "ns").mkdir()
    os.symlink("mnt:[4026531841]", d / "ns" / "mnt")
    (d / "mountinfo").write_text("")
    (d / "fd").mkdir()
    (d / "fdinfo").mkdir()
    os.symlink(node, d / "fd" / "7")
    (d / "fdinfo" / "7").write_text("pos:\t0\nflags:\t02\nmnt_id:\t5\n")
    (d / "maps").write_text("")
    for link in ("cwd", "root"):
        os.symlink("/", d / link)
    null = os.stat(node).st_rdev
    point = "/srv/n"
    ours = Mount(70, 1, os.major(null), os.minor(null), "/", point, frozenset({"rw"}), "ext4",
                 node, frozenset({"rw"}))
    seen = Leftovers((), {}, (), (), (Helper(21, "rbd-nbd", node),), (ours,), {})
    assert not mount_users(point, seen, proc, ask_kernel=False)
