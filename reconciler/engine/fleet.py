"""``fleet status`` read directly: every node's report from RADOS
(drivers/fleetstore.py), each revision's fleet.yaml from this node's source
mirror (source/fleetfile.py; only of revisions this node verified: a
report may name any commit), summed up by plan/fleetstatus.py.

Which fleet.yaml: each revision in the reports is judged by its own
fleet.yaml (a revision's waves are the ones it was signed with); the node
rows are placed by the newest revision this node verified (the one it
holds back, else the one it applies). A revision the mirror does not hold,
or whose fleet.yaml cannot be used, is judged by that same policy and said
so in the problems. No fleet.yaml: no waves (every node applies at once).

``fleet_status`` has seen every report once (``observed_for`` 0): no
report is stale to it and no node has been healthy for any time yet, as a
daemon just started sees them: the command's read when no daemon answers.
A running daemon keeps its sightings: ``summary_of`` is the same summary
from them (its answer to ``fleet status``, daemon/rollout.py).

Imported by cli/fleet.py (the front door; the names it re-exports are the
CLI's way to the document and its words) and daemon/rollout.py.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from reconciler.drivers.fleetstore import FleetRead, FleetStore
from reconciler.drivers.fleetstore import FleetUnavailable as FleetUnavailable
from reconciler.drivers.run import CommandError, Runner
from reconciler.facts.fleetreport import Report
from reconciler.plan.fleetstatus import FleetSummary as FleetSummary
from reconciler.plan.fleetstatus import document as document
from reconciler.plan.fleetstatus import summarize
from reconciler.plan.rollout import Sighting
from reconciler.source.fleetfile import read_fleet
from reconciler.source.gitenv import Git
from reconciler.source.layout import Layout
from reconciler.source.outcome import Failed, rev_name
from reconciler.spec.config import Config
from reconciler.spec.fleet import Rollout
from reconciler.spec.source import SourceFleet

GIT_TIMEOUT_S = 10.0


class NotInFleet(Exception):
    """The node config names no fleet (``source.fleet``)."""


def fleet_status(config: Config, store: FleetStore | None = None) -> FleetSummary:
    """One read of every report, summed up. NotInFleet without
    ``source.fleet``; FleetUnavailable when Ceph does not answer."""
    src = in_fleet(config)
    own = store is None
    store = store or FleetStore(config.ceph, src.pool, src.namespace)
    try:
        read = store.read_all()
    finally:
        if own:
            store.close()
    now_mono = time.monotonic()
    seen = {node: Sighting(r, now_mono, now_mono) for node, r in read.reports.items()}
    return summary_of(config, seen, now_mono, observed_for=0.0, problems=problems_of(read))


def problems_of(read: FleetRead) -> tuple[str, ...]:
    """A read's problems, led by one saying so when its listing was cut."""
    cut = () if read.complete else (
        "not every report was read (the listing stopped, see below): nodes not reached are "
        "not shown, and a gate shown passing may not; the daemons' gates wait meanwhile",)
    return cut + read.problems


def in_fleet(config: Config) -> SourceFleet:
    """The node config's ``source.fleet``; NotInFleet without one."""
    src = config.git
    if src is None or src.fleet is None:
        raise NotInFleet("the node config has no source.fleet (source.fleet.pool: the pool "
                         "holding the fleet's reports; docs/fleets.md)"
                         if src is not None else
                         "the node config has no source: (a fleet follows a git "
                         "repository; source.fleet.pool names the pool of its reports)")
    return src.fleet


def summary_of(config: Config, seen: Mapping[str, Sighting], now_mono: float, *,
               observed_for: float | None, problems: tuple[str, ...] = ()) -> FleetSummary:
    """The summary of reports as a reader saw them (``seen``, on its own
    monotonic clock; ``observed_for``: how long it has been reading them):
    this one read's, or the running daemon's sightings (its answer to
    ``fleet status``), each revision judged by its own fleet.yaml."""
    rollout, rollouts, more = _policies(config, [s.report for s in seen.values()])
    return summarize(rollout, seen, now_mono, datetime.now(UTC), rollouts=rollouts,
                     observed_for=observed_for, problems=more + problems)


def _policies(config: Config, reports: list[Report]
              ) -> tuple[Rollout | None, dict[str, Rollout | None], tuple[str, ...]]:
    """The policy the node rows are placed by, each revision's own, and
    what could not be read (one line each)."""
    src = config.git
    assert src is not None
    layout = Layout(config.source_dir)
    git = Git(src, config.source_dir, Runner(timeout=GIT_TIMEOUT_S))
    node_path = src.node_path(config.node_name)
    problems: list[str] = []
    cache: dict[str, Rollout | str | None] = {}  # commit -> rollout, or why not

    def policy(commit: str) -> Rollout | str | None:
        if commit not in cache and not layout.meta_file(rev_name(commit, node_path)).exists():
            # A report may name any commit: only what this node verified is read.
            cache[commit] = "not a revision this node verified"
        if commit not in cache:
            try:
                cache[commit] = read_fleet(git, commit, src.max_file_bytes)
            except Failed as exc:
                cache[commit] = f"its fleet.yaml cannot be used: {exc.message}"
            except (CommandError, OSError):
                cache[commit] = "this node's mirror does not hold it"
        return cache[commit]

    mine = _newest_verified(layout)
    base = policy(mine) if mine is not None else None
    if isinstance(base, str):
        problems.append(f"{mine}: {base}; shown without waves")
        base = None
    rollouts: dict[str, Rollout | None] = {}
    commits = sorted({c for r in reports
                      for c in (r.applied, r.held_back) if c is not None})
    for commit in commits:
        got = policy(commit)
        if isinstance(got, str):
            if commit != mine:
                problems.append(f"{commit[:12]}: {got}; judged by "
                                + (f"{mine[:12]}'s fleet.yaml" if mine else "no fleet.yaml"))
            got = base
        rollouts[commit] = got
    return base, rollouts, tuple(problems)


def _newest_verified(layout: Layout) -> str | None:
    """The revision this node holds back (verified, not applied yet), else
    the one it applies; None: it has applied none."""
    state: dict[str, Any] = layout.read_state()
    held = state.get("heldBack")
    if isinstance(held, dict) and isinstance(held.get("commit"), str):
        return held["commit"]
    applied = layout.applied()
    return applied["commit"] if applied is not None else None
