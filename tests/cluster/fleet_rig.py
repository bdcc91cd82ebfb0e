"""A fleet on one machine for issue 40's cluster tests and benchmark: N
daemons in waves following one signed repository (file://), each with its
own stateDir, control socket and Ceph user with the per-node caps of
docs/fleets.md "Keys", reporting into a pool of their own (the default
namespace). Volumes are image-only (fast to converge).

Imported by tests/cluster/test_fleet_rollout.py (its fixtures wrap
``fleet_rig``) and benchmarks/p21_rollout.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from conftest import NodeUnderTest
from source_signing import Signing
from test_daemon import Daemon
from test_move import node_b
from test_source import Repo
from test_source_fleet import anchor

from reconciler.drivers.fleetstore import NAMESPACE, FleetStore
from reconciler.facts.fleetreport import HEALTHY, Report
from reconciler.source.layout import Layout
from reconciler.spec.config import CephConfig
from reconciler.testing.devcluster import DevCluster

HEALTHY_S = 3
INTERVAL_S = 1
Waves = Sequence[Sequence[str]]


def fleet_yaml(waves: Waves, healthy: int = HEALTHY_S, stale: int = 60,
               max_unhealthy: int = 0, windows: str = "") -> str:
    """A fleet.yaml: wave i is ``wave-{i+1}``; ``windows``: the YAML list's
    items (each a line ``    - {...}``)."""
    lines = "\n".join(f"    - {{name: wave-{i}, nodes: [{', '.join(ns)}]}}"
                      for i, ns in enumerate(waves, 1))
    return (f"apiVersion: rbd-reconciler/v1\nkind: Rollout\nmetadata: {{name: test}}\n"
            f"spec:\n  waves:\n{lines}\n"
            f"  gate: {{healthySeconds: {healthy}, maxUnhealthy: {max_unhealthy}, "
            f"staleSeconds: {stale}}}\n" + (f"  windows:\n{windows}" if windows else ""))


def mon(cluster: DevCluster, cmd: dict, target: str | None = None) -> bytes:
    with cluster.client() as c:
        rc, out, err = (c.mon_command(json.dumps(cmd), b"", target=target) if target
                        else c.mon_command(json.dumps(cmd), b""))
    if rc != 0:
        raise AssertionError(f"ceph {cmd['prefix']}: {rc} {err}")
    return out


def node_caps(rbd_pool: str, pool: str, node: str, write: bool = True) -> list[str]:
    """docs/fleets.md "Keys": RBD on the volumes' pool, read every report,
    write only its own (``write`` False: its report writes refused)."""
    osd = f"profile rbd pool={rbd_pool}, allow r pool={pool} namespace={NAMESPACE}"
    if write:
        osd += f", allow rw pool={pool} namespace={NAMESPACE} object_prefix node/{node}/"
    return ["mon", "profile rbd", "osd", osd]


@dataclass
class Fleet:
    cluster: DevCluster
    repo: Repo
    waves: list[list[str]]
    nodes: dict[str, NodeUnderTest]
    daemons: dict[str, Daemon]
    anchors: dict[str, str]  # node -> its image-only volume
    pool: str  # the reports' own pool
    users: dict[str, str] = field(default_factory=dict)  # node -> its Ceph entity
    blocked: list[str] = field(default_factory=list)  # client addresses blocklisted

    @property
    def names(self) -> list[str]:
        return [n for wave in self.waves for n in wave]

    def files(self, **extra: str) -> dict[str, str]:
        """Each node's anchor volume file, and ``extra`` (path -> text)."""
        return {**{f"nodes/{n}/anchor.yaml": anchor(self.nodes[n], self.anchors[n])
                   for n in self.names}, **extra}

    def report(self, n: str) -> Report | None:
        """Node ``n``'s report as the fleet reads it (the test's key: ``n``'s
        own may be cut)."""
        admin = CephConfig(conf=str(self.cluster.conf), user=self.cluster.user,
                           keyring=str(self.cluster.keyring))
        with FleetStore(admin, self.pool) as store:
            return store.read_one(n)

    def healthy(self, n: str, commit: str) -> bool:
        """Whether ``n``'s report says ``commit`` applied and Healthy."""
        r = self.report(n)
        return r is not None and r.applied == commit and r.health == HEALTHY

    def applied(self, n: str) -> str | None:
        meta = Layout(self.nodes[n].state / "source").applied()
        return meta["commit"] if meta is not None else None

    def state(self, n: str) -> dict:
        return Layout(self.nodes[n].state / "source").read_state()

    def held_back(self, n: str) -> dict:
        return self.state(n).get("heldBack") or {}

    def applied_at(self, n: str) -> float:
        """When node ``n`` last switched: its ``current`` link's making (the
        state's lastAppliedAt is written after the link: it may lag)."""
        return os.lstat(self.nodes[n].state / "source" / "current").st_mtime

    def log(self, n: str) -> list[dict]:
        out = []
        for line in self.daemons[n].log.read_text().splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
        return out

    def first_seen_healthy(self, reader: str, n: str, commit: str) -> float | None:
        """When ``reader``'s gate first saw ``n`` report ``commit`` Healthy
        (its log: the gate logs each change of whom it waits for and why)."""
        seen = re.compile(rf"(?:for |, ){re.escape(n)} \(healthy for only ")
        for rec in self.log(reader):
            msg = rec.get("message", "")
            if msg.startswith(f"fleet: {commit[:12]} not applied yet") and seen.search(msg):
                return datetime.fromisoformat(rec["time"]).timestamp()
        return None

    def pause(self, n: str) -> None:
        os.kill(self.daemons[n].proc.pid, signal.SIGSTOP)

    def resume(self, n: str) -> None:
        if self.daemons[n].proc.poll() is None:
            os.kill(self.daemons[n].proc.pid, signal.SIGCONT)

    def cut(self, n: str) -> None:
        """Node ``n``'s key may no longer write its report (it still reads
        the others', and RBD works), and its
        open sessions are blocklisted: caps bind a session when it opens."""
        mon(self.cluster, {"prefix": "auth caps", "entity": self.users[n],
                           "caps": node_caps(self.cluster.pool, self.pool, n, write=False)})
        sessions = json.loads(mon(self.cluster, {"prefix": "sessions", "format": "json"},
                                  target="a"))
        for s in sessions:
            if s.get("entity_name") == self.users[n]:
                a = s["socket_addr"]
                addr = f"{a['addr']}/{a['nonce']}"
                mon(self.cluster, {"prefix": "osd blocklist", "blocklistop": "add",
                                   "addr": addr})
                self.blocked.append(addr)

    def reconnect(self, n: str) -> None:
        """Node ``n``'s report write cap back (its next retry connects anew)."""
        mon(self.cluster, {"prefix": "auth caps", "entity": self.users[n],
                           "caps": node_caps(self.cluster.pool, self.pool, n)})


@contextlib.contextmanager
def fleet_rig(node: NodeUnderTest, tmp_path: Path, cluster: DevCluster, waves: Waves
              ) -> Iterator[Fleet]:
    """Daemons for the nodes of ``waves`` (the first is ``node``, the
    fixture's: its teardown removes every image the fleet made)."""
    names = [n for wave in waves for n in wave]
    tag = uuid.uuid4().hex[:6]
    pool = f"fleet-{tag}"
    mon(cluster, {"prefix": "osd pool create", "pool": pool, "pg_num": 8, "pgp_num": 8})
    node.config.write_text(re.sub(r"(?m)^nodeName: .*$", f"nodeName: {names[0]}",
                                  node.config.read_text()) + "resyncSeconds: 3600\n")
    nodes = {names[0]: node, **{n: node_b(node, tmp_path, n) for n in names[1:]}}
    daemons: dict[str, Daemon] = {}
    users: dict[str, str] = {}
    fleet: Fleet | None = None
    try:
        with Signing(tmp_path / "signer") as signer:
            repo = Repo(tmp_path, signer, signer.ssh_key("ops"))
            for n, under in nodes.items():
                users[n] = entity = f"client.{n}-{tag}"
                out = mon(cluster, {"prefix": "auth get-or-create", "entity": entity,
                                    "caps": node_caps(cluster.pool, pool, n), "format": "json"})
                keyring = under.root / "node.keyring"
                keyring.write_text(f"[{entity}]\n\tkey = {json.loads(out)[0]['key']}\n")
                cfg = re.sub(r"(?m)^  user: .*$", f"  user: {entity.removeprefix('client.')}",
                             under.config.read_text())
                under.config.write_text(re.sub(r"(?m)^  keyring: .*$", f"  keyring: {keyring}",
                                               cfg))
                repo.follow(under, interval=INTERVAL_S)
                under.config.write_text(under.config.read_text() + f"  fleet: {{pool: {pool}}}\n")
            anchors = {n: node.name(f"anchor-{n}") for n in names}
            for n, under in nodes.items():
                daemons[n] = Daemon(under, args=("--log-format", "json"))
            fleet = Fleet(cluster, repo, [list(w) for w in waves], nodes, daemons, anchors,
                          pool, users)
            yield fleet
    finally:
        for d in daemons.values():
            if d.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(d.proc.pid, signal.SIGCONT)  # a paused one stops too
                d.stop()
        for addr in fleet.blocked if fleet is not None else ():
            mon(cluster, {"prefix": "osd blocklist", "blocklistop": "rm", "addr": addr})
        for n in nodes:
            if n in users:
                mon(cluster, {"prefix": "auth caps", "entity": users[n],
                              "caps": node_caps(cluster.pool, pool, n)})
            nodes[n].cli("release", "--all")
        for entity in users.values():
            mon(cluster, {"prefix": "auth del", "entity": entity})
        mon(cluster, {"prefix": "osd pool rm", "pool": pool, "pool2": pool,
                      "yes_i_really_really_mean_it": True})
