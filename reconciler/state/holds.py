"""Volumes held down by ``rbd-reconciler release NAME`` through the daemon.

The daemon keeps such a volume released (unpublished, unstaged, unmapped;
its image kept) until ``apply`` names it (or names nothing: every volume),
whatever its file wants: a release for maintenance must not be undone by the
next pass. Kept in ``stateDir/held.json`` so that a restart of the daemon
(an upgrade) keeps them down too; a local ``apply`` (no daemon) lifts the
holds of what it applies, so the daemon, when it starts, does not take
those down again.

Imported by daemon/passes.py; engine/.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from pathlib import Path

from reconciler.state.files import read_json, remove, write_json

FILENAME = "held.json"


def read(state_dir: Path) -> set[str]:
    data = read_json(state_dir / FILENAME, {}) or {}
    names = data.get("names", []) if isinstance(data, dict) else []
    return {str(n) for n in names if isinstance(n, str)}


def write(state_dir: Path, names: Iterable[str]) -> None:
    """Raises CannotWrite (then the caller did not hold or lift anything)."""
    names = sorted(set(names))
    if names:
        write_json(state_dir / FILENAME, {"names": names})
    else:
        with contextlib.suppress(FileNotFoundError):
            remove(state_dir / FILENAME)


def lift(state_dir: Path, names: Iterable[str] | None) -> set[str]:
    """Lift the holds of ``names`` (None: every hold); returns those lifted."""
    held = read(state_dir)
    gone = held if names is None else held & set(names)
    if gone:
        write(state_dir, held - gone)
    return gone
