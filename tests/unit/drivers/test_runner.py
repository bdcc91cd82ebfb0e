"""The Runner's deadlines, host-only: a stuck command is killed with its whole
process group, the wait for its output after the kill is bounded, and a stop
refuses new commands and kills those still running after the grace.

The stand-ins fork a grandchild that keeps stdout open and ignore SIGTERM:
``subprocess.run(timeout=...)`` kills only the child; the grandchild lives on.
"""

from __future__ import annotations

import contextlib
import os
import signal
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from reconciler.drivers.run import KILL_WAIT_S, Aborted, CommandError, Halt, Runner
from reconciler.spec.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[3]


def alive(pid: int) -> bool:
    """Running, not a zombie (a dead child of ours stays one until reaped)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text[text.rindex(")") + 2] != "Z"


@pytest.fixture
def stuck(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """A script that prints, forks a grandchild holding stdout, ignores
    SIGTERM and waits; ``pids`` gets "child grandchild". Whatever the test
    did, both are killed (SIGKILL, checked to be our script's) at the end."""
    pids = tmp_path / "pids"
    script = tmp_path / "stuck"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        trap '' TERM
        echo started
        echo "about to hang" >&2
        ${{ESCAPE:+setsid}} sleep 1000 &
        echo "$$ $!" >> {pids}
        wait
        """))
    script.chmod(0o755)
    yield script, pids
    for pid in pids.read_text().split() if pids.exists() else []:
        with contextlib.suppress(OSError):
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"sleep" in cmd or str(script).encode() in cmd:
                os.kill(int(pid), signal.SIGKILL)
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(int(pid), os.WNOHANG)


def started_pids(pids: Path) -> list[int]:
    return [int(p) for p in pids.read_text().split()]


def wait_until(cond: object, what: str, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_deadline_kills_the_whole_group(stuck: tuple[Path, Path]) -> None:
    script, pids = stuck
    with pytest.raises(CommandError) as err:
        Runner(timeout=1).run([str(script)])
    assert err.value.returncode == 124
    assert "timed out after 1 s: killed (its process group)" in str(err.value)
    assert "about to hang" in str(err.value)  # what it said before it hung
    child, grandchild = started_pids(pids)
    wait_until(lambda: not alive(child) and not alive(grandchild), "the group to die")


def test_output_held_outside_the_group_is_abandoned(stuck: tuple[Path, Path]) -> None:
    """A grandchild in its own session escapes the group kill: the wait for
    the pipes it holds is bounded, and the error says the output was dropped."""
    script, pids = stuck
    result: list[BaseException] = []

    def run() -> None:
        try:
            Runner(timeout=1).run([str(script)], env={**os.environ, "ESCAPE": "1"})
        except BaseException as exc:  # handed to the test thread
            result.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout=1 + KILL_WAIT_S + 10)  # generous on a loaded machine; never 1000 s
    assert not t.is_alive(), "the runner waited for output a process outside the group holds"
    [exc] = result
    assert isinstance(exc, CommandError) and "output abandoned" in str(exc)
    child, _ = started_pids(pids)
    wait_until(lambda: not alive(child), "the child to die")


def test_a_stop_refuses_new_commands() -> None:
    halt = Halt()
    halt.begin(grace=0)
    with pytest.raises(Aborted, match="daemon stopping: true not started"):
        Runner(halt=halt).run(["true"])


def test_a_stop_says_why() -> None:
    """`release --all` at its deadline stops its chains with its own reason;
    the first reason given stays."""
    halt = Halt()
    halt.begin(0, "release --all deadline (6 s) reached")
    halt.begin(0, "daemon stopping")
    with pytest.raises(Aborted, match=r"^release --all deadline \(6 s\) reached: true not"):
        Runner(halt=halt).run(["true"])


def test_a_stop_lets_a_short_command_finish_within_the_grace() -> None:
    halt = Halt()
    halt.begin(grace=30)
    assert Runner(halt=halt).run(["echo", "hi"]).stdout == "hi\n"


def test_a_stop_kills_a_stuck_command_after_the_grace(stuck: tuple[Path, Path]) -> None:
    """Its own deadline is far away (600 s): the stop does not wait for it."""
    script, pids = stuck
    halt = Halt()
    runner = Runner(timeout=600, halt=halt)
    result: list[BaseException] = []

    def run() -> None:
        try:
            runner.run([str(script)])
        except BaseException as exc:  # handed to the test thread
            result.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    wait_until(lambda: pids.exists() and len(pids.read_text().split()) == 2, "the stand-in")
    # The script writes its pids as soon as it runs, which can be before the
    # Runner has registered it (Popen returns, then tracking): wait for that.
    wait_until(lambda: any(str(script) in r for r in halt.running()),
               "the Runner to track the stand-in")
    halt.begin(grace=0.5)
    t.join(timeout=30)
    assert not t.is_alive(), "a stop waited for a stuck command's own deadline"
    [exc] = result
    assert isinstance(exc, Aborted) and "killed after" in str(exc)
    assert halt.running() == []
    child, grandchild = started_pids(pids)
    wait_until(lambda: not alive(child) and not alive(grandchild), "the group to die")


def _config(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "config.yaml"
    p.write_text(textwrap.dedent(body))
    return p


def test_timeouts_config(tmp_path: Path) -> None:
    c = load_config(_config(tmp_path, """\
        timeouts: {commandSeconds: 20, mkfsSeconds: 900, stopSeconds: 60, stopGraceSeconds: 10}
        """))
    t = c.timeouts
    assert (t.command_seconds, t.mkfs_seconds, t.stop_seconds, t.stop_grace_seconds) == \
        (20, 900, 60, 10)
    d = load_config(_config(tmp_path, "timeouts: {}\n")).timeouts
    assert (d.command_seconds, d.mkfs_seconds, d.stop_seconds, d.stop_grace_seconds) == \
        (120, 600, 30, 5)
    for bad, field in (("commandSeconds: 0", "timeouts.commandSeconds"),
                       ("mkfsSeconds: ten", "timeouts.mkfsSeconds"),
                       ("stopSeconds: 2", "timeouts.stopSeconds"),
                       ("stopGraceSeconds: -1", "timeouts.stopGraceSeconds"),
                       ("stopGraceSeconds: 28", "timeouts.stopGraceSeconds"),
                       ("{stopSeconds: 8}", "timeouts.stopSeconds"),
                       ("commandTimeout: 5", "timeouts")):
        text = f"timeouts: {bad}\n" if bad.startswith("{") else f"timeouts:\n  {bad}\n"
        with pytest.raises(ConfigError) as err:
            load_config(_config(tmp_path, text))
        assert field in str(err.value), (bad, str(err.value))
        assert "Traceback" not in str(err.value)
