"""A volume with a problem no step may put right: its status and its series."""

from __future__ import annotations

from prometheus_client import generate_latest

from reconciler.daemon.metrics import STATUS_PHASES, VOLUME_CONDITIONS, Metrics
from reconciler.plan.types import VolumePlan
from reconciler.spec.model import Phase
from reconciler.state.status import converged_conditions


def test_conditions_are_series_per_volume_at_0_or_1() -> None:
    m = Metrics()
    sick = VolumePlan("sick", phase=Phase.STAGED,
                      problems={"Shadowed": "/srv/a is not served: tmpfs x is mounted on top"})
    well = VolumePlan("well", phase=Phase.PUBLISHED)
    m.observed([sick, well], [], None)
    m.set_phase("sick", "Degraded")
    text = generate_latest(m.registry).decode()
    assert 'rbd_reconciler_volume_condition{condition="Shadowed",volume="sick"} 1.0' in text
    assert ('rbd_reconciler_volume_condition{condition="FilesystemReadOnly",volume="sick"} 0.0'
            in text)
    for c in VOLUME_CONDITIONS:
        assert f'rbd_reconciler_volume_condition{{condition="{c}",volume="well"}} 0.0' in text
    assert 'rbd_reconciler_volume_phase{phase="Degraded",volume="sick"} 1.0' in text
    assert 'rbd_reconciler_volumes{phase="Degraded"} 1.0' in text
    assert "/srv/a" not in text  # label values are names and enums, never paths
    m.retain({"well"})
    assert 'volume="sick"' not in generate_latest(m.registry).decode()


def test_degraded_is_a_status_phase() -> None:
    assert "Degraded" in STATUS_PHASES


def test_converged_conditions() -> None:
    [ok] = converged_conditions({}, "t")
    assert ok == {"type": "Converged", "status": True, "reason": "UpToDate", "message": "",
                  "lastTransitionTime": "t"}
    conv, ro = converged_conditions({"FilesystemReadOnly": "ext4 on /dev/loop3 is read-only"},
                                    "t")
    assert conv["status"] is False and conv["reason"] == "Degraded"
    assert conv["message"] == "FilesystemReadOnly"
    assert ro == {"type": "FilesystemReadOnly", "status": True, "reason": "FilesystemReadOnly",
                  "message": "ext4 on /dev/loop3 is read-only", "lastTransitionTime": "t"}
