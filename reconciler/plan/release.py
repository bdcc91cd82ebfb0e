"""What ``release --all`` releases and what it reports: pure decisions.

Which volumes are ours (the declared ones, the daemon's records, the
mappings only identity names), which of those found by identity alone are
provably ours, which images ran into a deadline (their FUSE connections are
the ones ended when they do not answer), and what is still held afterwards.
The order of a release is the planner's (``plan(..., release=...)``).

Imported by the engine (engine/release.py, engine/unwedge.py) only; it reads
and runs nothing: the records, the mappings and the outcomes are handed in.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from collections.abc import Mapping as MappingOf
from pathlib import Path
from typing import Any, Protocol

from reconciler.facts import meta
from reconciler.facts.claim import parse as parse_claim
from reconciler.facts.observed import Mapping, Observed
from reconciler.plan.types import VolumePlan
from reconciler.spec.model import ImageSpec, MapSpec, Source, Volume, volume_from_dict

BY_IDENTITY = Path("(found by identity)")

Image = tuple[str, str]


# What the decisions read of a chain's result (apply/runner.py's StepOutcome
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
