"""``recover NAME``: the documented way out of a fence.

A node whose mapping is fenced (another node ran ``takeover``, or Ceph
blocklisted the client doing its I/O) must not write to the image again,
and nothing is done to it automatically. The recovery order: the operator
stops what uses the volume (theirs: it is refused while anything still
does); then this unmounts the publishes and the staging mount, closes the
LUKS2 container, unmaps the device (krbd: ``-o force``); then either leaves
the image to its new holder (``--leave``; a claim this node still holds is
released), or claims it back (``--reclaim``: ``takeover``, for a node that
is to keep the volume; the next apply maps it here afresh).

Imported by cli/main.py, by name, when its command runs (_Command).
"""

from __future__ import annotations

import argparse
import sys

from reconciler.cli.main import EXIT_FAILED, EXIT_OK
from reconciler.cli.reconcile import default_paths

TYPE_CHECKING = False  # typing itself costs ~5 ms at start-up
if TYPE_CHECKING:
    from reconciler.spec.config import Config
    from reconciler.spec.model import Volume


def cmd_recover(args: argparse.Namespace, config: Config) -> int:
    from reconciler.engine import Busy, state_lock
    from reconciler.spec.loader import load

    if args.leave == args.reclaim:
        print("rbd-reconciler recover: say what becomes of the volume: --leave (to its new "
              "holder) or --reclaim --yes-i-am-sure (keep it on this node)", file=sys.stderr)
        return EXIT_FAILED
    if args.reclaim and not args.sure:
        print("rbd-reconciler recover: --reclaim fences the node that holds the claim now "
              "(as takeover does); add --yes-i-am-sure to do it", file=sys.stderr)
        return EXIT_FAILED
    vol = next((v for v in load(default_paths(config), config).volumes
                if v.name == args.name and v.kind == "Volume"), None)
    if vol is None:
        print(f"rbd-reconciler: no volume {args.name!r} in {config.desired_dir}", file=sys.stderr)
        return EXIT_FAILED
    try:
        with state_lock(config):
            return _recover(args, config, vol)
    except Busy as exc:
        print(f"rbd-reconciler: {exc}: stop the daemon first (systemctl stop rbd-reconciler; "
              "the mounts stay), recover, then start it again", file=sys.stderr)
        return EXIT_FAILED


def _recover(args: argparse.Namespace, config: Config, vol: Volume) -> int:
    from reconciler.engine import Node, act, look, plan_again
    from reconciler.engine.operator import unmap_forced, users_of

    node = Node.from_config(config)
    looked = look([vol], config, node, release=[vol.name], all_watchers=True)
    observed, [vp] = looked.observed, looked.plans
    if vp.fenced is None:
        # What it would be, not taken down: why there is nothing to recover.
        [now] = plan_again([vol], observed, config, node)
        why = (f"its claim and Ceph's blocklist cannot be seen ({now.unknown}); recover acts "
               "only on a fence it sees" if now.unknown else
               f"it is not fenced (phase {now.phase_name}): nothing to recover; "
               "`rbd-reconciler release` gives a volume back")
        print(f"rbd-reconciler recover: {vol.name}: {why}", file=sys.stderr)
        return EXIT_FAILED
    print(f"{vol.name}: FENCED: {vp.fenced}")
    users = users_of(vp, observed)
    if users:
        print(f"rbd-reconciler recover: refusing: {vol.name} is still in use; stop these "
              "first (nothing was changed):", file=sys.stderr)
        for u in users:
            print(f"  {u}", file=sys.stderr)
        return EXIT_FAILED
    unmap_forced(vp, release_claim=args.leave)
    [out] = act([vp], {vol.name: vol}, observed, node)
    for s in out.steps:
        print(f"  {s.status:<7} {s.step.action:<16} {s.step.target}"
              + (f" ({s.message})" if s.message else ""))
    if out.status == "failed":
        print(f"rbd-reconciler recover: {vol.name}: {out.error}", file=sys.stderr)
        return EXIT_FAILED
    if args.leave:
        print(f"{vol.name}: released on this node; left to its holder. Remove its file (or "
              "its map/stage/publish) here, or the daemon maps it again once the claim allows")
        return EXIT_OK
    if vp.fence_reason == "TakenOver":
        from reconciler.cli.takeover import cmd_takeover

        rc = cmd_takeover(argparse.Namespace(name=vol.name, sure=True), config)
        if rc != EXIT_OK:
            return rc
    print(f"{vol.name}: released on this node and claimed by it; apply (or the daemon) "
          "maps it here afresh")
    return EXIT_OK

