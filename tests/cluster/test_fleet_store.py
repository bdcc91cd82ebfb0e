"""Issue 40: the nodes' reports in RADOS (drivers/fleetstore.py) on the real
cluster: written and read back, hostile objects reported as problems and
never a crash, Ceph that does not answer an error (never "no reports"),
and the caps that keep a node's key to its own report.

Each test uses a namespace of its own (the session's cluster is shared).
"""

from __future__ import annotations

import errno
import json
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
import rados

from reconciler.drivers.fleetstore import (
    MAX_REPORT_BYTES,
    FleetStore,
    FleetUnavailable,
    object_name,
)
from reconciler.facts.fleetreport import CONVERGING, FAILED, HEALTHY, Report
from reconciler.spec.config import CephConfig
from reconciler.testing.cephprocs import mon_cmd
from reconciler.testing.devcluster import DevCluster

pytestmark = pytest.mark.ceph

COMMIT = "a" * 40


def report(node: str, counter: int = 1, health: str = HEALTHY, **kw: object) -> Report:
    return Report(node=node, applied=COMMIT, health=health, counter=counter,
                  written_at=datetime.now(UTC).isoformat(timespec="seconds"), **kw)


def admin(cluster: DevCluster) -> CephConfig:
    return CephConfig(conf=str(cluster.conf), user=cluster.user, keyring=str(cluster.keyring))


@pytest.fixture
def namespace(ceph_cluster: DevCluster) -> Iterator[str]:
    ns = f"fleet-test-{uuid.uuid4().hex[:8]}"
    yield ns
    with ceph_cluster.client() as c, c.open_ioctx(ceph_cluster.pool) as io:
        io.set_namespace(ns)
        for obj in list(io.list_objects()):
            io.remove_object(obj.key)


def raw_write(cluster: DevCluster, ns: str, name: str, data: bytes) -> None:
    with cluster.client() as c, c.open_ioctx(cluster.pool) as io:
        io.set_namespace(ns)
        io.write_full(name, data)


def test_write_read_back(ceph_cluster: DevCluster, namespace: str) -> None:
    with FleetStore(admin(ceph_cluster), ceph_cluster.pool, namespace) as store:
        assert store.read_all().reports == {}
        assert store.read_one("edge-001") is None
        mine = report("edge-001", 7, wave="canary", phases=(("Published", 3),))
        store.write(mine)
        store.write(report("edge-002", 1, CONVERGING))
        store.write(report("edge-003", 2, FAILED, failed_volume="pg", failed_reason="never shrink"))
        got = store.read_all()
        assert got.problems == ()
        assert sorted(got.reports) == ["edge-001", "edge-002", "edge-003"]
        assert got.reports["edge-001"] == mine
        assert got.reports["edge-003"].failed_reason == "never shrink"
        assert store.read_one("edge-001") == mine
        newer = report("edge-001", 8)
        store.write(newer)  # write_full: the newest wins, nothing of the old one stays
        assert store.read_one("edge-001") == newer
        assert store.connects == 1  # one connection kept across the calls
    with ceph_cluster.client() as c, c.open_ioctx(ceph_cluster.pool) as io:
        io.set_namespace(namespace)
        assert io.read(object_name("edge-001"), 1 << 20, 0) == newer.to_bytes()


def test_hostile_objects_are_problems(ceph_cluster: DevCluster, namespace: str) -> None:
    good = report("edge-001")
    raw_write(ceph_cluster, namespace, object_name("edge-001"), good.to_bytes())
    hostile = {
        "node/big/report": b"{" + b" " * MAX_REPORT_BYTES + b"}",
        "node/badjson/report": b'{"v": 1, "node": ',
        "node/notutf8/report": b"\xff\xfe",
        "node/liar/report": report("edge-001", 99, FAILED, failed_reason="x").to_bytes(),
        "node/edge-001x/report": report("edge-001").to_bytes(),  # claims edge-001
        "node/edge-002/report/extra": report("edge-002").to_bytes(),
        "node/-bad-/report": report("edge-002").to_bytes(),
        "node//report": b"{}",
        "nodes/edge-003/report": report("edge-003").to_bytes(),
        "node/edge-004/report\n": report("edge-004").to_bytes(),
        "node/zero/report": b"",
        "node/list/report": b"[1, 2]",
        "node/deep/report": b"[" * 5000 + b"]" * 5000,
    }
    for name, data in hostile.items():
        raw_write(ceph_cluster, namespace, name, data)
    with FleetStore(admin(ceph_cluster), ceph_cluster.pool, namespace) as store:
        got = store.read_all()
        assert got.reports == {"edge-001": good}  # the liar's claim never becomes edge-001's
        assert store.read_one("liar") is None  # its report names another node
    assert len(got.problems) == len(hostile), got.problems
    for name in hostile:
        assert any(p.startswith(repr(name)) for p in got.problems), (name, got.problems)
    text = "\n".join(got.problems)
    assert f"larger than {MAX_REPORT_BYTES} bytes" in text
    assert "its report says it is node 'edge-001'" in text
    assert "not the name of a report" in text


def test_ceph_that_does_not_answer(ceph_cluster: DevCluster, namespace: str,
                                   tmp_path: Path) -> None:
    with pytest.raises(FleetUnavailable, match="pool no-such-pool does not exist"):
        FleetStore(admin(ceph_cluster), "no-such-pool", namespace).read_all()
    conf = tmp_path / "ceph.conf"  # a monitor nobody listens on
    conf.write_text("[global]\nmon host = 127.0.0.1:1\nauth supported = cephx\n")
    dead = CephConfig(conf=str(conf), user=ceph_cluster.user, keyring=str(ceph_cluster.keyring))
    store = FleetStore(dead, ceph_cluster.pool, namespace, timeout=1)
    with pytest.raises(FleetUnavailable, match="did not answer within 1 s"):
        store.read_all()
    with pytest.raises(FleetUnavailable):
        store.write(report("edge-001"))


# ---------------------------------------------------------------- the caps


def node_user(cluster: DevCluster, ns: str, node: str, tmp_path: Path) -> CephConfig:
    """A Ceph user with the caps docs/fleet.md gives a node."""
    pool = cluster.pool
    entity = f"client.fleet-{ns}-{node}"
    caps = ["mon", "allow r",
            "osd", f"allow r pool={pool} namespace={ns}, "
                   f"allow rw pool={pool} namespace={ns} object_prefix node/{node}/"]
    with cluster.client() as c:
        out = mon_cmd(c, {"prefix": "auth get-or-create", "entity": entity, "caps": caps})
    key = json.loads(out)[0]["key"]
    keyring = tmp_path / f"{node}.keyring"
    keyring.write_text(f"[{entity}]\n\tkey = {key}\n")
    return CephConfig(conf=str(cluster.conf), user=entity.removeprefix("client."),
                      keyring=str(keyring))


def drop_users(cluster: DevCluster, users: list[CephConfig]) -> None:
    with cluster.client() as c:
        for u in users:
            mon_cmd(c, {"prefix": "auth del", "entity": f"client.{u.user}"})


def test_a_nodes_key_writes_only_its_own_report(ceph_cluster: DevCluster, namespace: str,
                                                tmp_path: Path) -> None:
    one = node_user(ceph_cluster, namespace, "edge-001", tmp_path)
    two = node_user(ceph_cluster, namespace, "edge-002", tmp_path)
    try:
        with FleetStore(two, ceph_cluster.pool, namespace) as store:
            store.write(report("edge-002", 5))
        with FleetStore(one, ceph_cluster.pool, namespace) as store:
            store.write(report("edge-001", 3))  # its own: allowed
            with pytest.raises(FleetUnavailable, match="permission denied"):
                store.write(report("edge-002", 6, FAILED, failed_reason="forged"))
            got = store.read_all()  # it reads everyone's
            assert {n: r.counter for n, r in got.reports.items()} == {"edge-001": 3,
                                                                      "edge-002": 5}
        # Below the store: every name but its own prefix is refused (EPERM).
        handle = rados.Rados(conffile=one.conf, rados_id=one.user,
                             conf={"keyring": one.keyring, "rados_osd_op_timeout": "10",
                                   "rados_mon_op_timeout": "10"})
        handle.connect(timeout=10)
        try:
            with handle.open_ioctx(ceph_cluster.pool) as io:
                io.set_namespace(namespace)
                io.write_full("node/edge-001/report", b"{}")  # its own object: allowed
                io.write_full(object_name("edge-001"), report("edge-001", 4).to_bytes())
                for name in ("node/edge-002/report", "node/edge-001x/report", "node/edge-00/report",
                             "node/edge-001", "other", "node/edge-001x/"):
                    with pytest.raises(rados.PermissionError) as exc:
                        io.write_full(name, b"{}")
                    assert exc.value.errno == errno.EPERM, name
                    with pytest.raises(rados.PermissionError):
                        io.remove_object(name)
                # The same object name in another namespace is another object.
                io.set_namespace("")
                with pytest.raises(rados.PermissionError):
                    io.write_full("node/edge-001/report", b"{}")
                with pytest.raises(rados.PermissionError):
                    io.read("anything")
        finally:
            handle.shutdown()
        with FleetStore(admin(ceph_cluster), ceph_cluster.pool, namespace) as store:
            got = store.read_all()
        assert got.reports["edge-002"].counter == 5  # never forged
        assert got.reports["edge-001"].counter == 4
    finally:
        drop_users(ceph_cluster, [one, two])
