#!/usr/bin/env python3
"""P12: drift repair latency — how long the running daemon takes to repair
what was changed behind its back.

One `rbd-reconciler run` (resyncSeconds from --resync, default 60, the
shipped default) on a disposable local cluster (fuse mapper) holds three
volumes: an ext4 volume staged and published, an image-only mapped volume
(nothing mounted), and an adopted ext4 volume (no size in its spec, so a
resize made elsewhere is followed, not refused). Each trial waits until the
daemon has confirmed the volume (its status names where it is), waits a
random 0..--spread seconds (so drifts fall anywhere in the resync period
when --spread is the resync), makes the drift, and polls the real state
every millisecond until it is repaired (deadline: the resync plus 60 s):

- publish:  `umount` of the publish target      -> mounted again
- staging:  `umount` of the target, then of the staging mount -> both mounted again
- helper:   SIGKILL of the rbd-fuse helper       -> a new helper, the volume Mapped again
- resize:   `rbd resize` (+8 MiB) elsewhere, timed from its return -> the loop device
            shows the new size

Printed: p50, p99 and max per kind, and whether p99 <= 1 s (the goal).
Cleanup on every path: the daemon by pid, `release`, the sweep of mounts,
loops and rbd-fuse processes, the images, the cluster, the work directory.

Usage: .venv/bin/python benchmarks/p12_drift_repair.py [--trials N] [--quick]
       [--resync S] [--spread S] [--kinds publish,staging,helper,resize]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import signal
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
    fuse_pids_under,
    line,
    mounts,
    pct,
    run,
    signals_ignored,
    signals_raise,
    status,
)
from harness import cleanup as harness_cleanup

from reconciler.drivers.reaper import become_subreaper, reap_zombies
from reconciler.testing.devcluster import DevCluster, start_cluster

GOAL_P99 = 1.0
POLL_S = 0.001
SETTLE_TIMEOUT = 120.0
KINDS = ("publish", "staging", "helper", "resize")

CONFIG_YAML = """\
desiredDir: {desired}
stateDir: {state}
controlSocket: {state}/control.sock
nodeName: p12-bench
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
    pool: {pool}{size}
  map:
    mapper: fuse
{rest}"""

FS_REST = """\
  stage:
    fsType: ext4
  publish:
    - path: {target}
"""


class Bench:
    def __init__(self, root: Path, cluster: DevCluster, daemon: DaemonProc,
                 resync: float, spread: float) -> None:
        self.root, self.cluster, self.daemon = root, cluster, daemon
        self.state, self.srv = root / "state", root / "srv"
        self.deadline = resync + 60.0
        self.spread = spread
        self.rbd = ["rbd", "-c", str(cluster.conf), "--id", cluster.user,
                    "--keyring", str(cluster.keyring)]

    def settled(self, name: str, key: str) -> dict:
        """The confirming pass has written where the volume is."""
        s: dict = {}

        def ok() -> bool:
            nonlocal s
            s = status(self.state, name)
            return bool(s.get(key)) and s.get("phase") in ("Published", "Mapped")
        wait_for(self.daemon, ok, SETTLE_TIMEOUT, lambda: f"{name} did not settle ({s})")
        return s

    def until(self, what: str, ok: Callable[[], bool], t0: float | None = None) -> float:
        """Seconds from ``t0`` (the drift; default now) until ``ok()``."""
        return wait_for(self.daemon, ok, self.deadline,
                        lambda: f"not repaired in {self.deadline:.0f} s: {what}", POLL_S, t0)

    def pause(self) -> None:
        time.sleep(random.uniform(0, self.spread))  # where in the resync period: by chance

    # -- the drifts ---------------------------------------------------------------
    def publish(self) -> float:
        self.settled("p12-fs", "staging")
        self.pause()
        target = str(self.srv / "p12-fs")
        t0 = time.monotonic()
        run(["umount", target])
        return self.until("publish target", lambda: mounted(target), t0)

    def staging(self) -> float:
        s = self.settled("p12-fs", "staging")
        self.pause()
        target, staging = str(self.srv / "p12-fs"), s["staging"]
        t0 = time.monotonic()
        run(["umount", target])
        run(["umount", staging])
        return self.until("staging and publish",
                          lambda: mounted(staging) and mounted(target), t0)

    def helper(self) -> float:
        before = self.settled("p12-map", "device")
        self.pause()
        [pid] = fuse_pids_of(self.root, "p12-map")
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)

        def again() -> bool:
            s = status(self.state, "p12-map")
            return (s.get("phase") == "Mapped" and bool(s.get("device"))
                    and s.get("updated") != before.get("updated")
                    and fuse_pids_of(self.root, "p12-map") not in ([], [pid]))
        return self.until("helper", again, t0)

    def resize(self) -> float:
        s = self.settled("p12-rs", "device")
        self.pause()
        size = int(run(["blockdev", "--getsize64", s["device"]]).stdout) + 8 * 2**20
        run([*self.rbd, "resize", "--no-progress", "--size", f"{size // 2**20}M",
             f"{self.cluster.pool}/p12-rs"])
        t0 = time.monotonic()  # the drift is done when the command returns
        return self.until("resize", lambda: device_size(s["device"]) == size, t0)


def mounted(point: str) -> bool:
    return any(m.point == point for m in mounts())


def device_size(dev: str) -> int:
    with contextlib.suppress(OSError), open(dev, "rb") as f:
        return f.seek(0, os.SEEK_END)
    return -1


def fuse_pids_of(root: Path, image: str) -> list[int]:
    out = []
    for pid in fuse_pids_under(root):
        with contextlib.suppress(OSError):
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if any(a.endswith(f"@{image}".encode()) for a in args):
                out.append(pid)
    return out


def write_volumes(root: Path, cluster: DevCluster) -> list[Path]:
    run(["rbd", "-c", str(cluster.conf), "create", "--size", "64M", "--no-progress",
         f"{cluster.pool}/p12-rs"])
    bodies = {
        "p12-fs": VOLUME_YAML.format(name="p12-fs", pool=cluster.pool, size="\n    size: 64Mi",
                                     rest=FS_REST.format(target=root / "srv" / "p12-fs")),
        "p12-map": VOLUME_YAML.format(name="p12-map", pool=cluster.pool,
                                      size="\n    size: 64Mi", rest=""),
        "p12-rs": VOLUME_YAML.format(name="p12-rs", pool=cluster.pool, size="",
                                     rest=FS_REST.format(target=root / "srv" / "p12-rs")),
    }
    written = []
    for name, body in bodies.items():
        keep = root / "written" / f"{name}.yaml"
        keep.write_text(body)
        written.append(keep)
        shutil.copy(keep, root / "desired" / keep.name)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--trials", type=int, default=20, help="trials per kind (default 20)")
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
        print("p12_drift_repair: needs root (mount, losetup, FUSE)", file=sys.stderr)
        return 2

    become_subreaper()
    root = Path(tempfile.mkdtemp(prefix="rbd-bench-p12-"))
    cluster: DevCluster | None = None
    daemon: DaemonProc | None = None
    written: list[Path] = []
    rc = 1
    with signals_raise():
        try:
            cluster = start_cluster(root=root / "ceph")
            config = write_config(root, cluster, CONFIG_YAML,
                                  ("desired", "state", "srv", "written"), resync=args.resync)
            written = write_volumes(root, cluster)
            daemon = DaemonProc(root, find_cli(), config, args=())
            daemon.wait_ready()
            bench = Bench(root, cluster, daemon, args.resync, args.spread)
            results: dict[str, list[float]] = {}
            for kind in kinds:
                for i in range(trials):
                    t = getattr(bench, kind)()
                    results.setdefault(kind, []).append(t)
                    print(f"{kind:8} trial {i + 1:2}: repaired in {t * 1000:8.1f} ms", flush=True)
                    if os.environ.get("P12_DEBUG"):
                        print(daemon.tail(4000))
            print(f"\nresyncSeconds {args.resync:g}; drifts spread over 0..{args.spread:g} s; "
                  f"load average {os.getloadavg()[0]:.2f}")
            for kind, xs in results.items():
                verdict = "met" if pct(xs, 99) <= GOAL_P99 else "NOT met"
                print(f"{line(kind, xs)}   goal p99 <= {GOAL_P99:g} s: {verdict}")
            rc = 0
        except (BenchError, subprocess.TimeoutExpired, OSError, ValueError) as e:
            print(f"p12_drift_repair: {e}", file=sys.stderr)
        except KeyboardInterrupt:
            print("\np12_drift_repair: interrupted; cleaning up", file=sys.stderr)
            rc = 130
        finally:
            with signals_ignored():
                rc = cleanup(root, cluster, daemon, written) or rc
    return rc


def cleanup(root: Path, cluster: DevCluster | None, daemon: DaemonProc | None,
            written: list[Path]) -> int:
    problems: list[str] = []
    stop_daemon(daemon, problems)
    reap_zombies()
    if cluster is not None and written:
        release_with_cli(root, written, problems)
    return harness_cleanup(root, cluster, problems)


if __name__ == "__main__":
    sys.exit(main())
