"""What running a plan gave: each step's outcome, each volume's (the
documents ``apply`` prints, the daemon's status and metrics read), and the
refusals a step raises at execution time.

Imported by the apply modules (apply/runner.py and the chain's step rules)
and by every front door that reports an apply (engine.py, views.py, cli/,
daemon/).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from reconciler.plan.steps import Step
from reconciler.plan.types import VolumePlan

LEFT = ": left for the next start (daemon stopping)"  # an undo not done at a stop


class StepRefused(Exception):
    """A safety check at execution time said no."""


# What the engine's gate says (csi/recorded.py, Volumes.gate) of a CSI file
# whose controller record is gone or changed: what a step made after that is
# no one's (apply/runner.py removes it), and the refusal's metric reason.
MOVED_ON = "controller record moved on"


class FreezeExpired(Exception):
    """The watchdog thawed the filesystem before the snapshot was taken."""


@dataclass
class StepOutcome:
    step: Step
    status: str  # changed | ok | failed | aborted
    message: str = ""
    seconds: float = 0.0  # wall time of the step (the daemon's metrics observe it)

    def as_dict(self) -> dict[str, object]:
        return {**self.step.as_dict(), "status": self.status, "message": self.message}


@dataclass
class VolumeOutcome:
    name: str
    status: str = "ok"  # ok | changed | failed | aborted (the daemon is stopping)
    steps: list[StepOutcome] = field(default_factory=list)
    error: str | None = None
    notes: list[str] = field(default_factory=list)
    undone: list[str] = field(default_factory=list)
    refused: bool = False  # a safety check said no (StepRefused), not a failure to act

    def as_dict(self) -> dict[str, object]:
        return {"name": self.name, "status": self.status, "error": self.error,
                "notes": self.notes, "undone": self.undone,
                "steps": [s.as_dict() for s in self.steps]}


def with_refusal(plan: VolumePlan, out: VolumeOutcome) -> VolumeOutcome:
    """What was refused counts as a failure: the whole plan, or steps of it
    while the rest converged."""
    if plan.refusal:
        out.status, out.error = "failed", plan.refusal
    elif plan.withheld and out.status not in ("failed", "aborted"):
        out.status, out.error = "failed", "; ".join(plan.withheld)
    return out


def without_steps(plan: VolumePlan) -> VolumeOutcome:
    """The result ``apply`` reports for a plan it runs no step of (nothing
    to do, a refusal, a wait): for a front door that did not run it."""
    return with_refusal(plan, VolumeOutcome(plan.name, notes=list(plan.notes)))

