"""The sd_notify protocol: datagrams to $NOTIFY_SOCKET (see sd_notify(3)).

Small enough to speak ourselves: one sendto per message, no dependency.

Imported by daemon/passes.py, daemon/readiness.py, daemon/service.py.
"""

from __future__ import annotations

import os
import socket

from reconciler.facts.text import clip

MAX_MESSAGE = 2048


def notify(message: str) -> bool:
    """Send ``READY=1``, ``STATUS=...``, ``WATCHDOG=1`` ...; False without systemd.
    One assignment: the protocol separates them by newlines, so a text's own
    (a reason quoted in STATUS=) is sent escaped, never as one of its own;
    so are control and bidi characters (`systemctl status` shows it to the
    operator) and a lone surrogate (it cannot be encoded); at most
    MAX_MESSAGE characters."""
    message = clip(message, MAX_MESSAGE)
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):  # abstract namespace
        addr = "\0" + addr[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
        try:
            # Never block: a reader that stopped reading must not freeze the daemon.
            s.sendto(message.encode(), socket.MSG_DONTWAIT, addr)
        except OSError:
            return False
    return True


def watchdog_interval() -> float | None:
    """Seconds between WATCHDOG=1 pings: half of WatchdogSec, as systemd advises."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and int(pid) != os.getpid()):
        return None
    return int(usec) / 2e6
