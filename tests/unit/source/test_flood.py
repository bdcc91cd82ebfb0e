"""A git server that floods: the sync fails, clearly, and costs the node
little memory (issue 36, item 3).

The real sshd of tests/gitserver.py lets a key in whose forced command
prints 320 MB on stderr, then a last line, and exits 1: what ssh forwards
to git's stderr, and git to the Runner's pipe. ``Syncer.sync()`` runs in a
probe process of its own, whose peak RSS (VmHWM) is read over its baseline;
its address space is capped (RLIMIT_AS, inherited by git and ssh), so a
sync that keeps everything fails there with a MemoryError instead of taking
the machine's memory.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from gitserver import GitServer, commit, keygen, ssh_node_config
from gitserver import git as git_cli

from reconciler.drivers.run import DEFAULT_MAX_STDOUT, STDERR_KILL, CommandError, Runner
from reconciler.source.cause import remote_cause
from reconciler.source.gitenv import Git
from reconciler.source.outcome import MAX_MESSAGE
from reconciler.source.tree import list_tree, read_blobs
from reconciler.spec.source import SourceConfig, SourceRef, SourceVerify

# PROBE_ROOT: the probe imports another checkout's reconciler (to see an old Runner fail this)
ROOT = Path(os.environ.get("PROBE_ROOT") or Path(__file__).resolve().parents[3])
MiB = 1 << 20
PEAK_BOUND_KB = 64 * 1024  # the probe's peak RSS over its baseline, at most
PROBE_DEADLINE = 120.0
AS_HEADROOM = 512 * MiB
FLOOD = ("yes 'remote: noise' | head -c 320000000 >&2; "
         "echo 'fatal: the flood is over' >&2; exit 1")

PROBE = textwrap.dedent("""\
    import json, resource, sys
    from pathlib import Path
    from reconciler.source.sync import Syncer
    from reconciler.spec.config import load_config

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1])

    config = load_config(Path(sys.argv[1]))
    syncer = Syncer(config)
    base = status("VmRSS")
    limit = status("VmSize") * 1024 + int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    out = syncer.sync()
    print(json.dumps({"result": out.result, "reason": out.reason, "message": out.message,
                      "base_kb": base, "peak_kb": status("VmHWM")}))
    """)


def probe_sync(cfg: Path) -> dict[str, object]:
    """``Syncer(load_config(cfg)).sync()`` in a process of its own; what it said."""
    proc = subprocess.Popen([sys.executable, "-c", PROBE, str(cfg), str(AS_HEADROOM)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT)},
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=PROBE_DEADLINE)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the probe, git and ssh
        proc.communicate(timeout=10)
        raise AssertionError(f"the sync did not end within {PROBE_DEADLINE:g} s") from None
    assert proc.returncode == 0, f"the probe failed (exit {proc.returncode}): " \
                                 f"{err.decode(errors='replace')[-2000:]}"
    answer: dict[str, object] = json.loads(out)
    return answer


def test_a_server_flooding_stderr_fails_the_sync_with_a_bounded_message(
        git_server: GitServer, tmp_path: Path) -> None:
    flood_key = tmp_path / "flood_key"
    git_server.authorize(f'command="{FLOOD}",restrict {keygen(flood_key, "flood")}')
    allowed = tmp_path / "allowed_signers"
    allowed.write_text("")
    cfg = ssh_node_config(tmp_path, git_server, allowed, key=flood_key,
                          extra="  timeoutSeconds: 60\n")
    answer = probe_sync(cfg)
    assert (answer["result"], answer["reason"]) == ("failed", "FetchFailed"), answer
    message = str(answer["message"])
    assert message.startswith(f"{git_server.url}: printed more than {STDERR_KILL // MiB} MiB "
                              "on stderr: killed (its process group); it said: remote: noise"), \
        message
    assert len(message) <= MAX_MESSAGE
    grown = int(str(answer["peak_kb"])) - int(str(answer["base_kb"]))
    assert grown < PEAK_BOUND_KB, f"the sync's peak RSS grew by {grown} kB"
    assert "Accepted publickey for git" in git_server.log.read_text()  # the flood key, over ssh


def test_the_cause_shown_is_a_few_clipped_lines() -> None:
    """A line of 40 KiB (a flood has no newline to cut at) before git's
    last one: the cause shows both, the long one clipped."""
    with pytest.raises(CommandError) as err:
        Runner().run(["sh", "-c", "head -c 40000 /dev/zero | tr '\\0' x >&2; echo >&2; "
                      "echo 'fatal: the last line' >&2; exit 128"])
    cause = remote_cause(err.value)
    assert cause.endswith(" | fatal: the last line"), cause[-200:]
    assert cause.startswith("x" * 100) and len(cause) < 1000, len(cause)


def test_a_tree_past_the_default_stdout_bound_is_read_whole(tmp_path: Path) -> None:
    """``git cat-file --batch`` of a revision answers with every blob: the
    tree's listed sizes bound it, not the Runner's default (a 17 MiB tree
    is within maxTreeBytes)."""
    line = "# file {:02}\n"  # 10 bytes: each blob its own (cat-file answers once per blob)
    files = {f"nodes/a/f{i:02}.yaml": (line.format(i).encode() * (MiB // 10 + 1))[:MiB]
             for i in range(17)}
    assert sum(map(len, files.values())) > DEFAULT_MAX_STDOUT
    work = tmp_path / "work"
    sha = commit(work, files)
    config = SourceConfig(url=f"file://{tmp_path / 'none.git'}", ref=SourceRef("branch", "main"),
                          path="nodes/{nodeName}",
                          verify=SourceVerify(mode="head", format="ssh",
                                              allowed_signers=Path("/nonexistent")))
    mirror = Git(config, tmp_path / "source", Runner())
    mirror.init()
    git_cli("push", "--quiet", "--", str(mirror.repo), "HEAD:refs/heads/main", cwd=work)
    entries = list_tree(mirror, sha, "nodes/a", MiB, 64 * MiB)
    blobs = read_blobs(mirror, entries)
    assert {f"nodes/a/{e.path}": blobs[e.blob] for e in entries} == files
