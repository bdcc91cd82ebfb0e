"""``status`` and ``explain``: what is there, and why a volume is as it is.

With the daemon running, answered from its live view (cli/ask.py): what its
passes saw, no second look at the node or Ceph from here. Else this process
looks for itself, as it always has."""

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
    from reconciler.engine import context
    from reconciler.observe.node import Node
    from reconciler.views import daemon_status, status_doc, status_exit, status_row

    node = Node.from_config(config)
    done = local_pass(args, config, node, all_watchers=True)
    if done is None:
        return EXIT_FAILED
    p, sel = done
    ctx = context(config, node)
    plans = {vp.name: vp for vp in p.plans}  # planned already: problems are not found again
    rows = [status_row(v, p.observed, ctx, plans.get(v.name)) for v in p.loaded.volumes
            if v.name in plans]
    frozen = [n for n in p.loaded.frozen_names if n in plans]
    doc = status_doc(config, rows, frozen, sel.errors, daemon_status(config))
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
    from reconciler.engine import context, plan_pass
    from reconciler.observe.node import Node
    from reconciler.views import claim_doc, daemon_status, explain_exit, explanation

    node = Node.from_config(config)
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
                      lambda actual: claim_doc(actual, lambda: _blocklist(config)))
    if args.output == "json":
        show.as_json(doc)
    else:
        show.explanation(doc)
    return explain_exit(doc)


def _blocklist(config: Config) -> dict[str, str]:
    """Ceph's blocklist, through a connection of this command's own."""
    from reconciler.apply import claims
    from reconciler.drivers import ceph

    with ceph.connect(config.ceph, timeout=claims.MON_TIMEOUT_S) as cluster:
        return claims.blocklist(cluster)
