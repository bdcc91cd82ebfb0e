"""fastschema never says "valid" where jsonschema finds an error, and does say
it for the valid examples (else the fast path would never be taken)."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reconciler.spec.fastschema import surely_valid
from reconciler.spec.schemas import schema, validator

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
DOCS = [("volume", d) for f in sorted(EXAMPLES.glob("*.yaml"))
        for d in yaml.safe_load_all(f.read_text()) if d]
DOCS += [("config", yaml.safe_load(f.read_text()))
         for f in sorted((EXAMPLES / "config").glob("*.yaml"))]

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**65), 2**65),
                    st.floats(allow_nan=False), st.text(max_size=12),
                    st.sampled_from(["ext4", "xfs", "fuse", "Retain", "Delete", "release",
                                     "1Gi", "10Mi", "/srv/x", "rbd-reconciler/v1", "Volume",
                                     "layering", "filesystem", "block", "present", "absent"]))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=6)


def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*prefix, i))
    return out


@st.composite
def mutated(draw: st.DrawFn) -> tuple[str, Any]:
    name, doc = draw(st.sampled_from(DOCS))
    doc = copy.deepcopy(doc)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(_paths(doc)))
        if not path:
            continue
        parent = doc
        for p in path[:-1]:
            parent = parent[p]
        how = draw(st.sampled_from(["set", "delete", "add"]))
        if how == "delete":
            del parent[path[-1]]
        elif how == "add" and isinstance(parent, dict):
            parent[draw(st.text(max_size=8))] = draw(VALUES)
        else:
            parent[path[-1]] = draw(VALUES)
    return name, doc


@pytest.mark.parametrize(("name", "doc"), DOCS)
def test_valid_examples_are_surely_valid(name: str, doc: Any) -> None:
    assert validator(name).is_valid(doc)
    assert surely_valid(schema(name), doc)


@settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck))
@given(mutated())
def test_never_valid_where_jsonschema_is_not(case: tuple[str, Any]) -> None:
    name, doc = case
    if surely_valid(schema(name), doc):
        assert validator(name).is_valid(doc), doc


def test_validate_of_a_valid_file_does_not_import_jsonschema() -> None:
    code = ("import sys; from reconciler.cli.main import main; rc = main(['validate', "
            f"'{EXAMPLES / 'pgdata.yaml'}']); "
            "print(rc, 'jsonschema' in sys.modules, 'rados' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["0", "False", "False"]
