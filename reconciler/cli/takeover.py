"""``takeover``: claim an image held by a node that is gone, fencing it first."""

from __future__ import annotations

import argparse
import sys

from reconciler.cli.main import EXIT_FAILED, EXIT_OK
from reconciler.cli.reconcile import default_paths

TYPE_CHECKING = False  # typing itself costs ~5 ms at start-up
if TYPE_CHECKING:
    from reconciler.spec.config import Config


def cmd_takeover(args: argparse.Namespace, config: Config) -> int:
    import rados
    import rbd

    from reconciler.apply import claims
    from reconciler.apply.takeover import take_over
    from reconciler.drivers import ceph
    from reconciler.spec.loader import load

    vol = next((v for v in load(default_paths(config), config).volumes
                if v.name == args.name), None)
    if vol is None or vol.kind != "Volume":
        print(f"rbd-reconciler: no volume {args.name!r} in {config.desired_dir}", file=sys.stderr)
        return EXIT_FAILED
    pool, image, me = vol.image.pool, vol.image.name, config.node_name
    try:
        with ceph.connect(config.ceph) as cluster:
            held = claims.current(cluster, pool, image)
            if held is None:
                print(f"rbd-reconciler: {pool}/{image} is not claimed by any node; nothing "
                      "to take over (apply maps it)", file=sys.stderr)
                return EXIT_FAILED
            if held.node == me:
                print(f"{pool}/{image} is already claimed by this node ({me})")
                return EXIT_OK
            with cluster.open_ioctx(pool) as ioctx:
                fence = sorted(set(held.clients) | set(claims.watchers(ioctx, image)))
            what = (f"blocklist {', '.join(fence)} (the clients of node {held.node} and "
                    "any other client that has the image open)" if fence
                    else f"blocklist nothing (node {held.node} recorded no client and "
                         "nothing has the image open)")
            if not args.sure:
                print(f"would {what}, then claim {pool}/{image} for {me} (fencing too any "
                      f"client node {held.node} maps meanwhile). "
                      "Only do this when that node is gone for good: its writes will fail. "
                      "Re-run with --yes-i-am-sure to do it.")
                return EXIT_FAILED
            done = take_over(cluster, pool, image, me, held)
            for said in done.said:
                print(said)
            if done.late:
                print(f"fenced after the claim was swapped: {', '.join(done.late)} (a map "
                      f"node {held.node} began before it)")
            if done.error is not None:
                print(f"rbd-reconciler: {done.error}", file=sys.stderr)
                return EXIT_FAILED
    except (ceph.CephError, rados.Error, rbd.Error) as exc:
        print(f"rbd-reconciler: {pool}/{image}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print(f"{pool}/{image}: claimed by {me} (taken over from {held.node}); apply maps it here")
    return EXIT_OK
