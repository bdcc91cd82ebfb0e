"""What the kernel writes under /proc and /sys, read as the bytes it is.

A path, a process name or a device-mapper name is any bytes but NUL (and
"/"), UTF-8 or not, and anyone on the node may make one. Read as strict
UTF-8, one such name would fail every read of the file it appears in (every
mount of the node, for a mount point). Decoded with ``surrogateescape`` (as
``os.fsdecode`` does), each keeps its bytes: it is never equal to a path of
ours, which is text, and still names the same file when handed back to the
kernel.

Imported by apply/devicesteps.py; csi/node.py; drivers/ (6 modules);
observe/deadfuse.py, observe/leftovers.py, observe/node.py.
"""

from __future__ import annotations

from pathlib import Path

from reconciler.facts.observed import Mount
from reconciler.facts.parsers import parse_mountinfo

MOUNTINFO = Path("/proc/self/mountinfo")


def read_text(path: Path | str) -> str:
    """The file's bytes as str, an undecodable byte kept as a surrogate."""
    return Path(path).read_bytes().decode("utf-8", "surrogateescape")


def mountinfo() -> str:
    return read_text(MOUNTINFO)


def mounts() -> tuple[Mount, ...]:
    """Every mount of this mount namespace (``/proc/self/mountinfo``)."""
    return parse_mountinfo(mountinfo())


def stat_fields(path: Path | str) -> tuple[str, list[str]]:
    """``/proc/PID/stat``: the command name, and the fields after it (state,
    ppid, pgrp, ...). The name is in parentheses and may hold anything,
    parentheses and spaces included: it ends at the last ")". OSError when
    the process is gone; ValueError when the file is not such a line."""
    text = read_text(path)
    close = text.rindex(")")
    return text[text.index("(") + 1:close], text[close + 2:].split()
