"""``rbd-reconciler source``: the GitOps source's status, a sync now, a
verification, a rollback (docs/gitops-source.md).

Imported by cli/main.py, by name, when its command runs (_Command).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from reconciler.cli.show import rollout_lines
from reconciler.source.layout import SourceBusy
from reconciler.source.outcome import Failed
from reconciler.source.report import distrust, revision, source_status
from reconciler.source.sync import Syncer
from reconciler.spec.config import Config

EXIT_OK, EXIT_FAILED = 0, 1


def cmd_source(args: argparse.Namespace, config: Config) -> int:
    if config.git is None:
        print("rbd-reconciler source: the node config has no source: (docs/gitops-source.md)",
              file=sys.stderr)
        return EXIT_FAILED
    try:
        if args.action == "status":
            st = source_status(config)
            print(json.dumps(st, indent=2) if args.output == "json" else human(st))
            return EXIT_OK if st["conditions"][0]["status"] == "True" else EXIT_FAILED
        syncer = Syncer(config)
        if args.action == "sync":
            out = syncer.sync()
            st = source_status(config)
            if args.output == "json":
                print(json.dumps(st, indent=2))
            else:
                rev = revision(config.git, out.commit)
                print(f"{out.result}: {rev or config.git.url}"
                      + (f": {out.reason}: {out.message}" if out.reason else ""))
            return EXIT_OK if out.ok else EXIT_FAILED
        if args.action == "verify":
            out = syncer.verify_only(args.rev)
            rev = revision(config.git, out.commit) or args.rev
            if args.output == "json":
                print(json.dumps({"revision": rev, "tag": out.tag, "verified": out.ok,
                                  "reason": out.reason, "message": out.message,
                                  "signers": out.signers}, indent=2))
            elif out.ok:
                print(f"verified: {rev}: signed by " + ", ".join(
                    f"{s['name']} ({s['format']} {s['fingerprint']})" for s in out.signers)
                    + f"; {out.message}")
            else:
                print(f"refused: {rev}: {out.reason}: {out.message}")
            return EXIT_OK if out.ok else EXIT_FAILED
        if args.action == "rollback":
            commit = syncer.rollback()
            print(f"rolled back to {revision(config.git, commit)}; held there until "
                  "`rbd-reconciler source resume`")
            if (why := distrust(config)) is not None:
                # Verified under the policy of now, it does not pass: not served.
                print(f"rbd-reconciler source rollback: {revision(config.git, commit)} is "
                      f"distrusted: {why}", file=sys.stderr)
                return EXIT_FAILED
            return EXIT_OK
        if args.action == "hold":
            commit = syncer.hold(args.reason)
            print(f"held at {revision(config.git, commit) or 'nothing applied yet'}"
                  + (f" ({args.reason})" if args.reason else "")
                  + "; new revisions are fetched and verified, not applied, until "
                    "`rbd-reconciler source resume`")
            return EXIT_OK
        if args.reason:
            print(f"rbd-reconciler source {args.action}: --reason is for `source hold`",
                  file=sys.stderr)
            return EXIT_FAILED
        syncer.resume()
        print("resumed: the next sync applies the remote's revision")
        return EXIT_OK
    except (Failed, SourceBusy) as exc:
        print(f"rbd-reconciler source {args.action}: {exc}", file=sys.stderr)
        return EXIT_FAILED


def human(st: dict[str, Any]) -> str:
    applied = st["applied"] or {}
    last = st["lastAttempted"] or {}
    lines = [f"source    {st['url']} ({st['ref']}, path {st['path'] or '/'})",
             f"applied   {applied.get('revision') or '-'}"]
    for s in applied.get("signers", []):
        lines.append(f"  signed by {s['name']} ({s['format']} {s['fingerprint']})")
    lines += [f"observed  {st['observed'] or '-'}",
              f"attempted {last.get('revision') or '-'}: {last.get('result', '-')}"
              + (f" ({last['reason']}: {last['message']})" if last.get("reason") else ""),
              f"previous  {st['previous'] or '-'}",
              f"newest    {st.get('newest') or '-'} (later revisions must descend from it)",
              f"fetched   {st['lastFetchAt'] or 'never'}; last success "
              f"{st['lastSuccessAt'] or 'never'}"]
    if st["held"]:
        lines.append(f"held      since {st['held']['at']} (source resume)")
    if st.get("distrusted"):
        d = st["distrusted"]
        lines.append(f"distrusted since {d['at']}: {d['reason']}: every volume held as it is")
    lines += rollout_lines(st.get("rollout"))
    for c in st["conditions"]:
        lines.append(f"{c['type']:<15} {c['status']:<7} {c['reason']}"
                     + (f": {c['message']}" if c["message"] else ""))
    return "\n".join(lines)

