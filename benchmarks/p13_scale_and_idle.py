#!/usr/bin/env python3
"""P13: what a pass costs beside many volumes — a new file to Published with
0, 200 (and, with --max 1000, 1,000) other volumes present, and the idle
daemon's CPU and memory with 200.

The other volumes are image-only (an image of 4 MiB each, no map, no stage:
what every CSI volume is until it is staged); mapped ones would need a
rbd-fuse helper and a loop device each, too many for this machine. Their
images are made with the rbd binding before their files are written.

One `rbd-reconciler run` (resyncSeconds 60, the default) on a disposable
local cluster. For each size: the others are added and converged, then per
trial a new ext4 volume file (fuse mapper, staged and published) is renamed
into desiredDir and timed to Published (status file), then removed and
released (untimed); the same for a new image-only volume (to Created).
Printed: p50 per size and its ratio to the 0 case (goal <= 1.1x).
Idle (with 200 others, after they converged): CPU seconds of the daemon per
minute (utime+stime from /proc) over --idle seconds, its RSS, and the passes
it ran meanwhile.

Usage: .venv/bin/python benchmarks/p13_scale_and_idle.py [--trials N] [--max 200|1000]
       [--idle S] [--quick]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from daemonbench import release_with_cli, stop_daemon, wait_for, write_config
from harness import (
    BenchError,
    DaemonProc,
    cpu_seconds,
    create_images,
    find_cli,
    fuse_pids_under,
    pct,
    rss_kb,
    signals_ignored,
    signals_raise,
    status,
    wait_exit,
)
from harness import cleanup as harness_cleanup

from reconciler.drivers.reaper import become_subreaper, reap_zombies
from reconciler.testing.devcluster import DevCluster, start_cluster

GOAL_RATIO = 1.1
RUN_TIMEOUT = 120.0
POLL_S = 0.002

CONFIG_YAML = """\
desiredDir: {desired}
stateDir: {state}
controlSocket: {state}/control.sock
nodeName: p13-bench
ceph:
  conf: {conf}
  user: {user}
  keyring: {keyring}
allowedRoots: [{srv}]
mapper: fuse
"""

HEAD = """\
apiVersion: rbd-reconciler/v1
kind: Volume
metadata:
  name: {name}
spec:
  image:
    pool: {pool}
    size: {size}
"""

FS = """\
  map:
    mapper: fuse
  stage:
    fsType: ext4
  publish:
    - path: {target}
"""


class Bench:
    def __init__(self, root: Path, cluster: DevCluster, daemon: DaemonProc) -> None:
        self.root, self.cluster, self.daemon = root, cluster, daemon
        self.desired, self.state = root / "desired", root / "state"
        self.others = 0

    def wait_phase(self, names: list[str], phase: str) -> float:
        left = set(names)

        def ok() -> bool:
            nonlocal left
            left = {n for n in left if status(self.state, n).get("phase") != phase}
            return not left

        def failed() -> str:
            some = sorted(left)[:3]
            return (f"not {phase}: {len(left)} volume(s), e.g. "
                    f"{[(n, status(self.state, n)) for n in some]}")
        return wait_for(self.daemon, ok, RUN_TIMEOUT * max(1, len(names) / 100), failed,
                        POLL_S)

    def add_others(self, upto: int) -> None:
        names = [f"p13-o{i:04}" for i in range(self.others, upto)]
        t0 = time.monotonic()
        create_images(self.cluster, names, 4 << 20)
        for n in names:
            (self.desired / f"{n}.yaml").write_text(
                HEAD.format(name=n, pool=self.cluster.pool, size="4Mi"))
        self.wait_phase(names, "Created")
        self.others = upto
        print(f"{upto} other volumes present ({time.monotonic() - t0:.1f} s to make "
              f"and converge {len(names)})", flush=True)

    def new_volume(self, name: str, fs: bool) -> float:
        body = HEAD.format(name=name, pool=self.cluster.pool, size="64Mi") + (
            FS.format(target=self.root / "srv" / name) if fs else "")
        tmp = self.root / "incoming" / f"{name}.yaml"
        tmp.write_text(body)
        t0 = time.monotonic()
        os.rename(tmp, self.desired / f"{name}.yaml")
        self.wait_phase([name], "Published" if fs else "Created")
        took = time.monotonic() - t0
        fuse = fuse_pids_under(self.root)
        (self.desired / f"{name}.yaml").unlink()
        self.wait_phase([name], "Released")
        for pid in fuse:
            wait_exit(pid)
        reap_zombies()
        return took

    def idle(self, seconds: float) -> tuple[float, int, int]:
        """(CPU s per minute, RSS kB, passes) of the daemon over ``seconds``."""
        pid = self.daemon.proc.pid
        before = cpu_seconds(pid)
        passes0 = self.daemon.tail(10**9).count('"message": "pass ')
        time.sleep(seconds)  # the measurement window itself, not a synchronisation
        used = cpu_seconds(pid) - before
        passes = self.daemon.tail(10**9).count('"message": "pass ') - passes0
        return used * 60 / seconds, rss_kb(pid), passes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--trials", type=int, default=5, help="trials per size (default 5)")
    p.add_argument("--max", type=int, default=200, choices=(200, 1000),
                   help="most other volumes (default 200)")
    p.add_argument("--idle", type=float, default=120.0,
                   help="idle window in seconds, with 200 others (default 120; 0: skip)")
    p.add_argument("--quick", action="store_true", help="2 trials, a 30 s idle window")
    args = p.parse_args(argv)
    trials, idle = (2, 30.0) if args.quick else (args.trials, args.idle)
    if os.geteuid() != 0:
        print("p13_scale_and_idle: needs root (mount, losetup, FUSE)", file=sys.stderr)
        return 2

    become_subreaper()
    root = Path(tempfile.mkdtemp(prefix="rbd-bench-p13-"))
    cluster: DevCluster | None = None
    daemon: DaemonProc | None = None
    rc = 1
    with signals_raise():
        try:
            cluster = start_cluster(root=root / "ceph")
            config = write_config(root, cluster, CONFIG_YAML,
                                  ("desired", "state", "srv", "incoming"))
            daemon = DaemonProc(root, find_cli(), config)
            daemon.wait_ready()
            bench = Bench(root, cluster, daemon)
            sizes = [0, 200] + ([1000] if args.max == 1000 else [])
            fs: dict[int, list[float]] = {}
            img: dict[int, list[float]] = {}
            idle_figures = None
            for size in sizes:
                if size:
                    bench.add_others(size)
                for i in range(trials):
                    fs.setdefault(size, []).append(bench.new_volume(f"p13-fs{size}-{i}", True))
                    img.setdefault(size, []).append(
                        bench.new_volume(f"p13-img{size}-{i}", False))
                    print(f"{size:5} others, trial {i + 1}: fs {fs[size][-1] * 1000:7.1f} ms, "
                          f"image-only {img[size][-1] * 1000:7.1f} ms", flush=True)
                if size == 200 and idle > 0:
                    idle_figures = bench.idle(idle)
            print(f"\nload average {os.getloadavg()[0]:.2f}")
            for label, xs in (("new fs volume -> Published", fs),
                              ("new image-only volume -> Created", img)):
                base = pct(xs[0], 50)
                for size in sizes:
                    ratio = pct(xs[size], 50) / base
                    verdict = "" if size == 0 else (
                        f"   goal <= {GOAL_RATIO}x: {'met' if ratio <= GOAL_RATIO else 'NOT met'}")
                    print(f"{label:<34} {size:5} others: p50 {pct(xs[size], 50) * 1000:7.1f} ms"
                          f"   {ratio:4.2f}x{verdict}")
            if idle_figures is not None:
                cpu, rss, passes = idle_figures
                print(f"idle with 200 others: {cpu:.3f} CPU-s per minute, RSS {rss / 1024:.1f} "
                      f"MiB, {passes} pass(es) in {idle:.0f} s")
            rc = 0
        except (BenchError, subprocess.TimeoutExpired, OSError) as e:
            print(f"p13_scale_and_idle: {e}", file=sys.stderr)
        except KeyboardInterrupt:
            print("\np13_scale_and_idle: interrupted; cleaning up", file=sys.stderr)
            rc = 130
        finally:
            with signals_ignored():
                rc = cleanup(root, cluster, daemon) or rc
    return rc


def cleanup(root: Path, cluster: DevCluster | None, daemon: DaemonProc | None) -> int:
    problems: list[str] = []
    stop_daemon(daemon, problems)
    reap_zombies()
    desired = root / "desired"
    mapped = [f for f in desired.glob("p13-fs*.yaml")] if desired.is_dir() else []
    if cluster is not None and mapped:
        release_with_cli(root, mapped, problems)
    return harness_cleanup(root, cluster, problems)


if __name__ == "__main__":
    sys.exit(main())
