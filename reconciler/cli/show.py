"""The words of ``plan``, ``apply``, ``status``, ``explain`` and ``fleet
status``: each printed from its document (reconciler/views.py; fleet
status: plan/fleetstatus.py), whoever made it (this process's own pass, or
the running daemon's live view), so both print the same.

Imports nothing of the engine: a command answered by the daemon loads no
more than the parser, the config and this.

Imported by cli/ (5 modules).
"""

from __future__ import annotations

import json
import sys

TYPE_CHECKING = False  # typing itself costs ~5 ms at start-up
if TYPE_CHECKING:
    from typing import Any


def as_json(doc: dict[str, Any]) -> None:
    # One write: json.dump writes each token to the stream, ~10x slower on a
    # pipe (a status of 200 volumes: 38 ms against 4).
    sys.stdout.write(json.dumps(doc, indent=2) + "\n")


def diagnostics(errors: list[dict[str, Any]]) -> None:
    """Load errors, on stderr, as ``validate`` words them."""
    for e in errors:
        print(diagnostic(e), file=sys.stderr)


def diagnostic(e: dict[str, Any]) -> str:
    """As ``str(Diagnostic)``: the file name escaped too."""
    from reconciler.spec.diagnostics import escaped

    return f"{escaped(e['file'])}:{e['line']}:{e['column']}: {e['field']}: {e['message']}"


# -- plan -----------------------------------------------------------------------------
def _marker(step: dict[str, Any]) -> str:
    if step["destructive"]:
        return "!"
    if step["disruptive"]:
        return "-"
    return "+" if step["from"] in ("absent", "unmapped", "not staged", "not published") else "~"


def plan_entries(entries: list[dict[str, Any]]) -> None:
    for vp in entries:
        kind, name = vp["kind"], vp["name"]
        refusal = None if vp["withheld"] else vp["refusal"]  # refused as a whole
        if vp["stalled"] and not vp["steps"]:
            print(f"{kind} {name}: STALLED: {vp['stalled']}"
                  + (f"; UNKNOWN: {vp['unknown']}" if vp["unknown"] else ""))
            continue
        if vp["unknown"]:
            print(f"{kind} {name}: UNKNOWN: {vp['unknown']}")
            continue
        if refusal:
            print(f"{kind} {name}: REFUSED: {refusal}")
            continue
        if vp["waiting"]:
            print(f"{kind} {name}: {vp['waiting']}")
            continue
        if not vp["steps"]:
            print(f"{kind} {name}: ok ({vp['observed']})")
        else:
            arrow = f"{vp['observed']} -> {vp['wanted']}" if vp["wanted"] is not None else ""
            print(f"{kind} {name}: {arrow}")
        for s in vp["steps"]:
            flag = "  (destructive)" if s["destructive"] else ""
            print(f"  {_marker(s)} {s['action']:<16} {s['target']}: {s['from']} -> {s['to']}"
                  f"{flag}")
        for why in vp["withheld"]:
            print(f"  REFUSED: {why}")
        for kind_, why in vp["problems"].items():  # no step can put these right
            print(f"  PROBLEM ({kind_}): {why}")
        for note in vp["notes"]:
            print(f"  note: {note}")
        if vp.get("applying"):
            print("  note: the daemon is running these steps now")


def plan(doc: dict[str, Any]) -> None:
    diagnostics(doc["errors"])
    for path, owner in zip(doc["leftFrozen"], doc["leftFrozenBy"], strict=True):
        print(f"LEFT FROZEN: {path} (by {owner}, which is gone): "
              "apply thaws it first, before any Ceph call")
    entries = doc["volumes"]
    plan_entries(entries)
    steps = sum(len(e["steps"]) for e in entries) + len(doc["leftFrozen"])
    destructive = sum(s["destructive"] for e in entries for s in e["steps"])
    refused = sum(bool(e["refusal"]) for e in entries)
    unknown = sum(bool(e["unknown"]) for e in entries)
    print(f"Plan: {steps} step(s) for {sum(bool(e['steps']) for e in entries)} volume(s), "
          f"{destructive} destructive; {refused} refused"
          + (f", {unknown} unknown." if unknown else "."))


# -- apply and release ----------------------------------------------------------------
def outcome(o: dict[str, Any]) -> None:
    """One volume's result: ``changed: [pgdata]`` and its steps."""
    print(f"{o['status']}: [{o['name']}]" + (f" {o['error']}" if o["error"] else ""))
    for s in o["steps"]:
        msg = f" ({s['message']})" if s["message"] else ""
        print(f"  {s['status']:<7} {s['action']:<16} {s['target']}{msg}")
    for u in o["undone"]:
        print(f"  undone  {u}")
    for note in o["notes"]:
        print(f"  note: {note}")


def recap(counts: dict[str, int]) -> None:
    print("recap: " + " ".join(f"{k}={v}" for k, v in counts.items()))


def applied(doc: dict[str, Any]) -> None:
    diagnostics(doc["errors"])
    for o in doc["volumes"]:
        outcome(o)
    recap(doc["recap"])


def rollout_lines(ro: dict[str, Any] | None) -> list[str]:
    """The node's rollout state, for people (``source status``, ``status``)."""
    if not ro:
        return []
    if not ro["inFleet"] and ro["state"] == "NotInFleet":
        return [f"rollout   {ro['message']}"]
    where = f"wave {ro['wave']}" if ro.get("wave") else "in no wave"
    head = f"rollout   {ro['state']}" + (f" ({where} of {ro['rollout']})" if ro.get("rollout")
                                           else "")
    lines = [head + (f": {ro['message']}" if ro.get("message") else "")]
    hb = ro.get("heldBack") or {}
    if hb:
        lines.append(f"  held back {hb.get('revision') or hb.get('commit')} since {hb.get('at')}")
    for w in hb.get("waitingFor") or ():
        lines.append(f"  waiting for {w.get('node')}: {w.get('detail') or w.get('why')}")
    if hb.get("nextOpening"):
        lines.append(f"  next window opens at {hb['nextOpening']}")
    if halted := hb.get("halted"):
        lines.append(f"  halted by {halted.get('node')}"
                     + (f", volume {halted['volume']}" if halted.get("volume") else "")
                     + f": {halted.get('reason')}")
    return lines


# -- status ---------------------------------------------------------------------------
def status(doc: dict[str, Any]) -> None:
    from reconciler.spec.units import format_size

    diagnostics(doc["errors"])
    source = doc.get("source")
    if source is not None:
        done = (source["applied"] or {}).get("revision") or "no revision applied"
        print(f"source: {source['url']} ({source['ref']}): {done}")
        for c in source["conditions"]:
            if (c["type"] == "Stalled") == (c["status"] == "True"):  # what is not well
                print(f"source: {c['type']} {c['status']} {c['reason']}: {c['message']}")
        for line in rollout_lines(source.get("rollout")):
            print(f"source: {line.strip()}")
    if doc.get("stateDirProblem"):
        print(f"rbd-reconciler: {doc['stateDirProblem']}: new and changed volumes are not "
              "converged until it can (the daemon holds back what it cannot record)",
              file=sys.stderr)
    rows = doc["volumes"]
    print(f"{'VOLUME':<16} {'PHASE':<10} {'WANTED':<10} {'SIZE':>7}  {'DEVICE':<11} MOUNTS")
    for r in rows:
        size = format_size(r["size"]) if r["size"] else "-"
        mounts = [f"{r['staging']} (staging)"] if r["staging"] else []
        mounts += [f"{path} ({mode})" for path, mode in r["published"]]
        if r.get("kind") == "Snapshot":
            children = ", ".join(r["children"]) or "none"
            mounts = [f"snapshot {r['image']} of {r['source']}; clones: {children}"]
        elif r.get("kind") == "SnapshotGroup":
            mounts = [f"group snapshot {r['image']} of {r['source']}"]
        elif r.get("clonedFrom"):
            mounts.append(f"clone of {r['clonedFrom']}")
        if r.get("encryption"):
            enc = r["encryption"]
            mounts.append(f"LUKS2 {'open' if enc['open'] else 'closed'}")
        if r.get("qos"):
            mounts.append("QoS " + " ".join(f"{k}={v}" for k, v in r["qos"].items()))
        print(f"{r['name']:<16} {r['phase']:<10} {r['wanted']:<10} {size:>7}  "
              f"{r['device'] or '-':<11} {', '.join(mounts) or '-'}")
        if r.get("helper"):
            print(f"{'':<16} {_helper(r['helper'])}")
        if r.get("fenceReason"):
            print(f"{'':<16} fenced: {r['fenceReason']}")
        if r.get("stallReason"):
            print(f"{'':<16} stalled: {r['stallReason']}")
        if r["unknown"]:
            print(f"{'':<16} unknown: {r['unknown']}")
        if r.get("notConverged"):
            print(f"{'':<16} not converged ({r['observedPhase']} now): {r['notConverged']}")
    for name in doc["frozen"]:
        print(f"{name:<16} {'FROZEN':<10} (its file failed to load; left as it is)")
    for r in rows:
        if r["problem"]:
            print(f"{r['name']}: {r['phase']}: {r['problem']}", file=sys.stderr)
    unaccounted(doc.get("unaccounted"))


def unaccounted(found: dict[str, Any] | None) -> None:
    """What no volume accounts for (engine/orphans.py): each with its verdict."""
    if not found or not (found["orphans"] or found["unknown"]):
        return
    print("unaccounted for (release --orphans removes those ours that nothing uses):")
    for o in found["orphans"]:
        verdict = "ours" if o["ours"] else "not ours"
        print(f"  {verdict:<9} {o['kind']:<9} {o['what']}: {o['why']}")
    for line in found["unknown"]:
        print(f"  unknown: {line}")


# -- explain --------------------------------------------------------------------------
UNKNOWN = "unknown"


def explanation(doc: dict[str, Any]) -> None:
    actual, daemon = doc["actual"], doc["daemon"]
    kind = (actual or {}).get("kind", "Volume").lower()
    print(f"{kind} {doc['name']}" + (f" ({doc['declaredIn']})" if doc["declaredIn"] else ""))
    if doc["frozen"]:
        print("  FROZEN: its file failed to load; nothing is done to it until it loads:")
        for e in doc["loadErrors"]:
            print(f"    {e}")
    if actual:
        _actual(actual, doc["deviceHolders"], doc.get("claim"))
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


def _actual(actual: dict[str, Any], holders: list[str], claim: dict | None) -> None:
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
        members = UNKNOWN if unseen else ", ".join(actual["members"]) or "none"
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
            _claim(claim)
        for key, why in unreadable.items():
            print(f"  image-meta: {key} is {why}")
    print(f"  mapping:  {actual['mapper'] or '-'} {actual['device'] or ''}")
    if actual.get("helper"):
        print(f"  helper:   {_helper(actual['helper'])}")
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


def _helper(h: dict) -> str:
    """The rbd-nbd serving a device: its pid, the version of its binary, and
    whether a package upgrade replaced that binary on disk since."""
    return (f"rbd-nbd pid {h['pid']}, version {h['version'] or 'unknown'}, {h['state']}")


def _claim(claim: dict | None) -> None:
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


# -- fleet status --------------------------------------------------------------------
FLEET_DIRECT_READ = ("a direct read: no daemon answered (with one running, fleet status is "
                     "its answer); no report is stale to one read and no node has been healthy "
                     "for any time yet (the gate judges both on its reader's own clock over "
                     "time, never by writtenAt)")


def fleet(doc: dict[str, Any], output: str) -> None:
    """``fleet status``'s document (cli/fleet.py's read, or the daemon's) as
    ``-o json`` (with its caveat as ``note``) or a table."""
    if output == "json":
        if (note := fleet_note(doc)) is not None:
            doc = {**doc, "note": note}
        print(fleet_json(doc))
    else:
        print(fleet_table(doc))


def fleet_json(doc: dict[str, object]) -> str:
    """JSON with one node or revision a line: json's indented encoder is
    pure Python, ~0.15 s for 1,000 nodes; a line each is C's and as readable."""
    parts = []
    for key, value in doc.items():
        if isinstance(value, list) and value:
            items = ",\n    ".join(json.dumps(v, separators=(", ", ": ")) for v in value)
            parts.append(f"  {json.dumps(key)}: [\n    {items}\n  ]")
        else:
            parts.append(f"  {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(parts) + "\n}"


def _short(commit: str | None) -> str:
    return commit[:12] if commit else "-"


def fleet_note(doc: dict[str, Any]) -> str | None:
    """The caveat of a direct read, or of a daemon that has not read the
    reports for staleSeconds yet."""
    if doc.get("answeredBy") == "this command":
        return FLEET_DIRECT_READ
    watched, stale = doc["observedForSeconds"], doc["staleSeconds"]
    if watched is None or watched >= stale:
        return None
    return (f"read for {watched:g}s of the {stale}s after which a report is stale: no "
            "report is stale, and no node has been healthy, for longer than that yet")


def fleet_table(doc: dict[str, Any]) -> str:
    """The document as a table (the same from this read or the daemon's)."""
    lines = [f"rollout {doc['rollout']}" if doc["rollout"]
             else "no fleet.yaml: every node applies at once"]
    rows = [("NODE", "WAVE", "APPLIED", "HEALTH", "HEALTHY FOR", "UNCHANGED",
             "WRITTEN AT (its clock)", "NOTE")]
    for r in doc["nodes"]:
        if r["missing"]:
            rows.append((r["node"], r["wave"] or "-", "-", "-", "-", "-", "-",
                         "missing: no report"))
            continue
        notes = []
        if r["health"] == "Failed":
            notes.append(f"failed {r['failedVolume'] or '(revision)'}: {r['failedReason']}")
        if r["heldBack"]:
            notes.append(f"holds back {_short(r['heldBack'])}: {r['heldBackWhy']}")
        if r["held"]:
            notes.append("held" + (f": {r['holdReason']}" if r["holdReason"] else ""))
        if r["reportedWave"] and r["reportedWave"] != r["wave"]:
            notes.append(f"says wave {r['reportedWave']}")
        quiet = f"{r['unchangedForSeconds']:.0f}s" + (" STALE" if r["stale"] else "")
        healthy = r.get("healthyForSeconds")
        rows.append((r["node"], r["wave"] or "-", _short(r["applied"]), r["health"] or "-",
                     "-" if healthy is None else f"{healthy:.0f}s", quiet,
                     r["writtenAt"] or "-", "; ".join(notes)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[-1]
              for row in rows]
    for rev in doc["revisions"]:
        lines += ["", f"revision {_short(rev['commit'])}: {rev['state']}: {rev['summary']}",
                  f"  applied by {len(rev['appliedBy'])}, held back by "
                  f"{len(rev['heldBackBy'])}; waves done: "
                  + (", ".join(rev["wavesDone"]) or "none")]
    if (note := fleet_note(doc)) is not None:
        lines += ["", f"note: {note}"]
    if doc["problems"]:
        lines += ["", f"{len(doc['problems'])} problem(s) reading the fleet:"]
        lines += [f"  {p}" for p in doc["problems"]]
    return "\n".join(lines)
