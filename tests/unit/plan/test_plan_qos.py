"""QoS in the plan: librbd's keys and io.max, changed in place (never a remap),
and the parsers of what is in force."""

from __future__ import annotations

from dataclasses import replace

from test_plan import LOOP, MiB, World, actions, converged, owned_meta, plan_one, volume

from reconciler.facts.parsers import parse_io_max, parse_systemd_io
from reconciler.plan.steps import LimitDeviceIo, SetQos
from reconciler.spec.qos import QosSpec


def test_a_new_volume_gets_its_limits_before_it_is_mapped() -> None:
    vol = replace(volume(), qos=QosSpec(read_iops=100, bps=1 << 20))
    p = plan_one(vol, World())
    assert actions(p)[:3] == ["create image", "set qos", "map"], actions(p)
    [q] = [s for s in p.steps if isinstance(s, SetQos)]
    assert q.old == () and dict(q.new) == {"conf_rbd_qos_read_iops_limit": "100",
                                           "conf_rbd_qos_bps_limit": str(1 << 20)}


def test_a_changed_limit_is_one_step_and_nothing_disruptive() -> None:
    old = replace(volume(), qos=QosSpec(read_iops=100))
    new = replace(old, qos=QosSpec(read_iops=200))
    world = converged(new, image_meta=owned_meta(new, conf_rbd_qos_read_iops_limit="100"))
    p = plan_one(new, world)
    assert actions(p) == ["set qos"] and not any(s.disruptive for s in p.steps)
    same = converged(new, image_meta=owned_meta(new, conf_rbd_qos_read_iops_limit="200"))
    assert actions(plan_one(new, same)) == []


def test_no_qos_section_leaves_the_keys_alone() -> None:
    vol = volume()
    world = converged(vol, image_meta=owned_meta(vol, conf_rbd_qos_iops_limit="5"))
    assert actions(plan_one(vol, world)) == []


def io_steps(p) -> list[LimitDeviceIo]:  # type: ignore[no-untyped-def]
    return [s for s in p.steps if isinstance(s, LimitDeviceIo)]


def io_world(vol, limits: dict[str, dict[str, int]] | None, error: str | None = None):  # type: ignore[no-untyped-def]
    obs = converged(vol).observed()
    target = vol.qos.io_target
    return replace(obs, io_limits={target: limits} if limits is not None else {},
                   io_errors={target: error} if error else {})


def test_io_max_on_the_named_unit_in_place() -> None:
    vol = replace(volume(), qos=QosSpec(iops=50, write_bps=2 * MiB, unit="db.slice"))
    p = plan_one(vol, io_world(vol, {}))
    [s] = io_steps(p)
    assert s.target_name == "db.slice" and s.device == LOOP
    assert dict(s.new) == {"riops": 50, "wiops": 50, "wbps": 2 * MiB} and not s.disruptive
    assert io_steps(plan_one(vol, io_world(vol, {"7:0": dict(s.new)}))) == []
    # Another device's limits on the same unit are not this volume's.
    assert len(io_steps(plan_one(vol, io_world(vol, {"252:0": dict(s.new)})))) == 1


def test_io_max_target_unreadable_is_a_refusal_with_its_reason() -> None:
    vol = replace(volume(), qos=QosSpec(iops=50, cgroup="/sys/fs/cgroup/db"))
    p = plan_one(vol, io_world(vol, None, error="/sys/fs/cgroup/db: no io.max"))
    assert p.refusal is not None and p.refusal.startswith("QoS: ") and "io.max" in p.refusal


def test_io_max_for_a_device_this_run_maps() -> None:
    vol = replace(volume(), qos=QosSpec(read_bps=MiB, cgroup="/sys/fs/cgroup/db"))
    p = plan_one(vol, World())
    [s] = io_steps(p)
    assert s.device is None and dict(s.new) == {"rbps": MiB}
    assert actions(p).index("limit device io") == actions(p).index("map") + 1


def test_parse_io_max_and_systemd_properties() -> None:
    assert parse_io_max("7:0 rbps=max wbps=2097152 riops=50 wiops=max\n8:0 rbps=1 wbps=max "
                        "riops=max wiops=max\n") == {"7:0": {"wbps": 2097152, "riops": 50},
                                                     "8:0": {"rbps": 1}}
    text = ("IOReadIOPSMax=/dev/rbd0 50\nIOReadIOPSMax=/dev/rbd1 7\nIOWriteIOPSMax=\n"
            "IOReadBandwidthMax=/dev/rbd0 infinity\nIOWriteBandwidthMax=/dev/rbd0 1048576\n")
    assert parse_systemd_io(text) == {"/dev/rbd0": {"riops": 50, "wbps": 1048576},
                                      "/dev/rbd1": {"riops": 7}}


def test_a_publish_user_cgroup_mirrors_the_image_limits_and_never_refuses() -> None:
    pod = "/sys/fs/cgroup/kubepods.slice/kubepods-pod1.slice"
    base = volume()
    vol = replace(base, publish=(replace(base.publish[0], io_cgroup=pod), base.publish[1]))
    meta = owned_meta(vol, conf_rbd_qos_write_bps_limit=str(8 * MiB))
    obs = converged(vol, image_meta=meta).observed()
    [s] = io_steps(plan_one(vol, replace(obs, io_limits={pod: {}})))
    assert s.target_name == pod and dict(s.new) == {"wbps": 8 * MiB} and not s.required
    assert io_steps(plan_one(vol, replace(obs, io_limits={pod: {"7:0": {"wbps": 8 * MiB}}}))) \
        == []
    p = plan_one(vol, replace(obs, io_errors={pod: f"{pod}: no io.max"}))
    assert p.refusal is None and any("QoS not set" in n for n in p.notes), p.notes
    # No limits anywhere: nothing to do, and an unreadable cgroup is no news.
    bare = converged(vol).observed()
    p = plan_one(vol, replace(bare, io_errors={pod: "no io.max"}))
    assert io_steps(p) == [] and not p.notes
