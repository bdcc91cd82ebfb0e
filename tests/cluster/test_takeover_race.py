"""Issue 26: a takeover fences every client the old holder has when the claim
is swapped, not only those it saw at the start.

The old holder is meant to be gone, but may be hung and come back while the
takeover runs. Two real interleavings, each on two nodes of one cluster:

- while the takeover waits for the fenced clients' watches to go, node A's
  helper having died, A maps the image again (a new client, recorded in its
  claim). Before: the swap found the claim changed and gave up ("nothing
  taken"), with A's new client unfenced and writing;
- a map node A began before the swap brings a client right after it.
  Before: nobody looked again, and that client was never fenced.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest
from conftest import NodeUnderTest
from test_claim import Node, blocklisted, claim_of, mon, two_nodes, watchers  # noqa: F401

from reconciler.apply import claims
from reconciler.drivers import fusemapper
from reconciler.plan import volumeview

pytestmark = pytest.mark.ceph

# A Ceph client that keeps the image open read-write (a watcher), until killed.
OPEN_RW = """
import sys, time, rados, rbd
cluster = rados.Rados(conffile=sys.argv[1], rados_id=sys.argv[2], conf={"keyring": sys.argv[3]})
cluster.connect(timeout=30)
ioctx = cluster.open_ioctx(sys.argv[4])
image = rbd.Image(ioctx, sys.argv[5])
print("open", flush=True)
sys.stdin.read()
"""


def helper_of(node: NodeUnderTest, image: str) -> subprocess.Popen[bytes]:
    return fusemapper._fuse_children[str(node.state / "fuse" / f"{node.cluster.pool}@{image}")]


@pytest.fixture
def fenced(node: NodeUnderTest) -> Iterator[set[str]]:
    """Addresses to take off the blocklist after the test."""
    addrs: set[str] = set()
    yield addrs
    for addr in sorted(addrs):
        mon(node, {"prefix": "osd blocklist", "blocklistop": "rm", "addr": addr})


def test_a_client_the_holder_maps_while_being_fenced_is_fenced_too(
        node: NodeUnderTest, two_nodes: tuple[Node, Node, str], fenced: set[str],  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    a, b, image = two_nodes
    assert a.cli("apply")[0] == 0
    first = watchers(node, image)
    fenced.update(first)
    remapped: list[str] = []
    real_wait = claims.wait_watchers_gone

    def meanwhile(cluster: object, pool: str, img: str, addrs: set[str],
                  timeout: float = 30.0) -> tuple[str, ...]:
        if not remapped:  # node A, still alive: its helper died, its next apply maps again
            helper = helper_of(node, image)
            helper.kill()
            helper.wait(timeout=30)
            # A node of today sees its client blocklisted and maps nothing
            # (Fenced); one that does not look (an older version, or one that
            # read Ceph's blocklist an instant before the fence) maps again.
            with monkeypatch.context() as m:
                m.setattr(volumeview, "fence_of", lambda *_a, **_k: None)
                assert a.cli("apply")[0] == 0
            remapped.extend(claim_of(node, image).clients)  # type: ignore[union-attr]
            fenced.update(remapped)
        return real_wait(cluster, pool, img, addrs, timeout)  # type: ignore[arg-type]

    monkeypatch.setattr(claims, "wait_watchers_gone", meanwhile)
    try:
        rc, out = b.cli("takeover", image, "--yes-i-am-sure")
        assert remapped and set(remapped).isdisjoint(first), remapped
        assert rc == 0, out  # before: "the claim changed meanwhile; nothing taken"
        assert set(remapped) <= set(blocklisted(node)), out
        held = claim_of(node, image)
        assert held is not None and held.node == "node-b"
        assert set(first) | set(remapped) <= set(held.fenced)
    finally:
        helper = helper_of(node, image)
        helper.kill()  # fenced now: never finishes its writes; stopped, as by an operator
        helper.wait(timeout=30)


def test_a_client_that_appears_as_the_claim_is_swapped_is_fenced(
        node: NodeUnderTest, two_nodes: tuple[Node, Node, str], fenced: set[str],  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    a, b, image = two_nodes
    assert a.cli("apply")[0] == 0
    first = watchers(node, image)
    fenced.update(first)
    late: list[subprocess.Popen[str]] = []
    newcomers: list[str] = []
    real_replace = claims.replace

    def swap(*args: object) -> bool:
        swapped = real_replace(*args)  # type: ignore[arg-type]
        if swapped and not late:  # a map node A began before the swap comes up now
            c = node.cluster
            late.append(subprocess.Popen(
                [sys.executable, "-c", OPEN_RW, str(c.conf), c.user, str(c.keyring), c.pool,
                 image], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
            assert late[0].stdout is not None and late[0].stdout.readline() == "open\n"
            newcomers.extend(set(watchers(node, image)) - set(first))
            fenced.update(newcomers)
        return swapped

    monkeypatch.setattr(claims, "replace", swap)
    try:
        rc, out = b.cli("takeover", image, "--yes-i-am-sure")
        assert len(newcomers) == 1, newcomers
        assert rc == 0, out
        assert newcomers[0] in blocklisted(node), out  # before: never fenced
        held = claim_of(node, image)
        assert held is not None and held.node == "node-b" and newcomers[0] in held.fenced
        assert "fenced after the claim was swapped" in out
    finally:
        for p in late:
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=30)
        helper = helper_of(node, image)
        helper.kill()  # fenced: stopped, as by an operator
        helper.wait(timeout=30)
