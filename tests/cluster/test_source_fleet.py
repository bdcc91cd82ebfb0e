"""Issue 27: a fleet in one repository, a volume moved between nodes.

One signed commit moves a volume's file from nodes/a/ to nodes/b/. Two
daemons (nodes a and b: two state dirs, one cluster) follow the repository
every second, each on its own. Node B must not map the image while A still
holds its claim, and must take it as soon as A lets go, with A's data,
without waiting for its resync (an hour here) or its backoff: the checks of
test_move.py, for a move that arrives through git.

A's sync is held back (the test holds A's source lock, as a running CLI
`source sync` would) until B, which applied the commit, has been refused
by A's claim three times: B's backoff is then 4-8 s, so a B that maps
within FOLLOWS_WITHIN_S of A's release was woken by the claim poll, and
the order of the two nodes' syncs is not left to the phase of their
intervals. Each node keeps an image-only volume in its path, so that the
move is not a mass removal on A.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import NodeUnderTest
from source_signing import Signing
from test_daemon import Daemon, wait_for
from test_move import FOLLOWS_WITHIN_S, HELD_REFUSALS, Sampler, node_b, refusals, steps
from test_source import Repo, volume

from reconciler.source.layout import Layout

pytestmark = pytest.mark.ceph

NODES = ("a", "b")
HOLD_LOCK_S = 120.0  # A's sync waits this long for the test's hold of its lock


def anchor(node: NodeUnderTest, name: str) -> str:
    """An image-only volume: it keeps a node's path from emptying."""
    node.images.add(name)
    return (f"apiVersion: rbd-reconciler/v1\nkind: Volume\nmetadata:\n  name: {name}\n"
            f"spec:\n  image: {{pool: {node.cluster.pool}, size: 1Mi}}\n")


@dataclass
class Fleet:
    repo: Repo
    nodes: dict[str, NodeUnderTest]
    daemons: dict[str, Daemon]
    first: str  # the commit the daemons started from

    def revision(self, n: str) -> str | None:
        _, doc = self.nodes[n].cli_json("source", "status")
        return (doc.get("applied") or {}).get("revision")


@pytest.fixture
def fleet(node: NodeUnderTest, tmp_path: Path) -> Iterator[Fleet]:
    node.config.write_text(re.sub(r"(?m)^nodeName: .*$", "nodeName: a",
                                  node.config.read_text()) + "resyncSeconds: 3600\n")
    nodes = {"a": node, "b": node_b(node, tmp_path, "b")}
    daemons: dict[str, Daemon] = {}
    with Signing(tmp_path / "signer") as signer:
        repo = Repo(tmp_path, signer, signer.ssh_key("ops"))
        for under in nodes.values():
            repo.follow(under, interval=1)
        first = repo.push("the fleet", {
            **{f"nodes/{n}/anchor.yaml": anchor(node, node.name(f"anchor-{n}")) for n in NODES},
            f"nodes/a/{node.name('moved')}.yaml": volume(node, node.name("moved"), "64Mi")})
        try:
            for n, under in nodes.items():
                daemons[n] = Daemon(under, args=("--log-format", "json"))
            yield Fleet(repo, nodes, daemons, first)
        finally:
            for d in daemons.values():
                if d.proc.poll() is None:
                    d.stop()
            for under in nodes.values():  # whichever holds it now
                under.cli("release", "--all")


def test_a_commit_moves_a_volume_to_the_node_that_waited_for_the_claim(
        node: NodeUnderTest, fleet: Fleet) -> None:
    a, b = fleet.daemons["a"], fleet.daemons["b"]
    name = node.name("moved")
    for n in NODES:
        fleet.daemons[n].wait_phase(node.name(f"anchor-{n}"), "Created")
    s = a.wait_phase(name, "Published")
    assert s["sourceRevision"] == f"main@sha1:{fleet.first}", s
    token = uuid.uuid4().hex
    (node.srv / name / "token").write_text(token)  # no fsync: the release must carry it over
    seen_a, seen_b = len(steps(a, name)), len(steps(b, name))
    before = refusals(b, name)
    fuse_dirs = {n: f"{u.state}/fuse/" for n, u in fleet.nodes.items()}
    with Sampler(fuse_dirs) as sampler:
        with Layout(fleet.nodes["a"].state / "source").locked(HOLD_LOCK_S):
            moved = fleet.repo.push("move the volume to b", {
                f"nodes/a/{name}.yaml": None, f"nodes/b/{name}.yaml": volume(node, name, "64Mi")})
            wait_for(lambda: fleet.revision("b") == f"main@sha1:{moved}",
                     "b to apply the commit on its own")
            wait_for(lambda: refusals(b, name) >= before + HELD_REFUSALS,
                     f"b refused {HELD_REFUSALS} times while a holds the claim")
            assert not [st for st in steps(b, name)[seen_b:] if st.step == "map"]
            assert fleet.revision("a") == f"main@sha1:{fleet.first}"
        # A's follower takes the lock within its poll, syncs, and releases.
        sb = b.wait_phase(name, "Published", timeout=60)
        sa = a.wait_phase(name, "Released", timeout=60)
    unmaps = [st for st in steps(a, name)[seen_a:] if st.step == "unmap"]
    maps = [st for st in steps(b, name)[seen_b:] if st.step == "map"]
    assert [st.result for st in unmaps] == ["changed"], unmaps
    assert [st.result for st in maps] == ["changed"], maps
    released, mapped = unmaps[0], maps[0]
    # The history: A's unmap (its claim dropped with it) ended before B's
    # map began (2 ms: both ends are logged in ms); never both mapped.
    assert released.end <= mapped.start + 0.002, (released, mapped)
    assert not sampler.both and sampler.samples > 10, (sampler.both, sampler.samples)
    assert (node.srv / name / "token").read_text() == token
    lag = mapped.start - released.end
    print(f"a released at its sync; b mapped {lag:.3f} s after")
    assert lag < FOLLOWS_WITHIN_S, lag
    # Each node's status names the revision it converged from.
    want = f"main@sha1:{moved}"
    assert (sa["sourceRevision"], sb["sourceRevision"]) == (want, want), (sa, sb)
    for n in NODES:
        assert fleet.revision(n) == want
        wait_for(lambda n=n: fleet.daemons[n].status(node.name(f"anchor-{n}")).get(
            "phase") == "Created", f"{n}'s anchor to stay Created")
