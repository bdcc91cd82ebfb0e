"""Issue 40: the nodes' reports in RADOS (drivers/fleetstore.py) on the real
cluster: written and read back, hostile objects reported as problems and
never a crash, Ceph that does not answer an error (never "no reports"),
and the caps that keep a node's key to its own report.

Each test uses a namespace of its own (the session's cluster is shared).
"""

from __future__ import annotations

import errno
import json
import subprocess
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
        it = io.list_objects()
        while True:
            try:
                io.remove_object(next(it).key)
            except StopIteration:
                break
            except UnicodeDecodeError:  # a test's name that is not UTF-8: its own to remove
                continue


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


def test_a_lent_connection_serves_every_call_and_the_stores_own_is_closed(
        ceph_cluster: DevCluster, namespace: str) -> None:
    """The daemon lends its kept connection (a second idle one costs CPU
    every minute): while one is lent, the store makes none of its own, and
    the one it had is closed; each loan is given back."""
    loans: list[str] = []
    with ceph_cluster.client() as kept:
        lend: list[bool] = [False]

        def borrow() -> tuple[rados.Rados, object] | None:
            if not lend[0]:
                return None
            loans.append("out")
            return kept, lambda failed: loans.append("failed" if failed else "back")

        with FleetStore(admin(ceph_cluster), ceph_cluster.pool, namespace,
                        borrow=borrow) as store:  # type: ignore[arg-type]
            store.write(report("edge-001", 1))  # nothing lent: its own
            assert store.connects == 1 and store._ioctx is not None
            lend[0] = True
            second = report("edge-001", 2)
            store.write(second)
            assert store._ioctx is None  # its own closed at the first loan
            assert store.read_one("edge-001") == second
            assert sorted(store.read_all().reports) == ["edge-001"]
            assert store.connects == 1  # no connection made while one was lent
        assert loans == ["out", "back"] * 3
        loans.clear()
        with (FleetStore(admin(ceph_cluster), "no-such-pool", namespace,
                         borrow=borrow) as store,  # type: ignore[arg-type]
              pytest.raises(FleetUnavailable, match="does not exist")):
            store.write(report("edge-001", 3))
        assert loans == ["out", "failed"]  # the lender drops a loan a call failed on


def test_hostile_objects_are_problems(ceph_cluster: DevCluster, namespace: str,
                                     tmp_path: Path) -> None:
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
    # A name that is not UTF-8 (the binding cannot write one: the rados tool can).
    body = tmp_path / "body"
    body.write_bytes(good.to_bytes())
    rados = [b"rados", b"-c", bytes(ceph_cluster.conf), b"--id", ceph_cluster.user.encode(),
             b"--keyring", bytes(ceph_cluster.keyring), b"-p", ceph_cluster.pool.encode(),
             b"-N", namespace.encode()]
    subprocess.run([*rados, b"put", b"node/\xff/report", bytes(body)], check=True,
                   capture_output=True, timeout=60)
    with FleetStore(admin(ceph_cluster), ceph_cluster.pool, namespace) as store:
        got = store.read_all()
        assert got.reports == {"edge-001": good}  # the liar's claim never becomes edge-001's
        assert store.read_one("liar") is None  # its report names another node
    assert len(got.problems) == len(hostile) + 1, got.problems
    assert "b'node/\\xff/report': the name is not UTF-8" in got.problems, got.problems
    subprocess.run([*rados, b"rm", b"node/\xff/report"], check=True, capture_output=True,
                   timeout=60)  # the fixture's listing could not name it
    for name in hostile:
        assert any(p.startswith(repr(name)) for p in got.problems), (name, got.problems)
    text = "\n".join(got.problems)
    assert f"'node/big/report': larger than {MAX_REPORT_BYTES} bytes" in text
    assert "'node/zero/report': not JSON" in text  # an empty object is read as empty
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


# ---------------------------------------------------------------- fleet status

FLEET_YAML = """\
apiVersion: rbd-reconciler/v1
kind: Rollout
metadata: {name: edge}
spec:
  waves:
    - {name: canary, nodes: [edge-001]}
    - {name: rest, nodes: ["edge-*"]}
  gate: {healthySeconds: 5, staleSeconds: 30}
"""


def fleet_node(tmp_path: Path, cluster: DevCluster, ns: str | None) -> tuple[Path, Path]:
    """A node config following a (local) repository, in the fleet of ``ns``;
    its stateDir."""
    state = tmp_path / "state"
    state.mkdir()
    signers = tmp_path / "allowed_signers"
    signers.write_text("")
    fleet = f"  fleet: {{pool: {cluster.pool}, namespace: {ns}}}\n" if ns else ""
    config = tmp_path / "config.yaml"
    config.write_text(
        f"stateDir: {state}\nnodeName: edge-001\ncontrolSocket: {state}/control.sock\n"
        f"ceph:\n  conf: {cluster.conf}\n  user: {cluster.user}\n  keyring: {cluster.keyring}\n"
        f"allowedRoots: [{tmp_path}]\nmapper: fuse\n"
        f"source:\n  url: file://{tmp_path}/remote.git\n  ref: {{branch: main}}\n"
        f"  path: nodes/{{nodeName}}\n"
        f"  verify: {{mode: head, format: ssh, allowedSignersFile: {signers}}}\n{fleet}")
    return config, state


def verified_commit(state: Path, files: dict[str, str]) -> str:
    """A commit in the node's mirror, recorded as verified and applied by
    this node (as a sync leaves it: revs/<commit>-<path hash>.json, current)."""
    import hashlib
    import subprocess

    repo = state / "source" / "repo.git"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(state), "GIT_AUTHOR_NAME": "t",
           "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    subprocess.run(["git", "init", "-q", "--bare", str(repo)], check=True, env=env)
    work = state / "work"
    subprocess.run(["git", "init", "-q", str(work)], check=True, env=env)
    for name, text in files.items():
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).write_text(text)
    git = ["git", "-C", str(work)]
    subprocess.run([*git, "add", "-A"], check=True, env=env)
    subprocess.run([*git, "commit", "-qm", "x"], check=True, env=env)
    subprocess.run([*git, "push", "-q", str(repo), "HEAD:refs/heads/main"], check=True, env=env)
    commit = subprocess.run([*git, "rev-parse", "HEAD"], check=True, env=env,
                            capture_output=True, text=True).stdout.strip()
    revs = state / "source" / "revs"
    revs.mkdir(parents=True)
    path_hash = hashlib.sha256(b"nodes/edge-001").hexdigest()[:8]
    (revs / f"{commit}-{path_hash}.json").write_text("{}")
    (state / "source" / "current").symlink_to(f"revs/{commit}-{path_hash}")  # applied
    return commit


def run_cli(config: Path, *args: str) -> tuple[int, str, str]:
    import contextlib
    import io

    from reconciler.cli import main as cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(["--config", str(config), *args])
    return rc, out.getvalue(), err.getvalue()


def test_fleet_status_cli(ceph_cluster: DevCluster, namespace: str, tmp_path: Path) -> None:
    config, state = fleet_node(tmp_path, ceph_cluster, namespace)
    good = verified_commit(state, {"fleet.yaml": FLEET_YAML, "nodes/edge-001/v.yaml": ""})
    bad = "c" * 40  # a commit this node never verified: its fleet.yaml is never read
    with FleetStore(admin(ceph_cluster), ceph_cluster.pool, namespace) as store:
        store.write(Report(node="edge-001", applied=good, health=FAILED, counter=1,
                           written_at="2026-01-01T00:00:00+00:00", wave="canary",
                           failed_volume="pg", failed_reason="never shrink"))
        store.write(Report(node="edge-002", applied=bad, health=HEALTHY, counter=4,
                           written_at="2026-01-01T00:00:00+00:00", held_back=good,
                           held_back_why="halted by edge-001"))
    raw_write(ceph_cluster, namespace, "node/edge-003/report", b"not json")
    rc, out, err = run_cli(config, "fleet", "status", "-o", "json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["rollout"] == "edge" and doc["observedForSeconds"] == 0, doc["problems"]
    nodes = {n["node"]: n for n in doc["nodes"]}
    assert nodes["edge-001"]["wave"] == "canary" and nodes["edge-002"]["wave"] == "rest"
    assert nodes["edge-001"]["failedReason"] == "never shrink"
    assert nodes["edge-002"]["heldBack"] == good and nodes["edge-002"]["stale"] is False
    revs = {r["commit"]: r for r in doc["revisions"]}
    assert revs[good]["state"] == "Halted"
    assert revs[good]["halted"] == {"node": "edge-001", "volume": "pg", "reason": "never shrink"}
    assert revs[good]["heldBackBy"] == ["edge-002"]
    assert any(p.startswith(f"{bad[:12]}: not a revision this node verified")
               for p in doc["problems"]), doc["problems"]
    assert any(p.startswith("'node/edge-003/report': not JSON") for p in doc["problems"])
    assert doc["answeredBy"] == "this command" and "a direct read" in doc["note"]
    rc, text, err = run_cli(config, "fleet", "status")
    assert rc == 0, err
    assert f"revision {good[:12]}: Halted: halted: it failed on edge-001, volume pg" in text
    assert "edge-002" in text and "holds back" in text


def test_fleet_status_errors(ceph_cluster: DevCluster, tmp_path: Path) -> None:
    config, _ = fleet_node(tmp_path, ceph_cluster, None)
    rc, out, err = run_cli(config, "fleet", "status")
    assert rc == 1 and out == ""
    assert "no source.fleet" in err and "source.fleet.pool" in err
    config.write_text(config.read_text() + "  fleet: {pool: no-such-pool}\n")
    rc, out, err = run_cli(config, "fleet", "status", "-o", "json")
    assert rc == 1 and out == ""
    assert "pool no-such-pool does not exist" in err
    assert "Traceback" not in err


def test_an_osd_that_does_not_answer(ceph_cluster: DevCluster, namespace: str) -> None:
    """A listing that librados ends for a timed-out op looks complete: the
    store must say unavailable, never "no reports", within its bound."""
    import os
    import signal
    import time

    store = FleetStore(admin(ceph_cluster), ceph_cluster.pool, namespace, timeout=2)
    store.write(report("edge-001"))
    osd = ceph_cluster.pids["osd.0"]
    os.kill(osd, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(FleetUnavailable, match="did not answer within 2 s"):
            store.read_all()
        assert time.monotonic() - t0 < 8
        t0 = time.monotonic()
        with pytest.raises(FleetUnavailable):
            store.write(report("edge-001", 2))
        assert time.monotonic() - t0 < 8
    finally:
        os.kill(osd, signal.SIGCONT)
    # The failed connection was dropped; the next call connects anew.
    assert store.read_all().reports["edge-001"].counter == 1
    store.close()


@pytest.fixture
def fleet_pool(ceph_cluster: DevCluster) -> Iterator[str]:
    """A pool of its own for the reports (docs: the recommended set-up)."""
    pool = f"fleet-{uuid.uuid4().hex[:6]}"
    with ceph_cluster.client() as c:
        mon_cmd(c, {"prefix": "osd pool create", "pool": pool, "pg_num": 8, "pgp_num": 8})
    try:
        yield pool
    finally:
        with ceph_cluster.client() as c:
            mon_cmd(c, {"prefix": "osd pool rm", "pool": pool, "pool2": pool,
                        "yes_i_really_really_mean_it": True})


def keyed(cluster: DevCluster, entity: str, caps: list[str], tmp_path: Path) -> CephConfig:
    with cluster.client() as c:
        out = mon_cmd(c, {"prefix": "auth get-or-create", "entity": entity, "caps": caps})
    keyring = tmp_path / f"{entity}.keyring"
    keyring.write_text(f"[{entity}]\n\tkey = {json.loads(out)[0]['key']}\n")
    return CephConfig(conf=str(cluster.conf), user=entity.removeprefix("client."),
                      keyring=str(keyring))


def test_one_key_for_rbd_and_its_report(ceph_cluster: DevCluster, fleet_pool: str,
                                        tmp_path: Path) -> None:
    """The node's one Ceph user (the config's ceph.user serves RBD and the
    reports): ``profile rbd`` on the volumes' pool and the report caps on a
    pool of its own. And the residual risk when the reports share the
    volumes' pool: ``profile rbd pool=P`` covers every namespace of P, so
    that key writes any node's report."""
    ns, rbd_pool = "fleet", ceph_cluster.pool
    tag = uuid.uuid4().hex[:6]
    report_caps = (f"allow r pool={fleet_pool} namespace={ns}, allow rw pool={fleet_pool} "
                   f"namespace={ns} object_prefix node/edge-001/")
    good = keyed(ceph_cluster, f"client.edge-001-{tag}",
                 ["mon", "profile rbd", "osd", f"profile rbd pool={rbd_pool}, {report_caps}"],
                 tmp_path)
    shared = keyed(ceph_cluster, f"client.edge-009-{tag}",
                   ["mon", "profile rbd", "osd", f"profile rbd pool={rbd_pool}"], tmp_path)
    try:
        with FleetStore(good, fleet_pool, ns) as store:
            store.write(report("edge-001"))
            with pytest.raises(FleetUnavailable, match="permission denied"):
                store.write(report("edge-002"))
            assert list(store.read_all().reports) == ["edge-001"]
        with FleetStore(shared, fleet_pool, ns) as store, \
                pytest.raises(FleetUnavailable, match="permission denied"):
            store.write(report("edge-009"))  # no report caps on that pool
        with FleetStore(shared, rbd_pool, ns) as store:  # reports in the volumes' pool
            store.write(report("edge-002", 77))  # another node's: NOT refused
            assert store.read_one("edge-002") is not None
    finally:
        drop_users(ceph_cluster, [good, shared])
        with ceph_cluster.client() as c, c.open_ioctx(rbd_pool) as io:
            io.set_namespace(ns)
            for obj in list(io.list_objects()):
                io.remove_object(obj.key)
