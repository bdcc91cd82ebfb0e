"""The rollout gate as a sync sees it (source/sync.py): what it asks
(``Gate``: may this node apply commit C, whose fleet.yaml says ``Rollout``?)
and what it is told (``GateAnswer``), the record of a revision held back
(``state["heldBack"]``) and the node's own hold (``state["held"]``, set by
``source hold`` or ``source rollback``).

The answer is a plain record, not plan/rollout.py's ``Decision``: the source
sits below the planner's floor and may not import it. The daemon's side
(daemon/rollout.py) calls ``plan.rollout.decide`` and words its decision
into a ``GateAnswer`` (``describe``).

Imported by source/sync.py and source/report.py, and by daemon/rollout.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from reconciler.spec.fleet import Rollout

APPLY = "Apply"
# What a gate may answer instead of Apply (plan/rollout.py's Decision.state).
HOLDING = ("Waiting", "OutsideWindow", "Halted", "Held")


@dataclass(frozen=True)
class GateAnswer:
    state: str  # Apply, or one of HOLDING
    message: str = ""  # one line for a status (plan.rollout.describe)
    # JSON-ready particulars: waitingFor [{node, why, detail}], nextOpening
    # (ISO 8601 UTC), halted {node, volume, reason}, hold (the reason)
    details: Mapping[str, Any] = field(default_factory=dict)

    @property
    def applies(self) -> bool:
        return self.state == APPLY


# Commit, its rollout -> may it be applied now.
Gate = Callable[[str, Rollout], GateAnswer]

# A node in a fleet synced without the daemon's gate (the CLI's `source
# sync`): it fetches, verifies and exports, and applies nothing: only the
# daemon, which sees the fleet's reports, applies a revision of a rollout.
UNGATED = GateAnswer("Waiting", "this node is in a fleet (source.fleet): the daemon applies "
                                "a revision of a rollout when this node's wave may; fetched, "
                                "verified and kept until then")


def wave_name(rollout: Rollout, node: str) -> str | None:
    """The first wave naming ``node`` (None: no wave does)."""
    return next((w.name for w in rollout.waves if w.names_node(node)), None)


def held_back(commit: str, revision: str | None, answer: GateAnswer, at: str
              ) -> dict[str, Any]:
    """``state["heldBack"]``: a verified revision this node does not apply yet."""
    rec: dict[str, Any] = {"commit": commit, "revision": revision, "state": answer.state,
                           "message": answer.message, "at": at}
    rec.update(answer.details)
    return rec


def hold_of(state: Mapping[str, Any]) -> str | None:
    """This node's hold reason ("" when none was given); None: not held."""
    held = state.get("held")
    if not isinstance(held, dict) or not held:
        return None
    reason = held.get("reason")
    return reason if isinstance(reason, str) else ""


def held_message(held: Mapping[str, Any], at: str | None) -> str:
    """Why a held node applies nothing new (the sync's message)."""
    if held.get("by") == "hold":
        why = held.get("reason") or ""
        return (f"held at {at} by `rbd-reconciler source hold`" + (f" ({why})" if why else "")
                + "; `source resume` applies new revisions again")
    return (f"held at {at} by `rbd-reconciler source rollback`; `source resume` applies new "
            "revisions again")
