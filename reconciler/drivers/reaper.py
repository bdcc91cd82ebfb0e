"""Adopt and reap orphaned helpers (rbd-fuse) where PID 1 does not.

rbd-fuse must outlive the ``apply`` that started it, so it is orphaned when
that command exits. Under systemd it is reaped; in a container whose PID 1
does not reap, it would linger as a zombie after its mount goes away. A long
running parent (the daemon, the demo runner, the test session) can declare
itself a child subreaper so such orphans come back to it, and reap them.

A child we killed that is stuck in the kernel (D state) cannot be reaped
until the kernel lets go, maybe never: it is reaped from a thread instead
(``reap_later``), never waited for on the caller's.

Imported by daemon/passes.py, daemon/service.py; drivers/freeze.py,
drivers/fusemapper.py, drivers/run.py; engine/release.py;
testing/devcluster.py.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
import threading
import time
from pathlib import Path

from reconciler.drivers import procfs

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _children_stats() -> list[Path]:
    """The stat files of our children: from each thread's ``children`` list
    (a daemon pass reads a few files, not all of /proc), or, on a kernel
    without that list, of every process."""
    me = os.getpid()
    if not os.path.exists(f"/proc/{me}/task/{me}/children"):  # no CONFIG_PROC_CHILDREN
        return list(Path("/proc").glob("[0-9]*/stat"))
    pids: set[str] = set()
    for task in os.listdir(f"/proc/{me}/task"):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError), \
                open(f"/proc/{me}/task/{task}/children") as f:  # a thread may have ended
            pids.update(f.read().split())
    return [Path(f"/proc/{pid}/stat") for pid in pids]


def reap_zombies(names: tuple[str, ...] = ("rbd-fuse", "rbd-nbd")) -> list[int]:
    """Reap our zombie children with the given command names, and only those:
    reaping a child that ``subprocess`` still waits for would steal its status."""
    me = os.getpid()
    reaped = []
    for stat_path in _children_stats():
        with contextlib.suppress(OSError, ValueError, IndexError):
            comm, rest = procfs.stat_fields(stat_path)
            state, ppid = rest[:2]
            if state == "Z" and int(ppid) == me and comm in names:
                pid = int(stat_path.parent.name)
                os.waitpid(pid, os.WNOHANG)
                reaped.append(pid)
    return reaped


def reap_group(pgid: int) -> list[int]:
    """Reap our zombie children in process group ``pgid`` but not its leader
    (``subprocess`` waits for that one): a killed command's orphans, which
    come back to us as a subreaper and would otherwise stay zombies."""
    me = os.getpid()
    reaped = []
    for stat_path in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            state, ppid, pgrp = procfs.stat_fields(stat_path)[1][:3]
            pid = int(stat_path.parent.name)
            if state == "Z" and int(ppid) == me and int(pgrp) == pgid and pid != pgid:
                os.waitpid(pid, os.WNOHANG)
                reaped.append(pid)
    return reaped


def reap_later(proc: subprocess.Popen[bytes], wait: float = 0.0) -> bool:
    """Wait up to ``wait`` s for a child we killed; if it has not gone by then
    (stuck in the kernel, D state: SIGKILL takes effect only when the kernel
    lets go), reap it from a daemon thread instead. Never waits longer: a
    thread blocked in ``waitpid`` does not hold the process's exit, a wait on
    the caller's thread would. True when it was reaped here."""
    try:
        proc.wait(timeout=wait)
        return True
    except subprocess.TimeoutExpired:
        threading.Thread(target=proc.wait, daemon=True, name=f"reap:{proc.pid}").start()
        return False


GROUP_POLL_S = 1.0


def reap_group_later(proc: subprocess.Popen[bytes]) -> None:
    """``reap_later`` for a killed command's whole process group: a shell
    killed at once leaves its child stuck in the kernel (a read of a device
    that does not answer), which comes back to us (a subreaper) only when
    it dies. A daemon thread waits for the leader, then reaps what is left
    of the group as it dies, and ends when none of it is left."""
    def reap() -> None:
        proc.wait()
        while True:
            reap_group(proc.pid)
            if not _group_members(proc.pid):
                return
            time.sleep(GROUP_POLL_S)

    if proc.poll() is not None and not _group_members(proc.pid):
        return  # all of it is gone: no thread
    threading.Thread(target=reap, daemon=True, name=f"reap-group:{proc.pid}").start()


def _group_members(pgid: int) -> list[int]:
    """Processes of group ``pgid`` (a zombie that is not ours counts: its
    parent reaps it)."""
    out = []
    for stat_path in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            if int(procfs.stat_fields(stat_path)[1][2]) == pgid:
                out.append(int(stat_path.parent.name))
    return out
