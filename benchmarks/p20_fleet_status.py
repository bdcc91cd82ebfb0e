#!/usr/bin/env python3
"""P20: the fleet's reports in RADOS (issue 40): ``fleet status`` over 1,000
node reports, and what a node's report costs Ceph per interval.

On a disposable local cluster (1 mon + 1 memstore OSD), --reports (1,000)
synthetic reports are written into a namespace of their own (every health,
some held back, some held; three waves: 10 named canaries, a glob, the
rest). Then, --trials times each, interleaved:

- read_all: ``FleetStore.read_all()`` on a kept connection (what the daemon
  does every interval), and cold (a new store: connect, list, read);
- summary: ``plan.fleetstatus.summarize`` of what was read (pure);
- cli: ``rbd-reconciler fleet status -o json`` end to end (a fresh
  process: parse, config, git for fleet.yaml, connect, read, summarize);
- raw: ``rados -p P -N N ls`` alone, and the same listing followed by every
  object read in the same process with python-rados one after the other
  (the naive way); and once, ``rados ls`` + one ``rados get`` process per
  object (the shell way), for scale.

Then the cost of reporting: one store writes this node's report every
--interval seconds (each write bumps the counter, nothing else changes)
for --intervals intervals; the OSD's own op counters (``perf dump``: op,
op_r, op_w) before and after, beside an equal idle stretch with no writes
(what the cluster does by itself), say how many Ceph operations a report
costs per interval. Issue 40's goals, printed beside the figures (nothing
is asserted): fleet status of 1,000 reports <= 1 s; <= 2 Ceph operations
per interval when nothing changed.

Usage: .venv/bin/python benchmarks/p20_fleet_status.py [--reports 1000] [--trials 7]
       [--interval 1] [--intervals 10]
Needs root (the CLI does), git and the Ceph tools.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import cleanup, find_cli

from reconciler.drivers.fleetstore import FleetStore
from reconciler.facts.fleetreport import CONVERGING, FAILED, HEALTHY, Report
from reconciler.plan.fleetstatus import summarize
from reconciler.plan.rollout import Sighting
from reconciler.spec.config import CephConfig
from reconciler.spec.fleet import parse_fleet
from reconciler.testing.devcluster import DevCluster, start_cluster

NS = "bench-fleet"
GOAL_STATUS_S = 1.0
GOAL_OPS = 2
FLEET_YAML = """\
apiVersion: rbd-reconciler/v1
kind: Rollout
metadata: {name: bench}
spec:
  waves:
    - {name: canary, nodes: [%s]}
    - {name: early, nodes: ["edge-00*"]}
    - {name: rest, nodes: ["*"]}
  gate: {healthySeconds: 60, staleSeconds: 300}
"""


def synthetic(i: int, new: str, old: str) -> Report:
    node = f"edge-{i:04d}"
    at = datetime.now(UTC).isoformat(timespec="seconds")
    if i % 97 == 5:
        return Report(node=node, applied=new, health=FAILED, counter=i, written_at=at,
                      failed_volume=f"vol-{i}", failed_reason="refusing to shrink: 2Gi < 4Gi")
    if i < 10 or i % 3 == 0:
        return Report(node=node, applied=new, health=HEALTHY if i % 7 else CONVERGING,
                      counter=i, written_at=at, wave="canary" if i < 10 else "rest",
                      phases=(("Published", 12), ("Staged", 1)))
    return Report(node=node, applied=old, health=HEALTHY, counter=i, written_at=at,
                  held_back=new, held_back_why="waiting for wave early", held=i % 50 == 1,
                  hold_reason="maintenance" if i % 50 == 1 else None,
                  phases=(("Published", 13),))


def osd_ops(cluster: DevCluster) -> dict[str, int]:
    with cluster.client() as h:
        rc, out, err = h.osd_command(0, json.dumps({"prefix": "perf dump"}), b"")
    if rc != 0:
        raise RuntimeError(f"perf dump: {err}")
    osd = json.loads(out)["osd"]
    return {k: int(osd[k]) for k in ("op", "op_r", "op_w")}


def node_config(root: Path, cluster: DevCluster, canaries: list[str]) -> tuple[Path, str]:
    """A node config in the fleet, its mirror holding one verified commit
    with fleet.yaml (applied): what ``fleet status`` reads with git."""
    state = root / "state"
    state.mkdir()
    signers = root / "allowed_signers"
    signers.write_text("")
    config = root / "config.yaml"
    config.write_text(
        f"stateDir: {state}\nnodeName: edge-0000\ncontrolSocket: {state}/control.sock\n"
        f"ceph:\n  conf: {cluster.conf}\n  user: {cluster.user}\n  keyring: {cluster.keyring}\n"
        f"allowedRoots: [{root}]\nmapper: fuse\n"
        f"source:\n  url: file://{root}/remote.git\n  ref: {{branch: main}}\n"
        f"  path: nodes/{{nodeName}}\n"
        f"  verify: {{mode: head, format: ssh, allowedSignersFile: {signers}}}\n"
        f"  fleet: {{pool: {cluster.pool}, namespace: {NS}}}\n")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(root), "GIT_AUTHOR_NAME": "b",
           "GIT_AUTHOR_EMAIL": "b@b", "GIT_COMMITTER_NAME": "b", "GIT_COMMITTER_EMAIL": "b@b"}
    repo, work = state / "source" / "repo.git", root / "work"
    subprocess.run(["git", "init", "-q", "--bare", str(repo)], check=True, env=env)
    subprocess.run(["git", "init", "-q", str(work)], check=True, env=env)
    (work / "fleet.yaml").write_text(FLEET_YAML % ", ".join(canaries))
    git = ["git", "-C", str(work)]
    subprocess.run([*git, "add", "-A"], check=True, env=env)
    subprocess.run([*git, "commit", "-qm", "fleet"], check=True, env=env)
    subprocess.run([*git, "push", "-q", str(repo), "HEAD:refs/heads/main"], check=True, env=env)
    commit = subprocess.run([*git, "rev-parse", "HEAD"], check=True, env=env,
                            capture_output=True, text=True).stdout.strip()
    name = f"{commit}-{hashlib.sha256(b'nodes/edge-0000').hexdigest()[:8]}"
    (state / "source" / "revs").mkdir()
    (state / "source" / "revs" / f"{name}.json").write_text("{}")
    (state / "source" / "current").symlink_to(f"revs/{name}")
    return config, commit


def timed(fn: object) -> float:
    t0 = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - t0


def med(xs: list[float]) -> str:
    return f"median {statistics.median(xs) * 1000:8.1f} ms  (min {min(xs) * 1000:.1f}, " \
           f"max {max(xs) * 1000:.1f}, n={len(xs)})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reports", type=int, default=1000)
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--intervals", type=int, default=10)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="p20-"))
    cluster = None
    try:
        cluster = start_cluster()
        ceph = CephConfig(conf=str(cluster.conf), user=cluster.user, keyring=str(cluster.keyring))
        canaries = [f"edge-{i:04d}" for i in range(10)]
        config, new = node_config(root, cluster, canaries)
        old = "0" * 40
        rollout = parse_fleet((FLEET_YAML % ", ".join(canaries)).encode()).rollout
        assert rollout is not None
        env = {**cluster.client_env()}
        rados_base = ["rados", "-c", str(cluster.conf), "--id", cluster.user,
                      "--keyring", str(cluster.keyring), "-p", cluster.pool, "-N", NS]

        with FleetStore(ceph, cluster.pool, NS) as store:
            t0 = time.perf_counter()
            for i in range(args.reports):
                store.write(synthetic(i, new, old))
            wrote = time.perf_counter() - t0
        print(f"wrote {args.reports} reports (sync write_full each, one connection): "
              f"{wrote:.2f} s")

        cli = find_cli()
        # As installed: the bytecode cached (the warm-up writes it).
        cli_env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        warm = FleetStore(ceph, cluster.pool, NS)
        got = warm.read_all()
        assert len(got.reports) == args.reports and not got.problems, got.problems[:3]
        subprocess.run([str(cli), "--config", str(config), "fleet", "status", "-o", "json"],
                       check=True, capture_output=True, env=cli_env)  # warm-up

        def summary() -> None:
            now = time.monotonic()
            summarize(rollout, {n: Sighting(r, now, now) for n, r in got.reports.items()},
                      now, datetime.now(UTC))

        def cold() -> None:
            with FleetStore(ceph, cluster.pool, NS) as s:  # type: ignore[union-attr]
                s.read_all()

        def cli_json() -> None:
            out = subprocess.run([str(cli), "--config", str(config), "fleet", "status", "-o",
                                  "json"], check=True, capture_output=True, env=cli_env).stdout
            assert len(json.loads(out)["nodes"]) == args.reports

        def raw_ls() -> None:
            subprocess.run([*rados_base, "ls"], check=True, capture_output=True, env=env)

        def raw_naive() -> None:
            with cluster.client() as h, h.open_ioctx(cluster.pool) as io:  # type: ignore[union-attr]
                io.set_namespace(NS)
                for obj in list(io.list_objects()):
                    io.read(obj.key, 16385, 0)

        results: dict[str, list[float]] = {k: [] for k in (
            "read_all (kept connection)", "read_all (cold: connect too)",
            "summarize (pure)", "read_all + summarize", "cli fleet status -o json",
            "raw: rados ls (one process)", "raw: list + sequential reads (python-rados)")}
        for _ in range(args.trials):
            ra = timed(warm.read_all)
            results["read_all (kept connection)"].append(ra)
            su = timed(summary)
            results["summarize (pure)"].append(su)
            results["read_all + summarize"].append(ra + su)
            results["read_all (cold: connect too)"].append(timed(cold))
            results["cli fleet status -o json"].append(timed(cli_json))
            results["raw: rados ls (one process)"].append(timed(raw_ls))
            results["raw: list + sequential reads (python-rados)"].append(timed(raw_naive))
        warm.close()

        names = subprocess.run([*rados_base, "ls"], check=True, capture_output=True, env=env,
                               text=True).stdout.split()
        t0 = time.perf_counter()
        subprocess.run([*rados_base, "ls"], check=True, capture_output=True, env=env)
        for name in names:
            subprocess.run([*rados_base, "get", name, "-"], check=True, capture_output=True,
                           env=env)
        shell = time.perf_counter() - t0

        print(f"\n{args.reports} reports, {args.trials} trials each:")
        for label, xs in results.items():
            print(f"  {label:46s} {med(xs)}")
        print(f"  {'raw: rados ls + one rados get per object':46s} {shell * 1000:8.1f} ms (once)")
        m = {k: statistics.median(v) for k, v in results.items()}
        print("\nratios (median / median):")
        print(f"  read_all + summarize vs rados ls alone:          "
              f"{m['read_all + summarize'] / m['raw: rados ls (one process)']:.2f}x")
        naive = m["raw: list + sequential reads (python-rados)"]
        print(f"  read_all vs list + sequential reads:             "
              f"{m['read_all (kept connection)'] / naive:.2f}x")
        print(f"  cli fleet status -o json vs rados ls + gets:     "
              f"{m['cli fleet status -o json'] / shell:.3f}x")
        print(f"  goal: fleet status of {args.reports} reports <= {GOAL_STATUS_S:.0f} s: "
              f"read_all + summarize {m['read_all + summarize']:.3f} s, "
              f"the CLI end to end {m['cli fleet status -o json']:.3f} s")

        # -- what a node's report costs per interval when nothing changes ----
        mine = synthetic(0, new, old)
        with FleetStore(ceph, cluster.pool, NS) as store:
            store.write(mine)  # connected, and the first write done
            time.sleep(args.interval)
            idle0 = osd_ops(cluster)
            time.sleep(args.interval * args.intervals)  # the cluster by itself
            idle1 = osd_ops(cluster)
            for k in range(args.intervals):
                store.write(replace(mine, counter=mine.counter + 1 + k))
                time.sleep(args.interval)
            busy = osd_ops(cluster)
            connects = store.connects
        # Each osd_ops() reads the counters through a connection of its own:
        # its perf dump is an OSD command, not an op, so it is not counted.
        base = {k: idle1[k] - idle0[k] for k in idle0}
        spent = {k: busy[k] - idle1[k] - base[k] for k in idle0}
        per = {k: v / args.intervals for k, v in spent.items()}
        print(f"\nreporting, {args.intervals} intervals of {args.interval:g} s, one kept "
              f"connection ({connects} connect):")
        print(f"  the cluster idle, no writes:   {base}")
        print(f"  with one report per interval: "
              f"{ {k: busy[k] - idle1[k] for k in idle0} }")
        print(f"  per interval, the idle stretch subtracted: op {per['op']:.2f} "
              f"(reads {per['op_r']:.2f}, writes {per['op_w']:.2f}); goal <= {GOAL_OPS}")
        return 0
    finally:
        code = cleanup(root, cluster)
        if code:
            print("p20: cleanup left something behind", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
