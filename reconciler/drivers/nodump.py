"""No core dump of a process that holds keys.

A core file of the daemon or of ``apply``/``rotate-key`` would hold node keys
and unsealed LUKS2 passphrases, written wherever ``kernel.core_pattern``
says (systemd-coredump keeps them in /var/lib/systemd/coredump). So these
processes make themselves non-dumpable (``PR_SET_DUMPABLE`` 0: the kernel
writes no core at all, through a pipe either, and other users' ptrace and
/proc/PID/mem are closed) and set RLIMIT_CORE to 0, which the commands they
run (cryptsetup, which reads the keys on stdin) inherit. The units set
``LimitCORE=0`` too.

Imported by cli/main.py.
"""

from __future__ import annotations

import ctypes
import resource

PR_GET_DUMPABLE = 3
PR_SET_DUMPABLE = 4


def _prctl(option: int, arg: int = 0) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    rc = int(libc.prctl(option, arg, 0, 0, 0))
    if rc < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option})")
    return rc


def forbid_core_dumps() -> None:
    """Before any key is read: no core file, of this process or its children."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    _prctl(PR_SET_DUMPABLE, 0)


def dumpable() -> bool:
    return _prctl(PR_GET_DUMPABLE) != 0
