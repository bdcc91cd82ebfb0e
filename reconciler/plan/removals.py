"""The removal policy: what a managed volume whose file vanished means.

A pure function of what was managed, what is declared now, what failed to
load and what allow-removal let go: which removals proceed, which are held
(a file that fails to load may declare them: safety rule 3) and whether the
mass-removal guard refuses the rest (a checkout gone wrong). No I/O; the
daemon's passes (daemon/passes.py) gather the inputs, records and reports the
answer. May be imported by the daemon and by anything above ``plan``.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Removals:
    """What to do with the vanished volumes."""

    releasing: list[str] = field(default_factory=list)  # taken down now (onRemove aside)
    held: dict[str, str] = field(default_factory=dict)  # name -> why it is held
    # The mass-removal guard's words, keyed (a changed count is the same
    # condition); empty when it did not refuse.
    refused: dict[str, str] = field(default_factory=dict)
    guarded: int = 0  # how many the guard refused


def decide_removals(vanished: list[str], failed_files: list[str],
                    allowed: Collection[str], allow_all: bool, present: int, managed: int,
                    allow_mass_removal: bool, mass_removal_share: float) -> Removals:
    """``vanished``: managed volumes no file declares (frozen and forgettable
    ones left out), in order; ``failed_files``: files that fail to load,
    sorted; ``allowed``/``allow_all``: what allow-removal names; ``present``:
    managed volumes still declared, frozen ones included; ``managed``: every
    managed volume (records); ``allow_mass_removal``: ``run
    --allow-mass-removal``; ``mass_removal_share``: the config's guard."""
    if not vanished:
        return Removals()
    if failed_files:
        # A failed file may declare any of them (renamed and broken in one
        # change hides its names): while one fails, nothing is released
        # unless named by allow-removal (safety rule 3 holds across renames).
        more = f" (and {len(failed_files) - 1} more)" if len(failed_files) > 1 else ""
        why = f"removal held: {failed_files[0]}{more} fails to load"
        return Removals(releasing=[n for n in vanished if n in allowed],
                        held={n: why for n in vanished if n not in allowed})
    releasing = [n for n in vanished if allow_all or n in allowed]
    guarded = [n for n in vanished if not (allow_all or n in allowed)]
    if guarded and is_mass_removal(len(guarded), present, managed, allow_mass_removal,
                                   mass_removal_share):
        return Removals(releasing=releasing, guarded=len(guarded), refused={"mass-removal": (
            f"{len(guarded)} of {managed} managed volume(s) vanished in one "
            f"pass; doing nothing to them (a checkout gone wrong?). To let them go: "
            f"rbd-reconciler allow-removal --all (or NAME...)")})
    return Removals(releasing=releasing + guarded)


def is_mass_removal(removing: int, present: int, managed: int, allow_mass_removal: bool,
                    share: float) -> bool:
    """``present``: managed volumes still declared, frozen ones included."""
    if allow_mass_removal:
        return False
    if present == 0:
        return True
    return removing > 1 and removing / max(1, managed) > share
