"""Arbitrary YAML-ish text never makes the loader raise, and loading is deterministic."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reconciler.config import default_config
from reconciler.loader import load

FRAGMENTS = [
    "apiVersion: rbd-reconciler/v1\n", "kind: Volume\n", "metadata:\n", "  name: v\n",
    "spec:\n", "  image:\n", "    pool: rbd\n", "    size: 1Gi\n", "  map: {}\n",
    "  stage: {fsType: xfs}\n", "  publish:\n", "    - path: /srv/a\n", "---\n", "- x\n",
    "&a [*a]\n", "{", "}", "[", "]", ": ", "- ", "!!binary AA==\n", "<<: *a\n", "\t", "'",
    '"', "#", "\n", "size: -1\n", "~\n", "? complex\n", "!!python/object:os.system\n",
    "2024-01-01\n", "\x00", "\ufeff", "%YAML 1.1\n",
]

yamlish = st.lists(
    st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=12)), max_size=30
).map("".join)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(texts=st.lists(yamlish, min_size=1, max_size=3))
def test_loader_never_raises_and_is_deterministic(texts: list[str]) -> None:
    with tempfile.TemporaryDirectory() as d:
        for i, t in enumerate(texts):
            Path(d, f"f{i}.yaml").write_text(t, encoding="utf-8", errors="surrogatepass")
        first = load([Path(d)], default_config())
        second = load([Path(d)], default_config())
    assert first == second
    failed = {p.name for p in first.failed_files}
    # Every file is accounted for: it either failed or contributed volumes.
    for v in first.volumes:
        assert v.source.file.name not in failed
    for diag in first.diagnostics:
        assert diag.line >= 1 and diag.column >= 1 and diag.message
