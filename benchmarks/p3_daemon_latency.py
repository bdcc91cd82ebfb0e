#!/usr/bin/env python3
"""P3: daemon reaction latency — a new Volume file in desiredDir to its first step and to PUBLISHED.

What is measured: one `rbd-reconciler --config CFG run --log-format json` process
runs for the whole benchmark on a disposable local Ceph cluster
(reconciler.testing.devcluster), with resyncSeconds 3600 so that only file events
trigger passes. Each run writes a new Volume file (unique name; 64Mi, mapper
fuse, stage ext4, one publish target under the allowed root) atomically: the
file is written next to desiredDir, then os.rename()d into it; t0 = time.time()
just before the rename. Then a tight loop (1 ms sleeps) watches the daemon's log
and the status file stateDir/status/<name>.json and records the wall-clock time:

- first step: when the log line "<name>: N step(s) start" first appears
  (also reported: the same figure from the line's own "time" field, which has
  ms resolution);
- published: when the status file first says phase "Published".

After each run (untimed): the file is removed, the daemon releases the volume
(phase "Released") and its rbd-fuse process exits. The daemon runs with
--allow-mass-removal, since each removal takes the only managed volume away.
Printed: p50, p99 and max of both, and whether p99 to first step <= 100 ms.

At the end (and on any failure or Ctrl-C): SIGTERM to the daemon (if it hangs: its
thread stacks are printed, then SIGKILL); if anything is
still mounted, `rbd-reconciler release` on a directory holding every volume file
written; then the same sweep as P1 (unmount, losetup -d, FUSE mounts, rbd-fuse
processes by pid), the images are removed, the cluster stopped and the temporary
directory deleted.

Usage: .venv/bin/python benchmarks/p3_daemon_latency.py [--runs N]   (default 50)
Needs root, FUSE and loop devices (see /work/shared/DESIGN.md).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

# The shared helpers; importing harness also puts this tree's reconciler first on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from daemonbench import release_with_cli, stop_daemon, wait_for, write_config
from harness import (
    BenchError,
    DaemonProc,
    assert_published,
    find_cli,
    fuse_pids_under,
    line,
    loops_under,
    mounts_under,
    pct,
    run,
    signals_ignored,
    signals_raise,
    status,
    sweep,
    wait_exit,
)
from harness import cleanup as harness_cleanup

from reconciler.drivers.reaper import become_subreaper, reap_zombies
from reconciler.testing.devcluster import DevCluster, start_cluster

TARGET_P99_FIRST_STEP = 0.100
POLL_S = 0.001
RUN_TIMEOUT = 60.0  # never wait unbounded for one volume

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
  publish:
    - path: {target}
"""

CONFIG_YAML = """\
desiredDir: {desired}
stateDir: {state}
controlSocket: {state}/control.sock
nodeName: p3-bench
ceph:
  conf: {conf}
  user: {user}
  keyring: {keyring}
allowedRoots: [{srv}]
resyncSeconds: 3600
"""


def log_time(rec: dict) -> float | None:
    """The record's own "time" (logging's default local '%Y-%m-%d %H:%M:%S,mmm') as epoch."""
    with contextlib.suppress(KeyError, ValueError, TypeError):
        return datetime.strptime(rec["time"], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return None


def one_run(d: DaemonProc, root: Path, pool: str, name: str, written: list[Path]
            ) -> tuple[float, float, float | None]:
    """Returns (to first step polled, to Published, to first step by the log's stamp)."""
    desired, state, srv = root / "desired", root / "state", root / "srv"
    body = VOLUME_YAML.format(name=name, pool=pool, target=srv / name)
    keep = root / "written" / f"{name}.yaml"  # a copy for the final release, if needed
    keep.write_text(body)
    written.append(keep)
    tmp = root / "incoming" / f"{name}.yaml"
    tmp.write_text(body)
    d.new_lines()  # skip what the log said before

    t0 = time.time()
    os.rename(tmp, desired / f"{name}.yaml")
    first = first_logged = published = None
    needle = f"{name}: "
    deadline = time.monotonic() + RUN_TIMEOUT
    while published is None or first is None:
        now = time.time()
        if first is None:
            for rec in d.new_lines():
                msg = str(rec.get("message", ""))
                if msg.startswith(needle) and msg.endswith("step(s) start"):
                    first, first_logged = now, log_time(rec)
                    break
        if published is None:
            s = status(state, name)
            if s.get("phase") == "Published":
                published = now
            elif s.get("phase") == "Failed":
                raise BenchError(f"{name} failed: {s.get('lastError')}; log:\n{d.tail()}")
        if time.monotonic() > deadline:
            raise BenchError(f"{name}: not published in {RUN_TIMEOUT:.0f} s; "
                             f"log:\n{d.tail()}")
        d.check_alive()
        time.sleep(POLL_S)
    assert_published(srv / name, state / "staging" / name)

    # untimed: remove the file, wait for Released and for its rbd-fuse to go
    fuse = fuse_pids_under(root)
    (desired / f"{name}.yaml").unlink()
    wait_for(d, lambda: status(state, name).get("phase") == "Released", RUN_TIMEOUT,
             lambda: f"{name}: not released in {RUN_TIMEOUT:.0f} s")
    for pid in fuse:
        wait_exit(pid)
    reap_zombies()
    left = [m.point for m in mounts_under(root) if not m.point.startswith(str(root / "ceph"))]
    if left or loops_under(root):
        raise BenchError(f"{name}: released but left {left + loops_under(root)}")
    first_by_log = None if first_logged is None else first_logged - t0
    return first - t0, published - t0, first_by_log


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--runs", type=int, default=50, help="timed runs (default 50)")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("p3_daemon_latency: needs root (mount, losetup, FUSE)", file=sys.stderr)
        return 2

    become_subreaper()  # rbd-fuse processes orphaned by the daemon come back to us
    root = Path(tempfile.mkdtemp(prefix="rbd-bench-p3-"))
    cluster: DevCluster | None = None
    daemon: DaemonProc | None = None
    written: list[Path] = []
    rc = 1
    with signals_raise():
        try:
            t0 = time.perf_counter()
            cluster = start_cluster(root=root / "ceph")
            print(f"cluster up in {time.perf_counter() - t0:.1f}s "
                  f"(mon {cluster.mon_addr}, pool {cluster.pool}); workdir {root}")
            config = write_config(root, cluster, CONFIG_YAML,
                                  ("desired", "state", "srv", "incoming", "written"))
            daemon = DaemonProc(root, find_cli(), config)
            daemon.wait_ready()

            first: list[float] = []
            published: list[float] = []
            stamped: list[float] = []
            for i in range(1, args.runs + 1):
                f, pub, fl = one_run(daemon, root, cluster.pool, f"p3-{i}", written)
                first.append(f)
                published.append(pub)
                if fl is not None:
                    stamped.append(fl)
                print(f"run {i:3}: first step {f * 1000:7.1f} ms   published "
                      f"{pub * 1000:7.1f} ms", flush=True)
            print()
            print(line("file written -> first step (poll)", first))
            if stamped:
                print(line("file written -> first step (stamp)", stamped))
            print(line("file written -> Published", published))
            ok = pct(first, 99) <= TARGET_P99_FIRST_STEP
            print(f"p99 to first step {pct(first, 99) * 1000:.1f} ms: target <= "
                  f"{TARGET_P99_FIRST_STEP * 1000:.0f} ms {'met' if ok else 'NOT met'}")
            rc = 0
        except (BenchError, subprocess.TimeoutExpired, OSError) as e:
            print(f"p3_daemon_latency: {e}", file=sys.stderr)
        except KeyboardInterrupt:
            print("\np3_daemon_latency: interrupted; cleaning up", file=sys.stderr)
            rc = 130
        finally:
            with signals_ignored():
                rc = cleanup(root, cluster, daemon, written) or rc
    return rc


def cleanup(root: Path, cluster: DevCluster | None, daemon: DaemonProc | None,
            written: list[Path]) -> int:
    """Returns 1 if something could not be removed (and says what)."""
    problems: list[str] = []
    stop_daemon(daemon, problems)
    reap_zombies()
    ceph = f"{root / 'ceph'}/"
    if cluster is not None and [m for m in mounts_under(root)
                                if not m.point.startswith(ceph)]:
        # Give back whatever the daemon left published, the reconciler's own way.
        release_with_cli(root, written, problems)
    problems += sweep(root)
    if cluster is not None:
        for f in written:  # the cluster goes with its dir anyway: give up at the first hitch
            try:
                run(["rbd", "-c", str(cluster.conf), "rm", "--no-progress",
                     f"{cluster.pool}/{f.stem}"], timeout=30)
            except (BenchError, subprocess.TimeoutExpired) as e:
                problems.append(f"removing the images stopped at {f.stem}: {e}")
                break
    return harness_cleanup(root, cluster, problems)


if __name__ == "__main__":
    sys.exit(main())
