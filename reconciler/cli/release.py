"""``rbd-reconciler release --all``: give back everything of ours on this node.

The front door only: it asks the engine (engine/release.py does it, within
``--deadline``; plan/release.py decides what is ours) and prints the report,
at the deadline whatever happens. Imported by cli/reconcile.py's
``cmd_release`` when ``--all`` is given.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading

from reconciler.cli.exits import EXIT_FAILED, EXIT_OK
from reconciler.engine import Busy
from reconciler.engine.release import Released, release_all, report_at_deadline
from reconciler.engine.unwedge import unwedge
from reconciler.spec.config import Config


def cmd_release_all(args: argparse.Namespace, config: Config) -> int:
    if args.paths:
        print("rbd-reconciler: release --all takes no PATH (it releases every volume of ours)",
              file=sys.stderr)
        return EXIT_FAILED
    progress = Released()
    result: list[Released | BaseException] = []

    def work() -> None:
        try:
            result.append(release_all(config, args.step_timeout, args.deadline, progress))
        except BaseException as exc:  # handed to the main thread, which reports it
            result.append(exc)

    # The work runs in a thread so that the report is printed at the deadline
    # even when something is stuck where no command can be killed (a thaw or
    # an unmount in the kernel, a Ceph call): then the process exits at once,
    # leaving that thread (and the stuck call) behind.
    worker = threading.Thread(target=work, name="release-all", daemon=True)
    worker.start()
    worker.join(args.deadline)
    if not result:
        _report_release(args, report_at_deadline(progress, args.deadline))
        sys.stdout.flush()
        sys.stderr.flush()
        # A thread stuck in the kernel on an rbd-fuse helper that does not
        # answer would hold even os._exit: end that connection first.
        for line in unwedge(config, set()):
            print(f"forced: {line}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(EXIT_FAILED)  # not sys.exit: it would wait for the stuck threads
    if isinstance(result[0], Busy):
        print(f"rbd-reconciler: {result[0]}; nothing released", file=sys.stderr)
        return EXIT_FAILED
    if isinstance(result[0], BaseException):
        raise result[0]
    return _report_release(args, result[0])


def _report_release(args: argparse.Namespace, done: Released) -> int:
    for line in done.thawed:
        print(f"rbd-reconciler: {line}", file=sys.stderr)
    if done.late:
        print(f"rbd-reconciler: release --all: {done.late}; stopped there "
              "(--deadline)", file=sys.stderr)
    if args.output == "json":
        json.dump({"sync": done.sync, "thawed": done.thawed, "deadline": done.late,
                   "forced": done.forced, "notReleased": done.left,
                   "volumes": [o.as_dict() for o in done.outcomes]}, sys.stdout, indent=2)
        print()
    else:
        for o in done.outcomes:
            if o.steps or o.status in ("failed", "aborted"):
                print(f"{o.status}: [{o.name}]" + (f" {o.error}" if o.error else ""))
            for s in o.steps:
                msg = f" ({s.message})" if s.message else ""
                print(f"  {s.status:<7} {s.step.action:<16} {s.step.target}{msg}")
        if done.sync:
            print(f"warning: {done.sync}", file=sys.stderr)
        for line in done.forced:
            print(f"forced: {line}", file=sys.stderr)
        for line in done.left:
            print(f"not released: {line}", file=sys.stderr)
        # A volume released in a second round (after forcing) counts once.
        released = len({o.name for o in done.outcomes
                        if o.steps and o.status in ("ok", "changed")})
        print(f"released: {released} volume(s); "
              f"{len(done.left)} thing(s) still held")
    return EXIT_OK if done.ok else EXIT_FAILED
