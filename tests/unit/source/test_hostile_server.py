"""A hostile git server, for a bounded time: the sync keeps serving, its
memory stays bounded, and nothing is applied that was not verified.

The server is tests/gitserver.py's real sshd; the node's deploy key is
bound to a forced command (tests/hostile_git.py) that answers each git call
with the real upload-pack or with something hostile: cut, garbage, floods of
hundreds of MB, a huge pkt-line length, a commit nobody pushed, another
repository's main (an old signed commit, an unsigned or mis-signed one),
a stall or a trickle past the call's deadline, random exit codes.
Meanwhile the test pushes signed commits, and unsigned and mis-signed ones,
to the real repository.

The node is the Syncer the daemon's follower runs, in a process of its own
(its peak memory is its own: VmHWM), synced again and again. After every
sync: it answered within its deadlines, its peak memory is within a bound,
``current`` names a commit the test pushed signed and holds exactly that
commit's files, and it never moved back or away except to a newer signed
commit. At the end, with the server honest again, one sync applies the
newest signed commit.

RBD_FUZZ_SECONDS (default 50) sets how long syncs are started for;
RBD_FUZZ_SEED replays a run (the seed is printed, and named by any failure).
"""

from __future__ import annotations

import collections
import json
import os
import random
import select
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from gitserver import GitServer, keygen, ssh_node_config
from hostile_git import BEHAVIOURS
from source_signing import VOLUME_YAML, Signing, SshKey

from reconciler.drivers.run import KILL_WAIT_S, STOP_CHECK_S

pytestmark = pytest.mark.fuzz

SECONDS = float(os.environ.get("RBD_FUZZ_SECONDS", "50"))
SEED = int(os.environ.get("RBD_FUZZ_SEED") or random.SystemRandom().randrange(1 << 32))
# timeoutSeconds: small, so stalls cost little; 6 rather than 3-5 because
# ssh's ConnectTimeout is a third of it (2 s, not 1): on a loaded 2-core
# machine an honest handshake must not fail the final sync.
TIMEOUT = 6
# One sync calls the server at most three times: ls-remote and fetch (each
# timeoutSeconds), and the unshallow fetch a non-descendant offer brings
# (4 x timeoutSeconds); each call killed at its deadline adds the Runner's
# stop check and its wait after the SIGKILL. The local calls (rev-parse,
# verify, export: ~20, tens of ms each) get a generous slack on a shared machine.
SYNC_BOUND = 6 * TIMEOUT + 3 * (STOP_CHECK_S + KILL_WAIT_S) + 15.0
# The Syncer holds at most one revision's files (ours: a few KB, and
# maxTreeBytes is 1 MiB) and the output of one call at a time. 100 MB above
# its peak after a first honest sync leaves room for allocator noise and a
# bounded output buffer, and is far below a flood (150-400 MB per call)
# kept whole.
MEMORY_HEADROOM = 100 << 20
MAX_SYNCS = 10_000  # the loop's count bound (time ends it long before)

# The node: the daemon's follower's sync (a new Syncer each time, its own
# Runner), one per line read, its Outcome written back as one JSON line.
NODE = """
import json, sys, time
from pathlib import Path
from reconciler.source.sync import Syncer
from reconciler.spec.config import load_config
config = load_config(Path(sys.argv[1]))
for line in sys.stdin:
    out = Syncer(config).sync()
    print(json.dumps({"result": out.result, "reason": out.reason, "commit": out.commit,
                      "message": out.message[:300]}), flush=True)
"""


@dataclass
class Node:
    """The Syncer in its own process, driven one sync at a time."""

    proc: subprocess.Popen[bytes]
    buf: bytes = b""

    def sync(self, bound: float) -> tuple[dict[str, Any], float]:
        """One sync; its outcome and how long it took. Fails past ``bound``."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        t0 = time.monotonic()
        self.proc.stdin.write(b"sync\n")
        self.proc.stdin.flush()
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            left = t0 + bound - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out after {bound:g} s waiting for the sync's "
                                     "outcome")
            if select.select([fd], [], [], left)[0]:
                data = os.read(fd, 65536)
                if not data:
                    raise AssertionError(f"the node process ended (exit {self.proc.wait(5)})")
                self.buf += data
        line, _, self.buf = self.buf.partition(b"\n")
        return json.loads(line), time.monotonic() - t0

    def peak_rss(self) -> int:
        """VmHWM: the most resident memory the process ever had, in bytes."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise AssertionError(f"no VmHWM in /proc/{self.proc.pid}/status")

    def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()  # its loop ends at EOF
        try:
            self.proc.wait(timeout=SYNC_BOUND)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


@dataclass
class Hostile:
    """The forced command's control directory (tests/hostile_git.py)."""

    dir: Path
    conf: dict[str, Any]

    def set(self, **changes: Any) -> None:
        self.conf.update(changes)
        tmp = self.dir / "control.json.new"  # replaced whole: a call reads one or the other
        tmp.write_text(json.dumps(self.conf))
        tmp.chmod(0o644)
        tmp.rename(self.dir / "control.json")

    def calls(self) -> list[dict[str, Any]]:
        log = self.dir / "calls.log"
        return [json.loads(ln) for ln in log.read_text().splitlines()] if log.exists() else []


@dataclass
class Pushes:
    """What the test pushed: signed commits in order, with their node files."""

    signer: Signing
    alice: SshKey
    mallory: SshKey
    repo: Path
    signed: dict[str, tuple[int, dict[str, bytes]]] = field(default_factory=dict)
    refused: set[str] = field(default_factory=set)
    n: int = 0

    def files(self) -> dict[str, bytes]:
        node = self.signer.work / "nodes" / "a"
        return {str(p.relative_to(node)): p.read_bytes() for p in sorted(node.rglob("*"))
                if p.is_file()}

    def commit(self, key: SshKey | None) -> str:
        """A new commit on main: the volume resized, a second file now and
        then added or removed, another node's file changed too."""
        self.n += 1
        work = self.signer.work
        (work / "nodes" / "a").mkdir(parents=True, exist_ok=True)
        (work / "nodes" / "b").mkdir(parents=True, exist_ok=True)
        (work / "nodes/a/v.yaml").write_text(VOLUME_YAML.format(name="v", size=f"{self.n}Gi"))
        (work / "nodes/b/w.yaml").write_text(VOLUME_YAML.format(name="w", size=f"{self.n}Gi"))
        extra = work / "nodes/a/x.yaml"
        if self.n % 3 == 0:
            extra.unlink(missing_ok=True)
        else:
            extra.write_text(VOLUME_YAML.format(name="x", size=f"{self.n}Mi"))
        self.signer.git("add", "-A")
        sha = self.signer.commit(f"commit {self.n}", key)
        if key is self.alice:
            self.signed[sha] = (len(self.signed), self.files())
        else:
            self.refused.add(sha)
        return sha

    def push(self, key: SshKey | None, to: Path | None = None) -> str:
        """A commit pushed to the real repository's main, or only to ``to``'s
        (a lie: the work tree goes back to main's after)."""
        sha = self.commit(key)
        self.signer.git("push", "--quiet", "--force", str(to or self.repo),
                        f"{sha}:refs/heads/main")
        if to is not None:
            self.signer.git("reset", "--quiet", "--hard", "HEAD~1")
        return sha

    @property
    def newest(self) -> str:
        return max(self.signed, key=lambda s: self.signed[s][0])


def applied(state: Path) -> tuple[str | None, dict[str, bytes] | None]:
    """The commit ``current`` names and the files of the revision it points at."""
    link = state / "source" / "current"
    try:
        target = os.readlink(link)
    except FileNotFoundError:
        return None, None
    rev = link.parent / target
    files = {str(p.relative_to(rev)): p.read_bytes() for p in sorted(rev.rglob("*"))
             if p.is_file() or p.is_symlink()}
    return target.rpartition("/")[2][:40], files


def git_uid(server: GitServer) -> int:
    """The git user's uid (sshd's own passwd file, tests/gitserver.py)."""
    for line in (server.server_dir / "passwd").read_text().splitlines():
        name, _, uid, *_ = line.split(":")
        if name == "git":
            return int(uid)
    raise AssertionError("no git user in the server's passwd")


def test_a_hostile_server_gets_nothing_applied_and_the_node_recovers(
        tmp_path: Path, git_server: GitServer, signer: Signing, alice: SshKey) -> None:
    print(f"hostile server: seed {SEED} (RBD_FUZZ_SEED={SEED} replays), {SECONDS:g} s")
    rng = random.Random(SEED)  # the test's own choices (what to push, when)

    # The forced command, its control directory (the git user logs its calls
    # there) and the repositories a lie offers instead of the real one.
    ctl = git_server.root / "hostile"
    ctl.mkdir(mode=0o755)
    script = ctl / "hostile_git.py"
    shutil.copy(Path(__file__).parents[2] / "hostile_git.py", script)
    script.chmod(0o644)
    os.chown(ctl, git_uid(git_server), -1)
    key = git_server.client_dir / "hostile_key"
    git_server.authorize(f'command="/usr/bin/python3 -I -S {script} {ctl}",restrict '
                         + keygen(key, "hostile"))
    lies = {name: git_server.root / f"{name}.git" for name in ("old", "unsigned", "mallory")}
    for repo in lies.values():
        subprocess.run(["git", "init", "--quiet", "--bare", str(repo)], check=True,
                       capture_output=True, timeout=60)
    hostile = Hostile(ctl, {})
    hostile.set(mode="pass", seed=SEED, repo=str(git_server.repo), timeout=TIMEOUT,
                lies=[str(r) for r in lies.values()], max_life=5 * TIMEOUT, fuzz_from=0)

    allowed = signer.allowed_signers(tmp_path / "allowed_signers", ("alice", alice))
    cfg = ssh_node_config(tmp_path, git_server, allowed, key=key,
                          extra=f"  timeoutSeconds: {TIMEOUT}\n  maxTreeBytes: 1048576\n")
    state = tmp_path / "state"
    pushes = Pushes(signer, alice, signer.ssh_key("mallory"), git_server.repo)
    first = pushes.push(alice)
    signer.git("push", "--quiet", str(lies["old"]), f"{first}:refs/heads/main")
    pushes.push(None, to=lies["unsigned"])
    pushes.push(pushes.mallory, to=lies["mallory"])

    with (tmp_path / "node.stderr").open("wb") as err:
        proc = subprocess.Popen([sys.executable, "-c", NODE, str(cfg)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=err)
    node = Node(proc)
    outcomes: collections.Counter[str] = collections.Counter()
    peaks: list[int] = []
    slowest = 0.0

    def where(extra: str = "") -> str:
        """For a failure: the seed, and the server's last answers."""
        last = [f"#{c['n']} {c['do']}" for c in hostile.calls()[-4:]]
        return f"seed {SEED}; server's last calls: {', '.join(last)}; {extra}"

    try:
        out, took = node.sync(SYNC_BOUND)
        assert (out["result"], out["commit"]) == ("applied", first), out
        baseline = node.peak_rss()
        bound = baseline + MEMORY_HEADROOM
        print(f"node's peak RSS after an honest sync: {baseline >> 20} MiB; "
              f"bound {bound >> 20} MiB")
        current, files = applied(state)
        assert current == first and files == pushes.signed[first][1]

        hostile.set(mode="fuzz", fuzz_from=len(hostile.calls()))
        t0, syncs = time.monotonic(), 0

        def more() -> bool:
            """Syncs for SECONDS, and on until every behaviour was met (the
            first calls go through all of them: a slow machine may need a
            little longer), within a hard cap."""
            now = time.monotonic() - t0
            met = {c["do"] for c in hostile.calls()} >= set(BEHAVIOURS)
            return syncs < MAX_SYNCS and now < 3 * SECONDS and (now < SECONDS or not met)

        while more():
            syncs += 1
            roll = rng.random()  # what is pushed before this sync
            if roll < 0.30:
                pushes.push(alice)
            elif roll < 0.37:
                pushes.push(None)
            elif roll < 0.44:
                pushes.push(pushes.mallory)
            elif roll < 0.47:  # what a lie offers next
                pushes.push(None, to=lies["unsigned"])
            elif roll < 0.50:
                pushes.push(pushes.mallory, to=lies["mallory"])
            before, called = current, len(hostile.calls())
            out, took = node.sync(SYNC_BOUND)
            outcomes[f"{out['result']}:{out['reason']}"] += 1
            peaks.append(node.peak_rss())
            slowest = max(slowest, took)
            print(f"sync {syncs}: {out['result']} {out['reason']} in {took:.1f} s, peak "
                  f"{peaks[-1] >> 20} MiB; the server: "
                  + ", ".join(f"#{c['n']} {c['do']}" for c in hostile.calls()[called:]))
            said = where(f"sync {syncs}: {out}, after {took:.1f} s")
            assert proc.poll() is None, f"the node process ended; {said}"
            assert peaks[-1] <= bound, (f"peak RSS {peaks[-1] >> 20} MiB, over the bound "
                                        f"({baseline >> 20} + {MEMORY_HEADROOM >> 20} MiB); "
                                        f"{said}")
            current, files = applied(state)
            assert current in pushes.signed, (f"{current} applied: not a signed commit the test "
                                              f"pushed (refused: {current in pushes.refused}); "
                                              f"{said}")
            assert files == pushes.signed[current][1], f"{current}'s files differ: {files}; " \
                                                       f"{said}"
            assert pushes.signed[current][0] >= pushes.signed[before][0], \
                f"moved back from {before} to {current}; {said}"
            if out["result"] == "applied":
                assert out["commit"] == current != before, said
            else:
                assert current == before, f"{out['result']}, yet current moved; {said}"

        # The server honest again: one sync applies the newest signed commit.
        hostile.set(mode="pass")
        newest = pushes.push(alice)
        out, took = node.sync(SYNC_BOUND)
        assert (out["result"], out["commit"]) == ("applied", newest), where(str(out))
        current, files = applied(state)
        assert current == newest and files == pushes.signed[newest][1], where()
        assert node.peak_rss() <= bound, where(f"peak RSS {node.peak_rss() >> 20} MiB")
    finally:
        node.stop()
    assert proc.returncode == 0, f"the node process exited {proc.returncode}; {where()}"

    calls = hostile.calls()
    seen = collections.Counter(c["do"] for c in calls)
    print(f"{syncs} syncs in {time.monotonic() - t0:.0f} s (the slowest {slowest:.1f} s, "
          f"bound {SYNC_BOUND:g} s): {dict(outcomes)}; "
          f"server calls: {dict(seen)}; peak RSS {max(peaks, default=baseline) >> 20} MiB "
          f"(baseline {baseline >> 20} MiB)")
    # Every hostile behaviour was met at least once (the first calls go
    # through all of them), so each invariant above held against each.
    missing = set(BEHAVIOURS) - set(seen)
    assert not missing, f"never answered with {missing} in {len(calls)} calls; seed {SEED}"
