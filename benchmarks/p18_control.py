#!/usr/bin/env python3
"""P18: the command line beside the running daemon (issue 29), against the raw
commands, in one run.

One `rbd-reconciler run` (resyncSeconds 3600: only file events and the
command line start passes) on a disposable local cluster (1 mon + 1 memstore
OSD, fuse mapper). Each trial interleaves, pairwise:

- apply vs raw: a new Volume file (256 MiB, ext4, one publish target)
  renamed into desiredDir, then `rbd-reconciler apply NAME` (a cold CLI
  process, answered by the daemon through its control socket), timed from
  the rename to the CLI's exit, vs P1's raw sequence in bash (rbd create,
  rbd-fuse, losetup --direct-io=on, mkfs.ext4, mount, mount --bind);
- release vs raw: `rbd-reconciler release NAME` through the daemon vs the
  raw teardown in bash (umount target, umount staging, losetup -d, umount
  the FUSE mount), and vs the same job by hand on another raw volume: that
  teardown, then waiting for rbd-fuse to exit and removing the node's claim
  (`rbd image-meta remove`), as `release` does before it answers so that
  another node may map the image at once.

Then, with --status-volumes (200) image-only volumes present and converged
(images made with the rbd binding first, as P13 does), --status-trials cold
`rbd-reconciler status` (and `status -o json`) answered by the daemon, and
for comparison the same command alone (a config naming a control socket
nobody serves: it observes the node and Ceph itself).

Every CLI run is a fresh process with the package's bytecode cached (one
untimed warm-up of each first). Printed: each trial, medians, the median of
the per-trial ratios, and the goals (issue 29: apply <= 1.2x, release <= 2x,
status of 200 volumes <= 50 ms). Everything is swept and the cluster stopped
at the end (also on failure or Ctrl-C).

Usage: .venv/bin/python benchmarks/p18_control.py [--trials 11] [--status-trials 21]
       [--status-volumes 200]
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (
    CMD_TIMEOUT,
    CONFIG_YAML,
    FEATURES,
    SHELL_SEQUENCE,
    BenchError,
    DaemonProc,
    assert_clean,
    assert_published,
    cleanup,
    find_cli,
    fuse_pids_under,
    mounts_under,
    pct,
    run,
    signals_ignored,
    signals_raise,
    status,
    sweep,
    wait_exit,
)

from reconciler.drivers.reaper import become_subreaper, reap_zombies
from reconciler.facts import meta
from reconciler.testing.devcluster import DevCluster, start_cluster

GOALS = {"apply": 1.2, "release": 2.0}
STATUS_GOAL_S = 0.050
WAIT_S = 120.0
POLL_S = 0.005

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

IMAGE_ONLY = """\
apiVersion: rbd-reconciler/v1
kind: Volume
metadata:
  name: {name}
spec:
  image:
    pool: {pool}
    size: 4Mi
"""

RAW_TEARDOWN = """\
set -euo pipefail
umount "$1"
umount "$2"
losetup -d "$3"
umount "$4"
"""
# The same job as `release`: the helper gone (exited: a zombie counts, its
# parent here reaps later) and the claim dropped in Ceph.
SAME_JOB = RAW_TEARDOWN + """\
while read -r _ _ st _ 2>/dev/null <"/proc/$5/stat" && [[ $st != Z ]]; do :; done
rbd image-meta remove -c "$6" "$7" "$8"
"""


def timed(argv: list[str]) -> tuple[float, subprocess.CompletedProcess[str]]:
    t0 = time.perf_counter()
    r = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                       timeout=CMD_TIMEOUT)
    return time.perf_counter() - t0, r


class Bench:
    def __init__(self, root: Path, cluster: DevCluster, cli: Path, daemon: DaemonProc) -> None:
        self.root, self.cluster, self.cli, self.daemon = root, cluster, cli, daemon
        self.desired, self.state = root / "desired", root / "state"
        self.config = root / "config.yaml"
        # The same node, but a control socket nobody serves: the CLI alone.
        self.alone = root / "alone.yaml"
        self.alone.write_text(self.config.read_text().replace(
            f"controlSocket: {self.state}/control.sock", f"controlSocket: {root}/none.sock"))

    def argv(self, *args: str, config: Path | None = None) -> list[str]:
        return [str(self.cli), "--config", str(config or self.config), *args]

    def rbd_rm(self, name: str) -> None:
        run(["rbd", "-c", str(self.cluster.conf), "rm", "--no-progress",
             f"{self.cluster.pool}/{name}"])

    def wait_phase(self, names: list[str], phase: str) -> None:
        end = time.monotonic() + WAIT_S * max(1, len(names) / 100)
        left = set(names)
        while left:
            left = {n for n in left if status(self.state, n).get("phase") != phase}
            if left and time.monotonic() > end:
                raise BenchError(f"not {phase}: {sorted(left)[:3]}; log:\n{self.daemon.tail()}")
            self.daemon.check_alive()
            time.sleep(POLL_S)

    # -- one volume through the daemon: apply, then release ----------------------------
    def ours(self, name: str) -> tuple[float, float]:
        target = self.root / "pub" / name
        tmp = self.root / "incoming" / f"{name}.yaml"
        tmp.write_text(VOLUME_YAML.format(name=name, pool=self.cluster.pool,
                                          features=", ".join(FEATURES), target=target))
        t0 = time.perf_counter()
        os.rename(tmp, self.desired / f"{name}.yaml")
        r = subprocess.run(self.argv("apply", name), capture_output=True, text=True,
                           stdin=subprocess.DEVNULL, timeout=CMD_TIMEOUT)
        a = time.perf_counter() - t0
        if r.returncode != 0 or f"changed: [{name}]" not in r.stdout:
            raise BenchError(f"apply exited {r.returncode}:\n{r.stdout}{r.stderr}")
        assert_published(target, self.state / "staging" / name)
        fuse = fuse_pids_under(self.root)
        rel, r = timed(self.argv("release", name))
        if r.returncode != 0 or f"changed: [{name}]" not in r.stdout:
            raise BenchError(f"release exited {r.returncode}:\n{r.stdout}{r.stderr}")
        if mounts_under(self.root / "pub") or mounts_under(self.state / "staging"):
            raise BenchError("release left mounts")
        # Untimed: the file goes (its volume is released already), the image too.
        (self.desired / f"{name}.yaml").unlink()
        self.wait_phase([name], "Released")
        for pid in fuse:
            wait_exit(pid)
        self.rbd_rm(name)
        reap_zombies()
        assert_clean(self.root)
        return a, rel

    def raw(self, name: str, same_job: bool = False) -> tuple[float, float]:
        base = self.root / "shell"
        mnt, staging, target = base / "fuse" / name, base / "staging" / name, base / "pub" / name
        a, r = timed(["bash", "-c", SHELL_SEQUENCE, "p18-raw", str(self.cluster.conf),
                      self.cluster.pool, name, str(mnt), str(staging), str(target),
                      str(base / f"{name}.fuse.log")])
        if r.returncode != 0:
            raise BenchError(f"raw sequence exited {r.returncode}:\n{r.stdout}{r.stderr}")
        out = dict(ln.split("=", 1) for ln in r.stdout.splitlines() if "=" in ln)
        assert_published(target, staging)
        spec = f"{self.cluster.pool}/{name}"
        if same_job:  # untimed: the claim a node holds, as `apply` takes it
            run(["rbd", "image-meta", "set", "-c", str(self.cluster.conf), spec, meta.HOLDER,
                 "p18-raw"])
        rel, r = timed(["bash", "-c", SAME_JOB if same_job else RAW_TEARDOWN,
                        "p18-raw-teardown", str(target), str(staging), out["dev"], str(mnt),
                        out["fuse_pid"], str(self.cluster.conf), spec, meta.HOLDER])
        if r.returncode != 0:
            raise BenchError(f"raw teardown exited {r.returncode}:\n{r.stdout}{r.stderr}")
        problems = sweep(base)
        if problems:
            raise BenchError("; ".join(problems))
        self.rbd_rm(name)
        assert_clean(self.root)
        return a, rel

    # -- status of many volumes ---------------------------------------------------------
    def add_image_only(self, count: int) -> list[str]:
        import rados
        import rbd

        names = [f"p18-s{i:04}" for i in range(count)]
        with rados.Rados(conffile=str(self.cluster.conf), rados_id=self.cluster.user,
                         conf={"keyring": str(self.cluster.keyring)}) as c, \
                c.open_ioctx(self.cluster.pool) as io:
            for n in names:
                rbd.RBD().create(io, n, 4 << 20)
        for n in names:
            (self.desired / f"{n}.yaml").write_text(IMAGE_ONLY.format(name=n,
                                                                       pool=self.cluster.pool))
        self.wait_phase(names, "Created")
        return names

    def status(self, *args: str, config: Path | None = None, rows: int) -> float:
        t, r = timed(self.argv("status", *args, config=config))
        if r.returncode != 0 or r.stdout.count("p18-s") < rows:
            raise BenchError(f"status {' '.join(args)} exited {r.returncode}:\n"
                             f"{r.stdout[-2000:]}{r.stderr}")
        return t


def report(label: str, ours: list[float], raw: list[float], goal: float) -> None:
    mo, mr = statistics.median(ours), statistics.median(raw)
    ratios = [o / r for o, r in zip(ours, raw, strict=True)]
    mratio = statistics.median(ratios)
    print(f"{label:<8} median {mo * 1000:7.1f} ms vs raw {mr * 1000:7.1f} ms: ratio of medians "
          f"{mo / mr:.2f}, median paired ratio {mratio:.2f} (min {min(ratios):.2f}, max "
          f"{max(ratios):.2f}; n={len(ratios)}); goal <= {goal}: "
          f"{'met' if mratio <= goal else 'NOT met'}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--trials", type=int, default=11, help="apply/release trials (default 11)")
    ap.add_argument("--status-trials", type=int, default=21, help="status runs (default 21)")
    ap.add_argument("--status-volumes", type=int, default=200,
                    help="image-only volumes for status (default 200; 0 skips it)")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("p18_control: needs root (mount, losetup, FUSE)", file=sys.stderr)
        return 2
    become_subreaper()
    root = Path(tempfile.mkdtemp(prefix="rbd-bench-p18-"))
    os.chmod(root, 0o755)
    cluster: DevCluster | None = None
    daemon: DaemonProc | None = None
    rc = 1
    with signals_raise():
        try:
            cluster = start_cluster(root=root / "ceph", memstore_bytes=4 << 30)
            for sub in ("desired", "state", "incoming"):
                (root / sub).mkdir(mode=0o755)
            config = root / "config.yaml"
            config.write_text(CONFIG_YAML.format(
                desired=root / "desired", state=root / "state", conf=cluster.conf,
                user=cluster.user, keyring=cluster.keyring, root=root)
                + "resyncSeconds: 3600\n")
            cli = find_cli()
            daemon = DaemonProc(root, cli, config)
            daemon.wait_ready()
            b = Bench(root, cluster, cli, daemon)
            print(f"cluster up (pool {cluster.pool}); workdir {root}; "
                  f"load {os.getloadavg()[0]:.2f}", flush=True)
            b.ours("p18-warm")  # untimed warm-up: page cache, bytecode, the OSD
            b.raw("p18-warmraw")
            b.raw("p18-warmsame", same_job=True)
            res: dict[str, list[float]] = {k: [] for k in (
                "apply", "apply-raw", "release", "release-raw", "release-same")}
            for i in range(args.trials):
                a, rel = b.ours(f"p18-a{i}")
                ra, rrel = b.raw(f"p18-r{i}")
                _, rsame = b.raw(f"p18-s{i}", same_job=True)
                for k, x in zip(res, (a, ra, rel, rrel, rsame), strict=True):
                    res[k].append(x)
                print(f"trial {i + 1}: apply {a * 1000:6.1f} / raw {ra * 1000:6.1f} ms; "
                      f"release {rel * 1000:6.1f} / raw {rrel * 1000:5.1f} ms / the same job "
                      f"by hand {rsame * 1000:5.1f} ms", flush=True)
            through: dict[str, list[float]] = {"human": [], "json": [], "alone": []}
            if args.status_volumes:
                n = args.status_volumes
                t0 = time.monotonic()
                b.add_image_only(n)
                print(f"{n} image-only volumes made and converged in "
                      f"{time.monotonic() - t0:.1f} s", flush=True)
                b.status(rows=n)  # warm-up (bytecode; the daemon's rows)
                b.status(config=b.alone, rows=n)
                for _ in range(args.status_trials):
                    through["human"].append(b.status(rows=n))
                    through["json"].append(b.status("-o", "json", rows=n))
                    through["alone"].append(b.status(config=b.alone, rows=n))
            print(f"\nP18 (load {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs)")
            report("apply", res["apply"], res["apply-raw"], GOALS["apply"])
            report("release", res["release"], res["release-raw"], GOALS["release"])
            print("  the same job by hand (the teardown, rbd-fuse's exit waited for, the "
                  "claim removed with `rbd image-meta remove`):")
            report("release", res["release"], res["release-same"], GOALS["release"])
            if through["human"]:
                for label, key in (("status", "human"), ("status -o json", "json"),
                                   ("status alone", "alone")):
                    xs = through[key]
                    goal = "" if key == "alone" else (
                        f"; goal <= {STATUS_GOAL_S * 1000:.0f} ms: "
                        f"{'met' if statistics.median(xs) <= STATUS_GOAL_S else 'NOT met'}")
                    print(f"{label:<15} of {args.status_volumes} volumes: p50 "
                          f"{pct(xs, 50) * 1000:6.1f} ms, p99 {pct(xs, 99) * 1000:6.1f} ms "
                          f"(n={len(xs)}){goal}")
            rc = 0
        except (BenchError, subprocess.TimeoutExpired, OSError) as e:
            print(f"p18_control: {e}", file=sys.stderr)
        except KeyboardInterrupt:
            print("\np18_control: interrupted; cleaning up", file=sys.stderr)
            rc = 130
        finally:
            with signals_ignored():
                problems = []
                if daemon is not None and daemon.stop() not in (0, None):
                    problems.append("the daemon did not exit 0")
                rc = cleanup(root, cluster, problems) or rc
    return rc


if __name__ == "__main__":
    sys.exit(main())
