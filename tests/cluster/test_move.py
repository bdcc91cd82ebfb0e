"""Issue 27: a volume moved between two nodes.

One commit moves a volume's file from nodes/a/ to nodes/b/; each node's
checkout applies it, which is the same event as the file leaving one
daemon's desired directory and arriving in the other's. Two daemons (two
node names, two state dirs, one cluster), the same file, the same publish
path: node B must not map the image while A holds its claim, and must take
it as soon as A lets go, with A's data, long before its resync (an hour
here: only the claim poll can explain B acting).

Each move is checked from the history: A's unmap (its claim dropped with
it) logged before B's map started, a sampler that never saw both nodes'
rbd-fuse mappings at once, and the token written through A's publish read
back through B's. The held moves add B's file first and take A's away only
after B was refused three times: B's backoff is then 4-8 s, so a B that
follows within seconds of A's release was woken by the poll.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest
from conftest import NodeUnderTest
from test_daemon import Daemon, wait_for
from test_lifecycle import fs_spec

pytestmark = pytest.mark.ceph

# From the holder's release to the taker's map: measured 0.07-0.16 s with
# the claim poll (0.4 s in a held move); without it 1.0-1.9 s, and a held
# move waited out a backoff of 4-8 s (6.1 s measured).
FOLLOWS_WITHIN_S = 2.5
HELD_REFUSALS = 3
SAMPLE_S = 0.002


@dataclass
class Step:
    volume: str
    step: str
    result: str
    end: float  # epoch seconds, as logged (ms)
    ms: int

    @property
    def start(self) -> float:
        return self.end - self.ms / 1000


def steps(d: Daemon, name: str) -> list[Step]:
    out = []
    for line in d.log.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            rec = json.loads(line)
            if isinstance(rec, dict) and rec.get("volume") == name and "step" in rec:
                out.append(Step(name, rec["step"], rec["result"],
                                datetime.fromisoformat(rec["time"]).timestamp(),
                                int(rec["duration_ms"])))
    return out


def refusals(d: Daemon, name: str) -> int:
    """Chains of ``name`` refused because another node holds the claim."""
    n = 0
    for line in d.log.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            rec = json.loads(line)
            if (isinstance(rec, dict) and rec.get("volume") == name
                    and rec.get("result") == "failed" and "step" not in rec
                    and "is claimed by node" in rec.get("message", "")):
                n += 1
    return n


class Sampler:
    """Which node has the image mapped (its rbd-fuse mount), every 2 ms."""

    def __init__(self, fuse_dirs: dict[str, str]) -> None:
        self.fuse_dirs = fuse_dirs  # node -> its stateDir's fuse/ prefix
        self.both: list[float] = []
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            points = [line.split()[4] for line in
                      Path("/proc/self/mountinfo").read_text().splitlines()]
            mapped = {n for n, prefix in self.fuse_dirs.items()
                      if any(p.startswith(prefix) for p in points)}
            self.samples += 1
            if len(mapped) > 1:
                self.both.append(time.time())

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def node_b(a: NodeUnderTest, tmp_path: Path, name: str = "node-b") -> NodeUnderTest:
    """A second node (``name``) on the same cluster, sharing A's allowed
    root: the moved file publishes at the same path on either node."""
    root = tmp_path / name
    desired, state = root / "desired", root / "state"
    for d in (desired, state):
        d.mkdir(parents=True)
    cfg = a.config.read_text().replace(str(a.desired), str(desired)) \
        .replace(str(a.state), str(state))
    cfg = re.sub(r"(?m)^nodeName: .*$", f"nodeName: {name}", cfg)
    (root / "config.yaml").write_text(cfg)
    return NodeUnderTest(root, a.cluster, root / "config.yaml", desired, state, a.srv, a.tag,
                         images=a.images)  # one set: the node fixture removes them all


@pytest.fixture
def two_daemons(node: NodeUnderTest, tmp_path: Path
                ) -> Iterator[tuple[dict[str, NodeUnderTest], dict[str, Daemon]]]:
    node.config.write_text(node.config.read_text() + "resyncSeconds: 3600\n")
    b = node_b(node, tmp_path)
    nodes = {"test-node": node, "node-b": b}
    daemons: dict[str, Daemon] = {}
    for n, under in nodes.items():
        # A node whose last file goes is a checkout gone wrong to the
        # mass-removal guard (it holds the release): each keeps another.
        under.write(node.name(f"anchor-{n}"),
                    f"  image: {{pool: {node.cluster.pool}, size: 1Mi}}\n")
    try:
        for n, under in nodes.items():
            daemons[n] = Daemon(under, args=("--log-format", "json"))
        yield nodes, daemons
    finally:
        for d in daemons.values():
            if d.proc.poll() is None:
                d.stop()
        for under in nodes.values():  # whichever holds it now, the file may be anywhere
            under.cli("release", "--all")


def move(src: Path, dst: Path, order: str) -> None:
    if order == "rename":  # both directories change in one call
        src.rename(dst)
    elif order == "remove-first":
        text = src.read_text()
        src.unlink()
        dst.write_text(text)
    else:  # add-first
        dst.write_text(src.read_text())
        src.unlink()


@pytest.mark.ceph
def test_a_moved_volume_follows_its_file_after_the_old_node_lets_go(
        node: NodeUnderTest, two_daemons: tuple[dict[str, NodeUnderTest], dict[str, Daemon]]
) -> None:
    nodes, daemons = two_daemons
    name = node.name("moved")
    app = node.srv / "app"
    text = ("apiVersion: rbd-reconciler/v1\nkind: Volume\nmetadata:\n"
            f"  name: {name}\nspec:\n"
            + fs_spec(node.cluster.pool, "64Mi", "ext4", [(app, False)]))
    node.images.add(name)
    for n, d in daemons.items():
        d.wait_phase(node.name(f"anchor-{n}"), "Created")
    holder = "test-node"
    (nodes[holder].desired / f"{name}.yaml").write_text(text)
    daemons[holder].wait_phase(name, "Published")
    fuse_dirs = {n: f"{u.state}/fuse/" for n, u in nodes.items()}
    trials = [("rename", False), ("remove-first", False), ("add-first", False),
              ("rename", False), ("add-first", True), ("rename", False),
              ("add-first", True), ("remove-first", False)]
    report = []
    for i, (order, held) in enumerate(trials):
        taker = "node-b" if holder == "test-node" else "test-node"
        src = nodes[holder].desired / f"{name}.yaml"
        dst = nodes[taker].desired / f"{name}.yaml"
        token = uuid.uuid4().hex
        (app / "token").write_text(token)  # no fsync: the release must carry it over
        seen_a, seen_b = len(steps(daemons[holder], name)), len(steps(daemons[taker], name))
        with Sampler(fuse_dirs) as sampler:
            if held:
                before = refusals(daemons[taker], name)
                dst.write_text(src.read_text())
                wait_for(lambda t=taker, b=before: refusals(daemons[t], name) >= b + HELD_REFUSALS,
                         f"{taker} refused {HELD_REFUSALS} times while {holder} holds it")
                src.unlink()
            else:
                move(src, dst, order)
            t0 = time.time()
            daemons[taker].wait_phase(name, "Published", timeout=60)
            wait_for(lambda t=holder: daemons[t].status(name).get("phase") == "Released",
                     f"{holder} to report {name} released")
        unmaps = [s for s in steps(daemons[holder], name)[seen_a:] if s.step == "unmap"]
        maps = [s for s in steps(daemons[taker], name)[seen_b:] if s.step == "map"]
        assert [s.result for s in unmaps] == ["changed"], unmaps
        assert [s.result for s in maps] == ["changed"], maps
        released, mapped = unmaps[0], maps[0]
        # The history: the holder's unmap (the claim goes with it) ended
        # before the taker's map began (2 ms: both ends are logged in ms).
        assert released.end <= mapped.start + 0.002, (released, mapped)
        assert not sampler.both and sampler.samples > 10, (sampler.both, sampler.samples)
        assert (app / "token").read_text() == token
        lag = mapped.start - released.end
        report.append(f"{i}: {holder}->{taker} {order}{' held' if held else ''}: released "
                      f"{released.end - t0:+.3f} s, mapped {lag:.3f} s after")
        assert lag < FOLLOWS_WITHIN_S, report
        holder = taker
    print("\n".join(report))
