"""One volume's status file, ``<stateDir>/status/<name>.json``: what the
daemon last saw and did for it. Read by ``rbd-reconciler status``, the CSI
adapter (through the engine) and whoever monitors the node.

The keys, once (camelCase in the file; a field left unset is not written):

- ``phase``: Pending, Mapped, Staged, Published, Degraded, Deleting,
  Released, Failed, Frozen, Unknown, Stalled or Fenced.
- ``reason``, ``message``: why, for Frozen, Unknown, Interrupted, Held, Degraded
  (the first of its conditions: Shadowed, FilesystemReadOnly), ...
- ``stalled``: I/O not completing (device, inFlight, seconds, since,
  lastCompleted); ``fence``: taken over or blocklisted (reason, holder,
  takenFrom, blocklisted, readOnly).
- ``observedGeneration``: the spec hash the status is about.
- ``lastResult`` (changed, ok, failed, aborted), ``lastError``, ``refusal``.
- ``notes``, ``undone``, ``steps``: what the last chain said, undid, ran.
- ``device``, ``staging``, ``published``, ``size``: where it is, once converged.
- ``conditions``: ``[{type: Converged, status, reason, message, lastTransitionTime}]``,
  then one per problem no step can put right (``Shadowed``, ``FilesystemReadOnly``).

The daemon adds ``name`` and ``updated`` when it writes the file.

Imported by daemon/ (4 modules).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields
from typing import Any


class _Unset(enum.Enum):
    UNSET = 0


UNSET = _Unset.UNSET  # not written at all (unlike None, written as null)


@dataclass(frozen=True)
class VolumeStatus:
    phase: str
    reason: str | _Unset = UNSET
    message: str | _Unset = UNSET
    observed_generation: str | _Unset = UNSET
    last_result: str | _Unset = UNSET
    last_error: str | _Unset | None = UNSET
    refusal: str | _Unset | None = UNSET
    notes: list[str] | _Unset = UNSET
    undone: list[str] | _Unset = UNSET
    steps: list[dict[str, Any]] | _Unset = UNSET
    device: Any = UNSET
    staging: Any = UNSET
    published: Any = UNSET
    size: Any = UNSET
    conditions: list[dict[str, Any]] | _Unset = UNSET
    stalled: Any = UNSET  # Stalled: device, inFlight, seconds, since, lastCompleted
    fence: Any = UNSET  # Fenced: reason, holder, takenFrom, blocklisted, readOnly

    def to_json(self) -> dict[str, Any]:
        return {_camel(f.name): value for f in fields(self)
                if (value := getattr(self, f.name)) is not UNSET}


def _camel(name: str) -> str:
    first, *rest = name.split("_")
    return first + "".join(w.title() for w in rest)


def converged_conditions(problems: dict[str, str], now: str) -> list[dict[str, Any]]:
    """A volume with nothing left to do: Converged, unless something no step
    may put right is wrong (then Converged is false, and each problem is a
    condition of its own, named for what was seen)."""
    out: list[dict[str, Any]] = [{
        "type": "Converged", "status": not problems,
        "reason": "Degraded" if problems else "UpToDate",
        "message": ", ".join(problems) if problems else "", "lastTransitionTime": now}]
    out += [{"type": kind, "status": True, "reason": kind, "message": why,
             "lastTransitionTime": now} for kind, why in problems.items()]
    return out
