"""``validate``, ``plan``, ``apply`` and ``release``: one pass over the desired files.

With the daemon running, ``plan``, ``apply`` and ``release`` are answered by
it (cli/ask.py); else (and ``release --all``, always) they run here.

Imported by cli/ (4 modules).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from reconciler.cli import show
from reconciler.cli.main import EXIT_FAILED, EXIT_OK, EXIT_USAGE

TYPE_CHECKING = False  # typing itself costs ~5 ms at start-up
if TYPE_CHECKING:
    from reconciler.engine import Node, Pass, Session, VolumeOutcome
    from reconciler.spec.config import Config
    from reconciler.spec.loader import LoadResult
    from reconciler.views import Selection


def default_paths(config: Config) -> list[Path]:
    """The operator's files and the CSI adapter's (one engine, one view)."""
    return [config.desired_dir, *([config.csi_dir] if config.csi_dir.is_dir() else [])]


def outside_daemon(args: argparse.Namespace, config: Config) -> bool:
    """A PATH outside desiredDir and csi.dir: a file the daemon does not
    converge (a plan or status of it is made here, as it always was)."""
    from reconciler.cli.ask import is_path

    dirs = [os.path.abspath(d) for d in (config.desired_dir, config.csi_dir)]
    for item in args.paths:
        path = os.path.abspath(item)
        if is_path(str(item)) and not any(path == d or path.startswith(d.rstrip("/") + "/")
                                          for d in dirs):
            return True
    return False


@dataclass
class Picked:
    paths: list[Path]  # what was loaded
    loaded: LoadResult
    selection: Selection
    only: set[str] | None  # the volumes picked; None: every one loaded


def pick(args: argparse.Namespace, config: Config) -> Picked | None:
    """What the arguments name: PATHs, those files (as always); a NAME among
    them, the default files and only the volumes picked. None when something
    named picks nothing (said on stderr)."""
    from reconciler.cli.ask import targets
    from reconciler.spec.loader import load
    from reconciler.views import select

    picked = targets(args.paths)
    by_name = any("name" in t for t in picked)
    # Paths alone are loaded as given (load errors name them as typed).
    paths = default_paths(config) if by_name or not picked else [Path(a) for a in args.paths]
    loaded = load(paths, config)
    sel = select(loaded.volumes, loaded.frozen_names, loaded.failed_files, loaded.diagnostics,
                 picked if by_name else [])
    if sel.missing:
        print(f"rbd-reconciler: no volume {', '.join(sel.missing)} in {config.desired_dir} "
              f"or {config.csi_dir} (nothing done)", file=sys.stderr)
        return None
    return Picked(paths, loaded, sel, set(sel.names) if by_name else None)


def local_pass(args: argparse.Namespace, config: Config, node: Node,
               all_watchers: bool = False) -> tuple[Pass, Selection] | None:
    """This process's own pass (observe, plan) over what the arguments name."""
    from reconciler.engine import pass_over

    picked = pick(args, config)
    if picked is None:
        return None
    return (pass_over(picked.loaded, config, node, all_watchers=all_watchers, only=picked.only),
            picked.selection)


def connect_early(config: Config, picked: Picked) -> Session | None:
    """A Ceph connection begun now, for the pass about to observe the volumes
    picked: it overlaps the imports and the look at the node that come
    first. None when nothing is picked (the pass then reads nothing)."""
    if not picked.loaded.volumes:
        return None
    from reconciler.engine import session_begun

    return session_begun(config)


def cmd_plan(args: argparse.Namespace, config: Config) -> int:
    from reconciler.cli.ask import ask, targets

    if not outside_daemon(args, config):
        rc = ask(config, "plan", {"targets": targets(args.paths)}, args.output)
        if rc is not None:
            return rc
    picked = pick(args, config)
    if picked is None:
        return EXIT_FAILED
    session = connect_early(config, picked)
    from reconciler.engine import Node, pass_over
    from reconciler.engine.frozen import left_frozen
    from reconciler.views import answered, plan_doc, plan_exit

    # Plan changes nothing, not even a thaw (apply and the daemon thaw first
    # thing): it reports a freeze a dead run left, which Ceph need not answer.
    left = left_frozen(config)
    at = time.time()
    p = pass_over(picked.loaded, config, Node.from_config(config, session=session),
                  only=picked.only)
    sel = picked.selection
    doc = answered(plan_doc(p.plans, sel.errors, [(r.path, r.owner) for r in left]),
                   "this command", at)
    if args.output == "json":
        show.as_json(doc)
    else:
        show.plan(doc)
    return plan_exit(doc)


def _thaw_first(config: Config) -> list[str]:
    """A filesystem a dead run left frozen hangs every writer on it: thawed
    from the local record alone, before anything waits on Ceph (an outage
    must not keep it frozen). Freezes of a live run are left alone."""
    from reconciler.engine.frozen import thaw_left

    thawed = thaw_left(config)
    for line in thawed:
        print(f"rbd-reconciler: {line}", file=sys.stderr)
    return thawed


def cmd_apply(args: argparse.Namespace, config: Config) -> int:
    from reconciler.cli.ask import ask, targets

    release = getattr(args, "release", False)
    rc = ask(config, "release" if release else "apply", {"targets": targets(args.paths)},
             args.output)
    if rc is not None:
        return rc
    if (why := _source_distrusted(args, config)) is not None:
        print(f"rbd-reconciler {'release' if release else 'apply'}: the applied revision of "
              f"the git source is held: {why}; nothing done (`rbd-reconciler source status`)",
              file=sys.stderr)
        return EXIT_FAILED
    thawed = _thaw_first(config)
    from reconciler.engine import Busy, state_lock

    try:
        with state_lock(config):
            done = _apply_here(args, config, release)
    except Busy as exc:
        print(f"rbd-reconciler: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if done is None:
        return EXIT_FAILED
    from reconciler.views import apply_doc, apply_exit

    outcomes, sel = done
    doc = apply_doc(outcomes, [d.as_dict() for d in sel.errors], thawed)
    if args.output == "json":
        show.as_json(doc)
    else:
        show.applied(doc)
    return apply_exit(doc)


def _source_distrusted(args: argparse.Namespace, config: Config) -> str | None:
    """Why the git source's applied revision must not be acted on (the
    daemon's passes hold it: source/sync.py ``_recheck_applied``), when the
    arguments read it: no PATH, a NAME, or a PATH under desiredDir."""
    if config.git is None:
        return None
    from reconciler.cli.ask import is_path
    from reconciler.source.report import distrust

    desired = os.path.abspath(config.desired_dir)
    reads = not args.paths or any(
        not is_path(str(a)) or os.path.abspath(a) == desired
        or os.path.abspath(a).startswith(desired.rstrip("/") + "/") for a in args.paths)
    return distrust(config) if reads else None


def _apply_here(args: argparse.Namespace, config: Config, release: bool
                ) -> tuple[list[VolumeOutcome], Selection] | None:
    """Under the state lock: plan, run the chains, and go again while a
    clone or snapshot waits for one this pass created."""
    picked = pick(args, config)
    if picked is None:
        return None
    # A release reads nothing of Ceph before its teardown (it connects meanwhile).
    session = None if release else connect_early(config, picked)
    from reconciler.engine import (
        MAX_FOLLOW_UP_PASSES,
        Node,
        apply_pass,
        lift_holds,
        merge_outcomes,
        pass_over,
        release_over,
    )
    from reconciler.spec.loader import load

    node = Node.from_config(config, session=session)
    if release:
        p, outcomes = release_over(picked.loaded, config, node, picked.only)
    else:
        p = pass_over(picked.loaded, config, node, only=picked.only)
        # Applied here: no longer held down when the daemon starts again.
        try:
            lift_holds(config, [vp.name for vp in p.plans])
        except OSError as exc:
            print(f"rbd-reconciler: warning: {exc}: a `release` hold of these volumes "
                  "stays recorded (the daemon, when it starts, takes them down again)",
                  file=sys.stderr)
        outcomes = apply_pass(p, node)
    for _ in range(MAX_FOLLOW_UP_PASSES):
        if not (any(vp.waiting for vp in p.plans)
                and any(o.status == "changed" for o in outcomes)):
            break
        p = pass_over(load(picked.paths, config), config, node, only=picked.only)
        outcomes = merge_outcomes(outcomes, apply_pass(p, node))
    return outcomes, picked.selection


def cmd_release(args: argparse.Namespace, config: Config) -> int:
    if getattr(args, "dry_run", False) and (not args.all or getattr(args, "orphans", False)):
        # Never past here to a sweep or an apply that acts: --dry-run
        # promises nothing is done.
        print("rbd-reconciler: release --dry-run goes with --all alone (what release --all "
              "would take down); status lists the leftovers --orphans would remove, and "
              "`plan` what would be done to volumes by name", file=sys.stderr)
        return EXIT_USAGE
    if getattr(args, "orphans", False):
        from reconciler.cli.orphans import cmd_release_orphans

        return cmd_release_orphans(args, config)
    if not args.all:
        return cmd_apply(args, config)
    from reconciler.cli.release import cmd_release_all

    return cmd_release_all(args, config)


def cmd_validate(args: argparse.Namespace, config: Config) -> int:
    from reconciler.spec.loader import load

    paths = args.paths or default_paths(config)
    result = load(paths, config)
    if args.output == "json":
        json.dump({
            "valid": result.ok,
            "files": [str(f) for f in result.files],
            "volumes": [{"name": v.name, "file": str(v.source.file), "line": v.source.line,
                         "wantedPhase": v.wanted_phase.name} for v in result.volumes],
            "errors": [d.as_dict() for d in result.diagnostics],
        }, sys.stdout, indent=2)
        print()
    else:
        for d in result.diagnostics:
            print(d)
        status = "valid" if result.ok else f"{len(result.diagnostics)} error(s)"
        print(f"{len(result.files)} file(s), {len(result.volumes)} valid volume(s): {status}",
              file=sys.stderr)
    return EXIT_OK if result.ok else EXIT_FAILED
