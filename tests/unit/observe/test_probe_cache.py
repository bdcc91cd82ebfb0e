"""observe/devprobe.ProbeCache: a device nothing was written to is not read
again; one written to is read again, and probed again only if its start
changed; another device, size or an old entry is never taken for it."""

from __future__ import annotations

import pytest

from reconciler.observe.devprobe import ProbeCache, Probed

P = Probed("ext4", "u", "ext4", 1 << 20)
KEY = (7, 1, 1 << 20, b"digest")
COUNTERS = ("10", "0", "80", "0", "0", "0")


def test_unwritten_is_a_hit_without_a_read() -> None:
    c = ProbeCache()
    c.put("/dev/loop1", KEY, P, COUNTERS)
    assert c.unwritten("/dev/loop1", KEY[:3], COUNTERS) is P


@pytest.mark.parametrize(("device", "counters"), [
    ((7, 1, 1 << 20), ("11", "0", "88", "0", "0", "0")),  # written to
    ((7, 1, 1 << 20), ("10", "0", "80", "1", "0", "8")),  # discarded
    ((7, 1, 1 << 20), None),  # counters unreadable
    ((7, 2, 1 << 20), COUNTERS),  # another device at that path
    ((7, 1, 2 << 20), COUNTERS),  # grown
])
def test_anything_else_needs_a_read(device: tuple[int, int, int],
                                    counters: tuple[str, ...] | None) -> None:
    c = ProbeCache()
    c.put("/dev/loop1", KEY, P, COUNTERS)
    assert c.unwritten("/dev/loop1", device, counters) is None


def test_a_read_start_unchanged_is_a_hit_and_takes_the_new_counters() -> None:
    c = ProbeCache()
    c.put("/dev/loop1", KEY, P, COUNTERS)
    later = ("12", "0", "96", "0", "0", "0")
    assert c.get("/dev/loop1", KEY, later) is P
    assert c.unwritten("/dev/loop1", KEY[:3], later) is P
    assert c.get("/dev/loop1", (*KEY[:3], b"other"), later) is None


def test_an_old_entry_is_read_again() -> None:
    c = ProbeCache()
    c.put("/dev/loop1", KEY, P, COUNTERS)
    c.MAX_AGE = -1.0
    assert c.unwritten("/dev/loop1", KEY[:3], COUNTERS) is None
