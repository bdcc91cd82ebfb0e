#!/usr/bin/env python3
"""P7: N new volumes in one `apply` (parallel: 4) vs the serial raw sequence.

For each N (default 20 and 50), interleaved --rounds times on one disposable
local cluster:

- apply: `rbd-reconciler apply DIR` (CLI subprocess, config `parallel: 4`)
  over N fresh Volume files (64 MiB, fuse, ext4, one publish target);
- shell: for each of N fresh images, one after another, P1's plain sequence
  (rbd create, rbd-fuse, losetup --direct-io=on, mkfs.ext4, mount, mount --bind).

Printed: both times and the ratio apply/shell (goal <= 0.6). Teardown after
each run (untimed): `release` for apply, a sweep for the shell; the images
live in the memstore OSD's RAM and go with the cluster, stopped at the end
(also on Ctrl-C).

Usage: .venv/bin/python benchmarks/p7_apply_many.py [--sizes 20,50] [--rounds 1]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from harness import (  # noqa: E402
    SHELL_SEQUENCE,
    BenchError,
    find_cli,
    run,
    signals_ignored,
    signals_raise,
    sweep,
)

from reconciler.drivers.reaper import become_subreaper, reap_zombies  # noqa: E402
from reconciler.testing.devcluster import start_cluster  # noqa: E402

GOAL = 0.6
VOLUME = """\
apiVersion: rbd-reconciler/v1
kind: Volume
metadata:
  name: {name}
spec:
  image:
    pool: {pool}
    size: 256Mi
    features: [layering, exclusive-lock, object-map, fast-diff, deep-flatten]
  map:
    mapper: fuse
  stage:
    fsType: ext4
  publish:
    - path: {target}
"""
CONFIG = """\
desiredDir: {desired}
stateDir: {state}
controlSocket: {state}/control.sock
nodeName: p7-bench
ceph:
  conf: {conf}
  user: {user}
  keyring: {keyring}
allowedRoots: [{pub}]
parallel: {parallel}
"""


def apply_run(root: Path, cli: Path, cfg: Path, pool: str, tag: str, n: int) -> float:
    desired = root / "desired" / tag
    desired.mkdir(parents=True)
    for i in range(n):
        name = f"{tag}-{i:03d}"
        (desired / f"{name}.yaml").write_text(
            VOLUME.format(name=name, pool=pool, target=root / "pub" / name))
    t0 = time.perf_counter()
    r = run([str(cli), "--config", str(cfg), "apply", str(desired)], timeout=3600, check=False)
    elapsed = time.perf_counter() - t0
    if r.returncode != 0 or f"changed={n}" not in r.stdout:
        raise BenchError(f"apply failed:\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
    run([str(cli), "--config", str(cfg), "release", str(desired)], timeout=3600)
    return elapsed


def shell_run(root: Path, conf: str, pool: str, tag: str, n: int) -> float:
    base = root / "shell"
    t0 = time.perf_counter()
    for i in range(n):
        name = f"{tag}-{i:03d}"
        r = subprocess.run(["bash", "-c", SHELL_SEQUENCE, "p7-shell", conf, pool, name,
                            str(base / "fuse" / name), str(base / "staging" / name),
                            str(base / "pub" / name), str(base / f"{name}.log")],
                           capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600)
        if r.returncode != 0:
            raise BenchError(f"shell sequence failed:\n{r.stdout}{r.stderr}")
    elapsed = time.perf_counter() - t0
    problems = sweep(base)
    if problems:
        raise BenchError("; ".join(problems))
    return elapsed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="20,50")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--parallel", type=int, default=4)
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("needs root", file=sys.stderr)
        return 1
    become_subreaper()
    root = Path(tempfile.mkdtemp(prefix="p7-"))
    os.chmod(root, 0o755)
    cluster, cli = None, find_cli()
    results: dict[int, list[tuple[float, float]]] = {}
    try:
        with signals_raise():
            cluster = start_cluster(root=root / "ceph", memstore_bytes=4 << 30)
            for d in ("desired", "state", "pub", "shell"):
                (root / d).mkdir(mode=0o755)
            cfg = root / "config.yaml"
            cfg.write_text(CONFIG.format(desired=root / "desired", state=root / "state",
                                         conf=cluster.conf, user=cluster.user,
                                         keyring=cluster.keyring, pub=root / "pub",
                                         parallel=args.parallel))
            k = 0
            for rnd in range(args.rounds):
                for n in (int(x) for x in args.sizes.split(",")):
                    k += 1
                    a = apply_run(root, cli, cfg, cluster.pool, f"a{k}", n)
                    s = shell_run(root, str(cluster.conf), cluster.pool, f"s{k}", n)
                    results.setdefault(n, []).append((a, s))
                    print(f"round {rnd + 1} N={n}: apply {a:.2f} s, serial shell {s:.2f} s, "
                          f"ratio {a / s:.2f}", flush=True)
    except KeyboardInterrupt:
        print("interrupted; cleaning up", file=sys.stderr)
    finally:
        with signals_ignored():
            problems = sweep(root)
            reap_zombies()
            if cluster is not None:
                cluster.stop()
            if problems:
                print("cleanup problems: " + "; ".join(problems), file=sys.stderr)
    for n, runs in results.items():
        a = sum(x[0] for x in runs) / len(runs)
        s = sum(x[1] for x in runs) / len(runs)
        print(f"N={n}: apply (parallel {args.parallel}) {a:.2f} s vs serial shell {s:.2f} s: "
              f"ratio {a / s:.2f} (goal <= {GOAL}: {'met' if a / s <= GOAL else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
