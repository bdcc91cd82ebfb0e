"""librbd image opens per volume chain: each costs ~4 ms and several round
trips; image-meta is read and written on the header object instead."""

from __future__ import annotations

import pytest
from conftest import NodeUnderTest
from test_daemon import spec

from reconciler.drivers import rbdbase

pytestmark = pytest.mark.ceph


def opens_during(node: NodeUnderTest, *args: str) -> int:
    before = rbdbase.OPENS[0]
    rc, out = node.cli(*args)
    assert rc == 0, out
    return rbdbase.OPENS[0] - before


def test_one_open_for_a_new_volume_and_none_for_a_noop(node: NodeUnderTest) -> None:
    name = node.name("op")
    node.write(name, spec(node))
    # create, map, format, stage, publish: was 7 opens. Two read-only ones
    # are left: the watcher check after the map, and the has-data proof
    # before mkfs (librbd's diff_iterate); the image-meta records are omap ops.
    assert opens_during(node, "apply") == 2
    assert opens_during(node, "apply") == 0  # nothing to do: header reads only
    assert str(node.srv / "app") in node.mounts()
