"""``takeover``: claim an image held by a node that is gone, fencing it first.

With the daemon running, it runs inside the daemon (cli/ask.py), under its
lock on the volume: no chain of it runs meanwhile, and the daemon maps it
here right after.

Imported by cli/recover.py.
"""

from __future__ import annotations

import argparse
import sys

from reconciler.cli.main import EXIT_FAILED, EXIT_OK
from reconciler.cli.reconcile import default_paths

TYPE_CHECKING = False  # typing itself costs ~5 ms at start-up
if TYPE_CHECKING:
    from reconciler.spec.config import Config


def cmd_takeover(args: argparse.Namespace, config: Config) -> int:
    from reconciler.cli.ask import ask

    rc = ask(config, "takeover", {"name": args.name, "sure": args.sure})
    if rc is not None:
        return rc
    from reconciler.engine.operator import takeover
    from reconciler.spec.loader import load

    vol = next((v for v in load(default_paths(config), config).volumes
                if v.name == args.name), None)
    if vol is None or vol.kind != "Volume":
        print(f"rbd-reconciler: no volume {args.name!r} in {config.desired_dir}", file=sys.stderr)
        return EXIT_FAILED
    ok = takeover(config, vol, args.sure, _say, "apply maps it here")
    return EXIT_OK if ok else EXIT_FAILED


def _say(text: str, error: bool) -> None:
    print(text, file=sys.stderr if error else sys.stdout)
