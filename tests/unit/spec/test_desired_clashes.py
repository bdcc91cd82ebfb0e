"""Clashes between the CSI adapter's files, and with the operator's: the file
that brings a clash fails alone when the other side was already there; a
CSI path inside or around an operator's path is not loaded."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from pathlib import Path

import pytest
from test_loader_hardening import volume_text

from reconciler.spec.config import Config, default_config
from reconciler.spec.desired import load_desired
from reconciler.spec.loader import LoadCache


@pytest.fixture
def config(tmp_path: Path) -> Config:
    (tmp_path / "desired").mkdir()
    (tmp_path / "state" / "csi.d").mkdir(parents=True)
    return dataclasses.replace(default_config(), desired_dir=tmp_path / "desired",
                               state_dir=tmp_path / "state")


def failed(config: Config, settled: dict[str, Collection[tuple[str, str]]] | None = None,
           cache: LoadCache | None = None) -> set[str]:
    """The names of the files that fail; ``settled``: what each volume
    (by name, from its own file) claimed at its last load."""
    def was(name: str, file: Path) -> Collection[tuple[str, str]]:
        assert settled is not None
        return settled.get(name, ()) if file.stem == name else ()
    res = load_desired(config, cache, was if settled is not None else None)
    assert {v.name for v in res.volumes}.isdisjoint(res.frozen_names)
    return {f.stem for f in res.failed_files}


def test_a_new_csi_claim_inside_a_settled_one_fails_alone(config: Config) -> None:
    csi = config.csi_dir
    (csi / "outer.yaml").write_text(volume_text("outer", ["/srv/a"], staging="/srv/s/outer"))
    (csi / "inner.yaml").write_text(volume_text("inner", ["/srv/a/sub"],
                                                staging="/srv/s/inner"))
    outer = {("publish path", "/srv/a"), ("staging path", "/srv/s/outer")}
    assert failed(config) == {"outer", "inner"}  # nothing known: both, as the loader does
    assert failed(config, {"outer": outer}) == {"inner"}
    # Both were there (or both new): both fail, each naming the other.
    inner = {("publish path", "/srv/a/sub"), ("staging path", "/srv/s/inner")}
    assert failed(config, {"outer": outer, "inner": inner}) == {"outer", "inner"}
    assert failed(config, {}) == {"outer", "inner"}
    # Around it (the new one contains the settled one): the new one fails.
    (csi / "inner.yaml").write_text(volume_text("inner", ["/srv/a-b"], staging="/srv/s"))
    assert failed(config, {"outer": outer}) == {"inner"}
    # The settled one is the newcomer's: the other side fails.
    assert failed(config, {"inner": {("staging path", "/srv/s")}}) == {"outer"}


def test_a_decided_clash_is_not_kept_as_the_last_result(config: Config) -> None:
    """The result depends on more than the files: the next load decides again."""
    csi = config.csi_dir
    (csi / "a.yaml").write_text(volume_text("a", ["/srv/a"]))
    (csi / "b.yaml").write_text(volume_text("b", ["/srv/a"]))
    cache = LoadCache()
    assert failed(config, {"a": {("publish path", "/srv/a")}}, cache) == {"b"}
    assert failed(config, {"b": {("publish path", "/srv/a")}}, cache) == {"a"}


def test_operator_files_still_fail_both_sides(config: Config) -> None:
    d = config.desired_dir
    (d / "one.yaml").write_text(volume_text("one", ["/srv/o"]))
    (d / "two.yaml").write_text(volume_text("two", ["/srv/o/in"]))
    assert failed(config, {"one": {("publish path", "/srv/o")}}) == {"one", "two"}


@pytest.mark.parametrize(("publish", "staging", "words"), [
    (["/srv/x/o"], None, "publish path '/srv/x/o' is already claimed by the operator's"),
    (["/srv/x/o/in"], None, "publish path '/srv/x/o/in' is inside the operator's publish "
                            "path '/srv/x/o'"),
    (["/srv/c"], "/srv/x/o/stage", "staging path '/srv/x/o/stage' is inside the operator's "
                                   "publish path '/srv/x/o'"),
    (["/srv/x"], None, "publish path '/srv/x' contains the operator's publish path '/srv/x/o'"),
    (["/srv/os"], "/srv/s", "staging path '/srv/s' is already claimed by the operator's"),
])
def test_a_csi_path_on_in_or_around_an_operator_path_is_not_loaded(
        config: Config, publish: list[str], staging: str | None, words: str) -> None:
    (config.desired_dir / "op.yaml").write_text(volume_text("op", ["/srv/x/o"],
                                                            staging="/srv/s"))
    (config.csi_dir / "c.yaml").write_text(volume_text("c", publish, staging))
    res = load_desired(config)
    assert [v.name for v in res.volumes] == ["op"]
    assert "c" in res.frozen_names
    assert any(words in d.message and "this CSI volume is not loaded" in d.message
               for d in res.diagnostics), [d.message for d in res.diagnostics]


def test_siblings_of_operator_paths_are_fine(config: Config) -> None:
    (config.desired_dir / "op.yaml").write_text(volume_text("op", ["/srv/x/o"],
                                                            staging="/srv/s"))
    (config.csi_dir / "c.yaml").write_text(volume_text("c", ["/srv/x/o2", "/srv/x/ob"],
                                                       staging="/srv/s-c"))
    res = load_desired(config)
    assert [v.name for v in res.volumes] == ["c", "op"], [str(d) for d in res.diagnostics]
