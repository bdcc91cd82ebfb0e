"""Run a command inside the sandbox a unit file describes, without systemd.

    python tests/cluster/unit_sandbox.py UNIT -- COMMAND...

PID 1 here is not systemd, so `systemd-run` cannot start the units. This
applies the parts of their [Service] hardening that decide whether the
daemon can still do its job, the way systemd's executor does, then execs
COMMAND: UMask=, CapabilityBoundingSet= (dropped from the bounding set, so
root keeps only those), NoNewPrivileges=, SystemCallFilter= with
SystemCallErrorNumber= and SystemCallArchitectures=native (a libseccomp
filter over the groups `systemd-analyze syscall-filter` expands), and
RestrictAddressFamilies= (socket(2) of another family fails). Not applied:
ProtectClock's and ProtectHostname's namespaces and RestrictNamespaces,
RestrictRealtime, RestrictSUIDSGID, LockPersonality (none of them is
something the daemon does).
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import socket
import subprocess
import sys
from functools import cache
from pathlib import Path

CAPS = {"CAP_CHOWN": 0, "CAP_DAC_OVERRIDE": 1, "CAP_DAC_READ_SEARCH": 2, "CAP_FOWNER": 3,
        "CAP_KILL": 5, "CAP_SETUID": 7, "CAP_NET_BIND_SERVICE": 10, "CAP_NET_ADMIN": 12,
        "CAP_IPC_LOCK": 14, "CAP_SYS_MODULE": 16, "CAP_SYS_RAWIO": 17, "CAP_SYS_ADMIN": 21,
        "CAP_SYS_RESOURCE": 24, "CAP_MKNOD": 27, "CAP_SYSLOG": 34}
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_CMP_EQ = 4


def scmp_act_errno(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)


class ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int),
                ("datum_a", ctypes.c_uint64), ("datum_b", ctypes.c_uint64)]


def service_options(unit: Path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    section = ""
    for line in unit.read_text().splitlines():
        if line.startswith("["):
            section = line.strip()
        elif section == "[Service]" and (m := re.match(r"^([A-Za-z]+)=(.*)$", line)):
            out.setdefault(m.group(1), []).append(m.group(2))
    return out


@cache
def expand(group: str) -> frozenset[str]:
    text = subprocess.run(["systemd-analyze", "syscall-filter", group], check=True,
                          capture_output=True, text=True).stdout
    names: set[str] = set()
    for line in text.splitlines()[1:]:
        word = line.strip()
        if not word or word.startswith("#"):
            continue
        names |= expand(word) if word.startswith("@") else {word}
    return frozenset(names)


def allowed_syscalls(filters: list[str]) -> set[str]:
    allowed: set[str] = set()
    for entry in filters:
        deny = entry.startswith("~")
        names: set[str] = set()
        for word in entry.lstrip("~").split():
            names |= expand(word) if word.startswith("@") else {word}
        allowed = allowed - names if deny else allowed | names
    return allowed


def load_seccomp(allowed: set[str], families: list[int], errno_code: int) -> None:
    lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int,
                                           ctypes.c_uint, ctypes.POINTER(ArgCmp)]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    ctx = lib.seccomp_init(ctypes.c_uint32(scmp_act_errno(errno_code)))
    assert ctx, "seccomp_init failed"
    socket_nr = lib.seccomp_syscall_resolve_name(b"socket")
    for name in sorted(allowed):
        nr = lib.seccomp_syscall_resolve_name(name.encode())
        if nr < 0 or (nr == socket_nr and families):
            continue  # not a call on this architecture; socket: per family below
        rc = lib.seccomp_rule_add_array(ctx, SCMP_ACT_ALLOW, nr, 0, None)
        assert rc == 0, f"seccomp_rule_add {name}: {rc}"
    for family in families:
        cmp = ArgCmp(0, SCMP_CMP_EQ, family, 0)
        rc = lib.seccomp_rule_add_array(ctx, SCMP_ACT_ALLOW, socket_nr, 1, ctypes.byref(cmp))
        assert rc == 0, f"seccomp_rule_add socket({family}): {rc}"
    rc = lib.seccomp_load(ctx)
    assert rc == 0, f"seccomp_load: {rc}"


def enter(unit: Path) -> None:
    opts = service_options(unit)
    libc = ctypes.CDLL(None, use_errno=True)
    if "UMask" in opts:
        os.umask(int(opts["UMask"][-1], 8))
    if "CapabilityBoundingSet" in opts:
        keep = {CAPS[c] for c in opts["CapabilityBoundingSet"][-1].split()}
        last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
        for cap in range(last + 1):
            if cap not in keep and libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), f"PR_CAPBSET_DROP {cap}")
    if opts.get("NoNewPrivileges") == ["yes"]:
        assert libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0
    if "SystemCallFilter" in opts:
        code = getattr(errno, opts.get("SystemCallErrorNumber", ["EPERM"])[-1])
        families = [int(getattr(socket, f)) for f in
                    " ".join(opts.get("RestrictAddressFamilies", [])).split()]
        load_seccomp(allowed_syscalls(opts["SystemCallFilter"]), families, code)


def main() -> None:
    unit, sep, *argv = sys.argv[1:]
    assert sep == "--" and argv, __doc__
    enter(Path(unit))
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main()
