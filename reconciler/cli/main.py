"""Command line: ``rbd-reconciler COMMAND``.

Each command imports what it needs when it runs: ``--version`` and
``validate`` never load Ceph's bindings, the planner or the drivers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from reconciler import __version__
from reconciler.cli.pipe import reader_gone  # and exit 141 (EXIT_PIPE) when the reader is gone

TYPE_CHECKING = False  # typing itself costs ~5 ms at start-up
if TYPE_CHECKING:
    from typing import NoReturn

    from reconciler.apply.runner import VolumeOutcome
    from reconciler.drivers.freeze import Record
    from reconciler.engine import Pass, Served, Stoppable
    from reconciler.plan.planner import VolumePlan
    from reconciler.plan.steps import Step
    from reconciler.spec.config import Config

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_CHANGES = 2
EXIT_USAGE = 64  # sysexits EX_USAGE: not argparse's 2, which `plan` means "changes pending"
EXIT_INTERRUPTED = 130

# Only these run as any user: they read files and change nothing on the node.
UNPRIVILEGED = ("validate",)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _version() -> str:
    # A constant, not importlib.metadata: that import alone costs ~15 ms per command.
    return __version__


def _add_output(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--output", choices=("human", "json"), default="human",
                   help="output format (default: human)")


def _add_paths_and_output(p: argparse.ArgumentParser) -> None:
    p.add_argument("paths", nargs="*", type=Path, metavar="PATH",
                   help="files or directories (default: the config's desiredDir)")
    _add_output(p)


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < 86400:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds in (0, 86400)")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="rbd-reconciler",
        description="Declarative reconciler for Ceph RBD volumes on bare nodes.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("-c", "--config", type=Path, default=None,
                        help="node config file (default: /etc/rbd-reconciler/config.yaml; "
                             "built-in defaults if that is missing)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log every command run")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                parser_class=_Parser)

    p = sub.add_parser("validate", help="check desired-volume files; change nothing",
                       description="Load and validate desired-volume files. Exit 0 when all "
                                   "are valid, 1 otherwise; every error is reported as "
                                   "file:line:column: field: message.")
    _add_paths_and_output(p)
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("plan", help="show what apply would change (check + diff); change nothing",
                       description="Observe the node and Ceph, and print the steps that would "
                                   "converge them to the desired files. Exit 0: nothing to do; "
                                   "2: changes pending; 1: an error or a refusal.")
    _add_paths_and_output(p)
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("apply", help="converge the node to the desired files",
                       description="Plan and execute. Prints each volume's result (ok, "
                                   "changed, failed) and a recap; exit 1 if any failed.")
    _add_paths_and_output(p)
    p.set_defaults(func=cmd_apply)

    p = sub.add_parser("release", help="unpublish, unstage and unmap; keep every image",
                       description="Take the volumes of the given files down to CREATED "
                                   "(unpublish, unstage, unmap) whatever the files want. "
                                   "Images are never deleted. For maintenance, and for "
                                   "giving a node back. With --all: every volume of ours on "
                                   "this node (files, the daemon's records, and mappings ours "
                                   "by identity), after a sync; for shutdown and reboot. Exit "
                                   "1 if anything is still mounted or mapped afterwards.")
    _add_paths_and_output(p)
    p.add_argument("--all", action="store_true",
                   help="release everything of ours on this node (what "
                        "rbd-reconciler-shutdown.service runs at shutdown)")
    p.add_argument("--step-timeout", type=_positive_seconds, default=30.0, metavar="SECONDS",
                   help="with --all: deadline of the sync and of each unmount/unmap "
                        "command (default: 30)")
    p.set_defaults(func=cmd_release, release=True)

    p = sub.add_parser("run", help="the daemon: watch desiredDir and converge continuously",
                       description="Watch the desired directory, converge on every change and "
                                   "every resyncSeconds, write status under stateDir/status. "
                                   "SIGTERM finishes the chains in flight and exits; SIGHUP "
                                   "reloads the config. Speaks sd_notify under systemd.")
    p.add_argument("--allow-mass-removal", action="store_true",
                   help="let volumes go even when most or all files vanish at once")
    p.add_argument("--log-format", choices=("auto", "journal", "json", "plain"), default="auto",
                   help="auto (default): journal under journald, plain otherwise; journal: "
                        "native journal fields (python3-systemd) or <N> priority prefixes; "
                        "JSON lines; plain lines with ISO 8601 timestamps")
    p.add_argument("--csi-endpoint", metavar="unix:///PATH",
                   help="also serve CSI v1 (Identity, Controller, Node) on this unix socket "
                        "(default: the config's csi.endpoint; with neither, no CSI)")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("allow-removal", help="let the daemon's held-back removals go",
                       description="Let the daemon release managed volumes whose files "
                                   "vanished but that it holds back (the mass-removal guard; "
                                   "a name given here also passes the hold while another file "
                                   "fails to load). Writes stateDir/allow-removal.json; the "
                                   "daemon consumes it at its next pass, used or not.")
    p.add_argument("names", nargs="*", metavar="NAME", help="volume names (metadata.name)")
    p.add_argument("--all", action="store_true",
                   help="every removal pending at the next pass (past the mass-removal guard "
                        "only: never one held because a file fails to load)")
    p.set_defaults(func=cmd_allow_removal)

    p = sub.add_parser("explain", help="why a volume is where it is",
                       description="Image watchers, mapping, device holders, mounts, the "
                                   "daemon's last result and the next steps the planner would "
                                   "take. Exit 1 when its state is UNKNOWN (not seen in time).")
    p.add_argument("name", help="volume name (metadata.name)")
    _add_output(p)
    p.set_defaults(func=cmd_explain)

    p = sub.add_parser("takeover", help="fence the node holding a volume's claim; claim it here",
                       description="For a node that is gone for good: blocklist the Ceph "
                                   "clients of the node holding the image's claim (so it "
                                   "cannot write if it comes back), then take the claim for "
                                   "this node; the next apply maps it here. Without "
                                   "--yes-i-am-sure it only prints what it would do (exit 1).")
    p.add_argument("name", help="volume name (metadata.name)")
    p.add_argument("--yes-i-am-sure", dest="sure", action="store_true",
                   help="really blocklist the holder's clients and take the claim")
    p.set_defaults(func=cmd_takeover)

    p = sub.add_parser("status", help="show the observed state of every desired volume",
                       description="Phase (ABSENT, CREATED, MAPPED, STAGED, PUBLISHED; "
                                   "DEGRADED, or UNKNOWN with the reason when its pool, image "
                                   "or device did not answer within observeTimeoutSeconds), "
                                   "device, mounts and size of each desired volume. Exit 1 on "
                                   "load errors or any DEGRADED or UNKNOWN volume.")
    _add_paths_and_output(p)
    p.set_defaults(func=cmd_status)
    for p in sub.choices.values():
        # `rbd-reconciler plan -c FILE` works like `rbd-reconciler -c FILE plan`;
        # SUPPRESS: not given here, the top-level value stands.
        p.add_argument("-c", "--config", type=Path, default=argparse.SUPPRESS,
                       help="node config file (also accepted before COMMAND)")
        p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                       help="log every command run")
    return parser


def _marker(step: Step) -> str:
    if step.destructive:
        return "!"
    if step.disruptive:
        return "-"
    return "+" if step.before in ("absent", "unmapped", "not staged", "not published") else "~"


def _print_plans(plans: list[VolumePlan]) -> None:
    for vp in plans:
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
        for note in vp.notes:
            print(f"  note: {note}")


def _print_load_errors(p: Pass) -> None:
    for d in p.loaded.diagnostics:
        print(d, file=sys.stderr)


def _paths(args: argparse.Namespace, config: Config) -> list[Path]:
    """Default: the operator's files and the CSI adapter's (one engine, one view)."""
    return args.paths or _default_paths(config)


def _default_paths(config: Config) -> list[Path]:
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
    p = plan_pass(_paths(args, config), config, Node.from_config(config))
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
                         "wanted": vp.wanted.name if vp.wanted is not None else None,
                         "refusal": vp.refused, "notes": vp.notes,
                         "steps": [s.as_dict() for s in vp.steps]} for vp in p.plans],
        }, sys.stdout, indent=2)
        print()
    else:
        _print_load_errors(p)
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


MAX_FOLLOW_UP_PASSES = 8  # each level of a chain of sources is one more pass


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
    from reconciler.engine import Busy, apply_pass, plan_pass, state_lock
    from reconciler.observe.node import Node

    thawed = _thaw_first(config)
    node = Node.from_config(config)
    try:
        with state_lock(config):
            p = plan_pass(_paths(args, config), config, node,
                          release=getattr(args, "release", False))
            outcomes = apply_pass(p, node)
            # A clone or snapshot waiting for one this pass created: go again.
            for _ in range(MAX_FOLLOW_UP_PASSES):
                if not (any(vp.waiting for vp in p.plans)
                        and any(o.status == "changed" for o in outcomes)):
                    break
                p = plan_pass(_paths(args, config), config, node)
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
        _print_load_errors(p)
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
    from reconciler.cli.release import release_all
    from reconciler.engine import Busy

    try:
        done = release_all(config, args.step_timeout)
    except Busy as exc:
        print(f"rbd-reconciler: {exc}; nothing released", file=sys.stderr)
        return EXIT_FAILED
    if args.output == "json":
        json.dump({"sync": done.sync, "notReleased": done.left,
                   "volumes": [o.as_dict() for o in done.outcomes]}, sys.stdout, indent=2)
        print()
    else:
        for o in done.outcomes:
            if o.steps or o.status == "failed":
                print(f"{o.status}: [{o.name}]" + (f" {o.error}" if o.error else ""))
            for s in o.steps:
                msg = f" ({s.message})" if s.message else ""
                print(f"  {s.status:<7} {s.step.action:<16} {s.step.target}{msg}")
        if done.sync:
            print(f"warning: {done.sync}", file=sys.stderr)
        for line in done.left:
            print(f"not released: {line}", file=sys.stderr)
        print(f"released: {sum(bool(o.steps) for o in done.outcomes)} volume(s); "
              f"{len(done.left)} thing(s) still held")
    return EXIT_OK if done.ok else EXIT_FAILED


def cmd_status(args: argparse.Namespace, config: Config) -> int:
    from reconciler.engine import context, plan_pass
    from reconciler.observe.node import Node
    from reconciler.plan.planner import actual_state
    from reconciler.spec.units import format_size

    node = Node.from_config(config)
    p = plan_pass(_paths(args, config), config, node, all_watchers=True)
    ctx = context(config, node)
    rows = [actual_state(v, p.observed, ctx) for v in p.loaded.volumes]
    for r in rows:
        r["daemon"] = _daemon_status(config, str(r["name"]))
    # Unknown is not absent: what could not be seen fails the command.
    bad = any(r["unknown"] or r["problem"] for r in rows)
    rc = EXIT_FAILED if p.loaded.diagnostics or bad else EXIT_OK
    if args.output == "json":
        json.dump({"volumes": rows, "frozen": sorted(p.loaded.frozen_names),
                   "errors": [d.as_dict() for d in p.loaded.diagnostics]}, sys.stdout, indent=2)
        print()
        return rc
    _print_load_errors(p)
    print(f"{'VOLUME':<16} {'PHASE':<10} {'WANTED':<10} {'SIZE':>7}  {'DEVICE':<11} MOUNTS")
    for r in rows:
        size = format_size(r["size"]) if r["size"] else "-"  # type: ignore[arg-type]
        mounts = [f"{r['staging']} (staging)"] if r["staging"] else []
        mounts += [f"{path} ({mode})" for path, mode in r["published"]]  # type: ignore[union-attr]
        if r.get("kind") == "Snapshot":
            children = ", ".join(r["children"]) or "none"  # type: ignore[arg-type]
            mounts = [f"snapshot {r['image']} of {r['source']}; clones: {children}"]
        elif r.get("clonedFrom"):
            mounts.append(f"clone of {r['clonedFrom']}")
        print(f"{r['name']:<16} {r['phase']:<10} {r['wanted']:<10} {size:>7}  "
              f"{r['device'] or '-':<11} {', '.join(mounts) or '-'}")
        if r["unknown"]:
            print(f"{'':<16} unknown: {r['unknown']}")
    for name in sorted(p.loaded.frozen_names):
        print(f"{name:<16} {'FROZEN':<10} (its file failed to load; left as it is)")
    for r in rows:
        if r["problem"]:
            print(f"{r['name']}: {r['phase']}: {r['problem']}", file=sys.stderr)
    return rc


def cmd_validate(args: argparse.Namespace, config: Config) -> int:
    from reconciler.spec.loader import load

    paths = args.paths or _default_paths(config)
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


def cmd_run(args: argparse.Namespace, config: Config) -> int:
    from reconciler.apply.logfmt import setup
    from reconciler.daemon.service import Daemon

    setup(args.log_format, args.verbose)
    if args.csi_endpoint is not None and not args.csi_endpoint.startswith("unix:///"):
        print(f"--csi-endpoint {args.csi_endpoint!r}: expected unix:///absolute/path",
              file=sys.stderr)
        return 1
    return Daemon(config, args.config, args.allow_mass_removal, args.csi_endpoint,
                  serve_csi=_serve_csi).run()


def _serve_csi(engine: Served, endpoint: str) -> Stoppable:
    """The CSI front door, on the daemon's engine: built here, where both
    are known, so neither imports the other."""
    from reconciler.csi.server import CsiServer  # grpc loads only when CSI is served

    server = CsiServer(engine, endpoint)
    server.start()
    return server


def cmd_allow_removal(args: argparse.Namespace, config: Config) -> int:
    from reconciler.state.allowance import grant
    from reconciler.state.files import read_json

    if not args.names and not args.all:
        print("rbd-reconciler: allow-removal needs NAME... or --all", file=sys.stderr)
        return EXIT_FAILED
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


def _daemon_status(config: Config, name: str) -> dict | None:
    from reconciler.state.files import read_json

    return read_json(config.state_dir / "status" / f"{name}.json")


def cmd_explain(args: argparse.Namespace, config: Config) -> int:
    from reconciler.engine import context, plan_pass
    from reconciler.observe.node import Node
    from reconciler.plan.planner import actual_state
    from reconciler.spec.units import format_size

    node = Node.from_config(config)
    p = plan_pass(_default_paths(config), config, node, all_watchers=True)
    if p.loaded.refused:  # an untrusted directory or file: say so, explain nothing
        _print_load_errors(p)
        return EXIT_FAILED
    vols = {v.name: v for v in p.loaded.volumes}
    daemon = _daemon_status(config, args.name)
    if args.name not in vols and args.name not in p.loaded.frozen_names and daemon is None:
        print(f"rbd-reconciler: no volume {args.name!r} in {config.desired_dir}", file=sys.stderr)
        return EXIT_FAILED
    vp = next((x for x in p.plans if x.name == args.name), None)
    actual = actual_state(vols[args.name], p.observed, context(config, node)) \
        if args.name in vols else None
    holders: list[str] = []
    if actual and actual["device"]:
        dev = Path(str(actual["device"])).name
        holders = sorted(h.name for h in Path(f"/sys/class/block/{dev}/holders").glob("*"))
    doc = {
        "name": args.name,
        "declaredIn": str(vols[args.name].source) if args.name in vols else None,
        "frozen": args.name in p.loaded.frozen_names,
        "loadErrors": [str(d) for d in p.loaded.diagnostics
                       if args.name in p.loaded.frozen_names],
        "actual": actual,
        "deviceHolders": holders,
        "daemon": daemon,
        "unknown": vp.unknown if vp else None,
        "refusal": vp.refused if vp else None,
        "notes": vp.notes if vp else [],
        "nextSteps": [s.as_dict() for s in vp.steps] if vp else [],
        "claim": _claim_doc(config, actual),
    }
    rc = EXIT_FAILED if doc["unknown"] else EXIT_OK
    if args.output == "json":
        json.dump(doc, sys.stdout, indent=2)
        print()
        return rc
    kind = (actual or {}).get("kind", "Volume").lower()
    print(f"{kind} {args.name}" + (f" ({doc['declaredIn']})" if doc["declaredIn"] else ""))
    if doc["frozen"]:
        print("  FROZEN: its file failed to load; nothing is done to it until it loads:")
        for e in doc["loadErrors"]:
            print(f"    {e}")
    if actual:
        print(f"  phase:    {actual['phase']} (wanted {actual['wanted']})")
        if actual["unknown"]:
            print(f"  unknown:  {actual['unknown']}")
        if actual["problem"]:
            print(f"  PROBLEM:  {actual['problem']}")
        size = format_size(actual["size"]) if actual["size"] else "-"
        print(f"  image:    {actual['image']}  size {size}")
        if actual.get("kind") == "Snapshot":
            print(f"  snapshot: of {actual['source']}, owner {actual['owner'] or 'none recorded'}"
                  f", protected {actual['protected']}")
            print(f"  clones:   {', '.join(actual['children']) or 'none'}")
        else:
            if actual.get("clonedFrom"):
                print(f"  clone of: {actual['clonedFrom']} (depth {actual['cloneDepth']})")
            if actual.get("snapshots"):
                print(f"  snapshots: {', '.join(actual['snapshots'])}")
        print(f"  watchers: {', '.join(actual['watchers']) or 'none'}"
              + (f" (mapped by {actual['holder']})" if actual.get("holder") else ""))
        _print_claim(doc.get("claim"))
        print(f"  mapping:  {actual['mapper'] or '-'} {actual['device'] or ''}")
        print(f"  holders:  {', '.join(holders) or 'none'}")
        print(f"  staging:  {actual['staging'] or '-'}")
        for path, mode in actual["published"]:
            print(f"  published {path} ({mode})")
    if daemon:
        print(f"  daemon:   {daemon.get('phase')} at {daemon.get('updated')}"
              + (f" ({daemon['message']})" if daemon.get("message") else "")
              + (f"; last error: {daemon['lastError']}" if daemon.get("lastError") else ""))
    if doc["refusal"] and doc["refusal"] != doc["unknown"]:
        print(f"  REFUSED:  {doc['refusal']}")
    for n in doc["notes"]:
        print(f"  note:     {n}")
    for s in doc["nextSteps"]:
        print(f"  next:     {s['action']} {s['target']}: {s['from']} -> {s['to']}")
    if not doc["nextSteps"] and not doc["refusal"]:
        print("  next:     nothing; it is where it should be")
    return rc


def _claim_doc(config: Config, actual: dict | None) -> dict | None:
    """The claim, and which of the addresses it names Ceph has blocklisted."""
    claim = (actual or {}).get("claim")
    if not claim:
        return None
    doc = {**claim, "blocklisted": {}, "blocklistError": None}
    addrs = set(claim["clients"]) | set(claim["fenced"])
    if not addrs:
        return doc
    from reconciler.apply import claims
    from reconciler.drivers import ceph

    try:
        with ceph.connect(config.ceph, timeout=claims.MON_TIMEOUT_S) as cluster:
            listed = claims.blocklist(cluster)
    except Exception as exc:  # explain still answers; it says what it could not see
        doc["blocklistError"] = str(exc)
        return doc
    doc["blocklisted"] = {a: listed[a] for a in sorted(addrs) if a in listed}
    return doc


def _print_claim(claim: dict | None) -> None:
    if not claim:
        print("  claim:    none")
        return
    print(f"  claim:    node {claim['node']}"
          + (f", clients {', '.join(claim['clients'])}" if claim["clients"] else "")
          + (f" (took it over from {claim['takenFrom']})" if claim["takenFrom"] else ""))
    for addr, until in claim["blocklisted"].items():
        print(f"  blocklisted: {addr} until {until}")
    if claim["blocklistError"]:
        print(f"  blocklist: not listed ({claim['blocklistError']})")


def cmd_takeover(args: argparse.Namespace, config: Config) -> int:
    import rados
    import rbd

    from reconciler.apply import claims
    from reconciler.drivers import ceph
    from reconciler.facts.claim import Claim
    from reconciler.spec.loader import load

    vol = next((v for v in load(_default_paths(config), config).volumes
                if v.name == args.name), None)
    if vol is None or vol.snapshot is not None:
        print(f"rbd-reconciler: no volume {args.name!r} in {config.desired_dir}", file=sys.stderr)
        return EXIT_FAILED
    pool, image, me = vol.image.pool, vol.image.name, config.node_name
    try:
        with ceph.connect(config.ceph) as cluster:
            held = claims.current(cluster, pool, image)
            if held is None:
                print(f"rbd-reconciler: {pool}/{image} is not claimed by any node; nothing "
                      "to take over (apply maps it)", file=sys.stderr)
                return EXIT_FAILED
            if held.node == me:
                print(f"{pool}/{image} is already claimed by this node ({me})")
                return EXIT_OK
            with cluster.open_ioctx(pool) as ioctx:
                fence = sorted(set(held.clients) | set(claims.watchers(ioctx, image)))
            what = (f"blocklist {', '.join(fence)} (the clients of node {held.node} and "
                    "any other client that has the image open)" if fence
                    else f"blocklist nothing (node {held.node} recorded no client and "
                         "nothing has the image open)")
            if not args.sure:
                print(f"would {what}, then claim {pool}/{image} for {me}. "
                      "Only do this when that node is gone for good: its writes will fail. "
                      "Re-run with --yes-i-am-sure to do it.")
                return EXIT_FAILED
            for addr in fence:
                print(claims.blocklist_add(cluster, addr))
            left = claims.wait_watchers_gone(cluster, pool, image, set(fence))
            if left:
                print(f"rbd-reconciler: {', '.join(left)} still watch {pool}/{image} after "
                      "being blocklisted; the claim was not taken", file=sys.stderr)
                return EXIT_FAILED
            new = Claim(me, (), held.node, tuple(fence))
            if not claims.replace(cluster, pool, image, held, new):
                print(f"rbd-reconciler: the claim of {pool}/{image} changed meanwhile; "
                      "nothing taken (run takeover again to see it)", file=sys.stderr)
                return EXIT_FAILED
    except (ceph.CephError, rados.Error, rbd.Error) as exc:
        print(f"rbd-reconciler: {pool}/{image}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print(f"{pool}/{image}: claimed by {me} (taken over from {held.node}); apply maps it here")
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    try:
        try:
            return _main(argv)
        finally:
            # A closed pipe shows here, not at interpreter exit; this covers
            # argparse's --help and --version too (they exit from parse_args).
            sys.stdout.flush()
    except BrokenPipeError:
        return reader_gone()


def _main(argv: Sequence[str] | None) -> int:
    if list(sys.argv[1:] if argv is None else argv) == ["--version"]:
        print(f"rbd-reconciler {_version()}")  # argparse's help formatter costs ~5 ms
        return EXIT_OK
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except BrokenPipeError:
        raise  # main() ends quietly
    except KeyboardInterrupt:
        print("rbd-reconciler: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:  # never a traceback at a user: one line, and -v for details
        import logging
        import traceback

        if getattr(args, "verbose", False):
            traceback.print_exc()
        logging.getLogger("reconciler").debug("unexpected error", exc_info=True)
        print(f"rbd-reconciler {args.command}: internal error: {type(exc).__name__}: {exc}"
              + ("" if getattr(args, "verbose", False) else " (-v shows the traceback)"),
              file=sys.stderr)
        return EXIT_FAILED


def _run(args: argparse.Namespace) -> int:
    import logging

    from reconciler.spec.config import ConfigError, load_config

    if args.command not in UNPRIVILEGED and os.geteuid() != 0:
        print(f"rbd-reconciler {args.command}: needs root (it reads devices, mounts and the "
              "Ceph keyring, and maps and mounts volumes); only `validate` runs as any user",
              file=sys.stderr)
        return EXIT_FAILED
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        for d in exc.diagnostics:
            print(d, file=sys.stderr)
        return EXIT_FAILED
    return args.func(args, config)


if __name__ == "__main__":
    sys.exit(main())
