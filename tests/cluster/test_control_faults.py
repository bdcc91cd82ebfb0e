"""The control socket under faults (issue 37): the daemon SIGSTOPped (then
SIGCONT), SIGKILLed and SIGTERMed (then started again) at random moments
while 100 commands of each kind run beside it. Every command ends within
its bound (docs/cli.md, The command line beside the daemon), its exit code
says what is true, no traceback reaches the user, and once the daemon runs
on, no connection is left being served in it.

The moments are drawn from a seed, printed (and in every failure message);
RBD_FAULT_SEED=N repeats a run."""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
from conftest import NodeUnderTest
from test_daemon import ROOT, Daemon, spec, start, wait_for  # noqa: F401

from reconciler.cli.ask import view_bound
from reconciler.daemon.control import answering
from reconciler.daemon.protocol import LINE_TIMEOUT_S

pytestmark = pytest.mark.ceph

KINDS = ("status", "plan", "explain", "apply")
EACH = 100
AT_ONCE = 10  # commands running at a time (most of them wait on the daemon)
# The commands are spread over this long (no faster than one per
# SPREAD_S / 400 s): the first round of faults, a long stop in it, falls among them.
SPREAD_S = 75.0
OBSERVE_S = 5.0  # observeTimeoutSeconds (the default)
# What a command of its own process costs beyond its bound on a loaded
# machine: the interpreter's start, the imports of the long way, a look at
# Ceph's connection.
SLACK_S = 8.0
# status, plan, explain: the daemon waited for within view_bound, then a look
# of their own, which answers within about twice observeTimeoutSeconds.
LOOK_BOUND_S = view_bound(OBSERVE_S) + 2 * OBSERVE_S + SLACK_S
# apply: no bound of its own (a mkfs takes what it takes), but every line
# within LINE_TIMEOUT_S. Here every volume is converged already (its pass
# does nothing but look), so it ends within a line's bound of the daemon's
# last word, after the short stops it waited through (two at most, between
# the other faults) and a pass of a daemon just started.
SHORT_STOP_S = (0.5, 6.0)  # shorter than a line's bound: waited through
APPLY_BOUND_S = LINE_TIMEOUT_S + 2 * SHORT_STOP_S[1] + OBSERVE_S + SLACK_S
# Longer than any bound: a command that waited for a stopped daemon's next
# line would outlast it.
LONG_STOP_S = LOOK_BOUND_S + 5
# Each round, in a random order, at random moments: one of each (the first
# round a long stop too).
FAULTS = ("stop", "stop", "kill", "term")


@dataclass
class Ran:
    kind: str
    args: tuple[str, ...]
    rc: int
    took: float
    out: str
    err: str
    published: bool  # the volumes it named were mounted when it ended


class Faults:
    """The daemon, stopped, killed and terminated at random moments."""

    def __init__(self, node: NodeUnderTest, starts: Callable[..., Daemon], rng: random.Random,
                 seed: int) -> None:
        self.node, self.start, self.rng, self.seed = node, starts, rng, seed
        # Set while a daemon runs (stopped or not). While it is started again
        # no command begins: those begun meanwhile work alone, and a stream
        # of applies alone, each holding the state lock, would keep it from
        # starting (it refuses to, then) for as long as they come.
        self.up = threading.Event()
        self.daemon = self._started()
        self.done: list[str] = []
        self.amid: list[str] = []  # the faults made while commands ran

    def _started(self) -> Daemon:
        """A daemon that serves its socket: started again while a command
        alone holds the state lock (systemd's Restart= does the same)."""
        end = time.monotonic() + 60
        while True:
            d = self.start()
            wait_for(lambda d=d: d.proc.poll() is not None or serves(self.node),  # type: ignore[misc]
                     f"the daemon to serve its socket (seed {self.seed})", 60)
            if d.proc.poll() is None:
                self.up.set()
                return d
            d.stop()
            log = d.log.read_text()
            assert "in use by another" in log and time.monotonic() < end, log[-3000:]

    def round(self, busy: Callable[[], bool]) -> None:
        """One of each fault, in a random order, at random moments; after
        the first round, only while commands run."""
        first = not self.done
        faults = [*FAULTS, "long stop"] if first else [*FAULTS]
        for what in self.rng.sample(faults, len(faults)):
            pause(self.rng.uniform(0.5, 3.0))
            if not (first or busy()):
                return
            self.amid += [what] if busy() else []
            self.one(what)

    def one(self, what: str) -> None:
        """One fault, and the daemon back (or on) after it."""
        d = self.daemon
        if what.endswith("stop"):
            held = LONG_STOP_S if what == "long stop" else self.rng.uniform(*SHORT_STOP_S)
            d.proc.send_signal(signal.SIGSTOP)
            try:
                pause(held)
            finally:
                d.proc.send_signal(signal.SIGCONT)
            self.done.append(f"stop {held:.1f} s")
            return
        self.up.clear()
        if what == "kill":
            d.stop(signal.SIGKILL)
        else:
            rc = d.stop()  # SIGTERM: it ends what it started, then exits
            assert rc == 0, (rc, d.log.read_text()[-3000:])
        self.done.append(what)
        self.daemon = self._started()

    def resume(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.daemon.proc.send_signal(signal.SIGCONT)


def pause(seconds: float) -> None:
    """The test's own timing (how long a stop lasts, when the next fault or
    command comes): nothing is waited for here."""
    time.sleep(seconds)


def serves(node: NodeUnderTest) -> bool:
    with contextlib.suppress(OSError, ValueError):
        return answering(node.state / "control.sock") is not None
    return False


def run_one(node: NodeUnderTest, up: threading.Event, not_before: float, kind: str,
            args: tuple[str, ...], names: list[str]) -> Ran:
    pause(max(0.0, not_before - time.monotonic()))  # spread over SPREAD_S
    assert up.wait(120), "the daemon was not started again"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "reconciler", "--config", str(node.config),
                           kind, *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=LOOK_BOUND_S + APPLY_BOUND_S + 120)
    took = time.monotonic() - t0
    mounts = node.mounts()
    published = all(str(node.srv / n) in mounts for n in (names if kind == "apply" else ()))
    return Ran(kind, args, proc.returncode, took, proc.stdout, proc.stderr, published)


def truthful(r: Ran, names: list[str]) -> str | None:
    """Why ``r``'s exit code is not what its output says, or None."""
    if "Traceback" in r.err:
        return "a traceback"
    if r.rc not in {"status": (0, 1), "plan": (0, 1, 2), "explain": (0, 1),
                    "apply": (0, 1)}[r.kind]:
        return f"exit {r.rc}"
    if r.rc != 0:  # said on stderr, or what is wrong shown as the command shows it
        shown = re.search(r"unknown|degraded|stalled|fenced|refused", r.out, re.I)
        return None if r.err.strip() or shown else "a failure with nothing said"
    if r.kind == "status":  # the whole answer (the daemon's, or its own look)
        missing = [n for n in names if not re.search(rf"^{n}\s+PUBLISHED\b", r.out, re.M)]
        return f"status 0 without {missing} PUBLISHED" if missing else None
    if r.kind == "plan":
        return None if "Plan: 0 step(s) for 0 volume(s)" in r.out else "plan 0 with steps"
    if r.kind == "explain":
        return None if r.out.startswith(f"volume {r.args[0]}") and \
            "it is where it should be" in r.out else "explain 0 without its volume"
    if not r.published:
        return "apply 0, and its volumes are not published"
    return None if re.search(r"^recap: ok=\d+ changed=\d+ failed=0$", r.out, re.M) else \
        "apply 0 without its recap"


def test_commands_beside_a_daemon_stopped_killed_and_terminated_at_random(
        node: NodeUnderTest, start: Callable[..., Daemon]) -> None:  # noqa: F811
    seed = int(os.environ.get("RBD_FAULT_SEED") or random.SystemRandom().randrange(1 << 32))
    print(f"fault seed {seed} (RBD_FAULT_SEED={seed} repeats it)")
    rng = random.Random(seed)
    names = [node.name(f"f{i}") for i in range(3)]
    for n in names:
        node.write(n, spec(node, target=n))
    faults = Faults(node, start, rng, seed)
    for n in names:
        faults.daemon.wait_phase(n, "Published")

    t0 = time.monotonic()
    ran = run_all(node, faults, names, rng)
    tally(ran, faults, time.monotonic() - t0)
    late = [(r.kind, r.args, round(r.took, 1)) for r in ran
            if r.took > (APPLY_BOUND_S if r.kind == "apply" else LOOK_BOUND_S)]
    assert not late, f"past their bound (seed {seed}): {late}"
    untrue = [(r.kind, r.args, r.rc, why, r.out[-400:], r.err[-400:]) for r in ran
              if (why := truthful(r, names)) is not None]
    assert not untrue, f"untruthful (seed {seed}): {untrue[:5]}"
    assert {r.kind for r in ran if r.rc == 0} == set(KINDS), f"seed {seed}"
    assert set(faults.amid) == {*FAULTS, "long stop"}, f"seed {seed}: {faults.amid}"

    # Once the daemon runs on, nothing of the commands is left in it.
    sock = node.state / "control.sock"
    wait_for(lambda: (answering(sock) or {}).get("connections") == 0,
             f"no connection left in the daemon (seed {seed})", 30)
    for n in names:
        faults.daemon.wait_phase(n, "Published")
    for log in node.root.glob("daemon-*.log"):
        text = log.read_text()
        assert "Traceback" not in text and "request failed" not in text, text[-3000:]


def run_all(node: NodeUnderTest, faults: Faults, names: list[str], rng: random.Random
            ) -> list[Ran]:
    """EACH commands of each kind, in a random order, AT_ONCE at a time,
    spread over SPREAD_S, while the faults come."""
    commands = [(k, _args(k, names, rng)) for k in KINDS for _ in range(EACH)]
    rng.shuffle(commands)
    t0 = time.monotonic()
    try:
        with ThreadPoolExecutor(AT_ONCE) as pool:
            futures = [pool.submit(run_one, node, faults.up, t0 + i * SPREAD_S / len(commands),
                                   k, a, _named(k, a, names))
                       for i, (k, a) in enumerate(commands)]
            try:
                while not all(f.done() for f in futures):
                    faults.round(lambda: not all(f.done() for f in futures))
            except BaseException:
                # A fault that went wrong (a daemon that did not stop cleanly)
                # fails the test now, not after every waiting command's 120 s.
                for f in futures:
                    f.cancel()
                faults.up.set()
                raise
            return [f.result() for f in futures]
    finally:
        faults.resume()


def tally(ran: list[Ran], faults: Faults, took: float) -> None:
    """What happened, for the log of a run (and of a failure)."""
    print(f"{len(ran)} commands in {took:.0f} s; faults: {', '.join(faults.done)}")
    for k in KINDS:
        times = sorted(r.took for r in ran if r.kind == k)
        codes = sorted({r.rc for r in ran if r.kind == k})
        print(f"  {k}: exits {[(c, sum(r.rc == c for r in ran if r.kind == k)) for c in codes]}"
              f", median {times[len(times) // 2]:.1f} s, longest {times[-1]:.1f} s")
    said = Counter(_gist(r) for r in ran if r.rc != 0 or r.err)
    print("  said:\n" + "\n".join(f"    {n} x {line}" for line, n in said.most_common()))


def _args(kind: str, names: list[str], rng: random.Random) -> tuple[str, ...]:
    if kind == "explain":
        return (rng.choice(names),)
    if kind == "apply":
        return tuple(rng.sample(names, rng.randint(0, len(names))))
    return ()


def _named(kind: str, args: tuple[str, ...], names: list[str]) -> list[str]:
    """The volumes an apply answers for (none named: every one)."""
    return (list(args) or names) if kind == "apply" else []


def _gist(r: Ran) -> str:
    """What ``r`` said last, its numbers and paths left out (for the tally)."""
    last = (r.err.strip() or r.out.strip() or "-").splitlines()[-1]
    return f"{r.kind} {r.rc}: " + re.sub(r"\d+(\.\d+)? s|\[[^]]*\]|/\S+", "_", last)[:100]
