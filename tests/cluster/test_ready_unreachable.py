"""A start with Ceph unreachable: READY=1 within observeTimeoutSeconds + 10 s.

The unit is ``Type=notify`` and ``Before=remote-fs.target``: on Debian 12
the console's logins (systemd-user-sessions, getty@) wait for READY=1, and
so does the postinst's ``try-restart``. A volume whose pool did not answer
within ``observeTimeoutSeconds`` (here: its cluster's only mon is a
loopback port nobody listens on) is known not to come up soon: READY=1 does
not wait for it, and STATUS=, the log and ``rbd-reconciler status`` say
which volumes were not waited for and why. The same holds for a restart
(what ``try-restart`` waits for). Volumes converging on a healthy cluster
are still waited for: test_start_holds_nobody.py.
"""

from __future__ import annotations

import json
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import rados
from conftest import NodeUnderTest
from test_daemon import Daemon, spec, start, wait_for  # noqa: F401 - start: the fixture
from test_stop import StandIn, daemons, stand_in  # noqa: F401 - the fixtures

from reconciler.testing.devcluster import DevCluster

pytestmark = pytest.mark.ceph

OBSERVE_S = 5.0  # observeTimeoutSeconds (the default, said out loud)
BOUND_S = OBSERVE_S + 10.0  # the bound
PROBE_EVERY_S = 5.0  # daemon/readiness.py's: first chains' images are read this often


def unreachable_conf(root: Path, port: int) -> Path:
    """A Ceph conf whose only mon is a loopback port nobody listens on."""
    conf = root / "unreachable.conf"
    conf.write_text(f"[global]\nmon host = v2:127.0.0.1:{port}\n")
    return conf


def use_conf(node: NodeUnderTest, conf: Path) -> str:
    """Point the node's config at ``conf``; the config as it was."""
    before = node.config.read_text()
    node.config.write_text(before.replace(f"conf: {node.cluster.conf}", f"conf: {conf}")
                           + f"observeTimeoutSeconds: {OBSERVE_S}\n")
    assert f"conf: {conf}" in node.config.read_text()
    return before


def ready_within(d: Daemon, t0: float, bound: float) -> float:
    """Seconds from ``t0`` to READY=1; fails past ``bound`` (with the log)."""
    try:
        wait_for(lambda: d.saw("READY=1"), "READY=1", bound)
    except AssertionError:
        raise AssertionError(f"no READY=1 within {bound:g} s; notify "
                             f"{d.drain()}; log:\n{d.log.read_text()[-6000:]}") from None
    return time.monotonic() - t0


def test_ready_within_the_observe_timeout_when_ceph_is_unreachable(
        node: NodeUnderTest, start: Callable[..., Daemon]) -> None:  # noqa: F811
    # Bound and never listened on: a connect is refused (the mon is down).
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    try:
        conf = unreachable_conf(node.root, holder.getsockname()[1])
        a, b = node.name("a"), node.name("b")
        node.write(a, spec(node, target="a"))
        node.write(b, spec(node, target="b"))
        before = use_conf(node, conf)

        t0 = time.monotonic()
        d = start()
        took = ready_within(d, t0, BOUND_S)
        print(f"READY=1 {took:.1f} s after the start, Ceph unreachable")
        for name in (a, b):
            assert d.status(name)["phase"] == "Unknown", d.status(name)
        # STATUS= names the volumes not waited for, and why.
        status = [m for m in d.drain() if m.startswith("STATUS=")]
        said = next((m for m in reversed(status) if "not waited for" in m), None)
        assert said is not None, status
        assert a in said and b in said and node.cluster.pool in said, said
        assert f"cannot reach Ceph: no answer within {OBSERVE_S:g} s" in said, said
        log = d.log.read_text()
        assert "not waited for" in log and a in log and b in log, log[-4000:]
        # `status` says the reason too (through the running daemon).
        rc, out = node.cli("status")
        assert rc != 0 and "cannot reach Ceph" in out, out
        assert d.stop() == 0

        # A restart (the postinst's try-restart waits for READY=1): the same.
        t0 = time.monotonic()
        d2 = start()
        took = ready_within(d2, t0, BOUND_S)
        print(f"READY=1 {took:.1f} s after the restart, Ceph unreachable")
        assert d2.stop() == 0
        node.config.write_text(before)  # the teardown releases on the real cluster
    finally:
        holder.close()


# --- Ceph gone while a first chain runs ------------------------------------------


@dataclass
class SwitchablePool:
    """A pool that answers, until its CRUSH rule is switched to one that maps
    to no OSD (every op on it then waits), and back."""

    cluster: DevCluster
    pool: str
    dead_rule: str

    def mon(self, cmd: dict[str, object]) -> None:
        with self.cluster.client(timeout=30) as c:
            rc, _, err = c.mon_command(json.dumps(cmd), b"", timeout=30)
            assert rc == 0, f"{cmd['prefix']}: {err}"

    def rule(self, rule: str) -> None:
        self.mon({"prefix": "osd pool set", "pool": self.pool, "var": "crush_rule",
                  "val": rule})

    def answers(self) -> bool:
        try:
            with self.cluster.client(timeout=30, osd_op_timeout=2) as c, \
                    c.open_ioctx(self.pool) as io:
                io.stat("rbd_directory")
        except rados.ObjectNotFound:
            return True
        except rados.Error:
            return False
        return True


@pytest.fixture
def switchable_pool(ceph_cluster: DevCluster) -> Iterator[SwitchablePool]:
    tag = uuid.uuid4().hex[:6]
    root, dead, pool = f"empty-{tag}", f"dead-{tag}", f"switch-{tag}"
    p = SwitchablePool(ceph_cluster, pool, dead)
    p.mon({"prefix": "osd crush add-bucket", "name": root, "type": "root"})
    p.mon({"prefix": "osd crush rule create-replicated", "name": dead, "root": root,
           "type": "osd"})
    p.mon({"prefix": "osd pool create", "pool": pool, "pg_num": 8, "pgp_num": 8,
           "pool_type": "replicated"})
    p.mon({"prefix": "osd pool application enable", "pool": pool, "app": "rbd"})
    try:
        yield p
    finally:
        p.rule("replicated_rule")
        p.mon({"prefix": "osd pool rm", "pool": pool, "pool2": pool,
               "yes_i_really_really_mean_it": True})
        p.mon({"prefix": "osd crush rule rm", "name": dead})
        p.mon({"prefix": "osd crush remove", "name": root})


def test_a_first_chain_whose_pool_stops_answering_is_not_waited_for(
        node: NodeUnderTest, stand_in: StandIn,  # noqa: F811 - the fixtures
        daemons: Callable[..., Daemon],  # noqa: F811
        switchable_pool: SwitchablePool) -> None:
    """The first pass starts a chain (its mkfs hangs: the stand-in); then its
    pool stops answering. READY=1 comes within observeTimeoutSeconds plus a
    probe's interval plus 10 s, naming the volume and why, while the chain
    still runs; before the pool stopped answering, READY=1 waited for it."""
    stuck = stand_in.image
    f = node.write(stuck, spec(node, target="stuck").replace(
        f"pool: {node.cluster.pool}", f"pool: {switchable_pool.pool}"))
    node.config.write_text(node.config.read_text() + f"observeTimeoutSeconds: {OBSERVE_S}\n")
    stand_in.install("mkfs.ext4")
    d = daemons(extra_env=stand_in.env())
    try:
        wait_for(lambda: stand_in.started(), "mkfs to hang on the stuck volume")
        # Not a synchronisation: a stretch in which two probes find the pool
        # answering, and READY=1 must still wait for the chain.
        time.sleep(2 * PROBE_EVERY_S + 1)
        assert not d.saw("READY=1"), "READY=1 while the chain runs on a pool that answers"
        switchable_pool.rule(switchable_pool.dead_rule)
        t0 = time.monotonic()
        wait_for(lambda: not switchable_pool.answers(), "the pool to stop answering", 60)
        took = ready_within(d, t0, OBSERVE_S + PROBE_EVERY_S + 10.0)
        print(f"READY=1 {took:.1f} s after its pool stopped answering")
        assert stand_in.alive(), "the chain ended: READY=1 proves nothing"
        said = [m for m in d.drain() if m.startswith("STATUS=ready;")]
        assert said and stuck in said[-1] and "did not answer within" in said[-1], d.drain()
        assert f"{stuck} not waited for: its chain runs on" in d.log.read_text()
    finally:
        switchable_pool.rule("replicated_rule")
        wait_for(switchable_pool.answers, "the pool to answer again", 120)
        stand_in.kill_all()
    assert d.stop() == 0
    assert node.cli("release")[0] == 0
    f.unlink()
