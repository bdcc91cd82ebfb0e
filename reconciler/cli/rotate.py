"""``rotate-key``: a new LUKS2 passphrase for an encrypted volume mapped here.

With the daemon running, it runs inside the daemon (cli/ask.py), under its
lock on the volume: no pass opens or seals its key again meanwhile. Else
here, under the node's lock.

Imported by cli/main.py, by name, when its command runs (_Command).
"""

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
    from reconciler.cli.ask import ask

    new_key_file = args.new_key_file
    if new_key_file is not None and not new_key_file.startswith("/"):
        # Relative to here, as typed: joined, never normalised (a '..' in it
        # is refused by the key root check, not resolved away).
        new_key_file = os.path.join(os.getcwd(), new_key_file)
    rc = ask(config, "rotate-key", {"name": args.name, "newKeyFile": new_key_file})
    if rc is not None:
        return rc
    from reconciler.engine import Busy, state_lock

    # The node's lock, as apply and the daemon take it: one actor per node,
    # so no pass opens or re-seals the volume's key while it rotates.
    try:
        with state_lock(config):
            return _rotate(args.name, new_key_file, config)
    except Busy as exc:
        print(f"rbd-reconciler: rotate-key: {exc}", file=sys.stderr)
        return EXIT_FAILED


def _rotate(name: str, new_key_file: str | None, config: Config) -> int:
    from reconciler.engine import Node, look
    from reconciler.engine.operator import mapped_device, rotate_key
    from reconciler.spec.loader import load

    vol = next((v for v in load(default_paths(config), config).volumes if v.name == name), None)
    if vol is None or vol.kind != "Volume":
        print(f"rbd-reconciler: no volume {name!r} in {config.desired_dir}", file=sys.stderr)
        return EXIT_FAILED
    node = Node.from_config(config)
    seen = look([vol], config, node).observed
    device = mapped_device(vol, seen)
    if device is None:
        print(f"rbd-reconciler: {vol.image.spec} is not mapped on this node; rotate-key works "
              "on the mapped device (apply the volume first)", file=sys.stderr)
        return EXIT_FAILED
    ok = rotate_key(config, vol, device, node.crypt, new_key_file, _say)
    return EXIT_OK if ok else EXIT_FAILED


def _say(text: str, error: bool) -> None:
    print(text, file=sys.stderr if error else sys.stdout)
