"""``status`` and ``explain``: what is there, and why a volume is as it is.

With the daemon running, answered by it (cli/ask.py): a look it makes for
the question, through its Ceph connection; none from here. Else this process
looks for itself, as it always has.

Imported by cli/main.py, by name, when its command runs (_Command).
"""

from __future__ import annotations

import argparse
import sys

from reconciler.cli import show
from reconciler.cli.main import EXIT_FAILED
from reconciler.cli.reconcile import default_paths, local_pass, outside_daemon

TYPE_CHECKING = False  # typing itself costs ~5 ms at start-up
if TYPE_CHECKING:
    from reconciler.spec.config import Config


def cmd_status(args: argparse.Namespace, config: Config) -> int:
    from reconciler.cli.ask import ask, targets

    if not outside_daemon(args, config):
        rc = ask(config, "status", {"targets": targets(args.paths)}, args.output)
        if rc is not None:
            return rc
    import time

    from reconciler.engine import Node, context
    from reconciler.views import answered, status_exit, status_of

    node = Node.from_config(config)
    at = time.time()
    done = local_pass(args, config, node, all_watchers=True)
    if done is None:
        return EXIT_FAILED
    p, sel = done
    doc = answered(status_of(config, context(config, node), p.loaded, p.observed, p.plans,
                             sel.errors), "this command", at)
    if not args.paths:  # the node's leftovers: a status of the whole node only
        from reconciler.engine.orphans import find

        doc["unaccounted"] = find(config, node, p.loaded).as_dict()
    if args.output == "json":
        show.as_json(doc)
    else:
        show.status(doc)
    return status_exit(doc)


def cmd_explain(args: argparse.Namespace, config: Config) -> int:
    from reconciler.cli.ask import ask

    rc = ask(config, "explain", {"name": args.name}, args.output)
    if rc is not None:
        return rc
    import time

    from reconciler.engine import Node, blocklist, context, plan_pass
    from reconciler.views import answered, claim_doc, daemon_status, explain_exit, explanation

    node = Node.from_config(config)
    at = time.time()
    p = plan_pass(default_paths(config), config, node, all_watchers=True)
    if p.loaded.refused:  # an untrusted directory or file: say so, explain nothing
        for d in p.loaded.diagnostics:
            print(d, file=sys.stderr)
        return EXIT_FAILED
    daemon = daemon_status(config)(args.name)
    vols = {v.name: v for v in p.loaded.volumes}
    if args.name not in vols and args.name not in p.loaded.frozen_names and daemon is None:
        print(f"rbd-reconciler: no volume {args.name!r} in {config.desired_dir}", file=sys.stderr)
        return EXIT_FAILED
    vp = next((x for x in p.plans if x.name == args.name), None)
    doc = explanation(args.name, vols.get(args.name), vp, p.observed, context(config, node),
                      args.name in p.loaded.frozen_names, p.loaded.diagnostics, daemon,
                      lambda actual: claim_doc(actual, lambda: blocklist(config)))
    answered(doc, "this command", at)
    if args.output == "json":
        show.as_json(doc)
    else:
        show.explanation(doc)
    return explain_exit(doc)

