"""The planner's rules for group snapshots (pure; no I/O).

Mixed into the volume planner like the snapshot rules: a ``kind:
SnapshotGroup`` document plans here; a Volume whose ``image.source`` names a
group snapshot member is created as a copy of it.

A group snapshot records a moment of several images at once: taken once,
never re-taken, and the group's membership is not changed after it (a change
is refused and reported). Only what this node made is removed.

Imported by plan/planner.py.
"""

from __future__ import annotations

from reconciler.facts.observed import GroupState, Observed
from reconciler.plan.groupsteps import (
    AddToGroup,
    CopyFromGroupSnapshot,
    CreateGroup,
    CreateGroupSnapshot,
    DeleteGroup,
    DeleteGroupSnapshot,
    RemoveFromGroup,
)
from reconciler.plan.steps import Step, Thaw
from reconciler.plan.types import Context, Refused, VolumePlan, Waiting
from reconciler.spec.model import Phase, Volume


class GroupRules:
    v: Volume
    obs: Observed
    ctx: Context
    plan: VolumePlan

    def add(self, step: Step) -> None:
        raise NotImplementedError

    def image_mounts(self, pool: str, image: str
                     ) -> list[tuple[str, bool, str, tuple[int, int]]]:
        raise NotImplementedError

    def freeze_target(self, pool: str, image: str) -> tuple[str, tuple[int, int]] | None:
        raise NotImplementedError

    def group_unknown(self, pool: str, group: str) -> str | None:
        """Why the group cannot be known, if it cannot (unknown, never absent)."""
        if pool not in self.obs.pools_listed:
            why = self.obs.pool_errors.get(pool, "not listed")
            return f"cannot see pool {pool!r} ({why}); a group there is unknown, not absent"
        why = self.obs.group_errors.get((pool, group))
        if why is not None:
            return f"cannot see group {pool}/{group} ({why}); unknown, not absent"
        return None

    # -- kind: SnapshotGroup ------------------------------------------------------
    def run_group(self) -> None:
        v, spec = self.v, self.v.group
        assert spec is not None
        pool, name = v.image.pool, spec.group
        self.plan.kind = "group"
        self.plan.wanted = Phase.ABSENT if v.state == "absent" else Phase.CREATED
        why = self.group_unknown(pool, name)
        if why:
            self.plan.unknown = why
            raise Refused(why)
        state = self.obs.groups.get((pool, name))
        snap = state.snap(name) if state else None
        self.plan.phase = Phase.CREATED if snap is not None and snap.complete else Phase.ABSENT
        members = list(spec.members) + [m for m in (state.images if state else ())
                                        if m not in spec.members]
        for point in sorted({p for m in members for p, *_ in self.image_mounts(*m)}):
            if point in self.obs.freezes:
                self.add(Thaw(v.name, point))
        if v.state == "absent":
            if state is not None:
                self.remove_group(state)
            return
        if state is not None and state.owner != self.ctx.node_name:
            raise Refused(f"group {pool}/{name} exists and was not created by this node "
                          f"(owner: {state.owner or 'none recorded'}); left as it is")
        if snap is not None and snap.complete:
            self.check_membership(state)
            return  # a group snapshot records a moment: never re-taken
        if snap is not None:  # cut short (a crash inside librbd): ours to redo
            if state is None or state.snap_owner != self.ctx.node_name:
                raise Refused(f"group snapshot {pool}/{name}@{name} is incomplete and was "
                              "not taken by this node; left as it is")
            self.add(DeleteGroupSnapshot(v.name, pool, name, name))
        self.take_group_snapshot(state)

    def take_group_snapshot(self, state: GroupState | None) -> None:
        v, spec = self.v, self.v.group
        assert spec is not None
        pool, name = v.image.pool, spec.group
        for mpool, image in spec.members:
            key = (mpool, image)
            if key in self.obs.image_errors:
                raise Refused(f"cannot see member {mpool}/{image} "
                              f"({self.obs.image_errors[key]}); unknown, not absent")
            if key not in self.obs.images:
                if spec.volumes:
                    raise Waiting(f"waits for member {mpool}/{image} to exist")
                raise Refused(f"member image {mpool}/{image} does not exist")
        if state is None:
            self.add(CreateGroup(v.name, pool, name))
        have = set(state.images) if state else set()
        for mpool, image in sorted(have - set(spec.members)):
            self.add(RemoveFromGroup(v.name, pool, name, mpool, image))
        for mpool, image in spec.members:
            if (mpool, image) not in have:
                self.add(AddToGroup(v.name, pool, name, mpool, image))
        freeze = [t for m in spec.members if (t := self.freeze_target(*m)) is not None]
        # Sorted by device: two chains freezing overlapping sets never wait on each other.
        self.add(CreateGroupSnapshot(v.name, pool, name, name,
                                     tuple(sorted(freeze, key=lambda t: t[1]))))

    def check_membership(self, state: GroupState | None) -> None:
        spec = self.v.group
        assert spec is not None and state is not None
        want, have = set(spec.members), set(state.images)
        if want == have:
            return
        parts = ([f"add {', '.join(f'{p}/{i}' for p, i in sorted(want - have))}"]
                 if want - have else []) + \
                ([f"remove {', '.join(f'{p}/{i}' for p, i in sorted(have - want))}"]
                 if have - want else [])
        self.plan.withheld.append(
            f"refusing to change the members of group {state.pool}/{state.name} "
            f"({'; '.join(parts)}): its group snapshot is taken and never re-taken; "
            "set this SnapshotGroup to absent and declare a new one")

    def remove_group(self, state: GroupState) -> None:
        """The group snapshot, the members, the group: only when this node made
        them (a refusal is withheld, the rest of the node proceeds)."""
        v, name = self.v, self.v.name
        where = f"group {state.pool}/{state.name}"
        if state.owner != self.ctx.node_name:
            self.plan.withheld.append(f"refusing to remove {where}: it was not created by "
                                      f"this node (owner: {state.owner or 'none recorded'})")
            return
        others = [s.name for s in state.snaps if s.name != state.name]
        if others:
            self.plan.withheld.append(f"refusing to remove {where}: it has group snapshots "
                                      f"this node did not take ({', '.join(others)})")
            return
        if state.snap(state.name) is not None:
            if state.snap_owner != self.ctx.node_name:
                self.plan.withheld.append(
                    f"refusing to remove {where}: its snapshot {state.name} was not taken by "
                    f"this node (owner: {state.snap_owner or 'none recorded'})")
                return
            self.add(DeleteGroupSnapshot(name, state.pool, state.name, state.name))
        for mpool, image in state.images:
            self.add(RemoveFromGroup(name, state.pool, state.name, mpool, image))
        self.add(DeleteGroup(v.name, state.pool, state.name))

    # -- a Volume restored from a group snapshot member ---------------------------
    def plan_group_restore(self) -> None:
        v, src = self.v, self.v.image.source
        assert src is not None and src.group is not None
        why = self.group_unknown(src.pool, src.group)
        if why:
            raise Refused(f"cannot see the restore source: {why}")
        state = self.obs.groups.get((src.pool, src.group))
        snap = state.snap(src.group) if state else None
        if snap is None or not snap.complete:
            if "/" not in src.ref:  # a desired SnapshotGroup (loader): it may be on its way
                raise Waiting(f"waits for its source group snapshot {src.pool}/{src.group}"
                              f"@{src.group} to be taken")
            raise Refused(f"group snapshot {src.pool}/{src.group}@{src.group} does not exist"
                          + (" (incomplete)" if snap is not None else ""))
        key = (src.pool, src.image)
        if key in self.obs.image_errors:
            raise Refused(f"cannot see the restore source {src.pool}/{src.image} "
                          f"({self.obs.image_errors[key]})")
        if key not in self.obs.images:
            raise Refused(f"member image {src.pool}/{src.image} does not exist (a group "
                          "snapshot lives in its members' images)")
        self.add(CopyFromGroupSnapshot(v.name, src.pool, src.group, src.group, src.image,
                                       v.image.pool, v.image.name, v.image.features,
                                       v.image.size))


def group_row(v: Volume, obs: Observed) -> dict[str, object]:
    """A SnapshotGroup's status row: same keys as a volume's."""
    spec = v.group
    assert spec is not None
    key = (v.image.pool, spec.group)
    unknown = (obs.pool_errors.get(v.image.pool, "pool not listed")
               if v.image.pool not in obs.pools_listed else obs.group_errors.get(key))
    state = obs.groups.get(key)
    snap = state.snap(spec.group) if state else None
    return {
        "name": v.name, "kind": "SnapshotGroup",
        "phase": "UNKNOWN" if unknown else ("CREATED" if snap and snap.complete else "ABSENT"),
        "unknown": unknown, "problem": None, "imageUnknown": unknown,
        "wanted": v.wanted_phase.name,
        "image": f"{v.image.pool}/{spec.group}@{spec.group}",
        "source": ", ".join(f"{p}/{i}" for p, i in spec.members),
        "members": [f"{p}/{i}" for p, i in (state.images if state else ())],
        "size": None, "created": None,
        "owner": state.owner if state else None,
        "mapper": None, "device": None, "filesystem": None, "staging": None,
        "stagingOptions": None, "published": [], "watchers": [], "holder": None, "claim": None,
    }
