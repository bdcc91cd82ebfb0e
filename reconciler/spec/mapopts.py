"""Which map options a spec may pass: an allow-list per mapper.

``map.options`` reach ``rbd device map --options`` (krbd: the kernel's rbd
and libceph options; nbd: rbd-nbd's). Options that name the cluster, a key
or a secret (``fsid``, ``ip``, ``secret``, ``key``, ``name``), run a program
(rbd-nbd's ``quiesce-hook``), open the image another way (``read_only``: the
publish's ``readOnly`` says that, and a read-only map cannot be formatted)
or set up encryption behind the spec's back (``encryption-*``:
``spec.encryption`` does that) are refused, like anything not listed.

Imported by plan/mapping.py; spec/builder.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable

Check = Callable[[str], bool]


def _re(pattern: str) -> Check:
    compiled = re.compile(pattern)
    return lambda v: compiled.fullmatch(v) is not None


def _one_of(*values: str) -> Check:
    return lambda v: v in values


INT = _re(r"[0-9]{1,9}")
POW2 = _re(r"[0-9]{1,9}")  # checked below: a power of two


def _pow2(v: str) -> bool:
    return INT(v) and int(v) >= 512 and int(v) & (int(v) - 1) == 0


# name -> None (a flag) or a check of its value
KRBD: dict[str, Check | None] = {
    # rbd (per mapping)
    "queue_depth": INT, "alloc_size": _pow2, "lock_timeout": INT,
    "compression_hint": _one_of("none", "compressible", "incompressible"),
    "lock_on_read": None, "exclusive": None, "notrim": None,
    # libceph (per client)
    "ms_mode": _one_of("legacy", "crc", "secure", "prefer-crc", "prefer-secure"),
    "read_from_replica": _one_of("no", "balance", "localize"),
    "crush_location": _re(r"[A-Za-z0-9_.:|-]{1,256}"),
    "share": None, "noshare": None, "crc": None, "nocrc": None,
    "cephx_require_signatures": None, "nocephx_require_signatures": None,
    "cephx_sign_messages": None, "nocephx_sign_messages": None,
    "tcp_nodelay": None, "notcp_nodelay": None, "abort_on_full": None, "rxbounce": None,
    "mount_timeout": INT, "osdkeepalive": INT, "osd_idle_ttl": INT,
    # Off (0) unless asked: with N, an OSD request unanswered for N s fails
    # (EIO: a filesystem on it goes read-only) instead of waiting out a
    # partition (docs/ceph-unreachable.md).
    "osd_request_timeout": INT,
    "noudev": None, "udev": None,
}
NBD: dict[str, Check | None] = {
    "try-netlink": None, "exclusive": None, "notrim": None, "quiesce": None,
    "io-timeout": INT, "reattach-timeout": INT, "timeout": INT,
    "nbds_max": INT, "max_part": INT,
}
WHY_NOT = {
    "read_only": "a read-only map cannot be formatted; publish with readOnly: true",
    "ro": "a read-only map cannot be formatted; publish with readOnly: true",
    "read-only": "a read-only map cannot be formatted; publish with readOnly: true",
    "quiesce-hook": "it runs a program as root",
    "encryption-format": "spec.encryption sets up LUKS2",
    "encryption-passphrase-file": "spec.encryption sets up LUKS2",
}


def check_map_options(mapper: str, options: tuple[str, ...]) -> list[tuple[int, str]]:
    """(index, message) for each option ``mapper`` may not be given. ``auto``:
    what krbd or nbd takes (which one runs is the node's choice); fuse takes
    none of them."""
    lists = {"krbd": [KRBD], "nbd": [NBD], "auto": [KRBD, NBD], "fuse": []}[mapper]
    out = []
    for i, opt in enumerate(options):
        name, eq, value = opt.partition("=")
        if name in WHY_NOT:
            out.append((i, f"map option {name!r} is not allowed: {WHY_NOT[name]}"))
            continue
        known = [table[name] for table in lists if name in table]
        if not known:
            allowed = sorted({n for table in lists for n in table})
            out.append((i, f"map option {name!r} is not known for mapper {mapper} (allowed: "
                           f"{', '.join(allowed) or 'none: rbd-fuse takes no map options'})"))
            continue
        checks = [c for c in known if c is not None]
        if not checks and eq:
            out.append((i, f"map option {name!r} takes no value"))
        elif checks and (not eq or not any(c(value) for c in checks)):
            out.append((i, f"map option {name!r} needs a valid value (got {value!r})"))
    return out
