"""What a volume's status says after the daemon looked at it or ran its
chain: the phase, reason and message of a chain's end, a chain cut short
by SIGTERM, and a volume with nothing left to do. Pure: the status file is
written by daemon/progress.py (through state/statusfiles.py). Imported by
daemon/chains.py and daemon/passes.py.
"""

from __future__ import annotations

from typing import Any, Literal

from reconciler.apply.outcomes import VolumeOutcome
from reconciler.facts.clock import now_iso
from reconciler.plan.planner import VolumePlan
from reconciler.spec.model import Phase, Volume
from reconciler.state.status import UNSET, VolumeStatus, converged_conditions

# Why a volume is taken down: its file vanished, or `release` held it down
# through the daemon; None: converged to its file.
Down = Literal["vanished", "held"] | None

# The status of a volume held down (state/holds.py).
HELD = {"reason": "Held", "message": "released through the daemon (rbd-reconciler release); "
                                     "kept down until rbd-reconciler apply names it"}

PHASE_NAMES = {"ABSENT": "Absent", "CREATED": "Created", "MAPPED": "Mapped",
               "STAGED": "Staged", "PUBLISHED": "Published"}


def chain_ended(vol: Volume, vp: VolumePlan, out: VolumeOutcome, down: Down) -> VolumeStatus:
    """The status after a chain that ran to its end (failed or not)."""
    released = down == "vanished"
    # What no step fixes (a read-only filesystem, a covered publish) still
    # holds after the chain while the stage it concerns stays: the volume
    # is not what its phase would say (a CSI stage or publish waits on this).
    problems = vp.problems if (down is None and out.status != "failed" and vp.wanted
                               is not None and vp.wanted >= Phase.STAGED) else {}
    phase = ("Released" if released or (down == "held" and out.status != "failed") else
             "Failed" if out.status == "failed" else "Degraded" if problems else
             PHASE_NAMES[vp.wanted.name] if vp.wanted is not None else "Pending")
    said = HELD if down == "held" and out.status != "failed" else (
        {"reason": next(iter(problems)), "message": "; ".join(problems.values())}
        if problems else {})
    return VolumeStatus(
        phase,
        **said,
        observed_generation=vol.spec_hash,
        last_result=out.status,
        last_error=out.error,
        refusal=vp.refused or (out.error if out.refused else None),
        notes=out.notes,
        undone=out.undone,
        steps=[s.as_dict() for s in out.steps],
        conditions=converged_conditions(problems, now_iso()) if problems else [
            {"type": "Converged", "status": out.status != "failed",
             "reason": "Applied" if out.status != "failed" else "StepFailed",
             "message": out.error or "", "lastTransitionTime": now_iso()}],
    )


def chain_aborted(vol: Volume, out: VolumeOutcome) -> VolumeStatus:
    """Cut short by SIGTERM: not a failure; the next start resumes."""
    return VolumeStatus(
        "Pending", reason="Interrupted",
        message=f"{out.error}; the next start resumes",
        observed_generation=vol.spec_hash, last_result="aborted",
        notes=out.notes, undone=out.undone,
        steps=[s.as_dict() for s in out.steps],
    )


def nothing_to_do(vol: Volume, vp: VolumePlan, down: Down, problems: dict[str, str],
                  actual: dict[str, Any]) -> VolumeStatus:
    """A volume with no step to run: as it is (``actual``), or released."""
    held = HELD if down == "held" else {}
    return VolumeStatus(
        # A clone whose source is still on its way is pending, not absent;
        # one with a problem no step can fix is not what it looks like.
        "Released" if down is not None else "Pending" if vp.waiting else
        "Degraded" if problems else PHASE_NAMES[vp.phase.name],
        reason=held.get("reason") or next(iter(problems), UNSET),
        message=held.get("message") or "; ".join(problems.values()) or UNSET,
        observed_generation=vol.spec_hash,
        notes=vp.notes,
        device=actual["device"], staging=actual["staging"],
        published=actual["published"], size=actual["size"],
        conditions=converged_conditions(problems, now_iso()),
    )
