"""What ``release --all`` releases and what it reports: pure decisions.

Which volumes are ours (the declared ones, the daemon's records, the
mappings only identity names: ``volumes_of_ours``), and then, from one look
at those, one ``ReleasePlan``: which of them are provably ours (and why each
other one is refused), the steps of each in order (the planner's,
``plan(..., release=...)``), and ``ForceOff``, the rule for which FUSE
connections may be forced off after the round (those of the images whose
release ran into a deadline, when they do not answer); after it, what is
still held.

Imported by the engine (engine/release.py, engine/unwedge.py) only; it reads
and runs nothing: the records, the mappings, the look and the outcomes are
handed in.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from collections.abc import Mapping as MappingOf
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from reconciler.facts import meta
from reconciler.facts.claim import parse as parse_claim
from reconciler.facts.observed import Mapping, Observed
from reconciler.plan.planner import plan
from reconciler.plan.types import Context, VolumePlan
from reconciler.spec.model import ImageSpec, MapSpec, Source, Volume, volume_from_dict

BY_IDENTITY = Path("(found by identity)")

Image = tuple[str, str]


# What the decisions read of a chain's result (apply/outcomes.py's StepOutcome
# and VolumeOutcome): the planner may not import apply/, so only their shape.
class StepDone(Protocol):
    @property
    def step(self) -> Any: ...

    @property
    def status(self) -> str: ...

    @property
    def seconds(self) -> float: ...


class ChainDone(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def status(self) -> str: ...

    @property
    def steps(self) -> Sequence[StepDone]: ...


def identity_volume(m: Mapping) -> Volume:
    """A stand-in for a mapping no file or record names: no stage, no
    publish, so the planner finds its mounts by device number alone."""
    return Volume(name=f"{m.pool}/{m.image}", state="present",
                  image=ImageSpec(m.pool, m.image, None, (), "Retain"),
                  map=MapSpec(m.kind, ()), stage=None, publish=(), on_remove=None,
                  source=Source(BY_IDENTITY, 0))


def volumes_of_ours(declared: Iterable[Volume], records: MappingOf[str, Any],
                    mappings: Iterable[Mapping]) -> tuple[list[Volume], list[str]]:
    """Declared volumes, then recorded ones (``records``: managed.json), then
    mappings only identity names; each image once. Kernel mappings among the
    last are only candidates: see ``provably_ours``. Also one warning per
    record that could not be read."""
    out = list(declared)
    warnings = []
    images = {(v.image.pool, v.image.name) for v in out}
    names = {v.name for v in out}
    for name, record in sorted(records.items()):
        try:
            vol = volume_from_dict(record["volume"])
        except (KeyError, TypeError, ValueError) as exc:
            warnings.append(f"managed.json: record {name} unreadable ({exc}); its volume "
                            "is looked for by identity only")
            continue
        if vol.name in names or (vol.image.pool, vol.image.name) in images:
            continue
        out.append(vol)
        names.add(vol.name)
        images.add((vol.image.pool, vol.image.name))
    for m in mappings:
        if (m.pool, m.image) not in images:
            out.append(identity_volume(m))
            images.add((m.pool, m.image))
    return out, warnings


def provably_not_ours(v: Volume, observed: Observed, node_name: str) -> bool:
    """A kernel mapping found by identity whose image's claim, read, names
    another node or nobody: another tool's (rbdmap's, ceph-csi's, a hand's
    `rbd map`), which the release leaves alone. One whose image-meta could
    not be read is not: it may be ours."""
    if v.source.file != BY_IDENTITY or v.map is None or v.map.mapper == "fuse":
        return False
    img = observed.images.get((v.image.pool, v.image.name))
    if img is None or meta.HOLDER in img.unreadable:
        return False
    held = parse_claim(img.meta.get(meta.HOLDER))
    return held is None or held.node != node_name


def provably_ours(v: Volume, observed: Observed, node_name: str) -> str | None:
    """None when ``v`` may be released; else why not. A fuse mapping is ours
    by its mount point; a kernel mapping only when the image's claim names
    this node (another tool's, e.g. rbdmap's, is left alone)."""
    if v.source.file != BY_IDENTITY or v.map is None or v.map.mapper == "fuse":
        return None
    key = (v.image.pool, v.image.name)
    img = observed.images.get(key)
    if img is None:
        why = observed.image_errors.get(key) or observed.pool_errors.get(v.image.pool)
        return (f"{v.name}: mapped here by {v.map.mapper} but its image-meta could not be "
                f"read ({why or 'not found'}); not provably ours, left alone")
    if meta.HOLDER in img.unreadable:
        return (f"{v.name}: mapped here by {v.map.mapper}, but its claim is "
                f"{img.unreadable[meta.HOLDER]}; not provably ours, left alone")
    held = parse_claim(img.meta.get(meta.HOLDER))
    if held is None or held.node != node_name:
        return (f"{v.name}: mapped here by {v.map.mapper}, claimed by "
                f"{held.node if held else 'nobody'}; not ours, left alone")
    return None


def ran_into_deadline(outcomes: Iterable[ChainDone], volumes: MappingOf[str, Volume],
                      step_timeout: float, stalled: frozenset[str] = frozenset()) -> set[Image]:
    """Images whose chain was stopped at the deadline, or failed in a step that
    lasted a whole command deadline (a command killed at its step timeout), or
    failed at all while its device's I/O does not complete (``stalled``, by
    volume name: an umount refused as busy by a writer stuck in D state on
    that device fails at once, long before any deadline). Only their FUSE
    connections may be forced off (engine/unwedge.py)."""
    out = set()
    for o in outcomes:
        vol = volumes.get(o.name)
        if vol is None:
            continue
        if o.status == "aborted" or any(s.status == "failed" and (
                s.seconds >= step_timeout or o.name in stalled) for s in o.steps):
            out.add((vol.image.pool, vol.image.name))
    return out


def still_held(plans: Iterable[VolumePlan]) -> list[str]:
    """What a look after the release would still do (or refuses): one line each."""
    left = []
    for vp in plans:
        if vp.refusal:
            left.append(f"{vp.name}: {vp.refusal}")
        left += [f"{vp.name}: {s.action} {s.target} not done" for s in vp.steps]
    return left


def not_done(plans: Iterable[VolumePlan], outcomes: Iterable[ChainDone]) -> list[str]:
    """What the plans set out to do and their chains did not (nor are known
    to have done: a plan without an outcome yet counts as not done at all)."""
    done = {o.name: {id(s.step) for s in o.steps if s.status in ("ok", "changed")}
            for o in outcomes}
    left = []
    for vp in plans:
        if vp.refusal:
            left.append(f"{vp.name}: {vp.refusal}")
        left += [f"{vp.name}: {s.action} {s.target} not done" for s in vp.steps
                 if id(s) not in done.get(vp.name, set())]
    return left


@dataclass(frozen=True)
class ForceOff:
    """When a FUSE connection is forced off after a round of the release: the
    FUSE mounts of the images whose chain ran into a deadline
    (``ran_into_deadline``), and of those only the connections with requests
    waiting for an answer (engine/unwedge.py asks the kernel), within what
    is left of the deadline. A busy mount is not a dead helper: a volume
    whose release did not run into a deadline is never forced."""

    step_timeout: float  # a step that lasted this long was killed at its deadline
    stalled: frozenset[str]  # volumes whose device's I/O does not complete

    def images(self, outcomes: Iterable[ChainDone],
               volumes: MappingOf[str, Volume]) -> set[Image]:
        return ran_into_deadline(outcomes, volumes, self.step_timeout, self.stalled)


@dataclass
class ReleasePlan:
    """One round of ``release --all``, decided from one look at what is ours."""

    plans: list[VolumePlan]  # each volume provably ours: its steps, in order
    volumes: dict[str, Volume]  # those planned, by name
    observed: Observed  # the look they were planned from (the chains re-check it)
    refused: list[str]  # found by identity alone and not provably ours: why, one line each
    force_off: ForceOff
    # Of ``refused``, those provably another tool's (``provably_not_ours``).
    not_ours: list[str] = field(default_factory=list)

    def forced_off(self, outcomes: Iterable[ChainDone]) -> set[Image]:
        """The images whose FUSE connections may be forced off after ``outcomes``."""
        return self.force_off.images(outcomes, self.volumes)

    def left(self, outcomes: Iterable[ChainDone]) -> list[str]:
        """What is still held when the round was stopped at the deadline:
        the refused, and what the plans set out to do and did not."""
        return [*self.refused, *not_done(self.plans, outcomes)]

    def held(self) -> list[str]:
        """What is still held, when this plan comes from a look after the release."""
        return [*self.refused, *still_held(self.plans)]

    def held_of_ours(self) -> list[str]:
        """``held`` less another tool's mappings: what a removal of the
        package would leave with nothing to release it (the dry run's)."""
        return [x for x in self.held() if x not in self.not_ours]


def plan_release(candidates: Iterable[Volume], observed: Observed, ctx: Context,
                 step_timeout: float) -> ReleasePlan:
    """The release of ``candidates`` (``volumes_of_ours``) as ``observed``:
    each provably ours taken down to CREATED (unpublish, unstage, unmap), in
    the planner's order; each other one refused, with why."""
    volumes, refused, not_ours = [], [], []
    for v in candidates:
        why = provably_ours(v, observed, ctx.node_name)
        if why is None:
            volumes.append(v)
        else:
            refused.append(why)
            if provably_not_ours(v, observed, ctx.node_name):
                not_ours.append(why)
    plans = plan(volumes, observed, ctx, release=[v.name for v in volumes])
    return ReleasePlan(plans, {v.name: v for v in volumes}, observed, refused,
                       ForceOff(step_timeout, frozenset(vp.name for vp in plans if vp.stalled)),
                       not_ours)
