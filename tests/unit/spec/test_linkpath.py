"""Every symlink on the way to a directory (issue 26, item 7): the daemon
watches each directory holding one, and trusts the path only if each is
root's (tests/unit/spec/test_link_trust.py)."""

from __future__ import annotations

from pathlib import Path

from reconciler.spec.linkpath import MAX_LINKS, resolve


def test_a_plain_path_has_no_links(tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    found = resolve(tmp_path / "a" / "b")
    assert found.target == tmp_path / "a" / "b" and found.missing is None
    assert [d for d, _ in found.links if d.is_relative_to(tmp_path)] == []


def test_every_link_on_the_way_is_named_by_the_directory_holding_it(tmp_path: Path) -> None:
    gitops = tmp_path / "gitops"
    (gitops / "releases" / "r2" / "volumes").mkdir(parents=True)
    (gitops / "current").symlink_to("releases/r2")  # relative
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "volumes.d").symlink_to(gitops / "current" / "volumes")  # absolute
    found = resolve(tmp_path / "etc" / "volumes.d")
    assert found.target == gitops / "releases" / "r2" / "volumes"
    ours = [(d, n) for d, n in found.links if d.is_relative_to(tmp_path)]
    assert ours == [(tmp_path / "etc", "volumes.d"), (gitops, "current")]


def test_dot_dot_after_a_link_climbs_from_where_it_led(tmp_path: Path) -> None:
    (tmp_path / "real" / "x").mkdir(parents=True)
    (tmp_path / "real" / "y").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real" / "x")
    assert resolve(tmp_path / "link" / ".." / "y").target == tmp_path / "real" / "y"


def test_a_missing_component_is_named_with_its_parent(tmp_path: Path) -> None:
    (tmp_path / "cur").symlink_to("gone")
    found = resolve(tmp_path / "cur" / "volumes")
    assert found.missing == (tmp_path, "gone")
    assert (tmp_path, "cur") in found.links


def test_a_link_loop_ends(tmp_path: Path) -> None:
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    found = resolve(tmp_path / "a")
    assert found.missing is not None and len(found.links) == MAX_LINKS
