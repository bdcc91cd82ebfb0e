"""Arbitrary YAML-ish text never makes the loader raise, and loading is deterministic.

2,000 examples per property by default (CI, ~15 s). For a longer local run:

    RBD_FUZZ_EXAMPLES=10000 .venv/bin/python -m pytest -m fuzz -p no:cacheprovider
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reconciler.spec.config import ConfigError, default_config, load_config
from reconciler.spec.diagnostics import EXCERPT_CHARS, FORBIDDEN_CHARS
from reconciler.spec.loader import load

EXAMPLES = int(os.environ.get("RBD_FUZZ_EXAMPLES", "2000"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])
pytestmark = pytest.mark.fuzz

FRAGMENTS = [
    "apiVersion: rbd-reconciler/v1\n", "kind: Volume\n", "metadata:\n", "  name: v\n",
    "spec:\n", "  image:\n", "    pool: rbd\n", "    size: 1Gi\n", "  map: {}\n",
    "  stage: {fsType: xfs}\n", "  publish:\n", "    - path: /srv/a\n", "---\n", "- x\n",
    "&a [*a]\n", "{", "}", "[", "]", ": ", "- ", "!!binary AA==\n", "<<: *a\n", "\t", "'",
    '"', "#", "\n", "size: -1\n", "~\n", "? complex\n", "!!python/object:os.system\n",
    "2024-01-01\n", "\x00", "\ufeff", "%YAML 1.1\n",
    # Inputs issue 7 found: floats as sizes, bad explicit tags, alias bombs,
    # control and bidi characters, huge numbers, mkfs options, nested paths.
    "    size: 1048576.0\n", "kind: !!timestamp 2020-01-01x\n", "!!int 0x\n",
    "b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n", "c: &c [*b, *b, *b, *b, *b, *b, *b, *b]\n",
    "<<: [*a, *a]\n", '"\\u202e"', '"\\0"', '"\\e[2J"', "\u202e", "\u2066",
    "    size: 99999999999999999999Ti\n", "    size: " + "9" * 30 + "\n",
    "    mkfsOptions: [-l, logdev=/dev/sda]\n", "    mkfsOptions: [-L, data]\n",
    "    - path: /srv/a/b\n", "    path: /srv/a\n", "    path: /var/lib/rbd-reconciler\n",
    "X" * 200,
]

yamlish = st.lists(
    st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=12)), max_size=30
).map("".join)


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="rbd-fuzz-"))
    yield d
    shutil.rmtree(d)


def _fill(d: Path, texts: list[str]) -> None:
    for old in d.iterdir():
        old.unlink()
    for i, t in enumerate(texts):
        (d / f"f{i}.yaml").write_text(t, encoding="utf-8", errors="surrogatepass")


def _assert_message_is_safe(message: str) -> None:
    # Values are quoted as escaped excerpts: no raw control or bidi character,
    # and no long run of user text.
    assert FORBIDDEN_CHARS.search(message) is None, repr(message)
    assert "X" * (EXCERPT_CHARS + 1) not in message, message


@FUZZ
@given(texts=st.lists(yamlish, min_size=1, max_size=3))
def test_loader_never_raises_and_is_deterministic(scratch: Path, texts: list[str]) -> None:
    _fill(scratch, texts)
    first = load([scratch], default_config())
    second = load([scratch], default_config())
    assert first == second
    failed = {p.name for p in first.failed_files}
    # Every file is accounted for: it either failed or contributed volumes.
    for v in first.volumes:
        assert v.source.file.name not in failed
    for diag in first.diagnostics:
        assert diag.line >= 1 and diag.column >= 1 and diag.message
        _assert_message_is_safe(diag.message)
        _assert_message_is_safe(diag.field)


@FUZZ
@given(text=yamlish)
def test_config_loader_raises_only_config_errors(scratch: Path, text: str) -> None:
    _fill(scratch, [text])
    try:
        load_config(scratch / "f0.yaml")
    except ConfigError as exc:
        for diag in exc.diagnostics:
            assert diag.line >= 1 and diag.column >= 1 and diag.message
            _assert_message_is_safe(diag.message)
