"""The report objects' names (drivers/fleetstore.py): one object per valid
node name, and every other name read as no report's."""

from __future__ import annotations

import pytest

from reconciler.drivers.fleetstore import node_of, object_name, shown


def test_object_name_round_trip() -> None:
    for node in ("edge-001", "a", "n.x_y-z", "A" * 253):
        assert object_name(node) == f"node/{node}/report"
        assert node_of(object_name(node)) == node


@pytest.mark.parametrize("node", ["", "-a", "a-", "a/b", "..", "a b", "é", "a\n", "A" * 254])
def test_invalid_node_names_have_no_object(node: str) -> None:
    with pytest.raises(ValueError):
        object_name(node)


@pytest.mark.parametrize("name", [
    "node/a/report/", "node/a/reportx", "node//report", "node/a/b/report", "nodes/a/report",
    "node/a", "/node/a/report", "node/../report", "node/a\n/report", "node/-a/report",
    "node/a/report\x00", "Node/a/report", "",
])
def test_other_names_are_no_reports(name: str) -> None:
    assert node_of(name) is None


def test_shown_escapes_and_clips() -> None:
    assert shown("a\x1b[31m") == "'a\\x1b[31m'"
    assert len(shown("x" * 1000)) == 120
