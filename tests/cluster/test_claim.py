"""Issue 14.1 on the real cluster: one writer per image.

Two nodes (two configs, two state dirs, one cluster) map at the same moment:
exactly one wins, every time. A takeover fences the old holder (blocklist)
before claiming, and the old client's writes then fail. Each test failed on
the code before the claim (a read of image-meta in the planner).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import rbd
from conftest import NodeUnderTest
from test_daemon import wait_for

from reconciler.cli import main as cli
from reconciler.drivers import fusemapper
from reconciler.facts import meta
from reconciler.facts.claim import Claim, parse

pytestmark = pytest.mark.ceph

ROOT = Path(__file__).resolve().parents[2]
TRIALS = 20
# Imports everything an apply needs, says it is ready, then waits for the
# shared start signal (a file) and runs the CLI: both nodes start together.
BARRIER = """
import sys, time
from pathlib import Path
import rados, rbd
from reconciler import engine
from reconciler.apply import claims
from reconciler.apply import runner as apply
from reconciler.cli import main as cli
from reconciler.drivers import fusemapper
from reconciler.observe import node as observe
from reconciler.plan import planner as plan
Path(sys.argv[1]).touch()
deadline = time.monotonic() + 60
while not Path(sys.argv[2]).exists():
    if time.monotonic() > deadline:
        sys.exit(99)
    time.sleep(0.001)
sys.exit(cli.main(sys.argv[3:]))
"""


@dataclass
class Node:
    name: str
    config: Path
    root: Path

    def cli(self, *args: str) -> tuple[int, str]:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = cli.main(["--config", str(self.config), *args])
        return rc, out.getvalue()

    def mounted(self) -> list[str]:
        return [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()
                if line.split()[4].startswith(str(self.root))]


def map_only(pool: str, image: str) -> str:
    return (f"apiVersion: rbd-reconciler/v1\nkind: Volume\nmetadata:\n  name: {image}\n"
            f"spec:\n  image:\n    pool: {pool}\n    name: {image}\n  map: {{mapper: fuse}}\n")


def second_node(node: NodeUnderTest, tmp_path: Path, name: str = "node-b") -> Node:
    other = tmp_path / name
    desired, state, srv = other / "desired", other / "state", other / "srv"
    for d in (desired, state, srv):
        d.mkdir(parents=True)
    cfg = node.config.read_text().replace(str(node.desired), str(desired)) \
        .replace(str(node.state), str(state)).replace(str(node.srv), str(srv)) \
        .replace("nodeName: test-node", f"nodeName: {name}")
    (other / "config.yaml").write_text(cfg)
    return Node(name, other / "config.yaml", other)


@pytest.fixture
def two_nodes(node: NodeUnderTest, tmp_path: Path) -> Iterator[tuple[Node, Node, str]]:
    """Nodes A and B, each with a map-only volume of the same existing image."""
    image = node.name("shared")
    with node.cluster.client() as c, c.open_ioctx(node.cluster.pool) as ioctx:
        rbd.RBD().create(ioctx, image, 64 * 2**20, old_format=False,
                         features=rbd.RBD_FEATURE_LAYERING | rbd.RBD_FEATURE_EXCLUSIVE_LOCK)
    node.images.add(image)
    a = Node("test-node", node.config, node.root / "state")
    b = second_node(node, tmp_path)
    (node.desired / f"{image}.yaml").write_text(map_only(node.cluster.pool, image))
    (b.root / "desired" / f"{image}.yaml").write_text(map_only(node.cluster.pool, image))
    try:
        yield a, b, image
    finally:
        b.cli("release")
        a.cli("release")
        fusemapper.reap_fuse_children()
        assert not b.mounted(), b.mounted()


def watchers(node: NodeUnderTest, image: str) -> list[str]:
    with node.cluster.client() as c, c.open_ioctx(node.cluster.pool) as ioctx, \
            rbd.Image(ioctx, image, read_only=True) as img:
        return [w["addr"] for w in img.watchers_list()]


def claim_of(node: NodeUnderTest, image: str) -> Claim | None:
    with node.cluster.client() as c, c.open_ioctx(node.cluster.pool) as ioctx, \
            rbd.Image(ioctx, image, read_only=True) as img:
        return parse(dict(img.metadata_list()).get(meta.HOLDER))


def mon(node: NodeUnderTest, cmd: dict[str, object]) -> str:
    with node.cluster.client() as c:
        rc, out, err = c.mon_command(json.dumps(cmd), b"", timeout=30)
    assert rc == 0, err
    return out.decode()


def blocklisted(node: NodeUnderTest) -> dict[str, str]:
    """addr -> until (UTC, as Ceph prints it)."""
    out = mon(node, {"prefix": "osd blocklist ls", "format": "json"})
    return {e["addr"]: e["until"] for e in json.JSONDecoder().raw_decode(out)[0]}


def race(nodes: list[Node], tmp_path: Path, trial: int) -> list[tuple[int, dict]]:
    """Both nodes' `apply` released at the same moment; their (rc, json)."""
    ready = [tmp_path / f"ready-{trial}-{n.name}" for n in nodes]
    go = tmp_path / f"go-{trial}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", BARRIER, str(r), str(go),
                               "--config", str(n.config), "apply", "-o", "json"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
             for n, r in zip(nodes, ready, strict=True)]
    try:
        wait_for(lambda: all(r.exists() for r in ready), "both CLIs ready", 60)
        go.touch()
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [(p.returncode, json.loads(out)) for p, (out, _) in zip(procs, outs, strict=True)]


def test_two_nodes_mapping_at_once_exactly_one_wins(
        node: NodeUnderTest, two_nodes: tuple[Node, Node, str], tmp_path: Path) -> None:
    a, b, image = two_nodes
    for trial in range(TRIALS):
        results = race([a, b], tmp_path, trial)
        winners = [n for n, (rc, _) in zip((a, b), results, strict=True) if rc == 0]
        assert len(winners) == 1, f"trial {trial}: {results}"
        winner = winners[0]
        loser, (_, lost) = next((n, r) for n, r in zip((a, b), results, strict=True)
                                if n is not winner)
        error = lost["volumes"][0]["error"]
        assert f"claimed by node {winner.name}" in error or \
            f"mapped by {winner.name}" in error, f"trial {trial}: {error}"
        assert len(watchers(node, image)) == 1, f"trial {trial}"
        assert not [m for m in loser.mounted() if "fuse" in m], f"trial {trial}"
        held = claim_of(node, image)
        assert held is not None and held.node == winner.name
        assert held.clients == tuple(watchers(node, image))
        # Giving it back drops the claim: the other node may map it next time.
        assert winner.cli("release")[0] == 0
        assert claim_of(node, image) is None
        wait_for(lambda: not watchers(node, image), "the winner's watch to go", 30)


def test_release_drops_the_claim_and_a_stale_own_claim_never_refuses(
        node: NodeUnderTest, two_nodes: tuple[Node, Node, str]) -> None:
    a, b, image = two_nodes
    assert a.cli("apply")[0] == 0
    assert claim_of(node, image).node == "test-node"  # type: ignore[union-attr]
    rc, out = b.cli("plan", "-o", "json")
    assert rc == 1 and "test-node" in json.loads(out)["volumes"][0]["refusal"]
    assert a.cli("release")[0] == 0
    assert claim_of(node, image) is None  # before the fix: still "test-node"
    wait_for(lambda: not watchers(node, image), "A's watch to go", 30)
    # Our own claim left behind with nothing mapped (an unmap that could not
    # reach Ceph): a release pass drops it, and it never refuses us.
    with node.cluster.client() as c, c.open_ioctx(node.cluster.pool) as ioctx, \
            rbd.Image(ioctx, image) as img:
        img.metadata_set(meta.HOLDER, Claim("test-node", ("127.0.0.1:0/1",)).encode())
    rc, out = a.cli("release", "-o", "json")
    assert rc == 0 and [s["action"] for s in json.loads(out)["volumes"][0]["steps"]] == [
        "release claim"]
    assert claim_of(node, image) is None
    with node.cluster.client() as c, c.open_ioctx(node.cluster.pool) as ioctx, \
            rbd.Image(ioctx, image) as img:
        img.metadata_set(meta.HOLDER, "test-node")  # an earlier version's record
    assert a.cli("apply")[0] == 0
    assert claim_of(node, image).node == "test-node"  # type: ignore[union-attr]


def test_takeover_fences_the_old_holder(
        node: NodeUnderTest, two_nodes: tuple[Node, Node, str], tmp_path: Path) -> None:
    a, b, image = two_nodes
    assert a.cli("apply")[0] == 0
    old = watchers(node, image)
    assert claim_of(node, image) == Claim("test-node", tuple(old))
    device = json.loads(a.cli("status", "-o", "json")[1])["volumes"][0]["device"]
    assert device
    helper = fusemapper._fuse_children[str(node.state / "fuse" / f"{node.cluster.pool}@{image}")]
    helper.send_signal(signal.SIGSTOP)  # node A hangs: alive, silent
    try:
        fence_and_take_over(node, a, b, image, old, helper, device, tmp_path)
    finally:
        # A fenced helper never finishes its writes (a release would wait on
        # them): stop it, as an operator would.
        helper.send_signal(signal.SIGCONT)
        helper.kill()
        helper.wait(timeout=30)
    assert a.cli("release")[0] == 0
    assert claim_of(node, image).node == "node-b"  # type: ignore[union-attr]
    mon(node, {"prefix": "osd blocklist", "blocklistop": "rm", "addr": old[0]})


def fence_and_take_over(node: NodeUnderTest, a: Node, b: Node, image: str, old: list[str],
                        helper: subprocess.Popen[bytes], device: str, tmp_path: Path) -> None:
    rc, out = b.cli("plan", "-o", "json")
    refusal = json.loads(out)["volumes"][0]["refusal"]
    assert rc == 1 and "claimed by node test-node" in refusal and "takeover" in refusal
    # Without the confirmation it only says what it would do.
    rc, out = b.cli("takeover", image)
    assert rc == 1 and old[0] in out and "--yes-i-am-sure" in out
    assert claim_of(node, image).node == "test-node"  # type: ignore[union-attr]
    assert old[0] not in blocklisted(node)

    rc, out = b.cli("takeover", image, "--yes-i-am-sure")
    assert rc == 0, out
    assert old[0] in blocklisted(node)
    # Fenced for weeks, not Ceph's default hour: a node cut off for an
    # afternoon must not come back able to write.
    until = datetime.fromisoformat(blocklisted(node)[old[0]].replace("+0000", "+00:00"))
    assert until - datetime.now(UTC) > timedelta(days=7), until
    assert claim_of(node, image) == Claim("node-b", (), "test-node", tuple(old))
    rc, out = b.cli("explain", image)
    assert f"blocklisted: {old[0]}" in out and "took it over from test-node" in out
    assert b.cli("apply")[0] == 0
    new = watchers(node, image)
    assert len(new) == 1 and new != old
    assert claim_of(node, image).clients == tuple(new)  # type: ignore[union-attr]
    # Node A comes back: its client is fenced, its writes do not land.
    helper.send_signal(signal.SIGCONT)
    pattern = tmp_path / "pattern"
    pattern.write_bytes(b"A" * 4096)
    dd = subprocess.run(["dd", f"if={pattern}", f"of={device}", "bs=4096", "count=1",
                         "oflag=direct", "conv=fsync"], capture_output=True, timeout=60)
    # Usually the write fails (EIO). Sometimes, under load, dd "succeeds": the
    # helper took the write into librbd's cache before it heard of its fence,
    # and its flush's error does not reach dd. What fencing promises is that
    # nothing lands, so: the helper gone (nothing of it can land later), then
    # the image read.
    helper.kill()
    helper.wait(timeout=30)
    with node.cluster.client() as c, c.open_ioctx(node.cluster.pool) as ioctx, \
            rbd.Image(ioctx, image, read_only=True) as img:
        assert img.read(0, 4096) != b"A" * 4096, f"a fenced write landed (dd: {dd.stderr!r})"
    rc, out = a.cli("plan", "-o", "json")
    refusal = json.loads(out)["volumes"][0]["refusal"]
    assert rc == 1 and "claimed by node node-b" in refusal and "release" in refusal
    rc, out = a.cli("explain", image)
    assert f"blocklisted: {old[0]}" in out


def test_takeover_bad_input_changes_nothing(
        node: NodeUnderTest, two_nodes: tuple[Node, Node, str],
        capsys: pytest.CaptureFixture[str]) -> None:
    a, b, image = two_nodes
    assert b.cli("takeover", "no-such-volume", "--yes-i-am-sure")[0] == 1
    assert "no volume 'no-such-volume'" in capsys.readouterr().err
    assert b.cli("takeover", image, "--yes-i-am-sure")[0] == 1  # nobody holds it
    assert "not claimed by any node" in capsys.readouterr().err
    assert claim_of(node, image) is None
    assert a.cli("apply")[0] == 0
    rc, out = a.cli("takeover", image, "--yes-i-am-sure")
    assert rc == 0 and "already claimed by this node" in out
    assert claim_of(node, image).taken_from is None  # type: ignore[union-attr]


def test_a_failed_undo_keeps_the_claim_of_an_image_still_mapped(
        node: NodeUnderTest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stage fails after the map and the undo cannot unmap: the image is
    still mapped here, so its claim must stay (released, another node could
    map it beside our live helper)."""
    from reconciler.drivers import fs

    image = node.name("undo")
    node.write(image, f"  image: {{pool: {node.cluster.pool}, size: 64Mi}}\n"
                      f"  map: {{mapper: fuse}}\n  stage: {{fsType: ext4}}\n")

    def mkfs_fails(*_: object, **__: object) -> None:
        raise RuntimeError("mkfs fails (test)")

    def unmap_fails(*_: object, **__: object) -> None:
        raise RuntimeError("unmap fails (test)")

    monkeypatch.setattr(fs.Filesystems, "mkfs", mkfs_fails)
    monkeypatch.setattr(fusemapper.FuseMapper, "unmap", unmap_fails)
    out = node.apply()
    assert out["rc"] == 1
    undone = out["volumes"][0]["undone"]
    assert any("FAILED" in u and u.startswith("unmap") for u in undone), undone
    assert claim_of(node, image) is not None and claim_of(node, image).node == "test-node"
    monkeypatch.undo()
    assert node.cli("release")[0] == 0
    assert claim_of(node, image) is None


def test_a_fenced_node_is_refused_naming_the_fence(node: NodeUnderTest, tmp_path: Path) -> None:
    """Node A is taken over while its helper hangs: its client is blocklisted
    and its mounted device no longer answers a probe. A's `plan` and `apply`
    refuse naming the fence (the way out is `release`), not `UNKNOWN:
    cannot read /dev/loopN`, which says nothing of what to do."""
    image = node.name("fenced")
    node.write(image, f"  image: {{pool: {node.cluster.pool}, size: 64Mi}}\n"
                      f"  map: {{mapper: fuse}}\n  stage: {{fsType: ext4}}\n"
                      f"  publish:\n    - path: {node.srv / 'app'}\n")
    node.config.write_text(node.config.read_text() + "observeTimeoutSeconds: 2\n")
    a = Node("test-node", node.config, node.root / "state")
    b = second_node(node, tmp_path)
    (b.root / "desired" / f"{image}.yaml").write_text(map_only(node.cluster.pool, image))
    assert a.cli("apply")[0] == 0
    old = watchers(node, image)
    helper = fusemapper._fuse_children[str(node.state / "fuse" / f"{node.cluster.pool}@{image}")]
    helper.send_signal(signal.SIGSTOP)  # node A hangs: alive, silent
    try:
        assert b.cli("takeover", image, "--yes-i-am-sure")[0] == 0
        assert old[0] in blocklisted(node)
        helper.send_signal(signal.SIGCONT)  # A comes back, fenced
        fence = "claimed by node node-b, which took it over from test-node"
        rc, out = a.cli("plan")
        assert rc == 1 and "UNKNOWN" not in out and f"REFUSED: rbd/{image} is mapped here " \
            f"but is {fence}" in out and "`rbd-reconciler release`" in out, out
        rc, out = a.cli("apply", "-o", "json")
        [vol] = json.loads(out)["volumes"]
        assert rc == 1 and vol["status"] == "failed" and fence in vol["error"], out
        assert not vol["steps"]
    finally:
        helper.send_signal(signal.SIGCONT)
        helper.kill()  # a fenced helper never finishes its writes: stopped, as by an operator
        helper.wait(timeout=30)
    assert a.cli("release")[0] == 0
    assert b.cli("release")[0] == 0
    assert claim_of(node, image) is None
    mon(node, {"prefix": "osd blocklist", "blocklistop": "rm", "addr": old[0]})
