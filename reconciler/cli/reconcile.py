"""``validate``, ``plan``, ``apply`` and ``release``: one pass over the desired files."""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from pathlib import Path

from reconciler.cli.main import EXIT_CHANGES, EXIT_FAILED, EXIT_OK

TYPE_CHECKING = False  # typing itself costs ~5 ms at start-up
if TYPE_CHECKING:
    from reconciler.apply.runner import VolumeOutcome
    from reconciler.cli.release import Released
    from reconciler.drivers.freeze import Record
    from reconciler.engine import Pass
    from reconciler.plan.planner import VolumePlan
    from reconciler.plan.steps import Step
    from reconciler.spec.config import Config


MAX_FOLLOW_UP_PASSES = 8  # each level of a chain of sources is one more pass


def _marker(step: Step) -> str:
    if step.destructive:
        return "!"
    if step.disruptive:
        return "-"
    return "+" if step.before in ("absent", "unmapped", "not staged", "not published") else "~"


def _print_plans(plans: list[VolumePlan]) -> None:
    for vp in plans:
        if vp.stalled and not vp.steps:
            print(f"{vp.kind} {vp.name}: STALLED: {vp.stalled}"
                  + (f"; UNKNOWN: {vp.unknown}" if vp.unknown else ""))
            continue
        if vp.unknown:
            print(f"{vp.kind} {vp.name}: UNKNOWN: {vp.unknown}")
            continue
        if vp.refusal:
            print(f"{vp.kind} {vp.name}: REFUSED: {vp.refusal}")
            continue
        arrow = f"{vp.phase.name} -> {vp.wanted.name}" if vp.wanted is not None else ""
        if vp.waiting:
            print(f"{vp.kind} {vp.name}: {vp.waiting}")
            continue
        if not vp.steps:
            print(f"{vp.kind} {vp.name}: ok ({vp.phase.name})")
        else:
            print(f"{vp.kind} {vp.name}: {arrow}")
        for s in vp.steps:
            flag = "  (destructive)" if s.destructive else ""
            print(f"  {_marker(s)} {s.action:<16} {s.target}: {s.before} -> {s.after}{flag}")
        for why in vp.withheld:
            print(f"  REFUSED: {why}")
        for kind, why in vp.problems.items():  # no step can put these right
            print(f"  PROBLEM ({kind}): {why}")
        for note in vp.notes:
            print(f"  note: {note}")


def print_load_errors(p: Pass) -> None:
    for d in p.loaded.diagnostics:
        print(d, file=sys.stderr)


def paths_of(args: argparse.Namespace, config: Config) -> list[Path]:
    """Default: the operator's files and the CSI adapter's (one engine, one view)."""
    return args.paths or default_paths(config)


def default_paths(config: Config) -> list[Path]:
    return [config.desired_dir, *([config.csi_dir] if config.csi_dir.is_dir() else [])]


def _left_frozen(config: Config) -> list[Record]:
    """Plan changes nothing, not even a thaw (apply and the daemon thaw first
    thing): it reports a freeze a dead run left, which Ceph need not answer."""
    from reconciler.drivers.freeze import left_frozen

    if not (config.state_dir / "freezes.json").exists():
        return []
    return left_frozen(config.state_dir)


def cmd_plan(args: argparse.Namespace, config: Config) -> int:
    from reconciler.engine import plan_pass
    from reconciler.observe.node import Node

    left = _left_frozen(config)
    p = plan_pass(paths_of(args, config), config, Node.from_config(config))
    steps = sum(len(vp.steps) for vp in p.plans) + len(left)
    refused = [vp for vp in p.plans if vp.refused]
    failed = bool(refused or p.loaded.diagnostics)
    if args.output == "json":
        json.dump({
            "changes": steps > 0,
            "errors": [d.as_dict() for d in p.loaded.diagnostics],
            "leftFrozen": [r.path for r in left],
            "volumes": [{"name": vp.name, "kind": vp.kind, "waiting": vp.waiting,
                         "phase": vp.phase_name, "unknown": vp.unknown,
                         "stalled": vp.stalled, "fenced": vp.fenced,
                         "wanted": vp.wanted.name if vp.wanted is not None else None,
                         "refusal": vp.refused, "notes": vp.notes,
                         "problems": vp.problems,
                         "steps": [s.as_dict() for s in vp.steps]} for vp in p.plans],
        }, sys.stdout, indent=2)
        print()
    else:
        print_load_errors(p)
        for r in left:
            print(f"LEFT FROZEN: {r.path} (by {r.owner}, which is gone): "
                  "apply thaws it first, before any Ceph call")
        _print_plans(p.plans)
        destructive = sum(s.destructive for vp in p.plans for s in vp.steps)
        unknown = sum(bool(vp.unknown) for vp in p.plans)
        print(f"Plan: {steps} step(s) for {sum(bool(vp.steps) for vp in p.plans)} volume(s), "
              f"{destructive} destructive; {len(refused)} refused"
              + (f", {unknown} unknown." if unknown else "."))
    if failed:
        return EXIT_FAILED
    # One waiting for a source another step makes is a change pending too.
    return EXIT_CHANGES if steps or any(vp.waiting for vp in p.plans) else EXIT_OK


def _merge_outcomes(first: list[VolumeOutcome], then: list[VolumeOutcome]
                    ) -> list[VolumeOutcome]:
    """One result per volume over the passes of one apply."""
    by_name = {o.name: o for o in first}
    for o in then:
        prev = by_name.get(o.name)
        if prev is None:
            by_name[o.name] = o
            continue
        prev.steps += o.steps
        prev.notes = o.notes
        if o.status == "failed" or prev.status == "failed":
            prev.status, prev.error = "failed", o.error or prev.error
        elif o.status == "changed":
            prev.status = "changed"
    return [by_name[n] for n in sorted(by_name)]


def _thaw_first(config: Config) -> list[str]:
    """A filesystem a dead run left frozen hangs every writer on it: thawed
    from the local record alone, before anything waits on Ceph (an outage
    must not keep it frozen). Freezes of a live run are left alone."""
    from reconciler.drivers.freeze import thaw_recorded

    if not (config.state_dir / "freezes.json").exists():
        return []
    thawed = thaw_recorded(config.state_dir)
    for line in thawed:
        print(f"rbd-reconciler: {line}", file=sys.stderr)
    return thawed


def cmd_apply(args: argparse.Namespace, config: Config) -> int:
    from reconciler.engine import Busy, apply_pass, plan_pass, release_pass, state_lock
    from reconciler.observe.node import Node

    thawed = _thaw_first(config)
    node = Node.from_config(config)
    try:
        with state_lock(config):
            if getattr(args, "release", False):
                p, outcomes = release_pass(paths_of(args, config), config, node)
            else:
                p = plan_pass(paths_of(args, config), config, node)
                outcomes = apply_pass(p, node)
            # A clone or snapshot waiting for one this pass created: go again.
            for _ in range(MAX_FOLLOW_UP_PASSES):
                if not (any(vp.waiting for vp in p.plans)
                        and any(o.status == "changed" for o in outcomes)):
                    break
                p = plan_pass(paths_of(args, config), config, node)
                outcomes = _merge_outcomes(outcomes, apply_pass(p, node))
    except Busy as exc:
        print(f"rbd-reconciler: {exc}", file=sys.stderr)
        return EXIT_FAILED
    counts = {k: sum(o.status == k for o in outcomes) for k in ("ok", "changed", "failed")}
    if args.output == "json":
        json.dump({"recap": counts, "errors": [d.as_dict() for d in p.loaded.diagnostics],
                   "thawed": thawed, "volumes": [o.as_dict() for o in outcomes]},
                  sys.stdout, indent=2)
        print()
    else:
        print_load_errors(p)
        for o in outcomes:
            print(f"{o.status}: [{o.name}]" + (f" {o.error}" if o.error else ""))
            for s in o.steps:
                msg = f" ({s.message})" if s.message else ""
                print(f"  {s.status:<7} {s.step.action:<16} {s.step.target}{msg}")
            for u in o.undone:
                print(f"  undone  {u}")
            for note in o.notes:
                print(f"  note: {note}")
        print("recap: " + " ".join(f"{k}={v}" for k, v in counts.items()))
    return EXIT_FAILED if counts["failed"] or p.loaded.diagnostics else EXIT_OK


def cmd_release(args: argparse.Namespace, config: Config) -> int:
    if not args.all:
        return cmd_apply(args, config)
    if args.paths:
        print("rbd-reconciler: release --all takes no PATH (it releases every volume of ours)",
              file=sys.stderr)
        return EXIT_FAILED
    from reconciler.cli.release import Released, release_all, report_at_deadline
    from reconciler.cli.unwedge import unwedge
    from reconciler.engine import Busy

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
