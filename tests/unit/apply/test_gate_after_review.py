"""Review of ``ask_gate_after`` (apply/runner.py): what a create, clone or
snapshot made is removed when the CSI gate, asked again, refuses. The gate
refuses as well when the record cannot be read at all: unknown, not
"moved on" (safety rule 7). Nothing is deleted on an unknown."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from reconciler.apply import runner as runner_mod
from reconciler.apply.outcomes import StepRefused
from reconciler.apply.runner import _VolumeRun
from reconciler.plan.steps import CreateImage, CreateSnapshot


def chain(gate_says: str) -> _VolumeRun:
    run = object.__new__(_VolumeRun)
    run.cluster = object()
    run.volume = SimpleNamespace(name="pvc-1", source=SimpleNamespace(
        file=Path("/var/lib/rbd-reconciler/csi/pvc-1.yaml")))
    run.gate = lambda name, file, step: gate_says
    return run


@pytest.mark.parametrize("step", [
    CreateImage("pvc-1", "rbd", "csi-vol-1", 1 << 30, ("layering",)),
    CreateSnapshot("pvc-1", "rbd", "csi-vol-1", "snap-1", None),
])
def test_what_a_step_made_is_not_removed_when_the_record_cannot_be_read(
        monkeypatch: pytest.MonkeyPatch, step: CreateImage | CreateSnapshot) -> None:
    removed: list[str] = []
    monkeypatch.setattr(runner_mod.ceph, "remove_image",
                        lambda c, p, i: removed.append(f"{p}/{i}"))
    monkeypatch.setattr(runner_mod.ceph, "remove_snapshot",
                        lambda c, p, i, s: removed.append(f"{p}/{i}@{s}"))
    # What Volumes.gate says when the records' object does not answer in time.
    run = chain("its controller record cannot be read (timed out); nothing is done "
                "until it can")
    with pytest.raises(StepRefused):
        run.ask_gate_after(step)
    assert removed == [], "removed on an unknown record (it may still be current)"
