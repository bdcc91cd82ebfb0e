"""How a stalled device is worded, the same in status, explain, plan and the
daemon's status file. Pure; no I/O.

Imported by observe/node.py; plan/planner.py.
"""

from __future__ import annotations

from datetime import UTC, datetime

from reconciler.facts.observed import IoStall


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds")


def stall_reason(s: IoStall) -> str:
    last = (f"the last I/O completed at {iso(s.last_completed)}" if s.last_completed is not None
            else f"none completed since watching began at {iso(s.since)}")
    return (f"I/O to {s.device} is not completing: {s.in_flight} request(s) in flight, none "
            f"completed for {s.seconds:.0f} s ({last})")


def stall_doc(s: IoStall) -> dict[str, object]:
    """The ``stalled`` object of status -o json and the daemon's status file."""
    return {"device": s.device, "inFlight": s.in_flight, "seconds": round(s.seconds, 1),
            "since": iso(s.since),
            "lastCompleted": iso(s.last_completed) if s.last_completed is not None else None}
