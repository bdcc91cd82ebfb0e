#!/usr/bin/env python3
"""P21: a fleet's rollout end to end (issue 40): six daemons in three waves
(two nodes each) on one machine and one disposable cluster, each with its
own Ceph user and the reports in a pool of their own (the cluster tests'
rig, tests/cluster/fleet_rig.py), the gate --healthy seconds, the source's
interval 1 s.

- rollout, --runs times: a signed commit growing every node's image-only
  volume by 1 MiB. From the push's return, per wave: when its nodes applied
  it (their source's ``current`` link made) and when their reports said it
  Healthy (the first report read that says so; its writer's clock), beside
  the floor: wave k (from 0) applies no sooner than k x healthySeconds
  after the push, and each wave needs a sync to notice (up to an interval
  each): k x healthySeconds + (k + 1) x interval. The whole rollout's floor
  is 2 x healthySeconds + 3 intervals to the last wave's apply (the brief's
  "3 x healthySeconds + sync intervals" counts a third gate, which nothing
  waits for after the last wave: printed too).
- halt, --halt-runs times: a signed commit shrinking one canary's image
  (refused: never shrink) halts the rollout; printed: how many nodes outside
  wave 1 applied it (the goal: 0) over 3 x (gate + interval) after every
  later node saw it Halted, and how long that took from the push. Each is
  followed by an untimed fix-forward commit that rolls through.

Image-only volumes have no Published phase: "done" is the report's
Healthy (every volume of the revision converged). Nothing is asserted.

Usage: .venv/bin/python benchmarks/p21_rollout.py [--runs 3] [--halt-runs 3] [--healthy 3]
Needs root (the daemons do), git, ssh-keygen and the Ceph tools.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "tests"), str(HERE.parent / "tests" / "cluster")]

from conftest import _remove_with_snapshots, new_node  # noqa: E402
from fleet_rig import INTERVAL_S, Fleet, fleet_rig, fleet_yaml  # noqa: E402

from reconciler.drivers.fleetstore import FleetStore  # noqa: E402
from reconciler.facts.fleetreport import HEALTHY  # noqa: E402
from reconciler.spec.config import CephConfig  # noqa: E402
from reconciler.testing.devcluster import start_cluster  # noqa: E402

SIX = [["n1a", "n1b"], ["n2a", "n2b"], ["n3a", "n3b"]]
DEADLINE_S = 180


def grown(fleet: Fleet, size_mi: int) -> dict[str, str]:
    return {p: t.replace("size: 1Mi", f"size: {size_mi}Mi") for p, t in fleet.files().items()}


def watch(fleet: Fleet, store: FleetStore, commit: str) -> tuple[dict[str, float],
                                                                 dict[str, float]]:
    """Wall times at which each node applied ``commit`` and first reported it Healthy."""
    applied: dict[str, float] = {}
    healthy: dict[str, float] = {}
    end = time.monotonic() + DEADLINE_S
    while len(healthy) < len(fleet.names):
        if time.monotonic() > end:
            raise RuntimeError(f"not every node reported {commit[:12]} Healthy within "
                               f"{DEADLINE_S} s: {sorted(healthy)}")
        for n, r in store.read_all().reports.items():
            if n not in healthy and r.applied == commit and r.health == HEALTHY:
                healthy[n] = datetime.fromisoformat(r.written_at).timestamp()
        for n in fleet.names:
            if n not in applied and fleet.applied(n) == commit:
                applied[n] = fleet.applied_at(n)
        time.sleep(0.05)  # polling what the daemons write
    return applied, healthy


def rollout_run(fleet: Fleet, store: FleetStore, size_mi: int,
                rows: list[list[tuple[float, float]]]) -> None:
    commit = fleet.repo.push(f"grow to {size_mi}Mi", grown(fleet, size_mi))
    pushed = time.time()
    applied, healthy = watch(fleet, store, commit)
    row = []
    for wave in fleet.waves:
        row.append((max(applied[n] for n in wave) - pushed,
                    max(healthy[n] for n in wave) - pushed))
    rows.append(row)
    print("  rollout: " + "; ".join(f"wave {k + 1} applied {a:5.2f} s, Healthy {h:5.2f} s"
                                    for k, (a, h) in enumerate(row)), flush=True)


def halt_run(fleet: Fleet, store: FleetStore, size_mi: int, healthy_s: int
             ) -> tuple[int, float]:
    """A shrink of the canary at ``size_mi`` - 1: (nodes outside wave 1
    that applied it, seconds until every later node saw it Halted)."""
    canary = fleet.waves[0][0]
    files = grown(fleet, size_mi)
    path = f"nodes/{canary}/anchor.yaml"
    bad = fleet.repo.push("shrink the canary",
                          {path: files[path].replace(f"size: {size_mi}Mi",
                                                     f"size: {size_mi - 1}Mi")})
    pushed = time.monotonic()
    later = [n for w in fleet.waves[1:] for n in w]
    end = pushed + DEADLINE_S
    while not all(fleet.held_back(n).get("state") == "Halted" and
                  fleet.held_back(n).get("commit") == bad for n in later):
        if time.monotonic() > end:
            raise RuntimeError("the later waves did not see the halt within "
                               f"{DEADLINE_S} s")
        time.sleep(0.05)
    halted = time.monotonic() - pushed
    reached: set[str] = set()
    until = time.monotonic() + 3 * (healthy_s + INTERVAL_S)
    while time.monotonic() < until:
        reached |= {n for n in later if fleet.applied(n) == bad}
        time.sleep(0.2)
    print(f"  halt: {len(reached)} of {len(later)} nodes outside wave 1 applied it; all saw "
          f"it halted {halted:.2f} s after the push", flush=True)
    return len(reached), halted


def summary(label: str, xs: list[float], floor: float) -> str:
    return (f"{label}: median {statistics.median(xs):6.2f} s, max {max(xs):6.2f} s; "
            f"floor {floor:5.2f} s; median over floor {statistics.median(xs) - floor:+.2f} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--halt-runs", type=int, default=3)
    ap.add_argument("--healthy", type=int, default=3, help="the gate's healthySeconds")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="p21-"))
    cluster = start_cluster()
    node = None
    try:
        (root / "fleet").mkdir()
        node = new_node(root / "fleet", cluster)
        admin = CephConfig(conf=str(cluster.conf), user=cluster.user,
                           keyring=str(cluster.keyring))
        with fleet_rig(node, root / "fleet", cluster, SIX) as fleet, \
                FleetStore(admin, fleet.pool) as store:
            yaml = fleet_yaml(fleet.waves, healthy=args.healthy)
            print(f"6 daemons, waves {fleet.waves}, healthySeconds {args.healthy}, "
                  f"interval {INTERVAL_S} s", flush=True)
            first = fleet.repo.push("the fleet", {**fleet.files(), "fleet.yaml": yaml})
            watch(fleet, store, first)  # untimed: the daemons' first revision
            size, rows, halts = 1, [], []
            for _ in range(args.runs):
                size += 1
                rollout_run(fleet, store, size, rows)
            for _ in range(args.halt_runs):
                halts.append(halt_run(fleet, store, size, args.healthy))
                size += 1  # fix forward: untimed
                watch(fleet, store, fleet.repo.push("fix", grown(fleet, size)))
            print(f"\nrollout over {args.runs} runs (from the push's return):")
            for k in range(len(fleet.waves)):
                floor = k * args.healthy + (k + 1) * INTERVAL_S
                print("  " + summary(f"wave {k + 1} applied", [r[k][0] for r in rows], floor))
                print("  " + summary(f"wave {k + 1} Healthy", [r[k][1] for r in rows], floor))
            last = [r[-1][1] for r in rows]
            brief = 3 * args.healthy + 3 * INTERVAL_S
            print(f"  every node Healthy: median {statistics.median(last):.2f} s; the brief's "
                  f"floor 3 x {args.healthy} + 3 x {INTERVAL_S} = {brief} s")
            if halts:
                print(f"halted rollouts: {args.halt_runs} runs; nodes outside wave 1 reached: "
                      f"{[h[0] for h in halts]} (goal 0); halt seen by all later nodes after "
                      f"median {statistics.median(h[1] for h in halts):.2f} s")
    finally:
        if node is not None:
            with cluster.client() as c, c.open_ioctx(cluster.pool) as io:
                for name in sorted(node.images):
                    with contextlib.suppress(Exception):
                        _remove_with_snapshots(io, name)
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
