"""What a CSI node call answers for each status the engine writes: a call is
OK only when what it asked for is done and usable."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from reconciler.csi.errors import CsiError
from reconciler.csi.volumes import Volumes

Code = grpc.StatusCode


def answer(status: dict[str, Any], bring_up: bool) -> Code:
    stub = SimpleNamespace(config=SimpleNamespace(csi_dir="/var/lib/rbd-reconciler/csi"))
    try:
        Volumes._answer(stub, "pvc-1", status, bring_up)  # type: ignore[arg-type]
    except CsiError as exc:
        return exc.code
    return Code.OK


@pytest.mark.parametrize("bring_up", [True, False])
@pytest.mark.parametrize(("status", "code"), [
    ({"phase": "Published"}, Code.OK),
    ({"phase": "Staged"}, Code.OK),
    # Held as it was: nothing of the call was done, whichever way it goes.
    ({"phase": "Stalled", "reason": "IoStalled", "message": "I/O to /dev/nbd0 ..."},
     Code.UNAVAILABLE),
    ({"phase": "Fenced", "reason": "Fenced", "message": "node-b took it over"},
     Code.FAILED_PRECONDITION),
    ({"phase": "Unknown"}, Code.UNAVAILABLE),
    ({"phase": "Failed", "lastResult": "failed", "lastError": "mkfs failed"}, Code.INTERNAL),
])
def test_held_and_failed_are_never_ok(status: dict[str, Any], code: Code,
                                      bring_up: bool) -> None:
    assert answer(status, bring_up) == code


def test_degraded_is_not_ok_for_a_stage_or_publish_only() -> None:
    degraded = {"phase": "Degraded", "reason": "FilesystemReadOnly",
                "message": "the filesystem at /staging is read-only"}
    assert answer(degraded, bring_up=True) == Code.FAILED_PRECONDITION
    # An unpublish or unstage is done: the way down is not held up.
    assert answer(degraded, bring_up=False) == Code.OK


def test_a_degraded_answer_keeps_what_was_made() -> None:
    stub = SimpleNamespace(config=None)
    with pytest.raises(CsiError) as err:
        Volumes._answer(stub, "pvc-1", {"phase": "Degraded", "reason": "Shadowed",  # type: ignore[arg-type]
                                        "message": "covered by a tmpfs"}, True)
    assert err.value.keep and "Shadowed" in err.value.message
    with pytest.raises(CsiError) as err:
        Volumes._answer(stub, "pvc-1", {"phase": "Fenced", "message": "x"}, True)  # type: ignore[arg-type]
    assert not err.value.keep
