"""Group snapshots without a cluster: the loader's checks and the planner's rules."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from test_snapshot_plan import CTX, actions, doc, image, load_text, observed, plans

from reconciler.facts.observed import (
    Device,
    GroupSnapState,
    GroupState,
    Mapping,
    Mount,
    Observed,
)
from reconciler.plan.groupsteps import CopyFromGroupSnapshot, CreateGroupSnapshot

A = doc("Volume", "a", "  image: {pool: rbd, size: 64Mi}\n")
B = doc("Volume", "b", "  image: {pool: rbd, size: 64Mi}\n")
GRP = doc("SnapshotGroup", "g", "  pool: rbd\n  volumes: [a, b]\n")
GONE = doc("SnapshotGroup", "g", "  state: absent\n  pool: rbd\n  volumes: [a, b]\n")
MEMBERS = (("rbd", "a"), ("rbd", "b"))
TAKEN = (GroupSnapState("g", True),)


def with_groups(obs: Observed, *groups: GroupState, **kw: object) -> Observed:
    return dataclasses.replace(obs, groups={(g.pool, g.name): g for g in groups}, **kw)


@pytest.mark.parametrize(("docs", "want"), [
    ([A, doc("SnapshotGroup", "g", "  pool: rbd\n  volumes: [a, nope]\n")],
     "spec.volumes[1]: no desired Volume named 'nope'"),
    ([A, doc("SnapshotGroup", "g", "  pool: rbd\n  volumes: [a, a]\n")],
     "spec.volumes[1]: volume 'a' is named twice"),
    ([doc("Volume", "o", "  image: {pool: other, size: 64Mi}\n"),
      doc("SnapshotGroup", "g", "  pool: rbd\n  volumes: [o]\n")],
     "spec.volumes[0]: volume o's image other/o is not in the group's pool 'rbd'"),
    ([doc("SnapshotGroup", "g", "  pool: rbd\n  images: [{pool: x, name: i}]\n")],
     "spec.images[0].pool: member x/i is not in the group's pool 'rbd'"),
    ([doc("SnapshotGroup", "g", "  pool: rbd\n")],
     "spec: name the members with exactly one of volumes or images"),
    ([doc("SnapshotGroup", "g", "  pool: rbd\n  volumes: []\n")], "spec.volumes"),
    ([doc("SnapshotGroup", "g", "  pool: rbd\n  images: [{pool: rbd}]\n")], "required"),
    ([A, doc("Volume", "r", "  image: {pool: rbd, size: 64Mi, source: {groupSnapshot: "
                            "{pool: rbd, group: g}}}\n")], "required"),
])
def test_loader_errors(tmp_path: Path, docs: list[str], want: str) -> None:
    _, errors = load_text(tmp_path, *docs)
    assert any(want in e for e in errors), errors


def test_members_resolve_to_images(tmp_path: Path) -> None:
    vols, errors = load_text(tmp_path, A, B, GRP)
    assert not errors
    g = vols["g"].group
    assert g is not None and g.members == MEMBERS and vols["g"].kind == "SnapshotGroup"


def test_first_pass_creates_adds_and_snapshots_once(tmp_path: Path) -> None:
    obs = observed(image("a"), image("b"))
    p = plans(tmp_path, obs, A, B, GRP)["g"]
    assert actions(p) == ["create group", "add to group", "add to group", "group snapshot"]
    assert p.kind == "group"
    # Half done (group made, one member added): only the rest.
    half = with_groups(obs, GroupState("rbd", "g", (("rbd", "a"),), owner="n1"))
    assert actions(plans(tmp_path, half, A, B, GRP)["g"]) == ["add to group", "group snapshot"]
    # Taken: never again.
    done = with_groups(obs, GroupState("rbd", "g", MEMBERS, TAKEN, "n1", "n1"))
    p = plans(tmp_path, done, A, B, GRP)["g"]
    assert actions(p) == [] and p.refusal is None and not p.withheld


def test_members_not_there_yet_wait(tmp_path: Path) -> None:
    p = plans(tmp_path, observed(image("a")), A, B, GRP)["g"]
    assert not p.steps and "waits for member rbd/b" in str(p.waiting)


def test_membership_change_after_the_snapshot_is_refused(tmp_path: Path) -> None:
    only_a = doc("SnapshotGroup", "g", "  pool: rbd\n  volumes: [a]\n")
    done = with_groups(observed(image("a"), image("b")),
                       GroupState("rbd", "g", MEMBERS, TAKEN, "n1", "n1"))
    p = plans(tmp_path, done, A, B, only_a)["g"]
    assert not p.steps and "refusing to change the members" in p.withheld[0]
    assert "remove rbd/b" in p.withheld[0]


def test_an_incomplete_snapshot_of_ours_is_redone(tmp_path: Path) -> None:
    cut = with_groups(observed(image("a"), image("b")),
                      GroupState("rbd", "g", MEMBERS, (GroupSnapState("g", False),), "n1", "n1"))
    assert actions(plans(tmp_path, cut, A, B, GRP)["g"]) == ["delete group snapshot",
                                                             "group snapshot"]


def test_foreign_group_is_refused(tmp_path: Path) -> None:
    foreign = with_groups(observed(image("a"), image("b")), GroupState("rbd", "g", MEMBERS))
    p = plans(tmp_path, foreign, A, B, GRP)["g"]
    assert p.refusal and "not created by this node" in p.refusal
    p = plans(tmp_path, foreign, A, B, GONE)["g"]
    assert not p.steps and "not created by this node" in p.withheld[0]


def test_absent_removes_only_what_we_made(tmp_path: Path) -> None:
    obs = observed(image("a"), image("b"))
    done = with_groups(obs, GroupState("rbd", "g", MEMBERS, TAKEN, "n1", "n1"))
    assert actions(plans(tmp_path, done, A, B, GONE)["g"]) == [
        "delete group snapshot", "remove from group", "remove from group", "delete group"]
    assert actions(plans(tmp_path, obs, A, B, GONE)["g"]) == []  # already gone
    other = with_groups(obs, GroupState("rbd", "g", MEMBERS, TAKEN, "n1", "n2"))
    p = plans(tmp_path, other, A, B, GONE)["g"]
    assert not p.steps and "was not taken by this node" in p.withheld[0]
    extra = with_groups(obs, GroupState("rbd", "g", MEMBERS, (*TAKEN, GroupSnapState("x", True)),
                                        "n1", "n1"))
    p = plans(tmp_path, extra, A, B, GONE)["g"]
    assert not p.steps and "did not take (x)" in p.withheld[0]


def test_unknown_group_is_refused_not_absent(tmp_path: Path) -> None:
    obs = with_groups(observed(image("a"), image("b")),
                      group_errors={("rbd", "g"): "no answer within 5 s"})
    p = plans(tmp_path, obs, A, B, GRP)["g"]
    assert p.refusal and "unknown, not absent" in p.refusal and not p.steps


def test_every_mounted_member_is_frozen(tmp_path: Path) -> None:
    loops = {"a": ("/dev/loop1", (7, 1)), "b": ("/dev/loop2", (7, 2))}
    obs = Observed(
        images={("rbd", n): image(n) for n in ("a", "b")}, pools_listed=frozenset({"rbd"}),
        pool_errors={},
        mappings=tuple(Mapping("fuse", "rbd", n, dev) for n, (dev, _) in loops.items()),
        devices={dev: Device(dev, *rdev, 64 << 20, "ext4", "u", "ext4")
                 for dev, rdev in loops.values()},
        mounts=tuple(Mount(i, 1, *rdev, "/", f"/srv/{n}", frozenset({"rw"}), "ext4", dev,
                           frozenset()) for i, (n, (dev, rdev)) in enumerate(loops.items())))
    [step] = plans(tmp_path, obs, A, B, GRP)["g"].steps[-1:]
    assert isinstance(step, CreateGroupSnapshot)
    assert step.freeze == (("/srv/a", (7, 1)), ("/srv/b", (7, 2)))
    assert "fsfreeze /srv/a, /srv/b" in step.after


RESTORE = doc("Volume", "r", "  image: {pool: rbd, size: 64Mi, source: {groupSnapshot: "
                             "{pool: rbd, group: g, image: a}}}\n")


def test_restore_is_a_copy_of_the_member(tmp_path: Path) -> None:
    obs = observed(image("a"), image("b"))
    p = plans(tmp_path, obs, RESTORE)["r"]
    assert p.refusal and "group snapshot rbd/g@g does not exist" in p.refusal
    done = with_groups(obs, GroupState("rbd", "g", MEMBERS, TAKEN, "n1", "n1"))
    [step] = plans(tmp_path, done, RESTORE)["r"].steps
    assert isinstance(step, CopyFromGroupSnapshot)
    assert (step.pool, step.group, step.snap, step.member) == ("rbd", "g", "g", "a")
    assert (step.image_pool, step.image, step.size) == ("rbd", "r", 64 << 20)
    gone = with_groups(observed(image("b")), GroupState("rbd", "g", MEMBERS, TAKEN, "n1", "n1"))
    p = plans(tmp_path, gone, RESTORE)["r"]
    assert p.refusal and "member image rbd/a does not exist" in p.refusal
    assert CTX.node_name == "n1"


def test_restore_from_a_desired_group_waits_for_it(tmp_path: Path) -> None:
    restore = doc("Volume", "r", "  image: {pool: rbd, size: 64Mi, source: {groupSnapshot: "
                                 "{pool: rbd, group: g, image: a}}}\n")
    p = plans(tmp_path, observed(image("a"), image("b")), A, B, GRP, restore)["r"]
    assert p.refusal is None and not p.steps and "waits for its source group" in str(p.waiting)
    _, errors = load_text(tmp_path, A, B, GRP, doc(
        "Volume", "r", "  image: {pool: rbd, size: 64Mi, source: {groupSnapshot: "
                       "{pool: rbd, group: g, image: c}}}\n"))
    assert any("spec.image.source.groupSnapshot: SnapshotGroup g has no member rbd/c" in e
               for e in errors), errors
    _, errors = load_text(tmp_path, A, doc("SnapshotGroup", "g", "  pool: rbd\n  images: "
                                              "[{pool: rbd, name: a}, {pool: rbd, name: r}]\n"),
                          restore.replace("name: r}", "name: r}"))
    assert any("a restore cannot start from its own group snapshot" in e for e in errors), errors
