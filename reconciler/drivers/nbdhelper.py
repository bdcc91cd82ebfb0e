"""rbd-nbd's binary and the processes running it: which file ``rbd device
map``/``attach`` would start (rbd runs the ``rbd-nbd`` beside its own
executable), that file's identity (st_dev, st_ino) and version, and whether a running rbd-nbd
still runs it (``/proc/PID/exe``) or a file replaced on disk since: a
package upgrade writes a new inode over the path, and the old process runs
on from the old, deleted one.

Imported by drivers/kernelmapper.py (what it records at a map or an attach,
what it observes of a live helper) and apply/mapsteps.py (``roll_lock``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading
from pathlib import Path

from reconciler.drivers import procfs
from reconciler.facts.observed import NbdHelper
from reconciler.facts.parsers import parse_rbd_nbd_version
from reconciler.state.lock import flock_within

BINARY = "rbd-nbd"
# One roll at a time on the node: the daemon's chains run in parallel, and a
# command-line apply of another stateDir may roll too. Root's /run, no
# other user's directory (as drivers/mountbusy.py's).
ROLL_LOCK = Path("/run/rbd-reconciler-nbd-roll.lock")
ROLL_LOCK_WAIT_S = 120.0  # a roll takes seconds; one not begun by then waits for a later pass
_LOCK_POLL_S = 0.05
Ident = tuple[int, int]  # (st_dev, st_ino)

# version by (st_dev, st_ino, st_mtime_ns): one `rbd-nbd --version` per file
# that ever was on the path, not one per map (a process start costs ~1 s in
# the VM of the kernel tests).
_versions: dict[tuple[int, int, int], str] = {}
_versions_guard = threading.Lock()


def binary_path() -> str | None:
    """The file ``rbd device map -t nbd`` would start: Ceph's rbd runs
    ``dirname(/proc/self/exe)/rbd-nbd`` (src/tools/rbd/action/Nbd.cc), not
    the one on PATH (measured in the VM: an rbd-nbd first on PATH was not
    the one started). rbd is found on PATH, as the runner finds it."""
    rbd = shutil.which("rbd")
    if rbd is None:
        return shutil.which(BINARY)
    return os.path.join(os.path.dirname(os.path.realpath(rbd)), BINARY)


def binary_ident(path: str | None = None) -> Ident | None:
    """The file rbd would start as rbd-nbd now; None: none found."""
    path = path or binary_path()
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def exe_ident(pid: int, proc_root: Path = Path("/proc")) -> Ident | None:
    """The file process ``pid`` runs (also one deleted since: the kernel keeps
    its inode); None: the process is gone or not readable."""
    try:
        st = os.stat(proc_root / str(pid) / "exe")
    except OSError:
        return None
    return st.st_dev, st.st_ino


def is_rbd_nbd(pid: int, proc_root: Path = Path("/proc")) -> bool:
    """Whether ``pid`` is (still) an rbd-nbd process."""
    try:
        return procfs.read_text(proc_root / str(pid) / "comm").strip() == BINARY
    except OSError:
        return False


VERSION_TIMEOUT_S = 10.0  # `rbd-nbd --version` talks to nothing: a local file's answer
VERSION_ARGV0 = "rbd-nbd-version-query"


def _version_of(path: str) -> str:
    """``rbd-nbd --version``, its argv[0] not "rbd-nbd": ``rbd device list -t
    nbd`` (rbd-nbd's list-mapped) takes any process whose comm and argv[0]
    are rbd-nbd for a mapping after a re-attach, parses its arguments, and a
    ``--version`` among them printed the version as the list (measured in
    the VM: the list was "ceph version 16.2.15 ...", not JSON)."""
    return subprocess.run([VERSION_ARGV0, "--version"], executable=path, capture_output=True,
                          text=True, timeout=VERSION_TIMEOUT_S, check=True,
                          stdin=subprocess.DEVNULL).stdout


def current() -> tuple[Ident, str] | None:
    """The binary rbd would start now, and its version; None when there is
    none or it does not say (a map goes ahead: the version is then unknown)."""
    path = binary_path()
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    key = (st.st_dev, st.st_ino, st.st_mtime_ns)
    with _versions_guard:
        known = _versions.get(key)
    if known is None:
        try:
            known = parse_rbd_nbd_version(_version_of(path))
        except (subprocess.SubprocessError, ValueError, OSError):
            return None
        with _versions_guard:
            _versions[key] = known
    return (st.st_dev, st.st_ino), known


def started() -> dict[str, object]:
    """What a map or an attach records beside the cookie: the file the new
    rbd-nbd runs (asked just before it starts) and its version."""
    now = current()
    return {} if now is None else {"exe": list(now[0]), "version": now[1]}


def helper(pid: int, record: dict[str, object], cookie: str | None,
           proc_root: Path = Path("/proc"), binary: Ident | None = None) -> NbdHelper:
    """What serves one of our live nbd devices: ``record`` is ours of it
    (drivers' NbdMappings). Its version is the recorded one while it runs
    the file recorded with it; stale once that is no longer the file on
    PATH (``binary``: that file's identity, looked up by the caller once)."""
    exe = exe_ident(pid, proc_root)
    stale = None if exe is None or binary is None else exe != binary
    recorded = record.get("exe")
    version = record.get("version")
    known = exe is not None and isinstance(recorded, list) and tuple(recorded) == exe
    return NbdHelper(pid=pid, version=str(version) if known and version else None,
                     stale=stale, cookie=cookie)


def roll_lock(path: Path | None = None, wait: float | None = None
              ) -> contextlib.AbstractContextManager[bool]:
    """Held while one rbd-nbd is rolled; False if not had within ``wait``
    (another roll still runs: this one is left to a later pass)."""
    return flock_within(path or ROLL_LOCK, ROLL_LOCK_WAIT_S if wait is None else wait,
                        _LOCK_POLL_S)
