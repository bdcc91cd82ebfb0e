#!/usr/bin/env python3
"""P2: "plan with nothing to do" over 100, 1,000 and 5,000 desired volumes.

What is measured, for each N:

- load: ``reconciler.spec.loader.load([DIR], config)`` over N generated Volume files
  (one per file: image + map fuse + stage ext4 + one publish target), i.e.
  discovery, YAML parsing with source marks, JSON-Schema validation, building
  typed volumes and the cross-file uniqueness checks;
- plan: ``reconciler.plan.planner.plan(volumes, observed, ctx)`` against an in-memory
  *converged* observed state (image with owner/spec-hash/formatted meta, a fuse
  mapping with its loop device, an ext4 device of the image's size, the
  staging mount and the publish bind of that device). Each repetition gets a
  fresh ``Observed`` (so its lazily built indexes are paid for, as after a real
  observe). The script asserts that every volume plans to PUBLISHED with no
  step, refusal or note: a benchmark that measures a wrong path is worthless;
- load+plan: both, back to back.

Every figure is the median of --repeat runs in one warm process (the JSON
schemas are compiled once per process; that one-off cost is printed apart),
reported as ms total and µs per volume, plus the per-volume ratio between the
largest and the smallest N (1.0 = linear). Target: 1,000 volumes under 1 s.

Then, unless --quick: ONE real ``reconciler.observe.node.observe(Node.from_config(cfg),
volumes)`` pass at N=100 against a disposable local Ceph cluster
(reconciler.testing.devcluster) holding all 100 images (created, not mapped).

Usage: .venv/bin/python benchmarks/p2_plan.py [--quick] [--repeat R] [--sizes 100,1000,5000]
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout: import this tree's reconciler

from harness import signals_ignored, signals_raise  # noqa: E402

from reconciler.facts import meta  # noqa: E402
from reconciler.facts.observed import Device, ImageState, Mapping, Mount, Observed  # noqa: E402
from reconciler.plan.planner import Context, VolumePlan, plan  # noqa: E402
from reconciler.spec.config import Config, load_config  # noqa: E402
from reconciler.spec.loader import LoadResult, load  # noqa: E402
from reconciler.spec.model import Phase, Volume  # noqa: E402

T = TypeVar("T")

POOL = "rbd"
SIZE = 256 * 2**20
FEATURES = ("layering", "exclusive-lock", "object-map", "fast-diff", "deep-flatten")
NODE = "p2-bench"
LOOP_MAJOR = 7
TARGET_1000_S = 1.0

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

CONFIG_YAML = """\
desiredDir: {desired}
stateDir: {state}
controlSocket: {state}/control.sock
nodeName: {node}
ceph:
  conf: {conf}
  user: {user}
{keyring}allowedRoots: [{root}]
"""

# A node's own mounts, so the planner's indexes are not only ours.
SYSTEM_MOUNTS = (
    (20, 1, 8, 1, "/", "ext4", "/dev/vda1"),
    (21, 20, 0, 21, "/proc", "proc", "proc"),
    (22, 20, 0, 22, "/sys", "sysfs", "sysfs"),
    (23, 20, 0, 5, "/dev", "devtmpfs", "udev"),
    (24, 20, 0, 24, "/run", "tmpfs", "tmpfs"),
    (25, 20, 0, 25, "/tmp", "tmpfs", "tmpfs"),
)


class BenchError(RuntimeError):
    pass


# --- inputs -------------------------------------------------------------------------------


def write_config(root: Path, desired: Path, conf: str = "/etc/ceph/ceph.conf",
                 user: str = "admin", keyring: str | None = None) -> Config:
    path = root / f"config-{desired.name}.yaml"
    path.write_text(CONFIG_YAML.format(
        desired=desired, state=root / "state", node=NODE, conf=conf, user=user,
        keyring=f"  keyring: {keyring}\n" if keyring else "", root=root))
    return load_config(path)


def write_volumes(root: Path, n: int) -> Path:
    desired = root / f"desired-{n}"
    desired.mkdir(mode=0o755)
    features = ", ".join(FEATURES)
    for i in range(n):
        name = f"vol-{i:05d}"
        (desired / f"{name}.yaml").write_text(VOLUME_YAML.format(
            name=name, pool=POOL, features=features, target=root / "pub" / name))
    return desired


def converged(volumes: tuple[Volume, ...], config: Config) -> Observed:
    """What observe would report once every volume is PUBLISHED by this node."""
    images: dict[tuple[str, str], ImageState] = {}
    mappings: list[Mapping] = []
    devices: dict[str, Device] = {}
    mounts = [Mount(mid, parent, major, minor, "/", point, frozenset({"rw", "relatime"}),
                    fs, src, frozenset({"rw"}))
              for mid, parent, major, minor, point, fs, src in SYSTEM_MOUNTS]
    mount_id = 100
    for i, v in enumerate(volumes):
        assert v.stage is not None and v.stage.fs_type == "ext4" and len(v.publish) == 1
        pool, image = v.image.pool, v.image.name
        dev = f"/dev/loop{i}"
        fuse_mnt = str(config.state_dir / "fuse" / f"{pool}@{image}")
        images[(pool, image)] = ImageState(
            pool=pool, name=image, size=SIZE, features=frozenset(FEATURES),
            meta={meta.OWNER: NODE, meta.SPEC_HASH: v.spec_hash, meta.FORMATTED: "ext4"},
            watchers=(f"127.0.0.1:0/{100000 + i}",))  # our own rbd-fuse
        mappings.append(Mapping("fuse", pool, image, dev, fuse_mount=fuse_mnt))
        devices[dev] = Device(dev, LOOP_MAJOR, i, SIZE, "ext4", f"uuid-{i:08x}", "ext4",
                              fs_size=SIZE)
        ext4_opts, ext4_super = frozenset({"rw", "relatime"}), frozenset({"rw"})
        mounts += [
            Mount(mount_id, 25, 0, 1000 + i, "/", fuse_mnt,
                  frozenset({"rw", "nosuid", "nodev", "relatime"}), "fuse.rbd-fuse",
                  "rbd-fuse", frozenset({"rw", "user_id=0", "group_id=0"})),
            Mount(mount_id + 1, 25, LOOP_MAJOR, i, "/", v.stage.path, ext4_opts, "ext4", dev,
                  ext4_super),
            Mount(mount_id + 2, 25, LOOP_MAJOR, i, "/", v.publish[0].path, ext4_opts, "ext4",
                  dev, ext4_super),
        ]
        mount_id += 3
    return Observed(images=images, pools_listed=frozenset({POOL}), pool_errors={},
                    mappings=tuple(mappings), devices=devices, mounts=tuple(mounts))


def context(config: Config) -> Context:
    return Context(node_name=config.node_name, staging_root=str(config.staging_root),
                   mappers_available=frozenset({"fuse"}))


def check_loaded(res: LoadResult, n: int) -> None:
    if res.diagnostics or len(res.volumes) != n:
        shown = "\n".join(str(d) for d in res.diagnostics[:5])
        raise BenchError(f"load: {len(res.volumes)}/{n} volumes, "
                         f"{len(res.diagnostics)} error(s)\n{shown}")


def check_nothing_to_do(plans: list[VolumePlan], n: int) -> None:
    bad = [p for p in plans if p.steps or p.refusal or p.notes
           or p.phase != Phase.PUBLISHED or p.wanted != Phase.PUBLISHED]
    if len(plans) != n or bad:
        p = bad[0] if bad else None
        detail = (f"first: {p.name} phase={p.phase.name} refusal={p.refusal} notes={p.notes} "
                  f"steps={[s.action for s in p.steps]}") if p else ""
        raise BenchError(f"plan is not 'nothing to do': {len(plans)} plans for {n} volumes, "
                         f"{len(bad)} not converged; {detail}")


# --- timing --------------------------------------------------------------------------------


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


@dataclasses.dataclass
class Row:
    n: int
    load: float
    plan: float
    both: float


def bench(root: Path, n: int, repeat: int) -> Row:
    desired = write_volumes(root, n)
    config = write_config(root, desired)
    ctx = context(config)
    res = load([desired], config)
    check_loaded(res, n)
    observed = converged(res.volumes, config)
    check_nothing_to_do(plan(res.volumes, dataclasses.replace(observed), ctx), n)

    loads, plans, boths = [], [], []
    for _ in range(repeat):
        t, r = timed(lambda: load([desired], config))
        check_loaded(r, n)
        loads.append(t)

        fresh = dataclasses.replace(observed)  # no cached indexes, as after an observe
        t, out = timed(lambda: plan(res.volumes, fresh, ctx))  # noqa: B023
        check_nothing_to_do(out, n)
        plans.append(t)

        fresh = dataclasses.replace(observed)

        def load_and_plan() -> list[VolumePlan]:
            r = load([desired], config)
            return plan(r.volumes, fresh, ctx, r.frozen_names)  # noqa: B023

        t, out = timed(load_and_plan)
        check_nothing_to_do(out, n)
        boths.append(t)
    return Row(n, statistics.median(loads), statistics.median(plans), statistics.median(boths))


def report(rows: list[Row]) -> None:
    print(f"\n{'N':>6}  {'load ms':>9} {'µs/vol':>7}  {'plan ms':>8} {'µs/vol':>7}  "
          f"{'load+plan ms':>12} {'µs/vol':>7}")
    for r in rows:
        print(f"{r.n:>6}  {r.load * 1e3:9.1f} {r.load / r.n * 1e6:7.1f}  "
              f"{r.plan * 1e3:8.1f} {r.plan / r.n * 1e6:7.1f}  "
              f"{r.both * 1e3:12.1f} {r.both / r.n * 1e6:7.1f}")
    lo, hi = rows[0], rows[-1]
    if hi.n != lo.n:
        def ratio(f: Callable[[Row], float]) -> float:
            return (f(hi) / hi.n) / (f(lo) / lo.n)

        print(f"\nper-volume ratio N={hi.n} / N={lo.n} (1.00 = linear): "
              f"load {ratio(lambda r: r.load):.2f}, plan {ratio(lambda r: r.plan):.2f}, "
              f"load+plan {ratio(lambda r: r.both):.2f}")
    for r in rows:
        if r.n == 1000:
            verdict = "met" if r.both < TARGET_1000_S else "NOT met"
            print(f"target: 1,000 volumes load+plan under {TARGET_1000_S:.0f} s: "
                  f"{r.both:.3f} s — {verdict}")


# --- one real observe ------------------------------------------------------------------------


def real_observe(root: Path, n: int) -> None:
    import rbd

    from reconciler.drivers import rbdbase
    from reconciler.observe import node as observe_mod
    from reconciler.observe.ceph import CephView
    from reconciler.observe.node import Node, observe
    from reconciler.testing.devcluster import start_cluster

    t0 = time.perf_counter()
    cluster = start_cluster(root=root / "ceph")
    try:
        print(f"\nreal observe: cluster up in {time.perf_counter() - t0:.1f}s "
              f"(mon {cluster.mon_addr})")
        desired = root / f"desired-{n}"
        if not desired.exists():
            write_volumes(root, n)
        config = write_config(root, desired, conf=str(cluster.conf), user=cluster.user,
                              keyring=str(cluster.keyring))
        res = load([desired], config)
        check_loaded(res, n)
        t0 = time.perf_counter()
        with cluster.client(timeout=30, osd_op_timeout=60) as r, r.open_ioctx(POOL) as ioctx:
            for v in res.volumes:
                rbd.RBD().create(ioctx, v.image.name, SIZE, old_format=False,
                                 features=rbdbase.feature_bits(FEATURES))
        print(f"real observe: created {n} images in {time.perf_counter() - t0:.1f}s")

        # Time the Ceph part inside the same pass, without a second pass.
        spent: dict[str, float] = {}
        orig = observe_mod.observe_images

        def observe_images_timed(*a: object, **kw: object) -> CephView:
            t, out = timed(lambda: orig(*a, **kw))  # type: ignore[arg-type]
            spent["observe_images"] = t
            return out

        node = Node.from_config(config)
        observe_mod.observe_images = observe_images_timed  # type: ignore[assignment]
        try:
            t, observed = timed(lambda: observe(node, res.volumes))
        finally:
            observe_mod.observe_images = orig  # type: ignore[assignment]
        if len(observed.images) != n or POOL not in observed.pools_listed:
            raise BenchError(f"observe saw {len(observed.images)}/{n} images "
                             f"(pool errors: {observed.pool_errors})")
        plans = plan(res.volumes, observed, context(config))
        phases = {p.phase.name for p in plans}
        if phases != {"CREATED"} or any(p.refusal for p in plans):
            raise BenchError(f"real observe: expected every volume CREATED, got {phases}")
        ims = spent.get("observe_images", 0.0)
        print(f"real observe (one pass, N={n}, images created, not mapped): "
              f"{t * 1e3:.1f} ms = {t / n * 1e6:.0f} µs/volume")
        print(f"  of which Ceph (connect, list, open/stat/meta/watchers per image, in the "
              f"background): {ims * 1e3:.1f} ms; the rest: {(t - ims) * 1e3:.1f} ms")
        print(f"  (plan on it: every volume CREATED, "
              f"{sum(len(p.steps) for p in plans)} steps to publish them all)")
    finally:
        with signals_ignored():  # a second Ctrl-C must not leave daemons half stopped
            cluster.stop()


# --- driver ---------------------------------------------------------------------------------



def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="skip the real-cluster observe")
    p.add_argument("--repeat", type=int, default=5, help="timed repetitions per N (median)")
    p.add_argument("--sizes", default="100,1000,5000", help="comma-separated N values")
    args = p.parse_args(argv)
    sizes = sorted(int(s) for s in args.sizes.split(","))

    root = Path(tempfile.mkdtemp(prefix="rbd-bench-p2-"))
    rc = 1
    with signals_raise():
        try:
            # One-off per process: schema compilation (and the imports above).
            desired = write_volumes(root, 1)
            t, res = timed(lambda: load([desired], write_config(root, desired)))
            check_loaded(res, 1)
            print(f"first load in this process (compiles the JSON schemas): {t * 1e3:.1f} ms "
                  f"for 1 file")
            rows = []
            for n in sizes:
                row = bench(root, n, args.repeat)
                print(f"N={n}: load {row.load * 1e3:.1f} ms, plan {row.plan * 1e3:.1f} ms, "
                      f"load+plan {row.both * 1e3:.1f} ms (median of {args.repeat}); "
                      f"plan verified: {n} volumes PUBLISHED, 0 steps", flush=True)
                rows.append(row)
            report(rows)
            if not args.quick:
                real_observe(root, 100)
            rc = 0
        except BenchError as e:
            print(f"p2_plan: {e}", file=sys.stderr)
        except KeyboardInterrupt:
            print("\np2_plan: interrupted", file=sys.stderr)
            rc = 130
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
