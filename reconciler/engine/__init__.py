"""One reconcile pass: load -> observe -> plan (-> apply). Shared by the CLI and daemon.

``look`` (observe, then plan) and ``act`` (run the plans' chains) are the
pass itself: the CLI's commands and each of the daemon's passes and chains
call these two and nothing below them, so every front door sees the node and
changes it the same way. ``release --all`` (engine/release.py) looks with
``seen`` (``look``'s first half) and plans with plan/release.py, then acts.
The package's modules: ``release`` and ``unwedge`` (``release --all``),
``frozen`` (freezes a dead run left), ``operator`` (takeover, rotate-key,
recover's own steps). Imported by the front doors (cli/, daemon/, csi/
through ``Served``) and by its own modules."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from reconciler.apply.outcomes import VolumeOutcome as VolumeOutcome  # a chain's result
from reconciler.apply.runner import apply
from reconciler.facts.observed import Observed as Observed  # what a look saw
from reconciler.observe.ceph import Connecting
from reconciler.observe.ceph import Session as Session  # a connection begun early
from reconciler.observe.node import Node as Node  # the node a pass looks at and acts on
from reconciler.observe.node import observe
from reconciler.plan.planner import Context, plan
from reconciler.plan.steps import Step
from reconciler.plan.types import VolumePlan as VolumePlan  # one volume's plan
from reconciler.spec.config import Config
from reconciler.spec.loader import LoadResult, load
from reconciler.spec.model import Volume
from reconciler.state import holds
from reconciler.state.lock import Busy as Busy  # at home in state/lock.py
from reconciler.state.lock import locked

# The names imported "as" themselves above are the front doors' (cli/) way to
# the types below the engine: they import the engine, views and spec only.


@dataclass
class Pass:
    loaded: LoadResult
    observed: Observed
    plans: list[VolumePlan]


# What a pass with nothing to look at saw: nothing of the node is read.
NOTHING_OBSERVED = Observed(images={}, pools_listed=frozenset(), pool_errors={}, mappings=(),
                            devices={}, mounts=())


@dataclass
class Looked:
    observed: Observed
    plans: list[VolumePlan]


# How a wait for a volume's status ended.
Awaited = Literal["covered", "deadline", "stopping"]


class FrontDoorMetrics(Protocol):
    def csi_served(self, methods: Iterable[str]) -> None: ...

    def csi_call(self, method: str, code: str, seconds: float) -> None: ...


# Asked by a volume's chain right before each of its steps, with the
# volume's name, file and the step: None to go on, or why that file must not
# take it (the CSI adapter's record moved on; a CSI volume never deletes a
# snapshot). Only the front door that owns the file knows; the engine asks
# and stops.
Gate = Callable[[str, Path, Step], str | None]


class Served(Protocol):
    """All a front door (the CSI server) may ask of the running engine. The
    daemon implements it; the front door never sees the daemon itself."""

    config: Config  # replaced by a reload (SIGHUP): read it at each use
    metrics: FrontDoorMetrics

    @property
    def ready(self) -> bool: ...  # a first pass is done

    def wake_volume(self, name: str) -> None: ...

    def set_gate(self, gate: Gate | None) -> None: ...

    def status(self, name: str) -> dict[str, Any]: ...

    def await_status(self, name: str, covers: Callable[[dict[str, Any]], bool],
                     deadline: float) -> tuple[Awaited, dict[str, Any]]: ...


class Stoppable(Protocol):
    def stop(self) -> None: ...


# Starts a front door on an endpoint, serving the engine: given to the daemon
# by whoever builds both (the CLI), so the daemon needs no front door's code.
FrontDoor = Callable[[Served, str], Stoppable]


def state_lock(config: Config, wait: bool = False) -> contextlib.AbstractContextManager[None]:
    """One actor per stateDir: the daemon, or one CLI apply, never both."""
    return locked(config.state_dir, wait)


def session_begun(config: Config) -> Session:
    """A Ceph connection begun now, for a pass about to observe: it overlaps
    whatever the caller does first (imports, the look at the node)."""
    session = Session()
    session.begin(config.ceph)
    return session


def lift_holds(config: Config, names: Iterable[str]) -> None:
    """Volumes applied outside the daemon: no longer held down by an earlier
    ``release`` when it starts again (state/holds.py). OSError: not recorded."""
    holds.lift(config.state_dir, list(names))


def blocklist(config: Config) -> dict[str, str]:
    """Ceph's blocklist, through a connection of the caller's own (``explain``)."""
    from reconciler.apply import claims
    from reconciler.drivers import ceph

    with ceph.connect(config.ceph, timeout=claims.MON_TIMEOUT_S) as cluster:
        return claims.blocklist(cluster)


def context(config: Config, node: Node) -> Context:
    return Context(node_name=config.node_name, staging_root=str(config.staging_root),
                   mappers_available=node.mappers_available,
                   clone_max_depth=config.clone.max_depth, clone_flatten=config.clone.flatten,
                   flatten_on_delete=config.clone.flatten_on_delete,
                   nbd_roll=config.nbd_roll_upgrades)


def seen(volumes: Iterable[Volume], node: Node, all_watchers: bool = False,
         ceph: bool = True) -> Observed:
    """One observation of the node for all of ``volumes``: nothing read when
    there are none (``look``'s first half; ``release --all`` plans what it
    saw with plan/release.py)."""
    volumes = list(volumes)
    return observe(node, volumes, all_watchers, ceph) if volumes else NOTHING_OBSERVED


def look(volumes: Iterable[Volume], config: Config, node: Node, *,
         frozen: Iterable[str] = (), release: Iterable[str] = (), all_watchers: bool = False,
         ceph: bool = True) -> Looked:
    """Observe ``volumes`` and plan them: one observation for all of them
    (nothing read when there are none), then the planner, a pure function of
    what is wanted and what was seen. ``release``: names only taken down to
    CREATED; ``frozen``: names refused (their file fails to load);
    ``ceph=False``: the node alone (a release's teardown)."""
    volumes = list(volumes)
    observed = seen(volumes, node, all_watchers, ceph)
    plans = plan(volumes, observed, context(config, node), frozen, release=release)
    return Looked(observed, plans)


def plan_again(volumes: Iterable[Volume], observed: Observed, config: Config, node: Node
               ) -> list[VolumePlan]:
    """The plans of what a look saw, planned once more as the planner would
    without ``release`` (``recover``: what a volume would be, not taken down)."""
    return plan(list(volumes), observed, context(config, node))


def act(plans: list[VolumePlan], volumes: dict[str, Volume], observed: Observed, node: Node,
        *, gate: Gate | None = None, claims_after: Connecting | None = None
        ) -> list[VolumeOutcome]:
    """Run each plan's chain (apply/runner.py), re-checking before each step."""
    return apply(plans, volumes, observed, node, gate=gate, claims_after=claims_after)


def plan_pass(paths: Iterable[Path], config: Config, node: Node, release: bool = False,
              all_watchers: bool = False, only: Collection[str] | None = None) -> Pass:
    """Load the files, then look at their volumes (``only``: those named)."""
    return pass_over(load(paths, config), config, node, release, all_watchers, only)


def pass_over(loaded: LoadResult, config: Config, node: Node, release: bool = False,
              all_watchers: bool = False, only: Collection[str] | None = None) -> Pass:
    volumes = [v for v in loaded.volumes if only is None or v.name in only]
    frozen = [n for n in loaded.frozen_names if only is None or n in only]
    looked = look(volumes, config, node, frozen=frozen,
                  release=[v.name for v in volumes] if release else (),
                  all_watchers=all_watchers)
    return Pass(loaded, looked.observed, looked.plans)


def apply_pass(p: Pass, node: Node) -> list[VolumeOutcome]:
    return act(p.plans, {v.name: v for v in p.loaded.volumes}, p.observed, node)


# A clone or snapshot waiting for one a pass created is planned again by the
# next: each level of a chain of sources is one more pass, this many at most.
MAX_FOLLOW_UP_PASSES = 8


def merge_outcomes(first: Iterable[VolumeOutcome], then: Iterable[VolumeOutcome]
                   ) -> list[VolumeOutcome]:
    """One result per volume over the passes of one apply, by name."""
    by_name = {o.name: o for o in first}
    for o in then:
        prev = by_name.get(o.name)
        if prev is None:
            by_name[o.name] = o
            continue
        prev.steps += o.steps
        prev.notes = o.notes
        if o.status == "failed" or prev.status == "failed":
            prev.status, prev.error = "failed", o.error or prev.error
        elif o.status == "changed":
            prev.status = "changed"
    return [by_name[n] for n in sorted(by_name)]


def release_pass(paths: Iterable[Path], config: Config, node: Node,
                 only: Collection[str] | None = None) -> tuple[Pass, list[VolumeOutcome]]:
    """``release``: the node's side first, Ceph's after. The teardown
    (unpublish, unstage, unmap) is planned from the node alone and never
    waits for Ceph; one connection, started in the background meanwhile,
    then drops this node's claims of the images no longer mapped here."""
    return release_over(load(paths, config), config, node, only)


def release_over(loaded: LoadResult, config: Config, node: Node,
                 only: Collection[str] | None = None) -> tuple[Pass, list[VolumeOutcome]]:
    volumes = [v for v in loaded.volumes if only is None or v.name in only]
    connecting = Connecting(config.ceph, config.observe_timeout_seconds) if volumes else None
    try:
        looked = look(volumes, config, node,
                      frozen=[n for n in loaded.frozen_names if only is None or n in only],
                      release=[v.name for v in volumes], ceph=False)
    except BaseException:
        if connecting is not None:
            connecting.close()
        raise
    p = Pass(loaded, looked.observed, looked.plans)
    return p, act(p.plans, {v.name: v for v in loaded.volumes}, p.observed, node,
                  claims_after=connecting)
