"""The pure decisions of ``release --all`` (plan/release.py), table by table:
what is ours, what is provably ours, what ran into a deadline (its FUSE
connection may be forced off), what is left held, and the one plan of a
round that holds them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from reconciler.facts.observed import ImageState, Mapping, Observed
from reconciler.plan.release import (
    BY_IDENTITY,
    ForceOff,
    identity_volume,
    not_done,
    plan_release,
    provably_ours,
    ran_into_deadline,
    still_held,
    volumes_of_ours,
)
from reconciler.plan.steps import Unmap, Unstage
from reconciler.plan.types import Context, VolumePlan
from reconciler.spec.model import ImageSpec, MapSpec, Source, Volume, volume_to_dict

KRBD = Mapping("krbd", "p", "i", "/dev/rbd0")
FUSE = Mapping("fuse", "p", "f", "/dev/loop0", "/x/fuse/p@f")


def vol(name: str, image: str) -> Volume:
    return Volume(name=name, state="present", image=ImageSpec("p", image, None, (), "Retain"),
                  map=MapSpec("krbd", ()), stage=None, publish=(), on_remove=None,
                  source=Source(Path("/d/x.yaml"), 1))


def record(name: str, image: str) -> dict[str, Any]:
    return {"volume": volume_to_dict(vol(name, image))}  # as the daemon records it


@pytest.mark.parametrize(("declared", "records", "mappings", "names", "warned"), [
    ([], {}, [], [], 0),
    ([vol("a", "i")], {}, [KRBD], ["a"], 0),  # the image is declared: no stand-in
    ([], {}, [KRBD, FUSE], ["p/i", "p/f"], 0),
    ([vol("a", "x")], {"b": record("b", "y")}, [], ["a", "b"], 0),
    ([vol("a", "x")], {"a": record("a", "z")}, [], ["a"], 0),  # the name is declared
    ([vol("a", "x")], {"b": record("b", "x")}, [], ["a"], 0),  # the image is declared
    ([], {"b": {"nothing": 1}}, [KRBD], ["p/i"], 1),  # unreadable: identity only
    ([], {"b": record("b", "i")}, [KRBD], ["b"], 0),  # the record names the mapping
])
def test_volumes_of_ours(declared: list[Volume], records: dict[str, Any],
                         mappings: list[Mapping], names: list[str], warned: int) -> None:
    out, warnings = volumes_of_ours(declared, records, mappings)
    assert [v.name for v in out] == names
    assert len(warnings) == warned
    assert all("looked for by identity only" in w for w in warnings)


def observed(holder: str | None, error: str | None = None) -> Observed:
    images = {} if holder is None else {
        ("p", "i"): ImageState("p", "i", 1, frozenset(), {"rbd-reconciler.holder": holder}
                               if holder else {})}
    return Observed(images=images, pools_listed=frozenset({"p"}), pool_errors={},
                    mappings=(), devices={}, mounts=(),
                    image_errors={("p", "i"): error} if error else {})


@pytest.mark.parametrize(("volume", "seen", "why"), [
    (identity_volume(KRBD), observed("me"), None),
    (identity_volume(KRBD), observed('{"node": "me", "clients": ["1.2.3.4:0/1"]}'), None),
    (identity_volume(KRBD), observed("n2"), "claimed by n2; not ours"),
    (identity_volume(KRBD), observed(""), "claimed by nobody"),
    (identity_volume(KRBD), observed(None, "timed out"), "(timed out); not provably ours"),
    (identity_volume(KRBD), observed(None), "(not found); not provably ours"),
    (identity_volume(FUSE), observed(None), None),  # its mount point says so
    (vol("a", "i"), observed("n2"), None),  # declared: the planner's rules apply
])
def test_provably_ours(volume: Volume, seen: Observed, why: str | None) -> None:
    got = provably_ours(volume, seen, "me")
    assert (got is None) if why is None else (got is not None and why in got)


@dataclass
class Step:
    step: Any
    status: str
    seconds: float = 0.0


@dataclass
class Chain:
    name: str
    status: str
    steps: list[Step] = field(default_factory=list)


UNMAP = Unmap("a", "p", "i", "krbd", "/dev/rbd0", None)


@pytest.mark.parametrize(("chain", "stalled", "stuck"), [
    (Chain("a", "ok", [Step(UNMAP, "ok", 9.0)]), frozenset(), False),
    (Chain("a", "aborted"), frozenset(), True),
    (Chain("a", "failed", [Step(UNMAP, "failed", 5.0)]), frozenset(), True),
    (Chain("a", "failed", [Step(UNMAP, "failed", 1.0)]), frozenset(), False),
    (Chain("a", "failed", [Step(UNMAP, "failed", 1.0)]), frozenset({"a"}), True),
    (Chain("gone", "aborted"), frozenset(), False),  # no volume of that name
])
def test_ran_into_deadline(chain: Chain, stalled: frozenset[str], stuck: bool) -> None:
    got = ran_into_deadline([chain], {"a": vol("a", "i")}, 5.0, stalled)
    assert got == ({("p", "i")} if stuck else set())


def test_what_is_left_held() -> None:
    unstage, unmap = Unstage("a", "/s/a", (7, 0)), UNMAP
    plans = [VolumePlan("a", steps=[unstage, unmap]), VolumePlan("b", refusal="busy")]
    assert still_held(plans) == ["a: unstage /s/a not done",
                                 "a: unmap p/i not done", "b: busy"]
    # What a chain did is not left; a plan without a chain is left whole.
    done = [Chain("a", "failed", [Step(unstage, "changed"), Step(unmap, "failed")])]
    assert not_done(plans, done) == ["a: unmap p/i not done", "b: busy"]
    assert not_done(plans, []) == still_held(plans)


def test_identity_volume_says_how_it_was_found() -> None:
    v = identity_volume(KRBD)
    assert (v.name, v.source.file, v.map.mapper if v.map else None) == ("p/i", BY_IDENTITY,
                                                                        "krbd")


def test_one_release_plan_from_one_look() -> None:
    """What is provably ours is planned down to CREATED; the rest is refused,
    with why; the force-off rule is the plan's own."""
    mine, theirs = identity_volume(KRBD), identity_volume(Mapping("krbd", "p", "j", "/dev/rbd1"))
    seen = Observed(images={key: ImageState("p", key[1], 1, frozenset(),
                                            {"rbd-reconciler.holder": holder})
                            for key, holder in ((("p", "i"), "me"), (("p", "j"), "n2"))},
                    pools_listed=frozenset({"p"}), pool_errors={},
                    mappings=(KRBD, Mapping("krbd", "p", "j", "/dev/rbd1")), devices={},
                    mounts=())
    planned = plan_release([mine, theirs], seen, Context("me", "/s", frozenset({"krbd"})), 5.0)
    assert list(planned.volumes) == ["p/i"]
    assert [vp.name for vp in planned.plans] == ["p/i"]
    assert [s.action for s in planned.plans[0].steps] == ["unmap"]
    assert len(planned.refused) == 1 and "claimed by n2; not ours" in planned.refused[0]
    assert planned.force_off == ForceOff(5.0, frozenset())
    assert planned.forced_off([Chain("p/i", "aborted")]) == {("p", "i")}
    assert planned.forced_off([Chain("p/j", "aborted")]) == set()  # refused: never forced
    assert planned.held() == [planned.refused[0], "p/i: unmap p/i not done"]
    assert planned.left([]) == planned.held()


def test_what_is_provably_not_ours_does_not_count_as_held_by_us() -> None:
    """Another tool's kernel mapping (rbdmap's, ceph-csi's, a hand's `rbd
    map`: claimed by nobody or by another node) is left alone by the release
    at a shutdown as at a removal; the dry run the prerm asks must not count
    it as ours (it refused the removal forever: RBD_RECONCILER_REMOVE=release
    could not clear it). One whose image-meta could not be read may be ours:
    it still counts."""
    maps = {n: Mapping("krbd", "p", n, f"/dev/rbd{k}") for k, n in enumerate("abc")}
    seen = Observed(images={("p", "a"): ImageState("p", "a", 1, frozenset(),
                                                   {"rbd-reconciler.holder": "n2"}),
                            ("p", "b"): ImageState("p", "b", 1, frozenset(), {})},
                    pools_listed=frozenset({"p"}), pool_errors={},
                    mappings=tuple(maps.values()), devices={}, mounts=(),
                    image_errors={("p", "c"): "timed out"})
    planned = plan_release([identity_volume(m) for m in maps.values()], seen,
                           Context("me", "/s", frozenset({"krbd"})), 5.0)
    assert len(planned.refused) == 3 and len(planned.held()) == 3  # the report: as before
    assert [x.split(":")[0] for x in planned.not_ours] == ["p/a", "p/b"]
    assert [x.split(":")[0] for x in planned.held_of_ours()] == ["p/c"]
