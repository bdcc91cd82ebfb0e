"""A fuse-loop volume whose rbd-fuse helper died (issue 41, item 3): its
FUSE connection is gone for good. Nobody uses its mounts: one plan takes
them down and brings the volume back (unpublish, unstage, unmap, map,
stage, publish). Someone does, or nobody knows: reported, left as it is."""

from __future__ import annotations

from dataclasses import replace

from test_plan import CTX, LOOP, RO, RW, STG, World, actions, converged, plan_one, refused, volume

from reconciler.facts.observed import MountUser, Observed
from reconciler.plan.mapping import HELPER_GONE
from reconciler.plan.planner import actual_state
from reconciler.plan.steps import MapImage, MountStaging, Publish, Unmap, Unpublish, Unstage

GONE = "its rbd-fuse helper is gone: the FUSE mount answers ENOTCONN"


def dead(w: World, users: tuple[MountUser, ...] | None) -> Observed:
    """``w`` with its mapping's helper gone; ``users``: who uses it (None: not looked at)."""
    w.mappings = [replace(m, problem=GONE) for m in w.mappings]
    obs = w.observed()
    return replace(obs, mount_users={} if users is None else {LOOP: users})


def test_an_unused_dead_volume_is_brought_back_in_one_plan() -> None:
    vol = volume()
    p = plan_one(vol, dead(converged(vol), ()))
    assert p.refusal is None and not p.problems
    assert actions(p) == ["unpublish", "unpublish", "unstage", "unmap", "map", "stage",
                          "publish", "publish"], actions(p)
    unpub = [s for s in p.steps if isinstance(s, Unpublish)]
    assert {s.path for s in unpub} == {RW, RO}
    [unstage] = [s for s in p.steps if isinstance(s, Unstage)]
    assert unstage.path == STG
    [unmap] = [s for s in p.steps if isinstance(s, Unmap)]
    assert unmap.device == LOOP and unmap.mapper == "fuse" and not unmap.release_claim
    [mp] = [s for s in p.steps if isinstance(s, MapImage)]
    assert mp.mapper == "fuse"
    [stage] = [s for s in p.steps if isinstance(s, MountStaging)]
    assert stage.path == STG and stage.device is None  # the device this plan maps
    assert {s.path for s in p.steps if isinstance(s, Publish)} == {RW, RO}
    assert "format" not in actions(p)  # formatted by us (image-meta): never again


def test_a_used_dead_volume_is_reported_and_left_alone() -> None:
    vol = volume()
    users = (MountUser(4242, "pid 4242 (postgres): open file"),)
    obs = dead(converged(vol), users)
    p = plan_one(vol, obs)
    assert p.steps == [] and p.refusal is None
    assert "pid 4242 (postgres)" in p.problems[HELPER_GONE]
    assert "never unmounted" in p.problems[HELPER_GONE]
    row = actual_state(vol, obs, CTX)
    assert row["phase"] == "DEGRADED" and "pid 4242 (postgres)" in str(row["problem"])


def test_a_stacked_mount_counts_as_a_user() -> None:
    vol = volume()
    users = (MountUser(None, f"a mount at {RW}/x (tmpfs t) inside {RW}"),)
    p = plan_one(vol, dead(converged(vol), users))
    assert p.steps == [] and f"{RW}/x" in p.problems[HELPER_GONE]


def test_users_not_looked_at_are_refused_as_before() -> None:
    vol = volume()
    refused(plan_one(vol, dead(converged(vol), None)), "is dead", "release")


def test_a_used_dead_volume_wanted_down_is_refused() -> None:
    vol = replace(volume(), state="absent")
    users = (MountUser(7, "pid 7 (sh): working directory"),)
    refused(plan_one(vol, dead(converged(vol), users)), "in use", "pid 7 (sh)")


def test_an_unused_dead_volume_wanted_down_is_torn_down() -> None:
    w = converged(volume())
    p = plan_one(replace(volume(), state="absent"), dead(w, ()))
    assert p.refusal is None
    assert actions(p)[:4] == ["unpublish", "unpublish", "unstage", "unmap"], actions(p)


def test_many_users_are_cut_short() -> None:
    vol = volume()
    users = tuple(MountUser(i, f"pid {i} (cat): open file") for i in range(1, 9))
    p = plan_one(vol, dead(converged(vol), users))
    msg = p.problems[HELPER_GONE]
    assert "pid 5 (cat)" in msg and "pid 6 (cat)" not in msg and "and 3 more" in msg


def test_unmapped_only_volume_unchanged() -> None:
    """Nothing mounted: remapped as before (no users asked for)."""
    vol = volume(stage=False)
    p = plan_one(vol, dead(converged(vol), None))
    assert actions(p) == ["unmap", "map"], actions(p)


def test_block_mode_is_not_repaired() -> None:
    """Who opened the device node through its bind is not known: refused as before."""
    vol = volume(mode="block")
    refused(plan_one(vol, dead(converged(vol), ())), "is dead")
