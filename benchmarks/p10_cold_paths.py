#!/usr/bin/env python3
"""P10: the cold CLI paths against the raw commands they run, in one run.

On one disposable local cluster (1 mon + 1 memstore OSD, fuse mapper), each
trial interleaves, pairwise:

- apply vs raw: `rbd-reconciler apply DIR` of one new Volume (256 MiB, ext4,
  one publish target) vs P1's raw sequence in bash (rbd create, rbd-fuse,
  losetup --direct-io=on, mkfs.ext4, mount, mount --bind);
- release vs raw: `rbd-reconciler release DIR` of that volume vs the raw
  teardown in bash (umount target, umount staging, losetup -d, umount the
  FUSE mount; like release, not waiting for rbd-fuse to exit);
- validate vs bare: `rbd-reconciler validate FILE` (one valid file) vs
  `/usr/bin/python3 -c pass`;

then, --many-trials times, interleaved:

- apply-8: one `apply` of 8 new volumes with `parallel: 4` vs the same 8 raw
  sequences started at once (8 bash processes, waited for together).

Every CLI run is a fresh process with the package's bytecode cached (as an
installed package has it; setup.sh byte-compiles it, and one untimed warm-up
of each command runs first). Printed: each trial, the medians, the median
of the per-trial ratios and the goals (issue 17: apply <= 1.4x, release <=
2x, apply-8 <= 1.1x). Teardown of each trial is untimed except where it is
the thing measured; everything is swept and the cluster stopped at the end
(also on failure or Ctrl-C).

Usage: .venv/bin/python benchmarks/p10_cold_paths.py [--trials 11] [--many-trials 3]
Needs root, FUSE and loop devices.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from harness import (  # noqa: E402
    CMD_TIMEOUT,
    CONFIG_YAML,
    FEATURES,
    SHELL_SEQUENCE,
    BenchError,
    assert_clean,
    assert_published,
    cleanup,
    find_cli,
    run,
    signals_ignored,
    signals_raise,
    sweep,
)

from reconciler.drivers.reaper import become_subreaper, reap_zombies  # noqa: E402
from reconciler.testing.devcluster import DevCluster, start_cluster  # noqa: E402

GOALS = {"apply": 1.4, "release": 2.0, "apply-8": 1.1}
MANY = 8
PARALLEL = 4

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

RAW_TEARDOWN = """\
set -euo pipefail
umount "$1"
umount "$2"
losetup -d "$3"
umount "$4"
"""


def timed(argv: list[str], timeout: float = CMD_TIMEOUT
          ) -> tuple[float, subprocess.CompletedProcess[str]]:
    t0 = time.perf_counter()
    r = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                       timeout=timeout)
    return time.perf_counter() - t0, r


class Bench:
    def __init__(self, root: Path, cluster: DevCluster, cli: Path) -> None:
        self.root, self.cluster, self.cli = root, cluster, cli
        self.config = root / "config.yaml"
        self.config.write_text(CONFIG_YAML.format(
            desired=root / "desired", state=root / "state", conf=cluster.conf,
            user=cluster.user, keyring=cluster.keyring, root=root)
            + f"parallel: {PARALLEL}\n")

    def rbd_rm(self, name: str) -> None:
        run(["rbd", "-c", str(self.cluster.conf), "rm", "--no-progress",
             f"{self.cluster.pool}/{name}"])

    def write(self, desired: Path, name: str) -> Path:
        desired.mkdir(parents=True, exist_ok=True)
        f = desired / f"{name}.yaml"
        f.write_text(VOLUME_YAML.format(name=name, pool=self.cluster.pool,
                                        features=", ".join(FEATURES),
                                        target=self.root / "pub" / name))
        return f

    def cli_argv(self, *args: str) -> list[str]:
        return [str(self.cli), "--config", str(self.config), *args]

    # -- one volume: apply, then release ------------------------------------------------
    def ours(self, name: str) -> tuple[float, float]:
        desired = self.root / "desired" / name
        self.write(desired, name)
        a, r = timed(self.cli_argv("apply", str(desired)))
        if r.returncode != 0 or f"changed: [{name}]" not in r.stdout:
            raise BenchError(f"apply exited {r.returncode}:\n{r.stdout}{r.stderr}")
        assert_published(self.root / "pub" / name, self.root / "state" / "staging" / name)
        rel, r = timed(self.cli_argv("release", str(desired)))
        if r.returncode != 0 or f"changed: [{name}]" not in r.stdout:
            raise BenchError(f"release exited {r.returncode}:\n{r.stdout}{r.stderr}")
        holder = run(["rbd", "-c", str(self.cluster.conf), "image-meta", "get",
                      f"{self.cluster.pool}/{name}", "rbd-reconciler.holder"], check=False)
        if holder.returncode == 0:
            raise BenchError(f"release left the holder record: {holder.stdout.strip()}")
        self.rbd_rm(name)
        reap_zombies()
        assert_clean(self.root)
        return a, rel

    def raw(self, name: str) -> tuple[float, float]:
        base = self.root / "shell"
        mnt, staging, target = base / "fuse" / name, base / "staging" / name, base / "pub" / name
        a, r = timed(["bash", "-c", SHELL_SEQUENCE, "p10-raw", str(self.cluster.conf),
                      self.cluster.pool, name, str(mnt), str(staging), str(target),
                      str(base / f"{name}.fuse.log")])
        if r.returncode != 0:
            raise BenchError(f"raw sequence exited {r.returncode}:\n{r.stdout}{r.stderr}")
        out = dict(ln.split("=", 1) for ln in r.stdout.splitlines() if "=" in ln)
        assert_published(target, staging)
        rel, r = timed(["bash", "-c", RAW_TEARDOWN, "p10-raw-teardown", str(target),
                        str(staging), out["dev"], str(mnt)])
        if r.returncode != 0:
            raise BenchError(f"raw teardown exited {r.returncode}:\n{r.stdout}{r.stderr}")
        problems = sweep(base)  # waits for (and reaps) the rbd-fuse that just lost its mount
        if problems:
            raise BenchError("; ".join(problems))
        self.rbd_rm(name)
        assert_clean(self.root)
        return a, rel

    # -- validate --------------------------------------------------------------------
    def validate(self) -> tuple[float, float]:
        f = self.write(self.root / "validate", "valid")
        v, r = timed(self.cli_argv("validate", str(f)))
        if r.returncode != 0:
            raise BenchError(f"validate exited {r.returncode}:\n{r.stdout}{r.stderr}")
        bare, _ = timed(["/usr/bin/python3", "-c", "pass"])
        return v, bare

    # -- 8 volumes at once -----------------------------------------------------------
    def ours_many(self, tag: str) -> float:
        desired = self.root / "desired" / tag
        names = [f"{tag}-{i}" for i in range(MANY)]
        for n in names:
            self.write(desired, n)
        t, r = timed(self.cli_argv("apply", str(desired)))
        if r.returncode != 0 or f"changed={MANY}" not in r.stdout:
            raise BenchError(f"apply of {MANY} exited {r.returncode}:\n{r.stdout}{r.stderr}")
        run(self.cli_argv("release", str(desired)))
        for n in names:
            self.rbd_rm(n)
        reap_zombies()
        assert_clean(self.root)
        return t

    def raw_many(self, tag: str) -> float:
        base = self.root / "shell"
        procs = []
        t0 = time.perf_counter()
        for i in range(MANY):
            n = f"{tag}-{i}"
            procs.append(subprocess.Popen(
                ["bash", "-c", SHELL_SEQUENCE, "p10-raw", str(self.cluster.conf),
                 self.cluster.pool, n, str(base / "fuse" / n), str(base / "staging" / n),
                 str(base / "pub" / n), str(base / f"{n}.fuse.log")],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True))
        outs = [p.communicate(timeout=CMD_TIMEOUT) for p in procs]
        t = time.perf_counter() - t0
        bad = [f"{o}{e}" for p, (o, e) in zip(procs, outs, strict=True) if p.returncode]
        problems = sweep(base)
        for i in range(MANY):
            self.rbd_rm(f"{tag}-{i}")
        if bad or problems:
            raise BenchError("; ".join(bad + problems))
        assert_clean(self.root)
        return t


def report(label: str, ours: list[float], raw: list[float], raw_label: str,
           goal: float | None) -> None:
    mo, mr = statistics.median(ours), statistics.median(raw)
    ratios = [o / r for o, r in zip(ours, raw, strict=True)]
    mratio = statistics.median(ratios)
    verdict = "" if goal is None else (
        f"; goal <= {goal}: {'met' if mratio <= goal else 'NOT met'}")
    print(f"{label:<9} median {mo * 1000:7.1f} ms vs {raw_label} {mr * 1000:7.1f} ms: "
          f"ratio of medians {mo / mr:.2f}, median paired ratio {mratio:.2f} "
          f"(min {min(ratios):.2f}, max {max(ratios):.2f}; n={len(ratios)}){verdict}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=11, help="one-volume trials (default 11)")
    ap.add_argument("--many-trials", type=int, default=3,
                    help=f"apply-{MANY} trials (default 3; 0 skips them)")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("p10_cold_paths: needs root (mount, losetup, FUSE)", file=sys.stderr)
        return 2
    become_subreaper()
    root = Path(tempfile.mkdtemp(prefix="rbd-bench-p10-"))
    os.chmod(root, 0o755)
    cluster: DevCluster | None = None
    rc = 1
    with signals_raise():
        try:
            cluster = start_cluster(root=root / "ceph", memstore_bytes=4 << 30)
            b = Bench(root, cluster, find_cli())
            print(f"cluster up (pool {cluster.pool}); workdir {root}; "
                  f"load {os.getloadavg()[0]:.2f}", flush=True)
            b.ours("p10-warm")  # untimed warm-up: page cache, bytecode, the OSD
            b.raw("p10-warmraw")
            b.validate()
            res: dict[str, list[float]] = {k: [] for k in (
                "apply", "apply-raw", "release", "release-raw", "validate", "bare")}
            for i in range(args.trials):
                a, rel = b.ours(f"p10-a{i}")
                ra, rrel = b.raw(f"p10-r{i}")
                v, bare = b.validate()
                for k, x in zip(res, (a, ra, rel, rrel, v, bare), strict=True):
                    res[k].append(x)
                print(f"trial {i + 1}: apply {a * 1000:6.1f} / raw {ra * 1000:6.1f} ms; "
                      f"release {rel * 1000:6.1f} / raw {rrel * 1000:5.1f} ms; "
                      f"validate {v * 1000:5.1f} / bare python {bare * 1000:5.1f} ms",
                      flush=True)
            many, many_raw = [], []
            for i in range(args.many_trials):
                many.append(b.ours_many(f"p10-m{i}"))
                many_raw.append(b.raw_many(f"p10-n{i}"))
                print(f"apply-{MANY} trial {i + 1}: {many[-1] * 1000:6.0f} ms vs {MANY} raw "
                      f"at once {many_raw[-1] * 1000:6.0f} ms", flush=True)
            print(f"\nP10 (load {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs)")
            report("apply", res["apply"], res["apply-raw"], "raw", GOALS["apply"])
            report("release", res["release"], res["release-raw"], "raw", GOALS["release"])
            report("validate", res["validate"], res["bare"], "bare python3", None)
            if many:
                report(f"apply-{MANY}", many, many_raw, f"{MANY} raw at once", GOALS["apply-8"])
            rc = 0
        except BenchError as e:
            print(f"p10_cold_paths: {e}", file=sys.stderr)
        except KeyboardInterrupt:
            print("\np10_cold_paths: interrupted; cleaning up", file=sys.stderr)
            rc = 130
        finally:
            with signals_ignored():
                rc = cleanup(root, cluster) or rc
    return rc


if __name__ == "__main__":
    sys.exit(main())
