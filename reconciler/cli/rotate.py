"""``rotate-key``: a new LUKS2 passphrase for an encrypted volume mapped here."""

from __future__ import annotations

import argparse
import os
import sys

from reconciler.cli.main import EXIT_FAILED, EXIT_OK
from reconciler.cli.reconcile import default_paths

TYPE_CHECKING = False  # typing itself costs ~5 ms at start-up
if TYPE_CHECKING:
    from reconciler.spec.config import Config


def cmd_rotate_key(args: argparse.Namespace, config: Config) -> int:
    from reconciler.engine import Busy, state_lock

    # The node's lock, as apply and the daemon take it: one actor per node,
    # so no pass opens or re-seals the volume's key while it rotates.
    try:
        with state_lock(config):
            return _rotate(args, config)
    except Busy as exc:
        print(f"rbd-reconciler: rotate-key: {exc}", file=sys.stderr)
        return EXIT_FAILED


def _rotate(args: argparse.Namespace, config: Config) -> int:
    import rados
    import rbd

    from reconciler.apply.rotate import CephStore, RotateRefused, Rotation
    from reconciler.drivers import ceph, keys
    from reconciler.drivers.run import CommandError
    from reconciler.observe.node import Node, observe
    from reconciler.spec.loader import load

    vol = next((v for v in load(default_paths(config), config).volumes
                if v.name == args.name), None)
    if vol is None or vol.kind != "Volume":
        print(f"rbd-reconciler: no volume {args.name!r} in {config.desired_dir}", file=sys.stderr)
        return EXIT_FAILED
    node = Node.from_config(config)
    maps = observe(node, [vol]).mappings_by_image.get((vol.image.pool, vol.image.name), [])
    device = maps[0].device if maps else None
    if device is None:
        print(f"rbd-reconciler: {vol.image.spec} is not mapped on this node; rotate-key works "
              "on the mapped device (apply the volume first)", file=sys.stderr)
        return EXIT_FAILED
    new_key_file = args.new_key_file
    if new_key_file is not None and not new_key_file.startswith("/"):
        # Relative to here, as typed: joined, never normalised (a '..' in it
        # is refused by the key root check, not resolved away).
        new_key_file = os.path.join(os.getcwd(), new_key_file)
    try:
        with ceph.connect(config.ceph) as cluster:
            store = CephStore(cluster, vol.image.pool, vol.image.name)
            Rotation(vol, device, node.crypt, store, config.encryption.key_root, print,
                     config.encryption.accept_unbound).run(new_key_file)
    except (RotateRefused, keys.KeyProblem, CommandError, ceph.CephError, rados.Error,
            rbd.Error) as exc:
        print(f"rbd-reconciler: rotate-key {vol.name}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK
