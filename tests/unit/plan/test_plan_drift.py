"""What no step may put right is reported, never acted on (issue 26):
someone else's mount on top of a publish (or over a directory above it),
and a filesystem gone read-only (errors=remount-ro, emergency_ro, by hand)."""

from __future__ import annotations

from dataclasses import replace

from test_plan import CTX, LOOP, RO, RW, STG, World, actions, converged, plan_one, volume

from reconciler.facts.observed import Mount
from reconciler.plan.planner import actual_state, problems
from reconciler.plan.steps import Remount, Unpublish
from reconciler.spec.model import Phase

ROOT = Mount(27, 1, 254, 0, "/", "/", frozenset({"rw"}), "ext4", "/dev/vda", frozenset({"rw"}))


def rooted(w: World) -> World:
    """The node's root mount under the world's mounts (all children of 27)."""
    w.mounts.insert(0, ROOT)
    return w


def bind_at(w: World, path: str) -> Mount:
    return next(m for m in w.mounts if m.mount_point == path and m.fs_type == "ext4")


def squat(w: World, on: Mount | None, point: str) -> None:
    """A tmpfs mounted by someone else at ``point`` (on top of ``on``, or on the root)."""
    w.mounts.append(Mount(900 + len(w.mounts), on.mount_id if on else 27, 0, 77, "/", point,
                          frozenset({"rw"}), "tmpfs", "squatter", frozenset({"rw"})))


def test_a_tmpfs_on_top_of_a_publish_is_reported_never_touched() -> None:
    vol = volume()
    w = rooted(converged(vol))
    squat(w, bind_at(w, RW), RW)
    p = plan_one(vol, w)
    assert p.steps == [] and p.refusal is None
    assert p.problems.keys() == {"Shadowed"}
    assert f"{RW} is not served: tmpfs squatter is mounted on top of it" in p.problems["Shadowed"]
    assert RO not in p.problems["Shadowed"]  # the other publish still serves
    assert p.phase == Phase.PUBLISHED  # through the read-only one


def test_a_shadowed_publish_is_not_published() -> None:
    vol = volume(publish=((RW, False),))
    w = rooted(converged(vol))
    squat(w, bind_at(w, RW), RW)
    p = plan_one(vol, w)
    assert p.phase == Phase.STAGED and p.steps == []
    row = actual_state(vol, w.observed(), CTX)
    assert row["phase"] == "DEGRADED" and "tmpfs squatter" in str(row["problem"])
    assert row["published"] == [(RW, "shadowed")]


def test_a_shadowed_bind_gets_no_remount_which_would_act_on_the_mount_on_top() -> None:
    vol = volume(publish=((RW, False),))
    w = rooted(converged(vol))
    w.mounts = [replace(m, options=frozenset({"ro", "noatime"})) if m.mount_point == RW else m
                for m in w.mounts]
    unshadowed = plan_one(vol, w)
    assert [type(s) for s in unshadowed.steps] == [Remount]
    squat(w, bind_at(w, RW), RW)
    assert plan_one(vol, w).steps == []


def test_a_mount_over_a_directory_above_shadows_too() -> None:
    vol = volume(publish=((RW, False),))
    w = rooted(converged(vol))
    squat(w, None, "/srv")
    p = plan_one(vol, w)
    assert "tmpfs squatter is mounted at /srv, above it" in p.problems["Shadowed"]
    # Taking it down would unmount through the path: what it reaches is not ours.
    gone = replace(vol, publish=())
    p = plan_one(gone, w)
    assert p.refusal is not None and "over /srv, above ours" in p.refusal
    assert not any(isinstance(s, Unpublish) for s in p.steps)


def test_our_own_bind_on_top_of_ours_is_no_shadow() -> None:
    vol = volume(publish=((RW, False),))
    w = rooted(converged(vol))
    lower = bind_at(w, RW)
    w.mounts.append(replace(lower, mount_id=950, parent_id=lower.mount_id))
    p = plan_one(vol, w)
    assert p.problems == {} and p.phase == Phase.PUBLISHED
    assert actual_state(vol, w.observed(), CTX)["published"] == [(RW, "rw"), (RW, "rw")]


def test_no_root_seen_means_nothing_is_called_shadowed() -> None:
    vol = volume()
    w = converged(vol)  # no "/" among the mounts: what a path reaches is not known
    assert plan_one(vol, w).problems == {}


def _fs_gone(w: World, super_options: set[str], per_mount_ro: bool = False) -> World:
    w.mounts = [replace(m, super_options=frozenset(super_options),
                        options=(m.options - {"rw"}) | {"ro"}
                        if per_mount_ro and m.mount_point == STG else m.options)
                if m.source == LOOP else m for m in w.mounts]
    return w


def test_a_filesystem_read_only_after_an_error_is_reported() -> None:
    vol = volume()
    w = _fs_gone(converged(vol), {"rw", "errors=remount-ro", "emergency_ro"})
    p = plan_one(vol, w)
    assert p.steps == [] and p.refusal is None
    assert "read-only after an error (emergency_ro)" in p.problems["FilesystemReadOnly"]
    assert "not remounted read-write" in p.problems["FilesystemReadOnly"]
    row = actual_state(vol, w.observed(), CTX)
    assert row["phase"] == "DEGRADED"
    assert row["published"] == [(RW, "ro"), (RO, "ro")]  # what a writer there gets
    assert problems(vol, w.observed(), CTX).keys() == {"FilesystemReadOnly"}


def test_a_superblock_remounted_read_only_is_never_remounted_read_write() -> None:
    """`mount -o remount,ro STAGING` (by hand, or 6.1's errors=remount-ro):
    the staging mount's own flag and the filesystem's. A spec that says rw
    would have the staging remounted rw: over errors, never."""
    vol = volume(mount_options=("noatime", "rw"))
    w = _fs_gone(converged(vol), {"ro"}, per_mount_ro=True)
    p = plan_one(vol, w)
    assert not any(isinstance(s, Remount) and not s.bind for s in p.steps), p.steps
    assert "is read-only" in p.problems["FilesystemReadOnly"]
    # A filesystem's own flag is not a bind's: binds may still be put back as asked.
    assert all(isinstance(s, Remount) and s.bind for s in p.steps)


def test_shut_down_is_reported() -> None:
    vol = volume()
    p = plan_one(vol, _fs_gone(converged(vol), {"rw", "shutdown"}))
    assert "shut down" in p.problems["FilesystemReadOnly"]


def test_read_only_asked_for_is_no_problem() -> None:
    vol = volume(mount_options=("noatime", "ro"))
    w = _fs_gone(converged(vol), {"ro"}, per_mount_ro=True)
    assert plan_one(vol, w).problems == {}


def test_a_healthy_volume_has_no_problem_and_releasing_reports_none() -> None:
    vol = volume()
    assert plan_one(vol, rooted(converged(vol))).problems == {}
    w = _fs_gone(converged(vol), {"ro"})
    p = plan_one(vol, w, release=["pgdata"])
    assert p.problems == {} and actions(p)[:2] == ["unpublish", "unpublish"]
