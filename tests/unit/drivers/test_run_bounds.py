"""The Runner bounds what it keeps of a command's output (issue 36, item 3).

stderr keeps its first and last ``STDERR_KEEP`` bytes and says how many fell
between; past ``STDERR_KILL`` in all the command is killed. stdout is whole
or the command is killed at its bound, never cut short silently. Each flood
runs in a probe process of its own (real processes, real pipes), whose peak
RSS (VmHWM) is read over its baseline; the probe's address space is capped
(RLIMIT_AS), so code that keeps everything fails there with a MemoryError
instead of taking the machine's memory.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

import pytest

from reconciler.drivers import fusemapper
from reconciler.drivers.run import (
    DEFAULT_MAX_STDOUT,
    STDERR_KEEP,
    STDERR_KILL,
    TOO_MUCH_OUTPUT,
    CommandError,
    Runner,
)

# PROBE_ROOT: the probe imports another checkout's reconciler (to see an old Runner fail these)
ROOT = Path(os.environ.get("PROBE_ROOT") or Path(__file__).resolve().parents[3])
MiB = 1 << 20
PEAK_BOUND_KB = 64 * 1024  # the probe's peak RSS over its baseline, at most
PROBE_DEADLINE = 120.0  # the probe process as a whole (each flood takes about a second)
AS_HEADROOM = 512 * MiB  # the probe's address space over what it had at the start

# Runs ARGV through a Runner (its deadline: 600 s, far past the bounds) and
# prints what came back, with the baseline RSS and the peak (kB).
PROBE = textwrap.dedent("""\
    import json, resource, sys
    from reconciler.drivers.run import CommandError, Runner

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1])

    argv, kwargs, headroom = json.loads(sys.argv[1])
    base = status("VmRSS")
    limit = status("VmSize") * 1024 + headroom
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        res = Runner(timeout=600).run(argv, **kwargs)
        out = {"ok": True, "returncode": res.returncode, "stdout_len": len(res.raw),
               "stderr": res.stderr, "stderr_dropped": res.stderr_dropped}
    except CommandError as exc:
        out = {"ok": False, "returncode": exc.returncode, "message": str(exc),
               "stderr": exc.stderr}
    out["base_kb"], out["peak_kb"] = base, status("VmHWM")
    print(json.dumps(out))
    """)


def probe(argv: list[str], **kwargs: object) -> dict[str, object]:
    """``Runner().run(argv, **kwargs)`` in a process of its own; its answer."""
    proc = subprocess.Popen([sys.executable, "-c", PROBE, json.dumps([argv, kwargs, AS_HEADROOM])],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT)},
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=PROBE_DEADLINE)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the probe and what it ran
        proc.communicate(timeout=10)
        raise AssertionError(f"the probe did not end within {PROBE_DEADLINE:g} s: "
                             f"{' '.join(argv)}") from None
    assert proc.returncode == 0, f"the probe failed (exit {proc.returncode}): " \
                                 f"{err.decode(errors='replace')[-2000:]}"
    answer: dict[str, object] = json.loads(out)
    return answer


def grown_kb(answer: dict[str, object]) -> int:
    peak, base = answer["peak_kb"], answer["base_kb"]
    assert isinstance(peak, int) and isinstance(base, int)
    return peak - base


def sh(script: str) -> list[str]:
    return ["sh", "-c", script]


def text_bound() -> int:
    """The longest stderr text kept: head, tail and the marker between."""
    return 2 * STDERR_KEEP + 100


def test_a_stderr_flood_ending_in_a_line_keeps_its_last_line_and_little_memory() -> None:
    """48 MiB on stderr, under the kill: the text holds the head, the count of
    what was dropped, and the last line, which the error shows."""
    flood = 48 * MiB
    answer = probe(sh(f"yes 'remote: noise' | head -c {flood} >&2; "
                      "echo 'fatal: the last line' >&2; exit 3"))
    assert answer["ok"] is False and answer["returncode"] == 3, answer["message"]
    message, stderr = str(answer["message"]), str(answer["stderr"])
    assert message.endswith("fatal: the last line"), message[-500:]
    total = flood + len("fatal: the last line\n")
    assert f"[... {total - 2 * STDERR_KEEP} bytes dropped ...]" in stderr
    assert stderr.startswith("remote: noise\n")
    assert len(stderr) <= text_bound() and len(message) <= 2000, (len(stderr), len(message))
    assert grown_kb(answer) < PEAK_BOUND_KB, f"peak RSS grew by {grown_kb(answer)} kB"


def test_the_issues_320_mb_on_stderr_is_killed_at_the_bound_with_little_memory() -> None:
    """The issue's case: 320 MB on stderr, then a non-zero exit. Past
    STDERR_KILL the group is killed (a flood costs neither memory nor a
    deadline of CPU), and the error says so, with what it said last."""
    answer = probe(sh("yes 'remote: noise' | head -c 320000000 >&2; "
                      "echo 'fatal: the last line' >&2; exit 1"))
    assert answer["ok"] is False and answer["returncode"] == TOO_MUCH_OUTPUT, answer
    message = str(answer["message"])
    assert f"printed more than {STDERR_KILL // MiB} MiB on stderr: killed (its process " \
           "group)" in message, message[-500:]
    assert "timed out" not in message
    assert "it said: remote: noise" in message
    assert len(str(answer["stderr"])) <= 2000 and len(message) <= 2000, len(message)
    assert grown_kb(answer) < PEAK_BOUND_KB, f"peak RSS grew by {grown_kb(answer)} kB"


@pytest.mark.parametrize("argv, stream, bound", [
    (["yes"], "stdout", DEFAULT_MAX_STDOUT),
    (sh("exec yes >&2"), "stderr", STDERR_KILL),
], ids=["yes", "yes >&2"])
def test_a_child_that_never_ends_its_output_ends_at_the_bound(
        argv: list[str], stream: str, bound: int) -> None:
    """Its deadline is 600 s away: the bound, not the deadline, ends it."""
    answer = probe(argv)
    message = str(answer["message"])
    assert answer["ok"] is False and answer["returncode"] == TOO_MUCH_OUTPUT, message
    assert f"printed more than {bound // MiB} MiB on {stream}: killed" in message, message
    assert "timed out" not in message
    assert grown_kb(answer) < PEAK_BOUND_KB, f"peak RSS grew by {grown_kb(answer)} kB"


def test_stdout_past_a_callers_bound_is_killed_never_cut_short(tmp_path: Path) -> None:
    """Exactly at its bound, stdout arrives whole (bytes identical); one byte
    more and the command is killed: a parser never sees a truncated answer."""
    data = os.urandom(3 * MiB + 17)
    blob = tmp_path / "blob"
    blob.write_bytes(data)
    res = Runner().run(["cat", "--", str(blob)], max_stdout=len(data))
    assert res.raw == data and res.stderr == "" and res.stderr_dropped == 0
    with pytest.raises(CommandError) as err:
        Runner().run(["cat", "--", str(blob)], max_stdout=len(data) - 1)
    assert err.value.returncode == TOO_MUCH_OUTPUT
    assert f"printed more than {len(data) - 1} bytes on stdout: killed" in str(err.value)


def test_a_short_stderr_is_kept_whole() -> None:
    """Under the bound nothing is dropped and no marker is added."""
    lines = "".join(f"line {i}\n" for i in range(2000))  # ~18 KiB, under STDERR_KEEP
    with pytest.raises(CommandError) as err:
        Runner().run(sh(f"printf '%s' '{lines}' >&2; exit 2"))
    assert err.value.stderr == lines
    assert str(err.value).endswith("line 1997 | line 1998 | line 1999")


def test_a_long_last_line_is_clipped_in_the_message() -> None:
    """One line of 40 KiB (no newline in a flood): the error's message stays
    a readable line; the bounded text is still in ``stderr``."""
    with pytest.raises(CommandError) as err:
        Runner().run(sh("head -c 40000 /dev/zero | tr '\\0' x >&2; exit 1"))
    assert len(str(err.value)) < 1000, len(str(err.value))
    assert "x" * 100 in str(err.value)


def test_a_helpers_log_is_read_from_its_end_only(tmp_path: Path) -> None:
    """rbd-fuse writes to a log of its own (appended across starts); a failed
    start quotes its last lines, read from the end, not the whole file."""
    log = tmp_path / "mnt.log"
    with log.open("wb") as f:
        for _ in range(16):
            f.write(b"rbd-fuse: noise\n" * (MiB // 16))
        f.write(b"rbd-fuse: the last line\n")
    tracemalloc.start()
    try:
        said = fusemapper._tail(log)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert said.endswith("rbd-fuse: noise | rbd-fuse: the last line"), said
    assert peak < MiB, f"reading the log's tail took {peak} bytes"
