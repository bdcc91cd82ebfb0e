#!/usr/bin/env python3
"""P5: CreateVolume latency through the adapter, alone and 100 at once.

One daemon serves CSI on a unix socket (benchmarks/csi_bench.py) on a
disposable local cluster (parallel 4 workers, the default).

- alone: N CreateVolume calls one after another (64Mi each), each timed from
  the call to its answer (file written, engine pass, image created, status);
- concurrent: 100 CreateVolume calls started together from 100 threads; each
  call's latency and the wall time of the whole batch.

Every volume is deleted afterwards (DeleteVolume), untimed. The anchor is
ceph-csi's reported mean of about 2.35 s per CreateVolume under load.
Usage: .venv/bin/python benchmarks/p5_csi_create.py [--runs N] [--concurrent M]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from csi_bench import Bench, csi_daemon, figures


def timed_create(b: Bench, name: str, out: list[float], errors: list[str]) -> None:
    t0 = time.perf_counter()
    try:
        b.create(name)
    except Exception as exc:
        errors.append(f"{name}: {exc}")
        return
    out.append(time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--concurrent", type=int, default=100)
    args = ap.parse_args()
    alone: list[float] = []
    together: list[float] = []
    errors: list[str] = []
    with csi_daemon() as b:
        for i in range(args.runs):
            timed_create(b, f"p5-Alone-{i}", alone, errors)
        start = threading.Barrier(args.concurrent + 1)

        def one(i: int) -> None:
            start.wait()
            timed_create(b, f"p5-Together-{i}", together, errors)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(args.concurrent)]
        for t in threads:
            t.start()
        start.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        print(f"P5 CreateVolume alone:         {figures(alone)}")
        print(f"P5 CreateVolume, {args.concurrent} at once: {figures(together)}; "
              f"mean {sum(together) / max(1, len(together)):.2f} s, batch wall {wall:.2f} s "
              f"(anchor: ceph-csi mean ~2.35 s under load)")
        if errors:
            print(f"P5: {len(errors)} call(s) failed, e.g. {errors[0]}")
        print("P5: deleting every volume (untimed)...", flush=True)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
