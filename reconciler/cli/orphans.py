"""``rbd-reconciler release --orphans``: remove the leftovers provably ours.

The front door only: engine/orphans.py looks, asks plan/orphans.py for the
verdicts and the order, and removes; this prints what it removed, what of
ours it left and why, and what it left because it is not known to be ours.
Never through the daemon: it holds the state lock, so the sweep refuses
while it runs (stop it, or let it release). Imported by cli/reconcile.py's
``cmd_release`` when ``--orphans`` is given.
"""

from __future__ import annotations

import argparse
import json
import sys

from reconciler.cli.exits import EXIT_FAILED, EXIT_OK
from reconciler.engine import Busy
from reconciler.engine.orphans import Swept, release_orphans
from reconciler.spec.config import Config


def cmd_release_orphans(args: argparse.Namespace, config: Config) -> int:
    if args.paths or args.all:
        print("rbd-reconciler: release --orphans takes no PATH and no --all (it sweeps what "
              "no volume accounts for)", file=sys.stderr)
        return EXIT_FAILED
    try:
        done = release_orphans(config, args.step_timeout)
    except Busy as exc:
        print(f"rbd-reconciler: {exc}; nothing removed (the daemon holds the state lock "
              "while it runs)", file=sys.stderr)
        return EXIT_FAILED
    report(args.output, done)
    return EXIT_OK if done.ok else EXIT_FAILED


def report(output: str, done: Swept) -> None:
    if output == "json":
        json.dump({"refused": done.refused, "removed": [o.as_dict() for o in done.removed],
                   "left": done.left, "notOurs": [o.as_dict() for o in done.not_ours]},
                  sys.stdout, indent=2)
        print()
        return
    if done.refused:
        print(f"rbd-reconciler: release --orphans: {done.refused}; nothing removed",
              file=sys.stderr)
    for o in done.removed:
        print(f"removed: {o}")
    for line in done.left:
        print(f"left: {line}", file=sys.stderr)
    for o in done.not_ours:
        print(f"not ours: {o}", file=sys.stderr)
    print(f"removed: {len(done.removed)}; left: {len(done.left)} of ours, "
          f"{len(done.not_ours)} not known to be ours")
