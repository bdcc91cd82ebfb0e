#!/usr/bin/env python3
"""P11: CSI CreateVolume against `rbd create`, alone and 50 at once, in one run.

One daemon serves CSI on a unix socket (benchmarks/csi_bench.py, parallel 4)
on a disposable local cluster. Interleaved, pairwise:

- alone (--runs pairs): one CreateVolume (64 MiB) timed from the call to its
  answer (volume file written, engine pass, image created, name recorded),
  then one `rbd create` of a 64 MiB image with the same features, as a
  command (a process start, a librados connect, the create);
- at once (--rounds pairs): --concurrent CreateVolume calls released together
  from as many threads, then as many `rbd create` processes started together;
  the batch's wall time and each call's latency.

Printed: medians, the median of the paired ratios (alone) and the ratio of
the batch walls (at once), against the goal (issue 17: <= 1.3). Every volume
is deleted afterwards (DeleteVolume) and every raw image removed, untimed.

Usage: .venv/bin/python benchmarks/p11_csi_create_vs_rbd.py [--runs 21]
       [--concurrent 50] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from csi_bench import Bench, csi_daemon
from harness import FEATURES, run

GOAL = 1.3
SIZE = "64M"  # the 64 MiB each CreateVolume asks for


def rbd_argv(b: Bench, conf: str, name: str) -> list[str]:
    return ["rbd", "-c", conf, "create", "--size", SIZE,
            *(x for f in FEATURES for x in ("--image-feature", f)), f"{b.pool}/{name}"]


def csi_once(b: Bench, name: str) -> float:
    t0 = time.perf_counter()
    b.create(name)
    return time.perf_counter() - t0


def rbd_once(b: Bench, conf: str, name: str, made: list[str]) -> float:
    t0 = time.perf_counter()
    run(rbd_argv(b, conf, name))
    t = time.perf_counter() - t0
    made.append(name)
    return t


def csi_batch(b: Bench, tag: str, n: int) -> tuple[float, list[float]]:
    lat: list[float] = []
    errors: list[str] = []
    start = threading.Barrier(n + 1)

    def one(i: int) -> None:
        start.wait()
        try:
            lat.append(csi_once(b, f"{tag}-{i}"))
        except Exception as exc:
            errors.append(f"{tag}-{i}: {exc}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} CreateVolume call(s) failed, e.g. {errors[0]}")
    return wall, lat


def rbd_batch(b: Bench, conf: str, tag: str, n: int, made: list[str]
              ) -> tuple[float, list[float]]:
    t0 = time.perf_counter()
    procs = [(subprocess.Popen(rbd_argv(b, conf, f"{tag}-{i}"), stdin=subprocess.DEVNULL,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE), f"{tag}-{i}")
             for i in range(n)]
    lat = []
    for p, name in procs:
        _, err = p.communicate(timeout=300)
        lat.append(time.perf_counter() - t0)  # when it was seen done; all started at t0
        if p.returncode:
            raise RuntimeError(f"rbd create {name}: {err.decode(errors='replace')}")
        made.append(name)
    return time.perf_counter() - t0, lat


def ms(x: float) -> str:
    return f"{x * 1000:.1f} ms"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=21)
    ap.add_argument("--concurrent", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    made: list[str] = []
    with csi_daemon() as b:
        conf = _conf_of(b)
        try:
            csi_once(b, "p11-warm")
            rbd_once(b, conf, "p11-warmraw", made)
            alone_csi, alone_rbd = [], []
            for i in range(args.runs):
                alone_csi.append(csi_once(b, f"p11-alone-{i}"))
                alone_rbd.append(rbd_once(b, conf, f"p11-rbd-alone-{i}", made))
            walls_csi, walls_rbd, lat_csi, lat_rbd = [], [], [], []
            for r in range(args.rounds):
                w, lat = csi_batch(b, f"p11-batch{r}", args.concurrent)
                walls_csi.append(w)
                lat_csi += lat
                w, lat = rbd_batch(b, conf, f"p11-rbd-batch{r}", args.concurrent, made)
                walls_rbd.append(w)
                lat_rbd += lat
                print(f"round {r + 1}: {args.concurrent} CreateVolume at once "
                      f"{ms(walls_csi[-1])}, {args.concurrent} rbd create at once "
                      f"{ms(walls_rbd[-1])}", flush=True)
            ratios = [c / r for c, r in zip(alone_csi, alone_rbd, strict=True)]
            ra = statistics.median(ratios)
            print(f"\nP11 alone (n={args.runs}): CreateVolume median "
                  f"{ms(statistics.median(alone_csi))} vs rbd create "
                  f"{ms(statistics.median(alone_rbd))}: median paired ratio "
                  f"{ra:.2f} (min {min(ratios):.2f}, max {max(ratios):.2f}); goal <= {GOAL}: "
                  f"{'met' if ra <= GOAL else 'NOT met'}")
            rw = statistics.median(walls_csi) / statistics.median(walls_rbd)
            print(f"P11 {args.concurrent} at once ({args.rounds} rounds): batch wall median "
                  f"{ms(statistics.median(walls_csi))} vs {ms(statistics.median(walls_rbd))}: "
                  f"ratio {rw:.2f}; goal <= {GOAL}: {'met' if rw <= GOAL else 'NOT met'}; "
                  f"per-call latency median {ms(statistics.median(lat_csi))} vs "
                  f"{ms(statistics.median(lat_rbd))}")
        finally:
            for name in made:
                run(["rbd", "-c", conf, "rm", "--no-progress", f"{b.pool}/{name}"], check=False)
        print("P11: deleting every volume (untimed)...", flush=True)
    return 0


def _conf_of(b: Bench) -> str:
    """The cluster's ceph.conf, as the daemon's config names it."""
    for line in (b.root / "config.yaml").read_text().splitlines():
        if line.strip().startswith("conf:"):
            return line.split(":", 1)[1].strip()
    raise RuntimeError("no ceph conf in the bench config")


if __name__ == "__main__":
    sys.exit(main())
