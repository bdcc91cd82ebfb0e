#!/usr/bin/env python3
"""P15: drift no mount event used to reach (issue 26, items 1-3) -> repaired
or reported by the running daemon.

One `rbd-reconciler run` (resyncSeconds from --resync, default 60, the
shipped default) on a disposable local cluster (fuse mapper) holds an ext4
volume staged and published (`errors=remount-ro`). Each trial waits until
the daemon has confirmed the volume, waits a random 0..--spread seconds,
makes the drift and polls every millisecond (deadline: the resync plus
60 s) for what must follow; then puts the node back and waits for
Published again (that time is printed too: "cleared").

- bind-ro:    `mount -o remount,bind,ro` of the publish  -> the bind rw again (repaired)
- shadow:     a tmpfs mounted on the publish target        -> status Degraded/Shadowed;
              cleared by unmounting it
- shadow-up:  a tmpfs mounted over the target's parent     -> the same
- fs-ro:      `mount -o remount,ro` of the staging mount   -> Degraded/FilesystemReadOnly;
              cleared by `mount -o remount,rw` (the daemon never does that)
- fs-error:   ext4 `trigger_fs_error` (errors=remount-ro, no mount event) -> Degraded/
              FilesystemReadOnly; a fresh volume per trial (its filesystem keeps the
              error), released after by removing its file

Printed: p50, p99 and max per kind, and whether p99 <= 1 s (the goal).
Cleanup on every path: the daemon by pid, `release`, the sweep of mounts,
loops and rbd-fuse processes, the cluster, the work directory.

Usage: .venv/bin/python benchmarks/p15_drift_report.py [--trials N] [--quick]
       [--resync S] [--spread S] [--kinds bind-ro,shadow,shadow-up,fs-ro,fs-error]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from daemonbench import release_with_cli, stop_daemon, wait_for, write_config
from harness import (
    BenchError,
    DaemonProc,
    find_cli,
    line,
    pct,
    run,
    signals_ignored,
    signals_raise,
    status,
)
from harness import cleanup as harness_cleanup

from reconciler.drivers.reaper import become_subreaper, reap_zombies
from reconciler.facts.observed import Mount
from reconciler.facts.parsers import parse_mountinfo
from reconciler.testing.devcluster import DevCluster, start_cluster

GOAL_P99 = 1.0
POLL_S = 0.001
SETTLE_TIMEOUT = 120.0
KINDS = ("bind-ro", "shadow", "shadow-up", "fs-ro", "fs-error")

CONFIG_YAML = """\
desiredDir: {desired}
stateDir: {state}
controlSocket: {state}/control.sock
nodeName: p15-bench
ceph:
  conf: {conf}
  user: {user}
  keyring: {keyring}
allowedRoots: [{srv}]
mapper: fuse
resyncSeconds: {resync}
"""

VOLUME_YAML = """\
apiVersion: rbd-reconciler/v1
kind: Volume
metadata:
  name: {name}
spec:
  image:
    pool: {pool}
    size: 64Mi
  map:
    mapper: fuse
  stage:
    fsType: ext4
    mountOptions: [errors=remount-ro]
  publish:
    - path: {target}
"""


def mount_at(point: str) -> Mount | None:
    found = [m for m in parse_mountinfo(Path("/proc/self/mountinfo").read_text())
             if m.mount_point == point]
    return found[-1] if found else None


class Bench:
    def __init__(self, root: Path, cluster: DevCluster, daemon: DaemonProc,
                 resync: float, spread: float) -> None:
        self.root, self.cluster, self.daemon = root, cluster, daemon
        self.state, self.srv = root / "state", root / "srv"
        self.deadline = resync + 60.0
        self.spread = spread
        self.cleared: dict[str, list[float]] = {}
        self.fresh = 0

    def settled(self, name: str) -> dict:
        s: dict = {}

        def ok() -> bool:
            nonlocal s
            s = status(self.state, name)
            return bool(s.get("staging")) and s.get("phase") == "Published"
        wait_for(self.daemon, ok, SETTLE_TIMEOUT, lambda: f"{name} did not settle ({s})")
        return s

    def until(self, what: str, ok: Callable[[], bool], t0: float) -> float:
        return wait_for(self.daemon, ok, self.deadline,
                        lambda: f"not seen in {self.deadline:.0f} s: {what}", POLL_S, t0)

    def reported(self, name: str, reason: str) -> Callable[[], bool]:
        def ok() -> bool:
            s = status(self.state, name)
            return s.get("phase") == "Degraded" and s.get("reason") == reason
        return ok

    def published(self, name: str) -> Callable[[], bool]:
        return lambda: status(self.state, name).get("phase") == "Published"

    def pause(self) -> None:
        time.sleep(random.uniform(0, self.spread))  # where in the resync period: by chance

    def clear(self, kind: str, name: str, undo: list[str]) -> None:
        t0 = time.monotonic()
        run(undo)
        self.cleared.setdefault(kind, []).append(
            self.until(f"{name} Published again", self.published(name), t0))

    # -- the drifts ---------------------------------------------------------------
    def bind_ro(self) -> float:
        self.settled("p15-fs")
        self.pause()
        target = str(self.srv / "p15-fs")
        t0 = time.monotonic()
        run(["mount", "-o", "remount,bind,ro", target])

        def rw() -> bool:
            m = mount_at(target)
            return m is not None and not m.read_only
        return self.until("the publish rw again", rw, t0)

    def _shadow(self, kind: str, point: str) -> float:
        self.settled("p15-fs")
        self.pause()
        t0 = time.monotonic()
        run(["mount", "-t", "tmpfs", "-o", "size=1m", "p15-squatter", point])
        try:
            t = self.until("Degraded/Shadowed", self.reported("p15-fs", "Shadowed"), t0)
        finally:
            self.clear(kind, "p15-fs", ["umount", point])
        return t

    def shadow(self) -> float:
        return self._shadow("shadow", str(self.srv / "p15-fs"))

    def shadow_up(self) -> float:
        return self._shadow("shadow-up", str(self.srv))

    def fs_ro(self) -> float:
        s = self.settled("p15-fs")
        self.pause()
        t0 = time.monotonic()
        run(["mount", "-o", "remount,ro", s["staging"]])
        try:
            t = self.until("Degraded/FilesystemReadOnly",
                           self.reported("p15-fs", "FilesystemReadOnly"), t0)
        finally:
            self.clear("fs-ro", "p15-fs", ["mount", "-o", "remount,rw", s["staging"]])
        return t

    def fs_error(self) -> float:
        self.fresh += 1
        name = f"p15-err{self.fresh}"
        f = self.root / "desired" / f"{name}.yaml"
        f.write_text(VOLUME_YAML.format(name=name, pool=self.cluster.pool,
                                        target=self.srv / name))
        s = self.settled(name)
        self.pause()
        trigger = Path(f"/sys/fs/ext4/{Path(s['device']).name}/trigger_fs_error")
        t0 = time.monotonic()
        trigger.write_text("1")
        try:
            return self.until("Degraded/FilesystemReadOnly",
                              self.reported(name, "FilesystemReadOnly"), t0)
        finally:
            f.unlink()  # onRemove: release (unpublish, unstage, unmap)
            self.until(f"{name} released",
                       lambda: status(self.state, name).get("phase") == "Released",
                       time.monotonic())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--trials", type=int, default=10, help="trials per kind (default 10)")
    p.add_argument("--quick", action="store_true", help="3 trials per kind")
    p.add_argument("--resync", type=float, default=60.0, help="resyncSeconds (default 60)")
    p.add_argument("--spread", type=float, default=2.0,
                   help="random wait before each drift, 0..S seconds (default 2)")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"of {','.join(KINDS)}")
    args = p.parse_args(argv)
    trials = 3 if args.quick else args.trials
    kinds = [k for k in args.kinds.split(",") if k]
    if bad := [k for k in kinds if k not in KINDS]:
        p.error(f"unknown kind(s): {', '.join(bad)}")
    if os.geteuid() != 0:
        print("p15_drift_report: needs root (mount, losetup, FUSE, /sys/fs/ext4)",
              file=sys.stderr)
        return 2

    become_subreaper()
    root = Path(tempfile.mkdtemp(prefix="rbd-bench-p15-"))
    cluster: DevCluster | None = None
    daemon: DaemonProc | None = None
    rc = 1
    with signals_raise():
        try:
            cluster = start_cluster(root=root / "ceph")
            config = write_config(root, cluster, CONFIG_YAML, ("desired", "state", "srv"),
                                  resync=args.resync)
            (root / "desired" / "p15-fs.yaml").write_text(VOLUME_YAML.format(
                name="p15-fs", pool=cluster.pool, target=root / "srv" / "p15-fs"))
            daemon = DaemonProc(root, find_cli(), config, args=())
            daemon.wait_ready()
            bench = Bench(root, cluster, daemon, args.resync, args.spread)
            results: dict[str, list[float]] = {}
            for kind in kinds:
                for i in range(trials):
                    t = getattr(bench, kind.replace("-", "_"))()
                    results.setdefault(kind, []).append(t)
                    print(f"{kind:9} trial {i + 1:2}: {t * 1000:8.1f} ms", flush=True)
            print(f"\nresyncSeconds {args.resync:g}; drifts spread over 0..{args.spread:g} s; "
                  f"load average {os.getloadavg()[0]:.2f}")
            for kind, xs in results.items():
                verdict = "met" if pct(xs, 99) <= GOAL_P99 else "NOT met"
                print(f"{line(kind, xs)}   goal p99 <= {GOAL_P99:g} s: {verdict}")
            for kind, xs in bench.cleared.items():
                print(line(f"{kind} cleared (Published again)", xs))
            rc = 0
        except (BenchError, subprocess.TimeoutExpired, OSError, ValueError) as e:
            print(f"p15_drift_report: {e}", file=sys.stderr)
        except KeyboardInterrupt:
            print("\np15_drift_report: interrupted; cleaning up", file=sys.stderr)
            rc = 130
        finally:
            with signals_ignored():
                rc = cleanup(root, cluster, daemon) or rc
    return rc


def cleanup(root: Path, cluster: DevCluster | None, daemon: DaemonProc | None) -> int:
    problems: list[str] = []
    stop_daemon(daemon, problems)
    reap_zombies()
    for point in (root / "srv" / "p15-fs", root / "srv"):  # a trial cut short
        while (m := mount_at(str(point))) is not None and m.fs_type == "tmpfs":
            subprocess.run(["umount", str(point)], check=False)
    desired = root / "desired"
    if cluster is not None and desired.is_dir() and any(desired.iterdir()):
        release_with_cli(root, None, problems)
        shutil.rmtree(desired, ignore_errors=True)
    return harness_cleanup(root, cluster, problems)


if __name__ == "__main__":
    sys.exit(main())
