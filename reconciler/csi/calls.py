"""The call a thread serves: its deadline and whether its caller is still
there, asked before the call writes anything that starts a change.

A replica can be paused anywhere (a frozen VM, a long GC, a partition that
holds its Ceph ops) and resume long after its caller gave up and moved on:
the CO's retry went to another replica, which may since have created and
deleted the volume. What the paused call read before it stopped is history,
so before a claim, a lease, a tombstone or a rebuilt record is written the
call must still be within its deadline on this process's monotonic clock
(which keeps counting while the process is stopped) and its caller still
connected; otherwise it does nothing more and says so. A change already
started (a claim written in time) goes on past the deadline by design: its
own record entry keeps every other replica off the name until it is done.

Imported by csi/converge.py.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc

from reconciler.csi.errors import CsiError

log = logging.getLogger("rbd-reconciler.csi")


class Calls:
    def __init__(self) -> None:
        self._local = threading.local()

    def begin(self, context: grpc.ServicerContext | None, deadline: float) -> None:
        """This thread now serves the call of ``context`` until ``deadline``
        (monotonic)."""
        self._local.call = (context, deadline)

    def in_time(self, name: str, what: str) -> None:
        """Raise DEADLINE_EXCEEDED, having written nothing, when the call this
        thread serves is over. A thread serving no call (a cut-off call's
        finish) goes on: it only finishes what was started in time."""
        context, deadline = getattr(self._local, "call", (None, 0.0))
        if context is None:
            return
        late = time.monotonic() - deadline
        if late < 0 and context.is_active():
            return
        why = f"{late:.1f} s past its deadline" if late >= 0 else "its caller has gone"
        log.warning("%s: the call came back to write %s %s (the process was paused, or Ceph "
                    "was slow): nothing more is done", name, what, why)
        raise CsiError(grpc.StatusCode.DEADLINE_EXCEEDED,
                       f"volume {name}: this call was over ({why}) before it wrote {what}; "
                       "nothing was changed by it, retry")
