"""The removal policy (plan/removals.py) as data: vanished volumes in, what
proceeds, what is held and why out."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from reconciler.plan.removals import Removals, decide_removals, is_mass_removal

GUARD = ("2 of 3 managed volume(s) vanished in one pass; doing nothing to them (a checkout "
         "gone wrong?). To let them go: rbd-reconciler allow-removal --all (or NAME...)")


@dataclass
class Case:
    vanished: list[str]
    present: int  # still declared, frozen included
    managed: int
    failed: list[str] = field(default_factory=list)
    allowed: set[str] = field(default_factory=set)
    allow_all: bool = False
    allow_mass: bool = False
    share: float = 0.5


CASES = {
    "nothing vanished": (Case([], present=3, managed=3), Removals()),
    "one of three goes": (Case(["a"], present=2, managed=3), Removals(releasing=["a"])),
    "two of three: mass removal refused": (
        Case(["a", "b"], present=1, managed=3),
        Removals(guarded=2, refused={"mass-removal": GUARD})),
    "two of three under a higher share": (
        Case(["a", "b"], present=1, managed=3, share=0.7), Removals(releasing=["a", "b"])),
    "two of three, run --allow-mass-removal": (
        Case(["a", "b"], present=1, managed=3, allow_mass=True), Removals(releasing=["a", "b"])),
    "the last one: nothing left declared is a mass removal": (
        Case(["a"], present=0, managed=1),
        Removals(guarded=1, refused={"mass-removal": GUARD.replace("2 of 3", "1 of 1")})),
    "the last one, allowed by name": (
        Case(["a"], present=0, managed=1, allowed={"a"}), Removals(releasing=["a"])),
    "allowed by name passes, the rest stay guarded": (
        Case(["a", "b", "c"], present=0, managed=3, allowed={"a"}),
        Removals(releasing=["a"], guarded=2, refused={"mass-removal": GUARD})),
    "allow-removal --all": (
        Case(["a", "b", "c"], present=0, managed=3, allow_all=True),
        Removals(releasing=["a", "b", "c"])),
    "a file fails to load: held, not refused": (
        Case(["a"], present=1, managed=2, failed=["/d/b.yaml"]),
        Removals(held={"a": "removal held: /d/b.yaml fails to load"})),
    "two files fail: the first named, the count given": (
        Case(["a"], present=1, managed=2, failed=["/d/b.yaml", "/d/c.yaml"]),
        Removals(held={"a": "removal held: /d/b.yaml (and 1 more) fails to load"})),
    "a file fails: a name allowed goes, --all does not reach past it": (
        Case(["a", "b"], present=1, managed=3, failed=["/d/x.yaml"], allowed={"a"},
             allow_all=True),
        Removals(releasing=["a"], held={"b": "removal held: /d/x.yaml fails to load"})),
}


@pytest.mark.parametrize("case,want", CASES.values(), ids=CASES.keys())
def test_decide_removals(case: Case, want: Removals) -> None:
    got = decide_removals(case.vanished, case.failed, case.allowed, case.allow_all,
                          present=case.present, managed=case.managed,
                          allow_mass_removal=case.allow_mass, mass_removal_share=case.share)
    assert got == want


@pytest.mark.parametrize("removing,present,managed,allow,share,want", [
    (1, 5, 6, False, 0.5, False),  # one at a time is never a mass removal
    (2, 2, 4, False, 0.5, False),  # exactly the share: not above it
    (3, 2, 5, False, 0.5, True),
    (1, 0, 1, False, 0.5, True),  # nothing declared is left
    (1, 0, 1, True, 0.5, False),
])
def test_is_mass_removal(removing: int, present: int, managed: int, allow: bool,
                         share: float, want: bool) -> None:
    assert is_mass_removal(removing, present, managed, allow, share) is want
