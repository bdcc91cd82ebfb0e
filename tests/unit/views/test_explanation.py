"""``explain`` of a volume whose file fails to load says the same whoever
made the document: the command alone (its pass plans the frozen volume) or
the daemon (its live view keeps no plan of it)."""

from __future__ import annotations

from reconciler.engine import NOTHING_OBSERVED
from reconciler.plan.planner import FROZEN, frozen_plan
from reconciler.views import explain_exit, explanation


def explain(vp: object) -> dict:
    return explanation("f", None, vp, NOTHING_OBSERVED, None, True, [],  # type: ignore[arg-type]
                       {"phase": "Frozen"}, lambda actual: None)


def test_a_frozen_volume_is_refused_with_or_without_a_plan() -> None:
    alone, daemon = explain(frozen_plan("f")), explain(None)
    assert daemon == alone
    assert daemon["refusal"] == FROZEN and daemon["nextSteps"] == [] and daemon["frozen"]
    assert explain_exit(daemon) == 0
