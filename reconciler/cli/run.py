"""``run`` (the daemon, with the CSI server when asked) and ``allow-removal``
(through the daemon's control socket when it runs; else a file it reads at
its next pass).

Imported by cli/main.py, by name, when its command runs (_Command).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys

from reconciler.cli.main import EXIT_FAILED, EXIT_OK

TYPE_CHECKING = False  # typing itself costs ~5 ms at start-up
if TYPE_CHECKING:
    from reconciler.engine import Served, Stoppable
    from reconciler.spec.config import Config


def cmd_run(args: argparse.Namespace, config: Config) -> int:
    from reconciler.apply.logfmt import setup
    from reconciler.daemon.service import Daemon

    setup(args.log_format, args.verbose)
    if args.csi_endpoint is not None and not args.csi_endpoint.startswith("unix:///"):
        print(f"--csi-endpoint {args.csi_endpoint!r}: expected unix:///absolute/path",
              file=sys.stderr)
        return 1
    rc = Daemon(config, args.config, args.allow_mass_removal, args.csi_endpoint,
                serve_csi=_serve_csi).run()
    # Out now, past the interpreter's and C++'s exit handlers: a command's
    # look or a CSI call may still be inside librados on a thread of its own
    # (what the stop waits for is done), and librados' static destructors
    # running under its threads abort the process ("terminate called without
    # an active exception", SIGABRT instead of 0: seen at a SIGTERM beside
    # commands under load).
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(rc)


def _serve_csi(engine: Served, endpoint: str) -> Stoppable:
    """The CSI front door, on the daemon's engine: built here, where both
    are known, so neither imports the other."""
    from reconciler.csi.server import CsiServer  # grpc loads only when CSI is served

    server = CsiServer(engine, endpoint)
    server.start()
    return server


def cmd_allow_removal(args: argparse.Namespace, config: Config) -> int:
    from reconciler.cli.ask import ask

    if not args.names and not args.all:
        print("rbd-reconciler: allow-removal needs NAME... or --all", file=sys.stderr)
        return EXIT_FAILED
    # The daemon lets them go at once, and says how each went.
    rc = ask(config, "allow-removal", {"names": args.names, "all": args.all})
    if rc is not None:
        return rc
    from reconciler.state.allowance import grant
    from reconciler.state.files import read_json

    managed = read_json(config.state_dir / "managed.json", {}) or {}
    unknown = [n for n in args.names if n not in managed]
    if unknown:
        print(f"rbd-reconciler: not managed by the daemon: {', '.join(unknown)}",
              file=sys.stderr)
        return EXIT_FAILED
    waiting = grant(config.state_dir, args.names, args.all)
    what = "every pending removal" if waiting.all else ", ".join(sorted(waiting.names))
    print(f"allowed: {what}; the daemon lets them go at its next pass "
          f"(within resyncSeconds, {config.resync_seconds:g} s)")
    return EXIT_OK
