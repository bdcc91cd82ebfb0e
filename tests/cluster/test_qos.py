"""QoS on the real cluster: librbd's limits in the image's metadata, set and
changed in place (no remap), and in force on the rbd-fuse path (measured)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import rbd
from conftest import NodeUnderTest

pytestmark = pytest.mark.ceph
MiB = 1 << 20


def qos_keys(node: NodeUnderTest, image: str) -> dict[str, str]:
    with node.cluster.client() as cl, cl.open_ioctx(node.cluster.pool) as io, \
            rbd.Image(io, image, read_only=True) as img:
        return {k: v for k, v in img.metadata_list() if k.startswith("conf_rbd_qos_")}


def direct_write_seconds(device: str, total: int) -> float:
    """Seconds to write ``total`` bytes with O_DIRECT (1 MiB at a time): the
    page cache would hide the limit."""
    import mmap
    buf = mmap.mmap(-1, MiB)  # page-aligned, as O_DIRECT wants
    buf.write(os.urandom(MiB))
    fd = os.open(device, os.O_WRONLY | os.O_DIRECT)
    try:
        t0 = time.monotonic()
        for i in range(total // MiB):
            os.pwrite(fd, buf, i * MiB)
        os.fsync(fd)
        return time.monotonic() - t0
    finally:
        os.close(fd)
        buf.close()


def spec(node: NodeUnderTest, stage: Path, qos: str) -> str:
    return (f"  image: {{pool: {node.cluster.pool}, size: 64Mi, reclaimPolicy: Delete}}\n"
            f"  map: {{mapper: fuse}}\n  stage: {{mode: block, path: {stage}}}\n{qos}")


def test_qos_set_changed_in_place_and_in_force(node: NodeUnderTest) -> None:
    name = node.name("qos")
    stage = node.srv / "qos-dev"
    node.write(name, spec(node, stage, "  qos: {writeBps: 2Mi, iopsPerGiB: 4000, maxIops: 200}\n"))
    doc = node.apply()
    assert doc["rc"] == 0, doc
    image = node.cli_json("status")[1]["volumes"][0]["image"].split("/")[1]
    node.images.add(image)
    # 64 MiB at 4000 IOPS per GiB: 250, at most 200; read back from Ceph.
    assert qos_keys(node, image) == {"conf_rbd_qos_write_bps_limit": str(2 * MiB),
                                     "conf_rbd_qos_iops_limit": "200"}
    rc, st = node.cli_json("status")
    assert st["volumes"][0]["qos"] == {"iops": 200, "writeBps": 2 * MiB}, st
    _, text = node.cli("explain", name)
    assert f"QoS:      iops 200, writeBps {2 * MiB}" in text, text

    # A change is a change in place: one step, not disruptive, no remap.
    device = st["volumes"][0]["device"]
    node.write(name, spec(node, stage, "  qos: {writeBps: 2Mi}\n"))
    rc, plan = node.plan()
    steps = plan["volumes"][0]["steps"]
    # (and the new spec's digest on the image)
    assert [(s["action"], s["disruptive"]) for s in steps] == [
        ("set image-meta", False), ("set qos", False)], steps
    assert "iops_limit=200" in steps[1]["from"] and "iops" not in steps[1]["to"], steps
    assert node.apply()["rc"] == 0
    assert qos_keys(node, image) == {"conf_rbd_qos_write_bps_limit": str(2 * MiB)}
    assert node.cli_json("status")[1]["volumes"][0]["device"] == device

    # In force on the open image (rbd-fuse is a librbd client): 12 MiB at
    # 2 MiB/s is at least 5 s after the first second's burst.
    took = direct_write_seconds(device, 12 * MiB)
    assert took >= 4.0, f"12 MiB written in {took:.1f} s: the 2 MiB/s limit is not in force"

    # Lifted live (qos: {} lifts every limit), same mapping: far faster now.
    node.write(name, spec(node, stage, "  qos: {}\n"))
    assert node.apply()["rc"] == 0
    assert qos_keys(node, image) == {}
    fast = direct_write_seconds(device, 12 * MiB)
    assert fast < took / 2, f"unlimited {fast:.1f} s vs limited {took:.1f} s"
    assert node.cli_json("status")[1]["volumes"][0]["device"] == device

    # No qos section: the image's QoS keys are left alone (not ours to drop).
    with node.cluster.client() as cl, cl.open_ioctx(node.cluster.pool) as io, \
            rbd.Image(io, image) as img:
        img.metadata_set("conf_rbd_qos_read_iops_limit", "77")
    node.write(name, spec(node, stage, ""))
    assert node.apply()["rc"] == 0
    rc, plan = node.plan()
    assert rc == 0, plan
    assert qos_keys(node, image) == {"conf_rbd_qos_read_iops_limit": "77"}
    node.write(name, spec(node, stage, "").replace("  image: {", "  state: absent\n  image: {"))
    assert node.apply()["rc"] == 0


def test_io_max_on_a_cgroup_without_the_io_controller_is_a_clear_failure(
        node: NodeUnderTest) -> None:
    """This host's cgroup v2 hierarchy has no io controller (blkio is a v1
    hierarchy here): the step fails saying why, and so does the next pass (a
    failed step stops the volume's later ones); the kernel tests set io.max
    for real on krbd."""
    unified = Path("/sys/fs/cgroup/unified")
    if not (unified / "cgroup.controllers").exists():
        pytest.skip("no cgroup v2 hierarchy at /sys/fs/cgroup/unified")
    assert "io" not in (unified / "cgroup.controllers").read_text().split()
    cg = unified / f"rbdr-test-{node.tag}"
    cg.mkdir()
    try:
        name = node.name("qos-cg")
        stage = node.srv / "qos-cg-dev"
        node.write(name, spec(node, stage, f"  qos: {{writeBps: 1Mi, cgroup: {cg}}}\n"))
        doc = node.apply()
        assert doc["rc"] != 0
        text = json.dumps(doc)
        assert "limit device io" in text and "no io.max" in text, text
        _, st = node.cli_json("status")
        assert st["volumes"][0]["phase"] == "MAPPED", st
        assert st["volumes"][0]["qos"] == {"writeBps": 1 << 20}  # librbd's part holds
        again = node.apply()
        assert again["rc"] != 0 and "no io.max" in json.dumps(again)
        node.write(name, spec(node, stage, "").replace("  image: {",
                                                       "  state: absent\n  image: {"))
        assert node.apply()["rc"] == 0
    finally:
        cg.rmdir()


def test_a_limit_librbd_refuses_leaves_the_previous_set(node: NodeUnderTest) -> None:
    """set_qos changes several keys one by one: when librbd refuses one of
    them half-way, the keys already changed go back (never a mix)."""
    from reconciler.drivers.ceph import set_qos
    from reconciler.drivers.rbdbase import CephError
    from reconciler.spec.qos import QOS_KEYS

    image = node.name("qos-rollback")
    node.images.add(image)
    with node.cluster.client() as cl:
        with cl.open_ioctx(node.cluster.pool) as io:
            rbd.RBD().create(io, image, 16 * MiB)
            with rbd.Image(io, image) as img:
                img.metadata_set("conf_rbd_qos_iops_limit", "50")
                img.metadata_set("conf_rbd_qos_bps_limit", str(MiB))
        before = qos_keys(node, image)
        # iops is changed first, read_iops removed... then bps is a value
        # librbd cannot hold.
        want = {"conf_rbd_qos_iops_limit": "100", "conf_rbd_qos_read_iops_limit": "7",
                "conf_rbd_qos_bps_limit": str(1 << 64)}
        with pytest.raises((rbd.Error, CephError)):
            set_qos(cl, node.cluster.pool, image, QOS_KEYS, want)
        assert qos_keys(node, image) == before
