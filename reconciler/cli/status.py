"""``status`` and ``explain``: what the daemon last recorded, and why a volume is as it is."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from reconciler.cli.main import EXIT_FAILED, EXIT_OK
from reconciler.cli.reconcile import default_paths, paths_of, print_load_errors

TYPE_CHECKING = False  # typing itself costs ~5 ms at start-up
if TYPE_CHECKING:
    from typing import Any

    from reconciler.engine import Pass
    from reconciler.observe.node import Node
    from reconciler.spec.config import Config


def cmd_status(args: argparse.Namespace, config: Config) -> int:
    from reconciler.engine import context, plan_pass
    from reconciler.observe.node import Node
    from reconciler.plan.planner import actual_state
    from reconciler.spec.units import format_size

    node = Node.from_config(config)
    p = plan_pass(paths_of(args, config), config, node, all_watchers=True)
    ctx = context(config, node)
    found = {vp.name: vp.problems for vp in p.plans}  # planned already: not again
    rows = [actual_state(v, p.observed, ctx, found.get(v.name)) for v in p.loaded.volumes]
    for r in rows:
        r["daemon"] = _daemon_status(config, str(r["name"]))
        _daemon_stall(r)
    full = _state_dir_full(config, rows)
    # Unknown is not absent: what could not be seen fails the command, as
    # do I/O that does not complete and a fence.
    bad = any(r["unknown"] or r["problem"] or r.get("stalled") or r.get("fence") for r in rows)
    rc = EXIT_FAILED if p.loaded.diagnostics or bad or full else EXIT_OK
    source = None
    if config.git is not None:  # the GitOps source: what the files came from
        from reconciler.source.report import source_status

        source = source_status(config)
    if args.output == "json":
        json.dump({"volumes": rows, "frozen": sorted(p.loaded.frozen_names),
                   "errors": [d.as_dict() for d in p.loaded.diagnostics],
                   **({"source": source} if source else {})}, sys.stdout, indent=2)
        print()
        return rc
    print_load_errors(p)
    if source is not None:
        applied = (source["applied"] or {}).get("revision") or "no revision applied"
        print(f"source: {source['url']} ({source['ref']}): {applied}")
        for c in source["conditions"]:
            if (c["type"] == "Stalled") == (c["status"] == "True"):  # what is not well
                print(f"source: {c['type']} {c['status']} {c['reason']}: {c['message']}")
    if full:
        print(f"rbd-reconciler: {full}: new and changed volumes are not converged until it "
              "can (the daemon holds back what it cannot record)", file=sys.stderr)
    print(f"{'VOLUME':<16} {'PHASE':<10} {'WANTED':<10} {'SIZE':>7}  {'DEVICE':<11} MOUNTS")
    for r in rows:
        size = format_size(r["size"]) if r["size"] else "-"  # type: ignore[arg-type]
        mounts = [f"{r['staging']} (staging)"] if r["staging"] else []
        mounts += [f"{path} ({mode})" for path, mode in r["published"]]  # type: ignore[union-attr]
        if r.get("kind") == "Snapshot":
            children = ", ".join(r["children"]) or "none"  # type: ignore[arg-type]
            mounts = [f"snapshot {r['image']} of {r['source']}; clones: {children}"]
        elif r.get("kind") == "SnapshotGroup":
            mounts = [f"group snapshot {r['image']} of {r['source']}"]
        elif r.get("clonedFrom"):
            mounts.append(f"clone of {r['clonedFrom']}")
        if r.get("encryption"):
            enc = r["encryption"]
            mounts.append(f"LUKS2 {'open' if enc['open'] else 'closed'}")  # type: ignore[index]
        if r.get("qos"):
            mounts.append("QoS " + " ".join(f"{k}={v}" for k, v in r["qos"].items()))  # type: ignore[union-attr]
        print(f"{r['name']:<16} {r['phase']:<10} {r['wanted']:<10} {size:>7}  "
              f"{r['device'] or '-':<11} {', '.join(mounts) or '-'}")
        if r.get("fenceReason"):
            print(f"{'':<16} fenced: {r['fenceReason']}")
        if r.get("stallReason"):
            print(f"{'':<16} stalled: {r['stallReason']}")
        if r["unknown"]:
            print(f"{'':<16} unknown: {r['unknown']}")
        if r.get("notConverged"):
            print(f"{'':<16} not converged ({r['observedPhase']} now): {r['notConverged']}")
    for name in sorted(p.loaded.frozen_names):
        print(f"{name:<16} {'FROZEN':<10} (its file failed to load; left as it is)")
    for r in rows:
        if r["problem"]:
            print(f"{r['name']}: {r['phase']}: {r['problem']}", file=sys.stderr)
    return rc


def _daemon_stall(row: dict[str, Any]) -> None:
    """A CLI watches a device for a second; the daemon has watched it all
    along: where both see it stalled, the daemon's start of the stall and
    last completion are the ones to tell."""
    mine, theirs = row.get("stalled"), (row.get("daemon") or {}).get("stalled")
    if not mine or not isinstance(theirs, dict) or theirs.get("device") != mine["device"]:
        return
    if (row.get("daemon") or {}).get("phase") != "Stalled":
        return
    for key in ("since", "lastCompleted"):
        if isinstance(theirs.get(key), str) and (mine[key] is None or theirs[key] < mine[key]):
            mine[key] = theirs[key]
    mine["seenByDaemon"] = True
    last = (f"the last I/O completed at {mine['lastCompleted']}" if mine["lastCompleted"]
            else f"none completed since {mine['since']}")
    row["stallReason"] = (f"I/O to {mine['device']} is not completing: {mine['inFlight']} "
                          f"request(s) in flight; {last} (the daemon has seen it stalled "
                          f"since {mine['since']})")


def _state_dir_full(config: Config, rows: list[dict[str, Any]]) -> str | None:
    """A stateDir that cannot take the daemon's next record (read without
    writing): every volume not yet at its wanted phase is not converged,
    whatever it looks like now (PENDING, never ABSENT), and status fails."""
    from reconciler.state.files import space_problem

    why = space_problem(config.state_dir, config.state_dir / "managed.json")
    if why is None:
        return None
    full = f"stateDir {config.state_dir} cannot take a write ({why})"
    for r in rows:
        if (r.get("kind", "Volume") == "Volume" and r["phase"] != r["wanted"]
                and r["phase"] not in ("UNKNOWN", "DEGRADED", "STALLED", "FENCED")):
            r["observedPhase"], r["phase"] = r["phase"], "PENDING"
            r["notConverged"] = full
    return full


def _daemon_status(config: Config, name: str) -> dict | None:
    from reconciler.state.files import read_json

    return read_json(config.state_dir / "status" / f"{name}.json")


def cmd_explain(args: argparse.Namespace, config: Config) -> int:
    from reconciler.engine import plan_pass
    from reconciler.observe.node import Node

    node = Node.from_config(config)
    p = plan_pass(default_paths(config), config, node, all_watchers=True)
    if p.loaded.refused:  # an untrusted directory or file: say so, explain nothing
        print_load_errors(p)
        return EXIT_FAILED
    daemon = _daemon_status(config, args.name)
    declared = {v.name for v in p.loaded.volumes}
    if args.name not in declared and args.name not in p.loaded.frozen_names and daemon is None:
        print(f"rbd-reconciler: no volume {args.name!r} in {config.desired_dir}", file=sys.stderr)
        return EXIT_FAILED
    doc = _explanation(args.name, p, config, node, daemon)
    actual = doc["actual"] or {}
    rc = EXIT_FAILED if doc["unknown"] or actual.get("stalled") or actual.get("fence") \
        else EXIT_OK
    if args.output == "json":
        json.dump(doc, sys.stdout, indent=2)
        print()
        return rc
    _print_explanation(doc)
    return rc


def _explanation(name: str, p: Pass, config: Config, node: Node,
                 daemon: dict | None) -> dict[str, Any]:
    """What ``explain NAME`` says, as the document ``-o json`` prints."""
    from reconciler.engine import context
    from reconciler.plan.planner import actual_state

    vols = {v.name: v for v in p.loaded.volumes}
    vp = next((x for x in p.plans if x.name == name), None)
    actual = actual_state(vols[name], p.observed, context(config, node),
                          vp.problems if vp else None) if name in vols else None
    holders: list[str] = []
    if actual and actual["device"]:
        dev = Path(str(actual["device"])).name
        holders = sorted(h.name for h in Path(f"/sys/class/block/{dev}/holders").glob("*"))
    return {
        "name": name,
        "declaredIn": str(vols[name].source) if name in vols else None,
        "frozen": name in p.loaded.frozen_names,
        "loadErrors": [str(d) for d in p.loaded.diagnostics
                       if name in p.loaded.frozen_names],
        "actual": actual,
        "deviceHolders": holders,
        "daemon": daemon,
        "unknown": vp.unknown if vp else None,
        "refusal": vp.refused if vp else None,
        "notes": vp.notes if vp else [],
        "problems": vp.problems if vp else {},
        "nextSteps": [s.as_dict() for s in vp.steps] if vp else [],
        "claim": _claim_doc(config, actual),
    }


def _print_explanation(doc: dict[str, Any]) -> None:
    actual, daemon = doc["actual"], doc["daemon"]
    kind = (actual or {}).get("kind", "Volume").lower()
    print(f"{kind} {doc['name']}" + (f" ({doc['declaredIn']})" if doc["declaredIn"] else ""))
    if doc["frozen"]:
        print("  FROZEN: its file failed to load; nothing is done to it until it loads:")
        for e in doc["loadErrors"]:
            print(f"    {e}")
    if actual:
        _print_actual(actual, doc["deviceHolders"], doc.get("claim"))
    if daemon:
        print(f"  daemon:   {daemon.get('phase')} at {daemon.get('updated')}"
              + (f" ({daemon['message']})" if daemon.get("message") else "")
              + (f"; last error: {daemon['lastError']}" if daemon.get("lastError") else ""))
        if daemon.get("sourceRevision"):  # the GitOps source's revision it converged from
            print(f"  source:   {daemon['sourceRevision']}")
    shown = {doc["unknown"], (actual or {}).get("fenceReason")}
    if doc["refusal"] and doc["refusal"] not in shown and "is not completing" not in doc["refusal"]:
        print(f"  REFUSED:  {doc['refusal']}")
    for n in doc["notes"]:
        print(f"  note:     {n}")
    for s in doc["nextSteps"]:
        print(f"  next:     {s['action']} {s['target']}: {s['from']} -> {s['to']}")
    if not doc["nextSteps"] and not doc["refusal"]:
        print("  next:     nothing a step can do: see PROBLEM above" if doc["problems"]
              else "  next:     nothing; it is where it should be")


UNKNOWN = "unknown"


def _print_actual(actual: dict[str, Any], holders: list[str], claim: dict | None) -> None:
    from reconciler.facts.meta import HOLDER
    from reconciler.spec.units import format_size

    print(f"  phase:    {actual['phase']} (wanted {actual['wanted']})")
    if actual.get("fenceReason"):
        print(f"  FENCED:   {actual['fenceReason']}")
    if actual.get("stallReason"):
        print(f"  STALLED:  {actual['stallReason']}")
    if actual["unknown"]:
        print(f"  unknown:  {actual['unknown']}")
    if actual["problem"]:
        print(f"  PROBLEM:  {actual['problem']}")
    # What only Ceph knows is "unknown" while the image is not seen (an
    # outage): never "none", which would say there is nothing.
    unseen = bool(actual.get("imageUnknown"))
    size = format_size(actual["size"]) if actual["size"] else UNKNOWN if unseen else "-"
    print(f"  image:    {actual['image']}  size {size}")
    if actual.get("kind") == "Snapshot":
        owner = UNKNOWN if unseen else actual["owner"] or "none recorded"
        print(f"  snapshot: of {actual['source']}, owner {owner}"
              f", protected {UNKNOWN if unseen else actual['protected']}")
        print(f"  clones:   {UNKNOWN if unseen else ', '.join(actual['children']) or 'none'}")
    elif actual.get("kind") == "SnapshotGroup":
        owner = UNKNOWN if unseen else actual["owner"] or "none recorded"
        print(f"  group:    of {actual['source']}, owner {owner}")
        members = UNKNOWN if unseen else ", ".join(actual["members"]) or "none"  # type: ignore[arg-type]
        print(f"  members:  {members}")
    else:
        if actual.get("clonedFrom"):
            print(f"  clone of: {actual['clonedFrom']} (depth {actual['cloneDepth']})")
        if actual.get("snapshots"):
            print(f"  snapshots: {', '.join(actual['snapshots'])}")
    if unseen:
        print(f"  watchers: {UNKNOWN} (the image was not seen)")
        print(f"  claim:    {UNKNOWN} (the image was not seen)")
    else:
        print(f"  watchers: {', '.join(actual['watchers']) or 'none'}"
              + (f" (mapped by {actual['holder']})" if actual.get("holder") else ""))
        unreadable = actual.get("unreadableMeta") or {}
        if HOLDER in unreadable:
            print(f"  claim:    {UNKNOWN} (image-meta {HOLDER} is {unreadable[HOLDER]})")
        else:
            _print_claim(claim)
        for key, why in unreadable.items():
            print(f"  image-meta: {key} is {why}")
    print(f"  mapping:  {actual['mapper'] or '-'} {actual['device'] or ''}")
    if enc := actual.get("encryption"):
        print(f"  encryption: {enc['type']}, key {enc['key'] or '(none in the spec)'}; "
              f"container {enc['container'] or 'not mapped'}; "
              + (f"open at {enc['open']}" if enc["open"] else "closed"))
        if enc.get("rotationInterrupted"):
            print(f"  rotation: interrupted; run `rbd-reconciler rotate-key {actual['name']}` "
                  "again to finish it (both passphrases may open the container until then)")
    if actual.get("qos"):
        print("  QoS:      " + ", ".join(f"{k} {v}" for k, v in actual["qos"].items())
              + " (librbd's limits in the image's metadata)")
    print(f"  holders:  {', '.join(holders) or 'none'}")
    print(f"  staging:  {actual['staging'] or '-'}")
    for path, mode in actual["published"]:
        print(f"  published {path} ({mode})")


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
