"""What the planner takes and gives, shared by its modules: the node's
context, one volume's plan, and the two ways a rule abandons a plan.

Imported by apply/outcomes.py; daemon/commands.py; engine/,
engine/operator.py, engine/release.py; plan/ (9 modules); views.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from reconciler.plan.steps import Step
from reconciler.spec.model import Phase


@dataclass(frozen=True)
class Context:
    node_name: str
    staging_root: str
    mappers_available: frozenset[str] = frozenset({"fuse"})
    clone_max_depth: int = 8  # a clone deeper than this is flattened (flatten: depth)
    clone_flatten: str = "depth"  # never | always | depth
    flatten_on_delete: bool = False  # deleting a snapshot flattens its clones first
    # An rbd-nbd whose binary was replaced on disk is replaced by one of the
    # new binary (nbdRollUpgrades in the node config).
    nbd_roll: bool = True


@dataclass
class VolumePlan:
    name: str
    steps: list[Step] = field(default_factory=list)
    refusal: str | None = None  # set: nothing may be done to this volume
    # Steps refused while the rest proceeds (a delete of an image we do not
    # own must not keep the node's mounts and mapping around forever).
    withheld: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    phase: Phase = Phase.ABSENT  # observed
    wanted: Phase | None = None
    # Set when part of the volume could not be seen (pool, image, device):
    # the phase is then unknown, not ``phase``; never ordered with phases.
    unknown: str | None = None
    kind: str = "volume"  # volume | snapshot | group
    # Set: it starts from another desired object not there yet; no steps, no
    # failure (a later pass, once that one converged, plans it).
    waiting: str | None = None
    # What is wrong and no step may put right (someone else's mount on top of
    # a publish, a filesystem gone read-only): condition type -> why. Reported,
    # never acted on; the rest of the plan goes ahead.
    problems: dict[str, str] = field(default_factory=dict)
    # Set: its mapped device's I/O does not complete (why, since when); no
    # steps but a release by hand's, which still tries.
    stalled: str | None = None
    # Set: this node's mapping is fenced (taken over, or its client
    # blocklisted); no steps but a release's (or ``recover``).
    fenced: str | None = None
    fence_reason: str | None = None  # TakenOver | Blocklisted
    # Set: another node's claim (that node's name) is what keeps this volume
    # from being mapped here (or its image deleted). The claim rules are
    # unchanged (refused, or withheld); the daemon polls that claim
    # meanwhile, so the volume follows as soon as the other node lets go.
    claimed_by: str | None = None

    @property
    def changes(self) -> bool:
        return bool(self.steps)

    @property
    def phase_name(self) -> str:
        return ("FENCED" if self.fenced else "STALLED" if self.stalled
                else "UNKNOWN" if self.unknown else self.phase.name)

    @property
    def refused(self) -> str | None:
        """Everything that was refused, in one line (None: nothing was)."""
        parts = ([self.refusal] if self.refusal else []) + self.withheld
        return "; ".join(parts) or None


class Refused(Exception):
    """Raised inside the planner to abandon one volume's plan with a reason."""


class Waiting(Exception):
    """Raised inside the planner: this one starts from another desired object
    that does not exist yet (a snapshot not yet taken). Not a failure: the
    next pass, once that one converged, plans it."""
