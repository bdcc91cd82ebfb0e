"""`recover` on the real cluster (rbd-fuse here; krbd and rbd-nbd in the VM:
tests/kernel/test_partition.py): a node fenced by another's takeover is
reported FENCED with the holder and the blocklist entry, and taken down by
`recover` only once nothing uses the volume, then left to its new holder or
claimed back."""

from __future__ import annotations

import contextlib
import io
import json
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import NodeUnderTest
from test_claim import Node, blocklisted, claim_of, mon, second_node, watchers

from reconciler.drivers import fusemapper

pytestmark = pytest.mark.ceph


def run(n: Node, *args: str) -> tuple[int, str]:
    """The CLI, stdout and stderr together (recover's refusals go to stderr)."""
    from reconciler.cli import main as cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = cli.main(["--config", str(n.config), *args])
    return rc, out.getvalue()


@pytest.fixture
def fenced(node: NodeUnderTest, tmp_path: Path) -> Iterator[tuple[Node, Node, str, list[str]]]:
    """Node A published a volume; node B took it over while A's helper hung;
    A's helper, fenced, is then stopped (as an operator would)."""
    image = node.name("rec")
    node.write(image, f"  image: {{pool: {node.cluster.pool}, size: 64Mi}}\n"
                      f"  map: {{mapper: fuse}}\n  stage: {{fsType: ext4}}\n"
                      f"  publish:\n    - path: {node.srv / 'app'}\n")
    node.config.write_text(node.config.read_text() + "observeTimeoutSeconds: 2\n")
    a = Node("test-node", node.config, node.root / "state")
    b = second_node(node, tmp_path)
    (b.root / "desired" / f"{image}.yaml").write_text(
        f"apiVersion: rbd-reconciler/v1\nkind: Volume\nmetadata:\n  name: {image}\n"
        f"spec:\n  image: {{pool: {node.cluster.pool}}}\n")
    assert run(a, "apply")[0] == 0
    (node.srv / "app" / "kept").write_text("written before the fence")
    subprocess.run(["sync"], check=True, timeout=60)
    old = watchers(node, image)
    helper = fusemapper._fuse_children[str(node.state / "fuse" / f"{node.cluster.pool}@{image}")]
    helper.send_signal(signal.SIGSTOP)
    try:
        assert run(b, "takeover", image, "--yes-i-am-sure")[0] == 0
    finally:
        helper.send_signal(signal.SIGCONT)
        helper.kill()
        helper.wait(timeout=30)
    try:
        yield a, b, image, old
    finally:
        a.cli("release")
        b.cli("release")
        for addr in old:
            mon(node, {"prefix": "osd blocklist", "blocklistop": "rm", "addr": addr})


def test_fenced_is_reported_with_the_holder_and_the_blocklist_entry(
        node: NodeUnderTest, fenced: tuple[Node, Node, str, list[str]]) -> None:
    a, _, image, old = fenced
    assert set(old) <= set(blocklisted(node))
    rc, out = run(a, "status", "-o", "json")
    [row] = json.loads(out[:out.rindex("}") + 1])["volumes"]
    assert rc == 1 and row["phase"] == "FENCED", row
    assert row["fence"]["reason"] == "TakenOver" and row["fence"]["holder"] == "node-b"
    assert set(row["fence"]["blocklisted"]) == set(old)
    assert isinstance(row["fence"]["readOnly"], bool)
    rc, out = run(a, "explain", image)
    assert rc == 1 and "FENCED:" in out and f"blocklisted: {old[0]} until" in out, out


def test_recover_refuses_while_a_process_uses_the_volume_then_leaves_it(
        node: NodeUnderTest, fenced: tuple[Node, Node, str, list[str]]) -> None:
    a, _, image, _ = fenced
    before = sorted(node.mounts())
    sleeper = subprocess.Popen(["sleep", "600"], cwd=node.srv / "app")
    try:
        rc, out = run(a, "recover", image, "--leave")
        assert rc == 1 and f"pid {sleeper.pid} (sleep): working directory" in out, out
        assert sorted(node.mounts()) == before  # nothing was changed
    finally:
        sleeper.kill()
        sleeper.wait()
    rc, out = run(a, "recover", image, "--leave")
    assert rc == 0 and "left to its holder" in out, out
    assert not node.mounts()  # publish, staging and the rbd-fuse mount all gone
    assert claim_of(node, image).node == "node-b"  # type: ignore[union-attr]
    rc, out = run(a, "recover", image, "--leave")  # nothing fenced any more
    assert rc == 1 and "not fenced" in out, out


def test_recover_reclaims_for_a_node_that_keeps_the_volume(
        node: NodeUnderTest, fenced: tuple[Node, Node, str, list[str]]) -> None:
    a, _, image, _ = fenced
    assert run(a, "recover", image, "--reclaim")[0] == 1  # --yes-i-am-sure: it fences B
    rc, out = run(a, "recover", image, "--reclaim", "--yes-i-am-sure")
    assert rc == 0 and "claimed by it" in out, out
    assert claim_of(node, image).node == "test-node"  # type: ignore[union-attr]
    assert run(a, "apply")[0] == 0
    assert (node.srv / "app" / "kept").read_text() == "written before the fence"


def test_recover_says_what_it_needs(node: NodeUnderTest) -> None:
    image = node.name("ok")
    node.write(image, f"  image: {{pool: {node.cluster.pool}, size: 16Mi}}\n"
                      f"  map: {{mapper: fuse}}\n")
    a = Node("test-node", node.config, node.root / "state")
    assert run(a, "apply")[0] == 0
    rc, out = run(a, "recover", image)
    assert rc == 1 and "--leave" in out and "--reclaim" in out
    rc, out = run(a, "recover", image, "--leave")
    assert rc == 1 and "it is not fenced (phase MAPPED)" in out, out
    assert run(a, "recover", "no-such", "--leave")[0] == 1
