"""rbd_reconciler_unaccounted: the leftovers of the last look, replacing the
last, with the series RbdLeftoversOfOurs sums always there."""

from __future__ import annotations

from prometheus_client import generate_latest

from reconciler.daemon.metrics import Metrics


def _series(m: Metrics) -> set[str]:
    return {line for line in generate_latest(m.registry).decode().splitlines()
            if line.startswith("rbd_reconciler_unaccounted{")}


def test_the_counts_replace_the_last_ones_and_the_alerted_series_stays() -> None:
    m = Metrics()
    assert _series(m) == {'rbd_reconciler_unaccounted{kind="any",ours="true"} 0.0'}
    m.set_unaccounted({("loop", True): 2, ("mount", False): 1})
    assert _series(m) == {'rbd_reconciler_unaccounted{kind="any",ours="true"} 0.0',
                          'rbd_reconciler_unaccounted{kind="loop",ours="true"} 2.0',
                          'rbd_reconciler_unaccounted{kind="mount",ours="false"} 1.0'}
    m.set_unaccounted({})  # all gone: no stale count of the loop devices
    assert _series(m) == {'rbd_reconciler_unaccounted{kind="any",ours="true"} 0.0'}
