#!/usr/bin/env python3
"""P22: what being in a fleet costs an idle node (issue 40).

Two nodes follow one signed repository (p18_source's Run: a disposable
local cluster, a file:// remote, ssh-signed commits), each with --volumes
image-only volumes under nodes/<name>/, the same intervalSeconds and
resync. The repository's root holds a fleet.yaml (one wave naming every
node). One node is in the fleet (``source.fleet`` on the cluster's pool:
it writes its report every interval and reads nobody's while nothing is
held back); the other has no ``source.fleet`` (today's node: it checks
fleet.yaml and applies at once). Both converge, then idle for --idle s,
--rounds times; each round reads each daemon's CPU seconds (its own and
its reaped children's: /proc/PID/stat) over the same window.

Printed: CPU-s a minute of each node, and the difference (the fleet's
cost). Goal (issue 40): within +0.01 CPU-s/min of the node in no fleet.
Nothing is asserted.

Usage: .venv/bin/python benchmarks/p22_fleet_idle.py [--idle S] [--rounds N]
       [--interval S] [--volumes N]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import BenchError, cpu_seconds, create_images, signals_ignored, signals_raise
from p18_source import HEAD, Run, cleanup

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from source_signing import Signing, bare_repository, source_yaml

from reconciler.drivers.reaper import become_subreaper
from reconciler.testing.devcluster import DevCluster, start_cluster

FLEET_YAML = """\
apiVersion: rbd-reconciler/v1
kind: Rollout
metadata: {name: p22}
spec:
  waves:
    - {name: all, nodes: ["*"]}
  gate: {healthySeconds: 5, maxUnhealthy: 0, staleSeconds: 300}
"""
NODES = ("p22-fleet", "p22-plain")


def run(r: Run, volumes: int, interval: float, idle: float, rounds: int
        ) -> dict[str, list[float]]:
    names = {n: [f"{n}-{j:03}" for j in range(volumes)] for n in NODES}
    create_images(r.cluster, [v for vs in names.values() for v in vs], 4 << 20)
    url = bare_repository(r.root / "p22.git")
    files: dict[str, str | None] = {"fleet.yaml": FLEET_YAML}
    for n, vs in names.items():
        files.update({f"nodes/{n}/{v}.yaml": HEAD.format(name=v, pool=r.cluster.pool,
                                                          size="4Mi") for v in vs})
    r.push(url, "p22: a fleet of two", files)
    fleet = f"  fleet: {{pool: {r.cluster.pool}}}\n"
    nodes = {"p22-fleet": r.start("p22-fleet", _source(r, url, interval, fleet)),
             "p22-plain": r.start("p22-plain", _source(r, url, interval, ""))}
    for n, node in nodes.items():
        node.wait_phase(names[n], "Created")
    print(f"p22: 2 nodes x {volumes} volumes converged; {rounds} round(s) of {idle:.0f} s",
          flush=True)
    per_min: dict[str, list[float]] = {n: [] for n in NODES}
    for i in range(rounds):
        before = {n: cpu_seconds(node.daemon.proc.pid, children=True)
                  for n, node in nodes.items()}
        end = time.monotonic() + idle
        while time.monotonic() < end:  # the window itself; the daemons must stay up
            for node in nodes.values():
                node.daemon.check_alive()
            time.sleep(0.5)
        for n, node in nodes.items():
            used = cpu_seconds(node.daemon.proc.pid, children=True) - before[n]
            per_min[n].append(used * 60 / idle)
        print(f"  round {i + 1}: " + ", ".join(f"{n} {per_min[n][-1]:.4f} CPU-s/min"
                                             for n in NODES), flush=True)
    return per_min


def _source(r: Run, url: str, interval: float, more: str) -> str:
    """The node's ``source:`` (``more``: keys under it), resync 60 s."""
    return source_yaml(url, r.allowed, interval) + more + "resyncSeconds: 60\n"


def report(per_min: dict[str, list[float]], interval: float) -> None:
    f, p = (statistics.median(per_min[n]) for n in NODES)
    print(f"\np22: idle CPU, interval {interval:g} s (median of {len(per_min[NODES[0]])} rounds):")
    print(f"  in a fleet (source.fleet)  {f:.4f} CPU-s/min")
    print(f"  in no fleet                {p:.4f} CPU-s/min")
    print(f"  the fleet's cost           {f - p:+.4f} CPU-s/min (goal <= +0.01)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--idle", type=float, default=120.0, help="each round's window, s (120)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds (3)")
    ap.add_argument("--interval", type=float, default=60.0, help="intervalSeconds (60)")
    ap.add_argument("--volumes", type=int, default=20, help="volumes a node (20)")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("p22_fleet_idle: needs root", file=sys.stderr)
        return 2
    become_subreaper()
    root = Path(tempfile.mkdtemp(prefix="rbd-bench-p22-"))
    cluster: DevCluster | None = None
    r: Run | None = None
    rc = 1
    with signals_raise(), contextlib.ExitStack() as stack:
        try:
            cluster = start_cluster(root=root / "ceph")
            (root / "srv").mkdir(mode=0o755)
            signer = stack.enter_context(Signing(root / "signer"))
            r = Run(root, cluster, signer, signer.ssh_key("ops"))
            report(run(r, args.volumes, args.interval, args.idle, args.rounds), args.interval)
            rc = 0
        except (BenchError, subprocess.TimeoutExpired, OSError, ValueError, KeyError) as e:
            print(f"p22_fleet_idle: {e!r}", file=sys.stderr)
        except KeyboardInterrupt:
            print("\np22_fleet_idle: interrupted; cleaning up", file=sys.stderr)
            rc = 130
        finally:
            with signals_ignored():
                rc = cleanup(root, cluster, r) or rc
    return rc


if __name__ == "__main__":
    sys.exit(main())
