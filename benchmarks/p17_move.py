#!/usr/bin/env python3
"""P17: a volume moved between two nodes -> published on the new node with the old one's data.

What is measured: two `rbd-reconciler run --log-format json` processes (nodes
p17-a and p17-b: two state dirs, two desired dirs, one disposable local
Ceph cluster), resyncSeconds 3600 (only events and the claim poll can make
them act), and one published ext4 volume (256Mi, rbd-fuse) whose file moves
from one node's desired directory to the other's, back and forth: the same
file, the same publish path, as one commit applied on both nodes of a fleet
repository. By default the file is renamed from one directory into the
other (both change at the same instant); t0 = time.time() just before.
Each trial first writes a token through the publish and checks it is read
back on the new node. A tight loop (1 ms sleeps) reads both daemons' logs
and the new node's status file:

- release: t0 -> the old node's unmap step ends (its claim is dropped with
  the unmap: the old node has let go);
- take: that -> the new node's status says Published, split into waited
  (-> its map step starts: how long it took to notice) and bring-up (map,
  stage, publish);
- total: t0 -> Published.

The history is checked every trial: the old node's unmap ended before the
new node's map began.

Baseline, paired and interleaved with those trials: the same move by hand on
another image (raw commands, no claim, no checks): umount the bind and the
staging mount, losetup -d, umount the rbd-fuse mount on the old side; start
rbd-fuse, losetup, mount, bind on the new side (`down` and `up`).

Printed: every trial, then p50/p99/max of each figure and the ratios of the
medians (ours / raw). `--claim-poll 0` turns the claim poll off, which is
the behaviour before it (the new node retries when its backoff ends).

Usage: .venv/bin/python benchmarks/p17_move.py [--trials N] [--claim-poll S]
       [--order rename|remove-first|add-first]
Needs root (mount, losetup, FUSE).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (
    BenchError,
    DaemonProc,
    RawMove,
    RawTimes,
    find_cli,
    fuse_pids_under,
    line,
    pct,
    run,
    signals_ignored,
    signals_raise,
    status,
    sweep,
    wait_exit,
    watch_move,
)
from harness import cleanup as harness_cleanup

from reconciler.drivers.reaper import become_subreaper, reap_zombies
from reconciler.testing.devcluster import DevCluster, start_cluster

TRIAL_TIMEOUT = 60.0  # far under the resync: a trial that waits this long failed
NODES = ("a", "b")
NAME = "p17-vol"
RAW = "p17-raw"

CONFIG = """\
desiredDir: {root}/desired
stateDir: {root}/state
controlSocket: {root}/state/control.sock
nodeName: p17-{node}
ceph:
  conf: {conf}
  user: {user}
  keyring: {keyring}
allowedRoots: [{srv}]
mapper: fuse
resyncSeconds: 3600
{events}"""

VOLUME = """\
apiVersion: rbd-reconciler/v1
kind: Volume
metadata:
  name: {name}
spec:
  image: {{pool: {pool}, size: 256Mi}}
  map: {{mapper: fuse}}
  stage: {{fsType: ext4}}
  publish:
    - path: {target}
"""


@dataclass
class Ours:
    release: float
    waited: float
    bring_up: float

    @property
    def take(self) -> float:
        return self.waited + self.bring_up

    @property
    def total(self) -> float:
        return self.release + self.take


def move(src: Path, dst: Path, order: str) -> float:
    """Returns t0: the moment the new state began to be written."""
    t0 = time.time()
    if order == "rename":
        src.rename(dst)
    elif order == "remove-first":
        text = src.read_text()
        src.unlink()
        dst.write_text(text)
    else:
        dst.write_text(src.read_text())
        src.unlink()
    return t0


class Bench:
    def __init__(self, root: Path, cluster: DevCluster, daemons: dict[str, DaemonProc]) -> None:
        self.root, self.cluster, self.daemons = root, cluster, daemons
        self.target = root / "srv" / "app"
        self.holder = "a"
        self.raw = RawMove(root / "raw", cluster, RAW, root / "srv" / "raw")

    def trial(self, order: str) -> Ours:
        old, new = self.holder, ("b" if self.holder == "a" else "a")
        token = uuid.uuid4().hex
        (self.target / "token").write_text(token)  # no fsync: the release carries it
        for d in self.daemons.values():
            d.new_lines()
        t0 = move(self.root / old / "desired" / f"{NAME}.yaml",
                  self.root / new / "desired" / f"{NAME}.yaml", order)
        seen = watch_move(self.daemons[old], self.daemons[new], self.root / new / "state", NAME,
                          (f"p17-{old}", f"p17-{new}"), TRIAL_TIMEOUT)
        if (self.target / "token").read_text() != token:
            raise BenchError("the token written on the old node is not on the new one")
        self.holder = new
        return Ours(seen.released - t0, seen.map_start - seen.released,
                    seen.published - seen.map_start)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--trials", type=int, default=7, help="moves, alternating (default 7)")
    p.add_argument("--claim-poll", type=float, default=None,
                   help="events.claimPollSeconds (default: the config's default; 0: off)")
    p.add_argument("--order", choices=("rename", "remove-first", "add-first"),
                   default="rename", help="how the file moves (default: one rename)")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("p17_move: needs root (mount, losetup, FUSE)", file=sys.stderr)
        return 2
    become_subreaper()
    root = Path(tempfile.mkdtemp(prefix="rbd-bench-p17-"))
    cluster: DevCluster | None = None
    daemons: dict[str, DaemonProc] = {}
    rc = 1
    with signals_raise():
        try:
            cluster = start_cluster(root=root / "ceph")
            (root / "srv").mkdir(mode=0o755)
            events = ("" if args.claim_poll is None else
                      f"events:\n  claimPollSeconds: {args.claim_poll:g}\n")
            for n in NODES:
                for sub in ("desired", "state"):
                    (root / n / sub).mkdir(mode=0o755, parents=True)
                (root / n / "config.yaml").write_text(CONFIG.format(
                    root=root / n, node=n, conf=cluster.conf, user=cluster.user,
                    keyring=cluster.keyring, srv=root / "srv", events=events))
            bench = Bench(root, cluster, daemons)
            bench.raw.setup()
            (root / "a" / "desired" / f"{NAME}.yaml").write_text(VOLUME.format(
                name=NAME, pool=cluster.pool, target=bench.target))
            for n in NODES:
                # --allow-mass-removal (the harness's default): each node's
                # only file comes and goes, which the guard would hold.
                daemons[n] = DaemonProc(root / n, find_cli(), root / n / "config.yaml")
                daemons[n].wait_ready()
            wait_published(root / "a" / "state", daemons["a"])
            ours: list[Ours] = []
            raws: list[RawTimes] = []
            for i in range(args.trials):
                frm = bench.holder
                o = bench.trial(args.order)
                r = bench.raw.trial()
                ours.append(o)
                raws.append(r)
                print(f"move {i + 1:2} {frm}->{bench.holder}: release {o.release * 1e3:6.1f} ms, "
                      f"take {o.take * 1e3:6.1f} ms (waited {o.waited * 1e3:6.1f}, bring-up "
                      f"{o.bring_up * 1e3:6.1f}), total {o.total * 1e3:6.1f} ms | raw: down "
                      f"{r.down * 1e3:5.1f}, up {r.up * 1e3:5.1f}, total {r.total * 1e3:5.1f} ms",
                      flush=True)
                reap_zombies()
            report(args, ours, raws)
            rc = 0
        except (BenchError, subprocess.TimeoutExpired, OSError, ValueError, KeyError) as e:
            print(f"p17_move: {e!r}", file=sys.stderr)
        except KeyboardInterrupt:
            print("\np17_move: interrupted; cleaning up", file=sys.stderr)
            rc = 130
        finally:
            with signals_ignored():
                rc = cleanup(root, cluster, daemons) or rc
    return rc


def wait_published(state: Path, daemon: DaemonProc) -> None:
    deadline = time.monotonic() + TRIAL_TIMEOUT
    while status(state, NAME).get("phase") != "Published":
        daemon.check_alive()
        if time.monotonic() > deadline:
            raise BenchError(f"{NAME} not published on p17-a; log:\n{daemon.tail()}")
        time.sleep(0.01)


def report(args: argparse.Namespace, ours: list[Ours], raws: list[RawTimes]) -> None:
    poll = "default" if args.claim_poll is None else f"{args.claim_poll:g} s"
    print(f"\nclaimPollSeconds {poll}; order {args.order}; resyncSeconds 3600; "
          f"load average {os.getloadavg()[0]:.2f}")
    series = {
        "ours: release (old node lets go)": [o.release for o in ours],
        "ours: take (-> Published on new)": [o.take for o in ours],
        "ours:   waited (-> its map starts)": [o.waited for o in ours],
        "ours:   bring-up (map..publish)": [o.bring_up for o in ours],
        "ours: total (moved -> Published)": [o.total for o in ours],
        "raw: down (old side)": [r.down for r in raws],
        "raw: up (new side)": [r.up for r in raws],
        "raw: total": [r.total for r in raws],
    }
    for label, xs in series.items():
        print(line(label, xs))

    def med(label: str) -> float:
        return pct(series[label], 50)

    print(f"ratios of the medians, ours / raw: release / down "
          f"{med('ours: release (old node lets go)') / med('raw: down (old side)'):.2f}, "
          f"take / up {med('ours: take (-> Published on new)') / med('raw: up (new side)'):.2f}, "
          f"total {med('ours: total (moved -> Published)') / med('raw: total'):.2f}")


def cleanup(root: Path, cluster: DevCluster | None, daemons: dict[str, DaemonProc]) -> int:
    problems: list[str] = []
    for n, d in daemons.items():
        rc = d.stop()
        if rc not in (0, None):
            problems.append(f"daemon p17-{n} exited {rc}")
    reap_zombies()
    if cluster is not None:
        fuse = fuse_pids_under(root)
        for n in NODES:
            if not (root / n / "desired" / f"{NAME}.yaml").exists():
                continue
            try:
                r = run([str(find_cli()), "--config", str(root / n / "config.yaml"), "release"],
                        check=False)
                if r.returncode:
                    problems.append(f"release on p17-{n} exited {r.returncode}: "
                                    f"{r.stdout}{r.stderr}")
            except (BenchError, subprocess.TimeoutExpired) as e:
                problems.append(f"release on p17-{n}: {e}")
        # Every mount under root down (the raw side's too) before the images
        # go; the harness's cleanup sweeps again, finding nothing.
        problems += sweep(root)
        for pid in fuse:
            wait_exit(pid)
        for image in (NAME, RAW):
            try:
                run(["rbd", "-c", str(cluster.conf), "rm", "--no-progress",
                     f"{cluster.pool}/{image}"], timeout=60, check=False)
            except (BenchError, subprocess.TimeoutExpired) as e:
                problems.append(f"rbd rm {image}: {e}")
    return harness_cleanup(root, cluster, problems)


if __name__ == "__main__":
    sys.exit(main())
