"""One reconcile pass: load -> observe -> plan (-> apply). Shared by the CLI and daemon."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from reconciler.apply.runner import VolumeOutcome, apply
from reconciler.facts.observed import Observed
from reconciler.observe.ceph import Connecting
from reconciler.observe.node import Node, observe
from reconciler.plan.planner import Context, VolumePlan, plan
from reconciler.plan.steps import Step
from reconciler.spec.config import Config
from reconciler.spec.loader import LoadResult, load
from reconciler.state.files import open_lock


@dataclass
class Pass:
    loaded: LoadResult
    observed: Observed
    plans: list[VolumePlan]


class Busy(Exception):
    pass


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


@contextlib.contextmanager
def state_lock(config: Config, wait: bool = False) -> Iterator[None]:
    """One actor per stateDir: the daemon, or one CLI apply, never both."""
    fd = open_lock(config.state_dir / "lock")
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise Busy(f"{config.state_dir} is in use by another rbd-reconciler "
                           "(the daemon, or another apply)") from None
            raise
        yield
    finally:
        os.close(fd)


def context(config: Config, node: Node) -> Context:
    return Context(node_name=config.node_name, staging_root=str(config.staging_root),
                   mappers_available=node.mappers_available,
                   clone_max_depth=config.clone.max_depth, clone_flatten=config.clone.flatten,
                   flatten_on_delete=config.clone.flatten_on_delete)


def plan_pass(paths: Iterable[Path], config: Config, node: Node, release: bool = False,
              all_watchers: bool = False) -> Pass:
    loaded = load(paths, config)
    observed = observe(node, loaded.volumes, all_watchers)
    plans = plan(loaded.volumes, observed, context(config, node), loaded.frozen_names,
                 release=[v.name for v in loaded.volumes] if release else ())
    return Pass(loaded, observed, plans)


def apply_pass(p: Pass, node: Node) -> list[VolumeOutcome]:
    return apply(p.plans, {v.name: v for v in p.loaded.volumes}, p.observed, node)


def release_pass(paths: Iterable[Path], config: Config, node: Node
                 ) -> tuple[Pass, list[VolumeOutcome]]:
    """``release``: the node's side first, Ceph's after. The teardown
    (unpublish, unstage, unmap) is planned from the node alone and never
    waits for Ceph; one connection, started in the background meanwhile,
    then drops this node's claims of the images no longer mapped here."""
    loaded = load(paths, config)
    connecting = Connecting(config.ceph, config.observe_timeout_seconds) \
        if loaded.volumes else None
    try:
        observed = observe(node, loaded.volumes, ceph=False)
        plans = plan(loaded.volumes, observed, context(config, node), loaded.frozen_names,
                     release=[v.name for v in loaded.volumes])
    except BaseException:
        if connecting is not None:
            connecting.close()
        raise
    p = Pass(loaded, observed, plans)
    return p, apply(plans, {v.name: v for v in loaded.volumes}, observed, node,
                    claims_after=connecting)
