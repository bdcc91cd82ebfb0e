"""Which images observe reads in full (librbd: watchers, snapshots, parent)
and which from their header alone: only what the planner may consult."""

from __future__ import annotations

from pathlib import Path

import pytest

from reconciler.facts.observed import Mapping
from reconciler.observe.node import _watchers_needed
from reconciler.spec.model import (
    DEFAULT_FEATURES,
    CloneSource,
    ImageSpec,
    MapSpec,
    SnapshotSpec,
    Source,
    Volume,
)

FUSE = frozenset({"fuse"})


def vol(name: str, *, state: str = "present", mapper: str | None = None,
        source: CloneSource | None = None, snapshot: SnapshotSpec | None = None) -> Volume:
    return Volume(name=name, state=state,
                  image=ImageSpec("rbd", name, 1 << 30, DEFAULT_FEATURES, "Delete", source),
                  map=MapSpec(mapper, ()) if mapper else None, stage=None, publish=(),
                  on_remove=None, source=Source(Path(f"/d/{name}.yaml"), 1), snapshot=snapshot)


def fuse(name: str, device: str | None = "/dev/loop0", problem: str | None = None) -> Mapping:
    return Mapping("fuse", "rbd", name, device, f"/f/{name}", problem)


@pytest.mark.parametrize(("volume", "mappings", "needed"), [
    # Image-only (every CSI volume until staged): the header read will do.
    (vol("a"), [], False),
    # Image-only but something is mapped here for it: the planner unmaps it.
    (vol("a"), [fuse("a")], True),
    # Deleting it (absent): foreign watchers and snapshots refuse the delete.
    (vol("a", state="absent"), [], True),
    (vol("a", state="absent", mapper="fuse"), [fuse("a")], True),
    # To be mapped: another client holding it open refuses the map.
    (vol("a", mapper="fuse"), [], True),
    # Mapped once, alive, by the wanted mapper: settled.
    (vol("a", mapper="fuse"), [fuse("a")], False),
    (vol("a", mapper="auto"), [fuse("a")], False),
    # Mapped but dead, half mapped, twice, or by another mapper: remapped.
    (vol("a", mapper="fuse"), [fuse("a", problem="helper gone")], True),
    (vol("a", mapper="fuse"), [fuse("a", device=None)], True),
    (vol("a", mapper="fuse"), [fuse("a"), fuse("a", "/dev/loop1")], True),
    (vol("a", mapper="krbd"), [fuse("a")], True),
    # A Snapshot reads its image's snapshots; a clone its parent.
    (vol("a", snapshot=SnapshotSpec("s1", "a")), [], True),
    (vol("a", source=CloneSource("snapshot", "s1", "rbd", "b", "s1")), [], True),
])
def test_image_needs_full_state(volume: Volume, mappings: list[Mapping], needed: bool) -> None:
    assert (("rbd", "a") in _watchers_needed([volume], mappings, FUSE)) is needed


def test_clone_source_image_is_read_in_full() -> None:
    """Its snapshots and clone depth decide the clone; the header has neither."""
    clone = vol("c", source=CloneSource("image", "rbd/base@gold", "rbd", "base", "gold"))
    assert ("rbd", "base") in _watchers_needed([clone], [], FUSE)


def test_only_the_volumes_that_need_it() -> None:
    vols = [vol(f"v{i}") for i in range(200)] + [vol("gone", state="absent")]
    assert _watchers_needed(vols, [], FUSE) == {("rbd", "gone")}
