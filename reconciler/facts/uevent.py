"""Kernel uevents as they arrive on a NETLINK_KOBJECT_UEVENT socket.

Imported by daemon/events.py.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Uevent:
    action: str
    devpath: str
    subsystem: str | None
    devname: str | None  # "loop3", "rbd0": the /dev name, without "/dev/"
    env: dict[str, str]


def parse_uevent(data: bytes) -> Uevent | None:
    """``ACTION@DEVPATH\\0KEY=VALUE\\0...`` from the kernel; None for anything
    else (udev's re-broadcasts start with ``libudev``, and we bind only the
    kernel's group, but a stray datagram must not stop the watching)."""
    fields = data.split(b"\0")
    head = fields[0].decode(errors="replace")
    if "@" not in head or head.startswith("libudev"):
        return None
    env: dict[str, str] = {}
    for f in fields[1:]:
        key, eq, value = f.decode(errors="replace").partition("=")
        if eq:
            env[key] = value
    action, _, devpath = head.partition("@")
    return Uevent(action=env.get("ACTION", action), devpath=env.get("DEVPATH", devpath),
                  subsystem=env.get("SUBSYSTEM"), devname=env.get("DEVNAME"), env=env)
