#!/usr/bin/env python3
"""P1: one volume from absent to PUBLISHED — `rbd-reconciler apply` vs a plain shell.

What is measured: the wall-clock time of bringing one fresh 256 MiB RBD image
all the way to a published ext4 bind mount, two ways, on the same disposable
local Ceph cluster (reconciler.testing.devcluster, 1 mon + 1 memstore OSD):

- apply: `.venv/bin/rbd-reconciler --config CFG apply DIR` run as a subprocess
  (so Python start-up, imports, config/spec loading, observe, plan, the
  image-meta bookkeeping and every command it runs are all counted), with
  DIR holding one Volume file (mapper fuse, stage ext4, one publish target).
- shell: one `bash -c` running the same operations by hand:
  rbd create (same features) -> rbd-fuse (background, wait for the mount) ->
  losetup --direct-io=on -> mkfs.ext4 (same options as the reconciler) ->
  mount -> mount --bind.

Runs are interleaved (apply, shell, apply, shell, ...), each with a fresh image
name. Teardown happens after each run, outside the timed region: for apply,
`rbd-reconciler release` then `rbd rm`; for the shell, umount target, umount
staging, losetup -d, umount the FUSE mount, wait for rbd-fuse to exit, rbd rm.
Printed: each run's time, both medians and the ratio apply/shell (target <= 1.10).

Everything lives under one temporary directory (cluster state included). On
any failure or Ctrl-C a sweep unmounts whatever is mounted under it (binds and
filesystems, then loop devices, then FUSE mounts), waits for (or kills, by pid)
the rbd-fuse processes this run started, stops the cluster and removes the dir.

Usage: .venv/bin/python benchmarks/p1_publish.py [--runs N] [--profile]
(--profile: one extra untimed run of each, apply under cProfile and the shell under
xtrace, printing where the time goes.)
Needs root, FUSE and loop devices (see /work/shared/DESIGN.md).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout: import this tree's reconciler

from harness import (  # noqa: E402  (the helpers all benchmarks share)
    CMD_TIMEOUT,
    CONFIG_YAML,
    FEATURES,
    SHELL_SEQUENCE,
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

from reconciler.drivers.reaper import become_subreaper, reap_zombies  # noqa: E402
from reconciler.testing.devcluster import DevCluster, start_cluster  # noqa: E402

TARGET_RATIO = 1.10

VOLUME_YAML = """\
apiVersion: rbd-reconciler/v1
kind: Volume
metadata:
  name: {name}
spec:
  image:
    pool: {pool}
    size: 256Mi
    features: [{features}]
  map:
    mapper: fuse
  stage:
    fsType: ext4
  publish:
    - path: {target}
"""


# --profile: each traced shell command is printed with the wall time stamp it started at.
TRACE_PREFIX = "PS4='+${EPOCHREALTIME} '; set -x\n"


# --- small helpers ------------------------------------------------------------------------


# --- the two contenders ---------------------------------------------------------------------


def apply_run(env: Env, name: str, profile: Path | None = None) -> float:
    desired = env.root / "desired" / name
    desired.mkdir(parents=True)
    target = env.root / "pub" / name
    (desired / f"{name}.yaml").write_text(VOLUME_YAML.format(
        name=name, pool=env.pool, features=", ".join(FEATURES), target=target))
    argv = [str(env.cli), "--config", str(env.config), "apply", str(desired)]
    if profile is not None:
        argv = [sys.executable, "-m", "cProfile", "-o", str(profile), *argv]

    t0 = time.perf_counter()
    r = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                       timeout=CMD_TIMEOUT)
    elapsed = time.perf_counter() - t0

    if r.returncode != 0 or f"changed: [{name}]" not in r.stdout:
        raise BenchError(f"apply exited {r.returncode}:\n{r.stdout}{r.stderr}")
    assert_published(target, env.root / "state" / "staging" / name)

    # teardown (untimed): release, wait for its rbd-fuse to go, remove the image
    fuse = fuse_pids_under(env.root)
    run([str(env.cli), "--config", str(env.config), "release", str(desired)])
    for pid in fuse:
        wait_exit(pid)
    run(["rbd", "-c", str(env.cluster.conf), "rm", "--no-progress", f"{env.pool}/{name}"])
    reap_zombies()
    assert_clean(env.root)
    return elapsed


def shell_run(env: Env, name: str, trace: list[str] | None = None) -> float:
    base = env.root / "shell"
    mnt, staging, target = base / "fuse" / name, base / "staging" / name, base / "pub" / name
    script = SHELL_SEQUENCE if trace is None else TRACE_PREFIX + SHELL_SEQUENCE
    argv = ["bash", "-c", script, "p1-shell", str(env.cluster.conf), env.pool, name,
            str(mnt), str(staging), str(target), str(base / f"{name}.fuse.log")]

    t0 = time.perf_counter()
    r = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                       timeout=CMD_TIMEOUT)
    elapsed = time.perf_counter() - t0

    if r.returncode != 0:
        raise BenchError(f"shell sequence exited {r.returncode}:\n{r.stdout}{r.stderr}")
    out = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)
    fuse_pid, dev = int(out["fuse_pid"]), out["dev"]
    if trace is not None:
        trace.extend(line for line in r.stderr.splitlines() if line.startswith("+"))
        trace.append(f"+{time.time():.6f} (end)")
    assert_published(target, staging)

    # teardown (untimed), in the order the design demands
    umount(str(target))
    umount(str(staging))
    run(["losetup", "-d", dev])
    umount(str(mnt))
    wait_exit(fuse_pid)
    run(["rbd", "-c", str(env.cluster.conf), "rm", "--no-progress", f"{env.pool}/{name}"])
    reap_zombies()
    assert_clean(env.root)
    return elapsed


# --- --profile: where the time goes ---------------------------------------------------------

# (label, file suffix, function name): cumulative times read from the apply's cProfile.
APPLY_PARTS = (
    ("import reconciler.cli.main (rados, rbd, jsonschema, sh...)", "reconciler/cli/main.py",
     "<module>"),
    ("load_config", "reconciler/spec/config.py", "load_config"),
    ("loader.load", "reconciler/spec/loader.py", "load"),
    ("schemas.validator: compiling the JSON schemas (in both)", "reconciler/spec/schemas.py",
     "validator"),
    ("observe", "reconciler/observe/node.py", "observe"),
    ("plan", "reconciler/plan/planner.py", "plan"),
    ("ceph.connect: librados connect+shutdown (x2 per session)",
     "reconciler/drivers/ceph.py", "connect"),
    ("apply", "reconciler/apply/runner.py", "apply"),
    ("  create image + meta", "reconciler/drivers/ceph.py", "create_image"),
    ("  map (rbd-fuse + losetup)", "reconciler/drivers/fusemapper.py", "map"),
    ("    of which rbd-fuse start/mount wait", "reconciler/drivers/fusemapper.py", "_start_fuse"),
    ("  format (probe, meta, mkfs)", "reconciler/apply/devicesteps.py", "format"),
    ("  stage (mount)", "reconciler/apply/devicesteps.py", "stage"),
    ("  publish (bind)", "reconciler/drivers/fs.py", "bind"),
)


def _find(stats: dict, suffix: str, name: str) -> tuple[int, float] | None:
    """(calls, cumulative seconds) of one function, summed over same-named matches."""
    hits = [(v[1], v[3]) for (fn, _, fname), v in stats.items()
            if fn.endswith(suffix) and fname == name]
    return (sum(h[0] for h in hits), sum(h[1] for h in hits)) if hits else None


def explain_apply(profile: Path, wall: float) -> None:
    import pstats

    stats = pstats.Stats(str(profile)).stats  # type: ignore[attr-defined]
    print(f"\napply breakdown (one extra run under cProfile: {wall * 1000:.0f} ms wall; "
          "profiling inflates pure-Python parts):")
    for label, suffix, name in APPLY_PARTS:
        hit = _find(stats, suffix, name)
        if hit is not None:
            print(f"  {label:<56} {hit[1] * 1000:7.1f} ms  x{hit[0]}")
    run = [(k, v) for k, v in stats.items()
           if k[0].endswith("reconciler/drivers/run.py") and k[2] == "run"]
    if not run:
        return
    (_, (_, calls, _, cum, callers)), = run
    print(f"  external commands through drivers.run.Runner.run: {calls} calls, "
          f"{cum * 1000:.0f} ms:")
    for (fn, _, fname), (_, ncalls, _, ct) in sorted(callers.items(), key=lambda kv: -kv[1][3]):
        where = "/".join(Path(fn).parts[-2:])
        print(f"    {where}:{fname:<14} {ct * 1000:7.1f} ms  x{ncalls}  "
              f"({ct / ncalls * 1000:.0f} ms each)")
    cleanup = _find(stats, "sh/__init__.py", "_process_exit_cleanup")
    if cleanup is not None:
        print(f"    of which in sh's _process_exit_cleanup (joining sh's helper threads "
              f"after the command ended): {cleanup[1] * 1000:.0f} ms")


def explain_shell(trace: list[str]) -> None:
    print("\nshell breakdown (bash xtrace with $EPOCHREALTIME; time until the next command):")
    stamped = []
    for line in trace:
        head, _, cmd = line.partition(" ")
        with contextlib.suppress(ValueError):
            stamped.append((float(head.lstrip("+")), head.count("+"), cmd))
    for (t, depth, cmd), (t_next, _, _) in itertools.pairwise(stamped):
        if len(cmd) > 90:
            cmd = cmd[:87] + "..."
        print(f"  {(t_next - t) * 1000:7.1f} ms  {'  ' * (depth - 1)}{cmd}")


# --- driver ---------------------------------------------------------------------------------


def summary(apply_times: list[float], shell_times: list[float]) -> None:
    a, s = statistics.median(apply_times), statistics.median(shell_times)
    ratio = a / s
    print()
    print(f"apply  median {a * 1000:8.1f} ms   (min {min(apply_times) * 1000:.1f}, "
          f"max {max(apply_times) * 1000:.1f})")
    print(f"shell  median {s * 1000:8.1f} ms   (min {min(shell_times) * 1000:.1f}, "
          f"max {max(shell_times) * 1000:.1f})")
    print(f"ratio apply/shell (medians): {ratio:.2f}  "
          f"(target <= {TARGET_RATIO:.2f}: {'met' if ratio <= TARGET_RATIO else 'NOT met'}; "
          f"apply overhead {(a - s) * 1000:+.0f} ms)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--runs", type=int, default=7, help="timed runs of each (default 7)")
    p.add_argument("--profile", action="store_true",
                   help="afterwards, one more (untimed) run of each: apply under cProfile, "
                        "the shell under xtrace; print where the time goes")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("p1_publish: needs root (mount, losetup, FUSE)", file=sys.stderr)
        return 2

    become_subreaper()  # orphaned rbd-fuse processes come back to us to be reaped
    root = Path(tempfile.mkdtemp(prefix="rbd-bench-p1-"))
    cluster: DevCluster | None = None
    rc = 1
    with signals_raise():
        try:
            t0 = time.perf_counter()
            cluster = start_cluster(root=root / "ceph")
            print(f"cluster up in {time.perf_counter() - t0:.1f}s "
                  f"(mon {cluster.mon_addr}, pool {cluster.pool}); workdir {root}")
            config = root / "config.yaml"
            config.write_text(CONFIG_YAML.format(
                desired=root / "desired", state=root / "state", conf=cluster.conf,
                user=cluster.user, keyring=cluster.keyring, root=root))
            env = Env(root=root, cluster=cluster, config=config, cli=find_cli())

            apply_times: list[float] = []
            shell_times: list[float] = []
            for i in range(1, args.runs + 1):
                a = apply_run(env, f"p1-apply-{i}")
                apply_times.append(a)
                s = shell_run(env, f"p1-shell-{i}")
                shell_times.append(s)
                print(f"run {i}: apply {a * 1000:7.1f} ms   shell {s * 1000:7.1f} ms   "
                      f"ratio {a / s:.2f}", flush=True)
            summary(apply_times, shell_times)
            if args.profile:
                prof = root / "apply.prof"
                explain_apply(prof, apply_run(env, "p1-apply-profile", profile=prof))
                trace: list[str] = []
                shell_run(env, "p1-shell-profile", trace=trace)
                explain_shell(trace)
            rc = 0
        except BenchError as e:
            print(f"p1_publish: {e}", file=sys.stderr)
        except KeyboardInterrupt:
            print("\np1_publish: interrupted; cleaning up", file=sys.stderr)
            rc = 130
        finally:
            with signals_ignored():
                rc = cleanup(root, cluster) or rc
    return rc


if __name__ == "__main__":
    sys.exit(main())
