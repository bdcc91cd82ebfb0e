"""``rbd-reconciler fleet status [-o json]``: every node of the fleet and
every revision being rolled out (docs/fleets.md).

With the daemon running, it answers (cli/ask.py; daemon/rollout.py
``fleet_view``): its sightings of the reports say how long each node has
been Healthy and each report unchanged, on its clock since its first read.
Else one direct read of the reports in RADOS here (engine/fleet.py), which
says so: no report is stale to one read, and no node healthy for any time.
Exit 0 when read, 1 when the node is in no fleet or Ceph does not answer
(never an empty fleet).

Either way cli/show.py ``fleet`` words the document.

Imported by cli/main.py, by name, when its command runs (_Command).
"""

from __future__ import annotations

import sys

from reconciler.cli import show
from reconciler.cli.exits import EXIT_FAILED, EXIT_OK

TYPE_CHECKING = False  # typing itself costs ~5 ms at start-up
if TYPE_CHECKING:
    import argparse

    from reconciler.spec.config import Config


def cmd_fleet(args: argparse.Namespace, config: Config) -> int:
    from reconciler.cli.ask import ask

    rc = ask(config, "fleet-status", {}, args.output)
    if rc is not None:
        return rc
    import time

    from reconciler.engine.fleet import FleetUnavailable, NotInFleet, document, fleet_status
    from reconciler.views import answered

    at = time.time()
    try:
        summary = fleet_status(config)
    except NotInFleet as exc:
        print(f"rbd-reconciler fleet {args.action}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except FleetUnavailable as exc:
        print(f"rbd-reconciler fleet {args.action}: cannot read the reports: {exc}",
              file=sys.stderr)
        return EXIT_FAILED
    show.fleet(answered(document(summary), "this command", at), args.output)
    return EXIT_OK
