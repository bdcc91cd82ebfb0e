"""``rbd-reconciler release --all``: give back everything of ours on this node.

The front door only: it asks the engine (engine/release.py does it, within
``--deadline``, and is back by then whatever happens; plan/release.py
decides what is ours) and prints the report. Imported by cli/reconcile.py's
``cmd_release`` when ``--all`` is given.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from reconciler.cli.exits import EXIT_CHANGES, EXIT_FAILED, EXIT_OK
from reconciler.engine import Busy
from reconciler.engine.release import (
    CannotTell,
    Released,
    force_off_stuck,
    held_now,
    release_all,
)
from reconciler.spec.config import Config
from reconciler.spec.diagnostics import escaped


def cmd_release_all(args: argparse.Namespace, config: Config) -> int:
    if args.paths:
        print("rbd-reconciler: release --all takes no PATH (it releases every volume of ours)",
              file=sys.stderr)
        return EXIT_FAILED
    if args.dry_run:
        return _dry_run(args, config)
    # Back by the deadline whatever happens (engine/release.py): a report of
    # what was done when the work is stuck where nothing can be killed.
    try:
        done = release_all(config, args.step_timeout, args.deadline)
    except Busy as exc:
        print(f"rbd-reconciler: {exc}; nothing released", file=sys.stderr)
        return EXIT_FAILED
    rc = _report_release(args, done)
    if done.stuck:
        sys.stdout.flush()
        sys.stderr.flush()
        # A thread stuck in the kernel on an rbd-fuse helper that does not
        # answer would hold even os._exit: end that connection first.
        for line in force_off_stuck(done):
            print(f"forced: {line}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(EXIT_FAILED)  # not sys.exit: it would wait for the stuck threads
    return rc


def _dry_run(args: argparse.Namespace, config: Config) -> int:
    """What ``release --all`` would take down now: exit 0 when nothing, 2
    (as ``plan``) when something; another tool's mappings are said, and
    count for nothing. The package's prerm asks before a removal
    (debian/rbd-reconciler.prerm)."""
    try:
        held, not_ours = held_now(config, args.step_timeout)
    except CannotTell as exc:  # neither 0 nor 2: the prerm refuses, saying why
        print(f"rbd-reconciler: release --all --dry-run cannot tell: {escaped(str(exc))}",
              file=sys.stderr)
        return EXIT_FAILED
    if args.output == "json":
        json.dump({"held": held, "notOurs": not_ours}, sys.stdout, indent=2)
        print()
    else:
        # A line may carry hostile image-meta (a claim's node): escaped,
        # on root's terminal (apt's, through the prerm), one line each.
        for line in held:
            print(f"held: {escaped(line)}")
        for line in not_ours:  # another tool's: left alone, counted for nothing
            print(f"not ours: {escaped(line)}")
        print(f"release --all would take down {len(held)} thing(s)" if held
              else "release --all has nothing to take down")
    return EXIT_CHANGES if held else EXIT_OK


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
        # As the dry run's lines: a listing's error quotes a command's output.
        for line in done.forced:
            print(f"forced: {escaped(line)}", file=sys.stderr)
        for line in done.left:
            print(f"not released: {escaped(line)}", file=sys.stderr)
        # A volume released in a second round (after forcing) counts once.
        released = len({o.name for o in done.outcomes
                        if o.steps and o.status in ("ok", "changed")})
        print(f"released: {released} volume(s); "
              f"{len(done.left)} thing(s) still held")
    return EXIT_OK if done.ok else EXIT_FAILED
