"""engine/operator.users_of (recover's check before a forced unmap): a
process table that cannot be listed is "users unknown", which refuses,
never "nobody" and never a traceback."""

from __future__ import annotations

import pytest

from reconciler.engine import operator
from reconciler.facts.observed import Observed
from reconciler.plan.types import VolumePlan


def test_an_unreadable_process_table_is_a_user(monkeypatch: pytest.MonkeyPatch) -> None:
    def users(*_: object, **__: object) -> list[object]:
        raise PermissionError(13, "Permission denied", "/proc")

    monkeypatch.setattr(operator, "users", users)
    found = operator.users_of(VolumePlan("v"), Observed({}, frozenset(), {}, [], {}, ()))
    assert len(found) == 1 and "users are unknown" in str(found[0]), found
