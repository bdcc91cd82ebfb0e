#!/usr/bin/env python3
"""P18: the GitOps source: a signed commit to Published, what following costs,
verification per revision, and a volume moved between nodes by one commit.

Every node here is an `rbd-reconciler run --log-format json` process on one
disposable local Ceph cluster, following a bare repository over file://
(commits signed with an ssh key, verified against an allowed-signers file),
or, for the baselines, reading a plain directory. Four parts, in one run:

a. Latency. Three nodes at once: one follows its repository every
   --interval s (default 2), one is synced by hand (`rbd-reconciler source
   sync`, a cold CLI; interval an hour), one reads a plain directory.
   Interleaved per round: a signed commit adding an ext4 volume (64Mi,
   rbd-fuse, published) pushed at a random phase of the interval -> its
   status says Published (split at the daemon's "source: applied" line);
   the same after `source sync` (t0 just before the CLI starts); the same
   file renamed into the plain directory (the raw convergence). Each volume
   is removed again (untimed). Goals: pushed -> Published <= interval + 1 s;
   `source sync` -> Published <= 1 s plus the raw convergence (medians).
b. The cost of following. Three idle nodes with 200 image-only volumes each
   (4 MiB images made with the binding first): the source at the default
   interval (60 s), at 5 s, and a plain directory; resync 60 s for all. CPU
   seconds of each daemon and of the children it reaped (git, ssh-keygen,
   upload-pack: /proc/PID/stat utime+stime+cutime+cstime) over --idle s;
   the syncs counted from the source's state file. Goal: <= 0.1 CPU-s a
   minute beyond the plain daemon at 60 s. Then one unchanged sync measured
   alone (in this process, getrusage of itself and its children, 20 in a
   row): over file:// and over ssh:// (the tests' sshd on 127.0.0.1, when
   scripts/setup.sh extracted it).
c. Verification per revision: `verify_revision` (the daemon's code) on a
   mirror holding a commit signed with ssh and one signed with OpenPGP, vs
   git's own `verify-commit` on the same commit (the raw command); 20 each,
   interleaved.
d. A fleet move: two nodes (resync and interval an hour) and one published
   ext4 volume (256Mi, as P17) whose file one signed commit moves from
   nodes/p18-a/ to nodes/p18-b/ and back. Both nodes synced by hand: at once
   ("together"), or the taker first, the holder once the taker was refused
   by its claim ("taker first"). From the later of the two switches
   (state.json's lastAppliedAt) to Published on the new node with the old
   one's data, split into the old node's release (its switch -> its unmap
   ended) and the new node's take (the later of that and its own switch ->
   Published); the history is checked (unmap ended before map began). Paired:
   the same move by hand (harness.RawMove). Goal: the take within a few
   seconds of the release.

Usage: .venv/bin/python benchmarks/p18_source.py [--trials N] [--interval S]
       [--idle S] [--moves N] [--parts abcd] [--quick]
Needs root (mount, losetup, FUSE).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (
    REPO,
    BenchError,
    DaemonProc,
    RawMove,
    RawTimes,
    cpu_seconds,
    create_images,
    find_cli,
    fuse_pids_under,
    line,
    logged,
    pct,
    rss_kb,
    run,
    signals_ignored,
    signals_raise,
    status,
    sweep,
    wait_exit,
    watch_move,
)
from harness import cleanup as harness_cleanup

sys.path.insert(0, str(REPO / "tests"))  # the signer's side: keys, signed commits, sshd

from gitserver import GitServer, serve
from source_signing import Signing, SshKey, bare_repository, fetch, mirror, source_yaml

from reconciler.drivers.reaper import become_subreaper, reap_zombies
from reconciler.drivers.run import Runner
from reconciler.source.gitenv import Git
from reconciler.source.sync import Syncer
from reconciler.source.verify import prepare_keys, verify_revision
from reconciler.spec.config import load_config
from reconciler.spec.source import SourceVerify
from reconciler.testing.devcluster import DevCluster, start_cluster

POLL_S = 0.002
TIMEOUT = 60.0
IDLE_VOLUMES = 200
PROBE_SYNCS = 20
VERIFY_TRIALS = 20
MOVED = "p18-moved"

CONFIG = """\
stateDir: {root}/state
controlSocket: {root}/state/control.sock
nodeName: {node}
ceph:
  conf: {conf}
  user: {user}
  keyring: {keyring}
allowedRoots: [{srv}]
mapper: fuse
{extra}"""

HEAD = """\
apiVersion: rbd-reconciler/v1
kind: Volume
metadata:
  name: {name}
spec:
  image: {{pool: {pool}, size: {size}}}
"""

FS = """\
  map: {{mapper: fuse}}
  stage: {{fsType: ext4}}
  publish:
    - path: {target}
"""


@dataclass
class Node:
    name: str  # its nodeName
    root: Path  # config, state, desired dir, daemon log
    daemon: DaemonProc

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def state(self) -> Path:
        return self.root / "state"

    @property
    def desired(self) -> Path:
        return self.root / "desired"

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return run([str(find_cli()), "--config", str(self.config), *args])

    def sync_argv(self) -> list[str]:
        return [str(find_cli()), "--config", str(self.config), "source", "sync"]

    def wait_phase(self, names: list[str], phase: str, timeout: float = TIMEOUT) -> float:
        """time.time() when every one of ``names`` said ``phase``."""
        left = set(names)
        deadline = time.monotonic() + timeout * max(1, len(names) / 100)
        while left:
            left = {n for n in left if status(self.state, n).get("phase") != phase}
            if left and time.monotonic() > deadline:
                some = sorted(left)[:3]
                raise BenchError(f"{self.name}: not {phase}: {len(left)}, e.g. "
                                 f"{[(n, status(self.state, n)) for n in some]}; log:\n"
                                 f"{self.daemon.tail()}")
            self.daemon.check_alive()
            if left:
                time.sleep(POLL_S)
        return time.time()

    def source_state(self) -> dict:
        try:
            return json.loads((self.state / "source" / "state.json").read_text())
        except (FileNotFoundError, ValueError):
            return {}

    def applied_at(self) -> float:
        return datetime.fromisoformat(self.source_state()["lastAppliedAt"]).timestamp()


class Run:
    """What one run holds: the cluster, the signer, the nodes (stopped and
    released at the end, whatever happened)."""

    def __init__(self, root: Path, cluster: DevCluster, signer: Signing, key: SshKey) -> None:
        self.root, self.cluster, self.signer, self.key = root, cluster, signer, key
        self.srv = root / "srv"
        self.allowed = signer.allowed_signers(root / "allowed_signers", ("ops", key))
        self.nodes: list[Node] = []

    def repository(self, name: str) -> str:
        url = bare_repository(self.root / f"{name}.git")
        self.push(url, "the fleet", {"README": "p18\n"})
        return url

    def push(self, url: str, message: str, files: dict[str, str | None]) -> str:
        return self.signer.push(url, message, files, self.key)

    def start(self, name: str, extra: str) -> Node:
        root = self.root / name
        for sub in ("state", "desired", "incoming"):
            (root / sub).mkdir(mode=0o755, parents=True, exist_ok=True)
        (root / "config.yaml").write_text(CONFIG.format(
            root=root, node=name, conf=self.cluster.conf, user=self.cluster.user,
            keyring=self.cluster.keyring, srv=self.srv,
            extra=extra.replace("{root}", str(root))))
        node = Node(name, root, DaemonProc(root, find_cli(), root / "config.yaml"))
        self.nodes.append(node)
        node.daemon.wait_ready()
        return node

    def following(self, name: str, url: str, interval: float, resync: float = 60) -> Node:
        return self.start(name, source_yaml(url, self.allowed, interval)
                          + f"resyncSeconds: {resync:g}\n")

    def plain(self, name: str) -> Node:
        return self.start(name, "desiredDir: {root}/desired\n")

    def fs_volume(self, name: str, size: str = "64Mi") -> str:
        return HEAD.format(name=name, pool=self.cluster.pool, size=size) + FS.format(
            target=self.srv / name)

    def stop(self, nodes: list[Node]) -> list[str]:
        problems = []
        for n in nodes:
            if n.daemon.logf.closed:  # stopped already (a part's end, then the clean-up)
                continue
            rc = n.daemon.stop()
            if rc not in (0, None):
                problems.append(f"daemon {n.name} exited {rc}")
        reap_zombies()
        return problems


def removed(node: Node, name: str, remove: Callable[[], None]) -> None:
    """Take a volume away (untimed) and wait for its rbd-fuse to exit."""
    fuse = fuse_pids_under(node.state)
    remove()
    node.wait_phase([name], "Released")
    for pid in fuse:
        wait_exit(pid)
    reap_zombies()


# -- a: latency -----------------------------------------------------------------------------

@dataclass
class Latency:
    follow: list[float]  # pushed -> Published, following every interval
    follow_applied: list[float]  # pushed -> the daemon's "source: applied"
    sync_cli: list[float]  # the `source sync` CLI, start -> exit
    sync: list[float]  # `source sync` started -> Published
    plain: list[float]  # renamed into the plain directory -> Published


def part_a(r: Run, trials: int, interval: float) -> Latency:
    urls = {"follow": r.repository("follow"), "sync": r.repository("sync")}
    follow = r.following("p18-f", urls["follow"], interval)
    synced = r.following("p18-s", urls["sync"], 3600)
    plain = r.plain("p18-p")
    lat = Latency([], [], [], [], [])
    try:
        for i in range(trials):
            # Following: pushed at a random phase of the follower's interval.
            name = f"p18-f{i}"
            path = f"nodes/p18-f/{name}.yaml"
            time.sleep(random.uniform(0, interval))  # the spread, not a synchronisation
            follow.daemon.new_lines()
            r.push(urls["follow"], f"add {name}", {path: r.fs_volume(name)})
            t0 = time.time()
            lat.follow.append(follow.wait_phase([name], "Published") - t0)
            applied = [logged(rec) for rec in follow.daemon.new_lines()
                       if str(rec.get("message", "")).startswith("source: applied")]
            lat.follow_applied.append(applied[0] - t0 if applied else float("nan"))
            removed(follow, name, lambda p=path, n=name: r.push(urls["follow"], f"remove {n}",
                                                                  {p: None}))
            # `source sync` by hand.
            name = f"p18-s{i}"
            path = f"nodes/p18-s/{name}.yaml"
            r.push(urls["sync"], f"add {name}", {path: r.fs_volume(name)})
            t0 = time.time()
            synced.cli("source", "sync")
            lat.sync_cli.append(time.time() - t0)
            lat.sync.append(synced.wait_phase([name], "Published") - t0)

            def unsync(p: str = path, n: str = name) -> None:
                r.push(urls["sync"], f"remove {n}", {p: None})
                synced.cli("source", "sync")

            removed(synced, name, unsync)
            # The raw convergence: the same file renamed into a plain directory.
            name = f"p18-p{i}"
            tmp = plain.root / "incoming" / f"{name}.yaml"
            tmp.write_text(r.fs_volume(name))
            t0 = time.time()
            os.rename(tmp, plain.desired / f"{name}.yaml")
            lat.plain.append(plain.wait_phase([name], "Published") - t0)
            removed(plain, name, (plain.desired / f"{name}.yaml").unlink)
            print(f"a {i + 1:2}: following {lat.follow[-1] * 1e3:7.1f} ms (applied after "
                  f"{lat.follow_applied[-1] * 1e3:7.1f}) | source sync {lat.sync[-1] * 1e3:7.1f} "
                  f"ms (CLI {lat.sync_cli[-1] * 1e3:6.1f}) | plain {lat.plain[-1] * 1e3:6.1f} ms",
                  flush=True)
    finally:
        problems = r.stop([follow, synced, plain])
        if problems:
            raise BenchError("; ".join(problems))
    return lat


def report_a(lat: Latency, interval: float) -> None:
    print(f"\na. latency, following every {interval:g} s (load average "
          f"{os.getloadavg()[0]:.2f})")
    for label, xs in (("pushed -> Published (following)", lat.follow),
                      ("pushed -> source: applied", lat.follow_applied),
                      ("source sync -> Published", lat.sync),
                      ("  of which the CLI (start..exit)", lat.sync_cli),
                      ("plain dir -> Published (raw)", lat.plain)):
        print(line(label, xs))
    worst = max(lat.follow)
    print(f"goal pushed -> Published <= {interval + 1:g} s: p50 {pct(lat.follow, 50):.2f} s, max "
          f"{worst:.2f} s: {'met' if worst <= interval + 1 else 'NOT met'}")
    extra = pct(lat.sync, 50) - pct(lat.plain, 50)
    print(f"goal source sync -> Published <= 1 s + the raw convergence: {extra * 1e3:.0f} ms "
          f"beyond it (ratio {pct(lat.sync, 50) / pct(lat.plain, 50):.2f}): "
          f"{'met' if extra <= 1 else 'NOT met'}")


# -- b: the cost of following ---------------------------------------------------------------

@dataclass
class Idle:
    seconds: float
    cpu: dict[str, float]  # node -> CPU-s used in the window (with reaped children)
    rss: dict[str, int]  # kB
    syncs: dict[str, int]
    probe: dict[str, tuple[float, float, int]]  # transport -> (CPU s, wall s, commands) a sync


def part_b(r: Run, seconds: float) -> Idle:
    kinds = {"p18-i60": 60.0, "p18-i5": 5.0}
    names = {k: [f"{k}-{j:03}" for j in range(IDLE_VOLUMES)] for k in [*kinds, "p18-ip"]}
    t0 = time.monotonic()
    create_images(r.cluster, [n for ns in names.values() for n in ns], 4 << 20)
    url = bare_repository(r.root / "idle.git")
    r.push(url, "200 volumes a node", {
        f"nodes/{k}/{n}.yaml": HEAD.format(name=n, pool=r.cluster.pool, size="4Mi")
        for k in kinds for n in names[k]})
    nodes = {k: r.following(k, url, iv) for k, iv in kinds.items()}
    plain = r.plain("p18-ip")
    for n in names["p18-ip"]:
        (plain.desired / f"{n}.yaml").write_text(HEAD.format(name=n, pool=r.cluster.pool,
                                                             size="4Mi"))
    nodes["p18-ip"] = plain
    try:
        for k, node in nodes.items():
            node.wait_phase(names[k], "Created")
        print(f"b: 3 nodes x {IDLE_VOLUMES} volumes converged in {time.monotonic() - t0:.1f} s; "
              f"idle for {seconds:.0f} s", flush=True)
        before = {k: cpu_seconds(n.daemon.proc.pid, children=True) for k, n in nodes.items()}
        seen: dict[str, set[str]] = {k: set() for k in kinds}
        end = time.monotonic() + seconds
        while time.monotonic() < end:  # the window itself; the state files read twice a second
            for k in kinds:
                at = (nodes[k].source_state().get("lastAttempt") or {}).get("at")
                if at:
                    seen[k].add(at)
            for n in nodes.values():
                n.daemon.check_alive()
            time.sleep(0.5)
        cpu = {k: cpu_seconds(n.daemon.proc.pid, children=True) - before[k]
               for k, n in nodes.items()}
        rss = {k: rss_kb(n.daemon.proc.pid) for k, n in nodes.items()}
        syncs = {k: max(0, len(s) - 1) for k, s in seen.items()}  # the first one seen: before
    finally:
        problems = r.stop(list(nodes.values()))
        if problems:
            raise BenchError("; ".join(problems))
    probe = {"file": probe_sync(nodes["p18-i5"].config, r.root / "probe-file", None)}
    # No sshd extracted (scripts/setup.sh): file:// only.
    with contextlib.suppress(FileNotFoundError), serve() as server:
        r.signer.git("push", "--quiet", str(server.repo), "main")
        probe["ssh"] = probe_sync(nodes["p18-i5"].config, r.root / "probe-ssh", server)
    return Idle(seconds, cpu, rss, syncs, probe)


def probe_sync(config_path: Path, state: Path, server: GitServer | None
               ) -> tuple[float, float, int]:
    """(CPU s, wall s, commands) of one unchanged sync: this process and the
    children it waited for, over PROBE_SYNCS syncs after a first that applies."""
    config = load_config(config_path)
    assert config.git is not None
    src = config.git
    if server is not None:
        src = replace(src, url=server.url, credentials=server.credentials())
    config = replace(config, state_dir=state, desired_dir=state / "source" / "current", git=src)
    first = Syncer(config).sync()
    if first.result != "applied":
        raise BenchError(f"probe over {src.scheme}: {first.result} {first.reason}: "
                         f"{first.message}")
    commands = 0
    c0, w0 = cpu_self_and_children(), time.perf_counter()
    for _ in range(PROBE_SYNCS):
        syncer = Syncer(config, Runner(timeout=src.timeout_seconds))
        out = syncer.sync()
        if out.result != "unchanged":
            raise BenchError(f"probe over {src.scheme}: {out.result} {out.reason}")
        commands += len(syncer.git.runner.history)
    cpu, wall = cpu_self_and_children() - c0, time.perf_counter() - w0
    return cpu / PROBE_SYNCS, wall / PROBE_SYNCS, commands // PROBE_SYNCS


def cpu_self_and_children() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(
        resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def report_b(idle: Idle) -> None:
    per_min = {k: v * 60 / idle.seconds for k, v in idle.cpu.items()}
    base = per_min["p18-ip"]
    print(f"\nb. idle, {IDLE_VOLUMES} image-only volumes a node, {idle.seconds:.0f} s, resync 60 s "
          f"(load average {os.getloadavg()[0]:.2f})")
    for k, label in (("p18-ip", "plain directory"), ("p18-i60", "source, interval 60 s"),
                     ("p18-i5", "source, interval 5 s")):
        syncs = f", {idle.syncs[k]} syncs" if k in idle.syncs else ""
        extra = f" (+{per_min[k] - base:.3f} beyond plain)" if k != "p18-ip" else ""
        print(f"  {label:<24} {per_min[k]:.3f} CPU-s a minute{extra}, RSS "
              f"{idle.rss[k] / 1024:.1f} MiB{syncs}")
    if idle.syncs["p18-i5"]:
        each = (idle.cpu["p18-i5"] - idle.cpu["p18-ip"]) / idle.syncs["p18-i5"]
        print(f"  per unchanged sync, from the 5 s daemon: {each * 1e3:.1f} ms CPU")
    for scheme, (cpu, wall, commands) in idle.probe.items():
        print(f"  one unchanged sync alone over {scheme}://: {cpu * 1e3:.1f} ms CPU, "
              f"{wall * 1e3:.1f} ms wall, {commands} git command(s)")
    over = per_min["p18-i60"] - base
    print(f"goal <= 0.1 CPU-s a minute beyond plain at 60 s: {over:+.3f}: "
          f"{'met' if over <= 0.1 else 'NOT met'}; from the probe: "
          f"{idle.probe['file'][0]:.3f} (file://)"
          + (f", {idle.probe['ssh'][0]:.3f} (ssh://)" if "ssh" in idle.probe else ""))


# -- c: verification ------------------------------------------------------------------------

@dataclass
class Verified:
    ours: dict[str, list[float]]  # format -> wall s per revision
    raw: dict[str, list[float]]
    cpu: dict[str, float]  # format -> CPU s per revision, ours (children included)


def part_c(root: Path) -> Verified:
    with Signing(root / "verify-signer") as s:
        ssh_key = s.ssh_key("ops")
        pgp = s.gpg_key("Ops <ops@example.invalid>")
        commits = {"ssh": s.commit("ssh-signed", ssh_key), "openpgp": s.commit("pgp-signed", pgp)}
        policies = {
            "ssh": SourceVerify("head", "ssh", allowed_signers=s.allowed_signers(
                root / "verify-allowed", ("ops", ssh_key))),
            "openpgp": SourceVerify("head", "openpgp", keyring=s.keyring(root / "verify.gpg", pgp),
                                    fingerprints=(pgp.fingerprint,))}
        git = mirror(root / "verify-mirror")
        fetch(git, s)
    prepare_keys(git, policies["openpgp"])  # once, as the daemon: a stamp check after
    allowed = policies["ssh"].allowed_signers
    raw_config = {"ssh": ["gpg.format=ssh", f"gpg.ssh.allowedSignersFile={allowed}"],
                  "openpgp": ["gpg.format=openpgp", "gpg.program=gpg"]}
    v = Verified({f: [] for f in commits}, {f: [] for f in commits}, {f: 0.0 for f in commits})
    for _ in range(VERIFY_TRIALS):
        for fmt, sha in commits.items():
            c0, t0 = cpu_self_and_children(), time.perf_counter()
            [signer] = verify_revision(git, sha, None, policies[fmt])
            v.ours[fmt].append(time.perf_counter() - t0)
            v.cpu[fmt] += (cpu_self_and_children() - c0) / VERIFY_TRIALS
            if signer.format != fmt:
                raise BenchError(f"{fmt}: verified as {signer}")
            t0 = time.perf_counter()
            raw_verify(git, sha, raw_config[fmt])
            v.raw[fmt].append(time.perf_counter() - t0)
    return v


def raw_verify(git: Git, sha: str, config: list[str]) -> None:
    """git's own verify-commit, in the same environment: the raw command."""
    argv = ["git", f"--git-dir={git.repo}", *(a for kv in config for a in ("-c", kv)),
            "verify-commit", sha]
    res = subprocess.run(argv, env=git.env(), capture_output=True, timeout=60, check=False)
    if res.returncode != 0:
        raise BenchError(f"{' '.join(argv)}: {res.stderr.decode(errors='replace')}")


def report_c(v: Verified) -> None:
    print(f"\nc. verification of one revision (mode head, {VERIFY_TRIALS} each, interleaved)")
    for fmt in v.ours:
        print(line(f"verify_revision, {fmt}", v.ours[fmt]))
        print(line(f"git verify-commit, {fmt} (raw)", v.raw[fmt]))
        print(f"  ratio of the medians {pct(v.ours[fmt], 50) / pct(v.raw[fmt], 50):.2f}; CPU "
              f"{v.cpu[fmt] * 1e3:.1f} ms a revision (with its children)")


# -- d: a fleet move through the repository --------------------------------------------------

@dataclass
class Moved:
    mode: str
    release: float  # the old node's switch -> its unmap ended
    waited: float  # the later of that and the new node's switch -> its map began
    bring_up: float  # -> Published
    total: float  # the later of the two switches -> Published
    raw: RawTimes

    @property
    def take(self) -> float:
        return self.waited + self.bring_up


def refused(recs: list[dict], name: str) -> bool:
    return any(rec.get("volume") == name and rec.get("result") == "failed"
               and "is claimed by node" in str(rec.get("message", "")) for rec in recs)


def part_d(r: Run, moves: int) -> list[Moved]:
    url = r.repository("move")
    nodes = {}
    target = r.srv / MOVED
    r.push(url, "the moved volume", {f"nodes/p18-a/{MOVED}.yaml": r.fs_volume(MOVED, "256Mi")})
    for n in ("p18-a", "p18-b"):
        nodes[n] = r.following(n, url, 3600, resync=3600)
    raw = RawMove(r.root / "raw", r.cluster, "p18-raw", r.srv / "raw")
    out: list[Moved] = []
    try:
        nodes["p18-a"].wait_phase([MOVED], "Published")
        raw.setup()
        holder = "p18-a"
        for i in range(moves):
            mode = "together" if i % 4 < 2 else "taker first"
            taker = "p18-b" if holder == "p18-a" else "p18-a"
            old, new = nodes[holder], nodes[taker]
            token = uuid.uuid4().hex
            (target / "token").write_text(token)  # no fsync: the release carries it
            for n in nodes.values():
                n.daemon.new_lines()
            r.push(url, f"move {MOVED} to {taker}", {
                f"nodes/{holder}/{MOVED}.yaml": None,
                f"nodes/{taker}/{MOVED}.yaml": r.fs_volume(MOVED, "256Mi")})
            if mode == "together":
                procs = [subprocess.Popen(n.sync_argv(), stdout=subprocess.DEVNULL)
                         for n in (old, new)]
                if any(p.wait(timeout=TIMEOUT) for p in procs):
                    raise BenchError("source sync failed")
            else:
                new.cli("source", "sync")
                seen: list[dict] = []
                deadline = time.monotonic() + TIMEOUT
                while not refused(seen, MOVED):
                    seen += new.daemon.new_lines()
                    if time.monotonic() > deadline:
                        raise BenchError(f"{taker} was never refused by {holder}'s claim")
                    time.sleep(POLL_S)
                old.cli("source", "sync")
            move = watch_move(old.daemon, new.daemon, new.state, MOVED, (holder, taker), TIMEOUT)
            if (target / "token").read_text() != token:
                raise BenchError("the token written on the old node is not on the new one")
            a_old, a_new = old.applied_at(), new.applied_at()
            from_ = max(move.released, a_new)
            moved = Moved(mode, move.released - a_old, move.map_start - from_,
                          move.published - move.map_start, move.published - max(a_old, a_new),
                          raw.trial())
            out.append(moved)
            print(f"d {i + 1:2} {holder}->{taker} {mode:<11}: switched "
                  f"{(a_new - a_old) * 1e3:+6.0f} ms apart (new - old); release "
                  f"{moved.release * 1e3:6.1f} ms, take "
                  f"{moved.take * 1e3:6.1f} (waited {moved.waited * 1e3:6.1f}, bring-up "
                  f"{moved.bring_up * 1e3:6.1f}), total {moved.total * 1e3:6.1f} ms | raw: "
                  f"{moved.raw.total * 1e3:5.1f} ms", flush=True)
            holder = taker
            reap_zombies()
    finally:
        problems = r.stop(list(nodes.values()))
        if problems:
            raise BenchError("; ".join(problems))
    return out


def report_d(moves: list[Moved]) -> None:
    print(f"\nd. a volume moved by one commit, both nodes synced by hand (load average "
          f"{os.getloadavg()[0]:.2f})")
    for mode in ("together", "taker first"):
        ms = [m for m in moves if m.mode == mode]
        if not ms:
            continue
        print(f"  {mode}:")
        for label, xs in (("  release (old node lets go)", [m.release for m in ms]),
                          ("  take (-> Published on new)", [m.take for m in ms]),
                          ("    waited (-> its map starts)", [m.waited for m in ms]),
                          ("    bring-up (map..publish)", [m.bring_up for m in ms]),
                          ("  total (both switched -> Pub.)", [m.total for m in ms])):
            print(line(label, xs))
    raws = [m.raw.total for m in moves]
    print(line("raw move by hand (down + up)", raws))
    takes = [m.take for m in moves]
    ratio = pct([m.total for m in moves], 50) / pct(raws, 50)
    print(f"ratio of the medians, total / raw {ratio:.2f}; goal: the take within a few "
          f"seconds of the release: max {max(takes):.2f} s: "
          f"{'met' if max(takes) <= 3 else 'NOT met'}")


# -- the run --------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--trials", type=int, default=7, help="latency rounds (default 7)")
    p.add_argument("--interval", type=float, default=2.0,
                   help="the following node's intervalSeconds (default 2)")
    p.add_argument("--idle", type=float, default=120.0, help="idle window, s (default 120)")
    p.add_argument("--moves", type=int, default=8, help="fleet moves (default 8)")
    p.add_argument("--parts", default="abcd", help="which parts to run (default abcd)")
    p.add_argument("--quick", action="store_true", help="3 rounds, 30 s idle, 4 moves")
    args = p.parse_args(argv)
    if args.quick:
        args.trials, args.idle, args.moves = 3, 30.0, 4
    if os.geteuid() != 0:
        print("p18_source: needs root (mount, losetup, FUSE)", file=sys.stderr)
        return 2
    become_subreaper()
    root = Path(tempfile.mkdtemp(prefix="rbd-bench-p18-"))
    cluster: DevCluster | None = None
    r: Run | None = None
    rc = 1
    with signals_raise(), contextlib.ExitStack() as stack:
        try:
            if "c" in args.parts:
                report_c(part_c(root))
            if set(args.parts) & set("abd"):
                cluster = start_cluster(root=root / "ceph")
                (root / "srv").mkdir(mode=0o755)
                signer = stack.enter_context(Signing(root / "signer"))
                r = Run(root, cluster, signer, signer.ssh_key("ops"))
            if "a" in args.parts and r is not None:
                report_a(part_a(r, args.trials, args.interval), args.interval)
            if "b" in args.parts and r is not None:
                report_b(part_b(r, args.idle))
            if "d" in args.parts and r is not None:
                report_d(part_d(r, args.moves))
            rc = 0
        except (BenchError, subprocess.TimeoutExpired, OSError, ValueError, KeyError) as e:
            print(f"p18_source: {e!r}", file=sys.stderr)
        except KeyboardInterrupt:
            print("\np18_source: interrupted; cleaning up", file=sys.stderr)
            rc = 130
        finally:
            with signals_ignored():
                rc = cleanup(root, cluster, r) or rc
    return rc


def cleanup(root: Path, cluster: DevCluster | None, r: Run | None) -> int:
    problems: list[str] = []
    if r is not None:
        problems += r.stop(r.nodes)
        for n in r.nodes:  # whatever a failed part left mapped
            if not fuse_pids_under(n.state):
                continue
            with contextlib.suppress(BenchError, subprocess.TimeoutExpired):
                res = run([str(find_cli()), "--config", str(n.config), "release", "--all"],
                          check=False)
                if res.returncode:
                    problems.append(f"release on {n.name} exited {res.returncode}: "
                                    f"{res.stdout}{res.stderr}")
        problems += sweep(root)
    return harness_cleanup(root, cluster, problems)


if __name__ == "__main__":
    sys.exit(main())
