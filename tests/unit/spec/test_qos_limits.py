"""QoS limits for a volume of a given size: what librbd and io.max get."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from reconciler.spec import qos
from reconciler.spec.qos import QosSpec

GiB = 1 << 30


def test_fixed_limits_become_librbd_keys() -> None:
    spec = QosSpec(read_iops=500, write_bps=10 << 20)
    assert qos.librbd_meta(spec, 10 * GiB) == {"conf_rbd_qos_read_iops_limit": "500",
                                               "conf_rbd_qos_write_bps_limit": str(10 << 20)}
    assert qos.librbd_meta(QosSpec(), GiB) == {}  # qos: {} lifts every limit


def test_per_gib_scales_with_size_and_is_capped() -> None:
    spec = QosSpec(iops_per_gib=10, max_iops=300, bps_per_gib=1 << 20)
    assert qos.limits(spec, 20 * GiB)[0] == 200
    assert qos.limits(spec, 100 * GiB)[0] == 300  # capped
    assert qos.limits(spec, 1 << 20)[0] == 1  # never 0 (librbd's "no limit")
    assert qos.limits(spec, 20 * GiB)[3] == 20 << 20  # bps, no cap
    assert qos.limits(QosSpec(iops=7, iops_per_gib=10), 20 * GiB)[0] == 7  # fixed wins
    assert qos.limits(spec, None)[0] is None  # size unknown yet: next pass


def test_io_max_has_no_combined_limit_so_it_bounds_each_direction() -> None:
    assert qos.io_max(QosSpec(iops=100, write_iops=40, read_bps=5 << 20), GiB) == {
        "riops": 100, "wiops": 40, "rbps": 5 << 20}


def test_describe_reads_back_the_keys_by_spec_name() -> None:
    meta = {"conf_rbd_qos_iops_limit": "9", "conf_rbd_qos_write_bps_limit": "oops",
            "rbd-reconciler.owner": "n1"}
    assert qos.describe(meta) == {"iops": 9}


@given(st.integers(1, 10**6), st.integers(1, 10**6), st.integers(1 << 20, 1 << 50))
def test_scaled_limit_is_between_1_and_max(per: int, most: int, size: int) -> None:
    got = qos.limits(QosSpec(iops_per_gib=per, max_iops=most), size)[0]
    assert got is not None and 1 <= got <= most
