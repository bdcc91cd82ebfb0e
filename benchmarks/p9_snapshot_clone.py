#!/usr/bin/env python3
"""P9: snapshot + clone to a published volume — `rbd-reconciler apply` vs the raw sequence.

What is measured, on one disposable local Ceph cluster (1 mon + 1 memstore OSD),
starting each run from the same formatted 256 MiB source image ("golden",
created once, untimed, not mapped):

- apply: one `rbd-reconciler apply DIR` subprocess, DIR holding the source
  Volume, a Snapshot of it and a Volume cloned from that snapshot (mapper
  fuse, ext4, one publish target). The clone waits for the snapshot, so the
  run is two passes (observe, plan, act) in one process.
- shell: one `bash -c` doing the same by hand: rbd snap create -> rbd snap
  protect -> rbd clone -> rbd-fuse (wait for the mount) -> losetup
  --direct-io=on -> mount -> mount --bind.

Runs are interleaved; teardown (untimed) unpublishes, unmaps and removes the
clone and the snapshot. Printed: each run, both medians, the ratio apply/shell.

Usage: .venv/bin/python benchmarks/p9_snapshot_clone.py [--runs N]
Needs root, FUSE and loop devices.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (
    CMD_TIMEOUT,
    CONFIG_YAML,
    BenchError,
    Env,
    assert_clean,
    assert_published,
    cleanup,
    find_cli,
    fuse_pids_under,
    run,
    signals_ignored,
    signals_raise,
    umount,
    wait_exit,
)

from reconciler.drivers.reaper import become_subreaper, reap_zombies
from reconciler.testing.devcluster import DevCluster, start_cluster

GOLDEN = """\
apiVersion: rbd-reconciler/v1
kind: Volume
metadata: {{name: golden}}
spec:
  image: {{pool: {pool}, size: 256Mi}}
"""
STAGED_GOLDEN = GOLDEN + "  map: {{mapper: fuse}}\n  stage: {{fsType: ext4}}\n"
SNAP_AND_CLONE = """\
apiVersion: rbd-reconciler/v1
kind: Snapshot
metadata: {{name: {snap}}}
spec:
  source: {{volume: golden}}
---
apiVersion: rbd-reconciler/v1
kind: Volume
metadata: {{name: {clone}}}
spec:
  image: {{pool: {pool}, reclaimPolicy: Delete, source: {{snapshot: {snap}}}}}
  map: {{mapper: fuse}}
  stage: {{fsType: ext4}}
  publish:
    - path: {target}
"""

# $1 conf, $2 pool, $3 snap, $4 clone, $5 fuse dir, $6 staging, $7 target, $8 fuse log
SHELL_SEQUENCE = """\
set -euo pipefail
conf=$1 pool=$2 snap=$3 img=$4 mnt=$5 staging=$6 target=$7 log=$8
rbd snap create -c "$conf" --no-progress "$pool/golden@$snap"
rbd snap protect -c "$conf" "$pool/golden@$snap"
rbd clone -c "$conf" "$pool/golden@$snap" "$pool/$img"
mkdir -p "$mnt" "$staging" "$target"
setsid rbd-fuse -c "$conf" -p "$pool" -r "$img" "$mnt" -f </dev/null >"$log" 2>&1 &
fuse_pid=$!
echo "fuse_pid=$fuse_pid"
until mountpoint -q "$mnt"; do
    kill -0 "$fuse_pid" 2>/dev/null || { echo "rbd-fuse exited" >&2; exit 1; }
    sleep 0.01
done
dev=$(losetup --find --show --direct-io=on "$mnt/$img")
echo "dev=$dev"
mount "$dev" "$staging"
mount --bind "$staging" "$target"
"""


def rbd(env: Env, *args: str) -> None:
    run(["rbd", "-c", str(env.cluster.conf), *args])


def drop_snapshot(env: Env, snap: str) -> None:
    spec = f"{env.pool}/golden@{snap}"
    run(["rbd", "-c", str(env.cluster.conf), "snap", "unprotect", spec], check=False)
    rbd(env, "snap", "rm", "--no-progress", spec)


def apply_run(env: Env, i: int) -> float:
    desired = env.root / "desired" / f"a{i}"
    desired.mkdir(parents=True)
    snap, clone, target = f"p6-snap-a{i}", f"p6-clone-a{i}", env.root / "pub" / f"a{i}"
    (desired / "golden.yaml").write_text(GOLDEN.format(pool=env.pool))
    (desired / "copy.yaml").write_text(SNAP_AND_CLONE.format(
        pool=env.pool, snap=snap, clone=clone, target=target))
    argv = [str(env.cli), "--config", str(env.config), "apply", str(desired)]
    t0 = time.perf_counter()
    r = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                       timeout=CMD_TIMEOUT)
    elapsed = time.perf_counter() - t0
    if r.returncode != 0 or f"changed: [{clone}]" not in r.stdout:
        raise BenchError(f"apply exited {r.returncode}:\n{r.stdout}{r.stderr}")
    assert_published(target, env.root / "state" / "staging" / clone)
    if (target / "golden.txt").read_text() != "golden\n":
        raise BenchError("the clone does not hold the source's data")

    fuse = fuse_pids_under(env.root)
    run([str(env.cli), "--config", str(env.config), "release", str(desired)])
    for pid in fuse:
        wait_exit(pid)
    rbd(env, "rm", "--no-progress", f"{env.pool}/{clone}")
    drop_snapshot(env, snap)
    reap_zombies()
    assert_clean(env.root)
    return elapsed


def shell_run(env: Env, i: int) -> float:
    base = env.root / "shell"
    snap, clone = f"p6-snap-s{i}", f"p6-clone-s{i}"
    mnt, staging, target = base / "fuse" / clone, base / "staging" / clone, base / "pub" / clone
    argv = ["bash", "-c", SHELL_SEQUENCE, "p6-shell", str(env.cluster.conf), env.pool, snap,
            clone, str(mnt), str(staging), str(target), str(base / f"{clone}.fuse.log")]
    t0 = time.perf_counter()
    r = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                       timeout=CMD_TIMEOUT)
    elapsed = time.perf_counter() - t0
    if r.returncode != 0:
        raise BenchError(f"shell sequence exited {r.returncode}:\n{r.stdout}{r.stderr}")
    out = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)
    assert_published(target, staging)
    if (target / "golden.txt").read_text() != "golden\n":
        raise BenchError("the shell's clone does not hold the source's data")

    umount(str(target))
    umount(str(staging))
    run(["losetup", "-d", out["dev"]])
    umount(str(mnt))
    wait_exit(int(out["fuse_pid"]))
    rbd(env, "rm", "--no-progress", f"{env.pool}/{clone}")
    drop_snapshot(env, snap)
    reap_zombies()
    assert_clean(env.root)
    return elapsed


def make_golden(env: Env) -> None:
    """The source, once: created, formatted, one file written, released (untimed)."""
    d = env.root / "desired" / "golden"
    d.mkdir(parents=True)
    (d / "golden.yaml").write_text(STAGED_GOLDEN.format(pool=env.pool))
    run([str(env.cli), "--config", str(env.config), "apply", str(d)])
    (env.root / "state" / "staging" / "golden" / "golden.txt").write_text("golden\n")
    os.sync()
    fuse = fuse_pids_under(env.root)
    run([str(env.cli), "--config", str(env.config), "release", str(d)])
    for pid in fuse:
        wait_exit(pid)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--runs", type=int, default=7, help="timed runs of each (default 7)")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("p9_snapshot_clone: needs root (mount, losetup, FUSE)", file=sys.stderr)
        return 2
    become_subreaper()
    root = Path(tempfile.mkdtemp(prefix="rbd-bench-p6-"))
    cluster: DevCluster | None = None
    rc = 1
    with signals_raise():
        try:
            cluster = start_cluster(root=root / "ceph")
            config = root / "config.yaml"
            config.write_text(CONFIG_YAML.format(
                desired=root / "desired", state=root / "state", conf=cluster.conf,
                user=cluster.user, keyring=cluster.keyring, root=root))
            env = Env(root=root, cluster=cluster, config=config, cli=find_cli())
            make_golden(env)
            applies, shells = [], []
            for i in range(1, args.runs + 1):
                a, s = apply_run(env, i), shell_run(env, i)
                applies.append(a)
                shells.append(s)
                print(f"run {i}: apply {a * 1000:7.1f} ms   shell {s * 1000:7.1f} ms   "
                      f"ratio {a / s:.2f}", flush=True)
            a, s = statistics.median(applies), statistics.median(shells)
            print(f"\napply  median {a * 1000:8.1f} ms   (min {min(applies) * 1000:.1f}, "
                  f"max {max(applies) * 1000:.1f})")
            print(f"shell  median {s * 1000:8.1f} ms   (min {min(shells) * 1000:.1f}, "
                  f"max {max(shells) * 1000:.1f})")
            print(f"ratio apply/shell (medians): {a / s:.2f}  (overhead {(a - s) * 1000:+.0f} ms)")
            rc = 0
        except BenchError as e:
            print(f"p9_snapshot_clone: {e}", file=sys.stderr)
        except KeyboardInterrupt:
            print("\np9_snapshot_clone: interrupted; cleaning up", file=sys.stderr)
            rc = 130
        finally:
            with signals_ignored():
                rc = cleanup(root, cluster) or rc
                shutil.rmtree(root, ignore_errors=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
