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

import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import NodeUnderTest
from test_daemon import Daemon, spec, start, wait_for  # noqa: F401 - start: the fixture

pytestmark = pytest.mark.ceph

OBSERVE_S = 5.0  # observeTimeoutSeconds (the default, said out loud)
BOUND_S = OBSERVE_S + 10.0  # the bound


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
        raise AssertionError(f"no READY=1 within {bound:g} s of the start; notify "
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
