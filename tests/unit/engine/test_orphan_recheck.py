"""engine/orphans.py's removal (review): each leftover is re-checked right
before it goes, and that includes that it is still the thing we judged
ours: a device number or loop device reused meanwhile is someone else's."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from reconciler.engine import orphans
from reconciler.facts.leftovers import Leftovers, LoopDev
from reconciler.facts.observed import Mapping
from reconciler.plan.orphans import Orphan

FUSE = "/var/lib/r/fuse"


def _seen(**kw: Any) -> Leftovers:
    base: dict[str, Any] = {"mappings": (), "nbd_records": {}, "loops": (), "crypts": (),
                            "helpers": (), "mounts": (), "rdevs": {}}
    return Leftovers(**{**base, **kw})


class _Runner:
    def __init__(self) -> None:
        self.ran: list[list[str]] = []

    def run(self, argv: list[str], **_: Any) -> None:
        self.ran.append(argv)


def test_a_loop_device_attached_again_since_the_look_is_not_detached(
        monkeypatch: pytest.MonkeyPatch) -> None:
    ours = Orphan("loop", "/dev/loop4", True, "loop device over our FUSE file", ("rbd", "z"))
    was = _seen(loops=(LoopDev("/dev/loop4", (7, 4), f"{FUSE}/rbd@z/z"),),
                rdevs={"/dev/loop4": (7, 4)})
    # Detached meanwhile (by anyone) and attached again over another file.
    now = _seen(loops=(LoopDev("/dev/loop4", (7, 4), "/srv/their.img"),),
                rdevs={"/dev/loop4": (7, 4)})
    monkeypatch.setattr(orphans.leftovers, "look", lambda node: now)
    monkeypatch.setattr(orphans.leftovers, "device_users", lambda *a, **k: ())
    runner = _Runner()
    why = orphans._remove(SimpleNamespace(runner=runner), ours, was)  # type: ignore[arg-type]
    assert runner.ran == [] and why is not None and "no longer" in why


def test_an_nbd_device_mapped_again_since_the_look_is_not_unmapped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    m = Mapping("nbd", "rbd", "n", "/dev/nbd0")
    ours = Orphan("nbd", "/dev/nbd0", True, "recorded by us", ("rbd", "n"), m)
    was = _seen(mappings=(m,), rdevs={"/dev/nbd0": (43, 0)},
                nbd_backends={"/dev/nbd0": "c1"})
    now = _seen(mappings=(Mapping("nbd", "rbd", "other", "/dev/nbd0"),),
                rdevs={"/dev/nbd0": (43, 0)}, nbd_backends={"/dev/nbd0": "c9"})
    monkeypatch.setattr(orphans.leftovers, "look", lambda node: now)
    monkeypatch.setattr(orphans.leftovers, "device_users", lambda *a, **k: ())
    unmapped: list[Mapping] = []
    node = SimpleNamespace(runner=_Runner(), mapper=lambda kind: SimpleNamespace(
        unmap=unmapped.append))
    why = orphans._remove(node, ours, was)  # type: ignore[arg-type]
    assert unmapped == [] and why is not None and "no longer" in why
