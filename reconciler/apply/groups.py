"""Running the group steps (``plan/groupsteps.py``) through ``drivers/groups``.

The group snapshot is taken with every listed filesystem frozen: each freeze
bounded by snapshots.freezeTimeoutSeconds (a watchdog thaws it even while
librbd hangs), recorded before it is made (a killed run's freezes are thawed
by the next one), and all thawed on the way out, error or not. A group
snapshot that completed only after a watchdog's thaw is not of one frozen
moment: it is removed, so the next pass takes it again.

Imported by apply/runner.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import rados

from reconciler.drivers import freeze
from reconciler.drivers import groups as rbdgroups
from reconciler.plan.groupsteps import (
    AddToGroup,
    CopyFromGroupSnapshot,
    CreateGroup,
    CreateGroupSnapshot,
    DeleteGroup,
    DeleteGroupSnapshot,
    GroupStep,
    RemoveFromGroup,
)
from reconciler.state.registry import Intents, intent_key


class GroupFreezeExpired(Exception):
    """A watchdog thawed a member's filesystem before the group snapshot was taken."""


def run_group_step(step: GroupStep, cluster: Callable[[], rados.Rados], node_name: str,
                   state_dir: Path, freeze_limit: float,
                   owner_meta: Callable[[], dict[str, str]],
                   seal: rbdgroups.Seal | None = None) -> tuple[str, str]:
    match step:
        case CreateGroup():
            if rbdgroups.create_group(cluster(), step.pool, step.group, node_name) == "ok":
                return "ok", "already created by this node"
        case AddToGroup():
            rbdgroups.add_image(cluster(), step.pool, step.group, step.image_pool, step.image)
        case RemoveFromGroup():
            if not rbdgroups.remove_image(cluster(), step.pool, step.group, step.image_pool,
                                          step.image):
                return "ok", "not a member"
        case CreateGroupSnapshot():
            return _snapshot(step, cluster(), node_name, state_dir, freeze_limit)
        case DeleteGroupSnapshot():
            if not rbdgroups.remove_group_snapshot(cluster(), step.pool, step.group, step.snap):
                return "ok", "already gone"
        case DeleteGroup():
            if not rbdgroups.remove_group(cluster(), step.pool, step.group):
                return "ok", "already gone"
        case CopyFromGroupSnapshot():
            _copy(step, cluster(), node_name, state_dir, owner_meta(), seal)
        case _:
            raise NotImplementedError(type(step).__name__)
    return "changed", ""


def _snapshot(step: CreateGroupSnapshot, cluster: rados.Rados, node_name: str,
              state_dir: Path, limit: float) -> tuple[str, str]:
    paths = ", ".join(p for p, _ in step.freeze)
    with contextlib.ExitStack() as stack:
        # Each freeze is undone by the stack, in reverse, whatever happens next.
        holds = [stack.enter_context(freeze.frozen(path, state_dir, rdev, limit))
                 for path, rdev in step.freeze]
        try:
            result = rbdgroups.create_group_snapshot(cluster, step.pool, step.group,
                                                     step.snap, node_name)
        except Exception as exc:
            if any(h is not None and h.expired for h in holds):
                raise GroupFreezeExpired(f"froze {paths} for more than {limit:g} s: thawed; "
                                         f"group snapshot not taken ({exc})") from exc
            raise
    if result == "changed" and any(h is not None and h.expired for h in holds):
        why = (f"froze {paths} for more than {limit:g} s: thawed; the group snapshot "
               "completed only after the thaw (not under the freeze)")
        try:
            rbdgroups.remove_group_snapshot(cluster, step.pool, step.group, step.snap)
        except Exception as exc:
            raise GroupFreezeExpired(f"{why}, and removing it failed ({exc})") from exc
        raise GroupFreezeExpired(f"{why}: removed it; the next pass takes it again")
    if result == "ok":
        return "ok", "already taken by this node"
    return "changed", f"frozen {paths}" if paths else ""


def _copy(step: CopyFromGroupSnapshot, cluster: rados.Rados, node_name: str,
          state_dir: Path, meta: dict[str, str], seal: rbdgroups.Seal | None) -> None:
    """The intent is recorded first: a copy cut short (crash, kill) leaves a
    partial image the next run knows to be its own, removes and copies again."""
    intents = Intents(state_dir)
    key = intent_key(step.image_pool, step.image)
    redo = intents.get(key) is not None
    intents.record(key, {"node": node_name})
    rbdgroups.copy_member(cluster, (step.pool, step.group, step.snap, step.member),
                          step.image_pool, step.image, step.features, step.size, meta,
                          redo=redo, seal=seal)
    intents.forget(key)
