"""Errors, not tracebacks: every way a user can get it wrong gets one line
that names what to fix, and the documented exit code (docs/cli.md: exit codes)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from reconciler.testing.devcluster import DevCluster

REPO = Path(__file__).resolve().parents[3]
CMD = str(Path(sys.executable).parent / "rbd-reconciler")
LOCAL = str(REPO / "examples" / "config" / "local-cluster.yaml")
EXAMPLE = str(REPO / "examples" / "pgdata.yaml")
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def run(*argv: str, prefix: tuple[str, ...] = (), stdout: int | None = subprocess.PIPE,
        timeout: float = 60) -> tuple[int, str, str]:
    proc = subprocess.run([*prefix, CMD, *argv], stdout=stdout, stderr=subprocess.PIPE,
                          text=True, timeout=timeout, check=False, cwd="/")
    out = proc.stdout or ""
    assert "Traceback" not in out + proc.stderr, out + proc.stderr
    return proc.returncode, out, proc.stderr


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, f"expected one line, got: {text!r}"
    return lines[0]


def test_non_root_gets_one_line_and_validate_still_works() -> None:
    rc, out, err = run("-c", LOCAL, "plan", prefix=tuple(NOBODY))
    assert rc == 1 and not out
    assert "plan: needs root" in one_line(err)
    rc, _, err = run("validate", "-c", LOCAL, EXAMPLE, prefix=tuple(NOBODY))
    assert rc == 0, err
    rc, out, err = run("--version", prefix=tuple(NOBODY))
    assert rc == 0 and out.startswith("rbd-reconciler "), err


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory anyone may enter (pytest's tmp_path sits under a 0700 one)."""
    path = Path(tempfile.mkdtemp(prefix="rbd-reconciler-cli-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def test_non_root_with_a_root_only_config_is_told_plainly(open_dir: Path) -> None:
    config = open_dir / "config.yaml"
    config.write_text("nodeName: x\n")
    config.chmod(0o644)  # the control: readable, so validate runs as nobody
    rc, _, err = run("-c", str(config), "validate", EXAMPLE, prefix=tuple(NOBODY))
    assert rc == 0, err
    config.chmod(0o600)
    rc, out, err = run("-c", str(config), "validate", EXAMPLE, prefix=tuple(NOBODY))
    assert rc == 1 and not out
    line = one_line(err)
    assert f"{config}:1:1: (file): cannot read: permission denied" in line, line
    assert "Errno" not in line


def test_a_config_that_is_not_text_is_told_plainly(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_bytes(b"\xff\xfe\x00binary")
    rc, _, err = run("-c", str(config), "plan")
    assert rc == 1
    line = one_line(err)
    assert f"{config}:1:1: (file): cannot read: not UTF-8 text" in line, line


def _into_closed_pipe(*argv: str, stderr_too: bool = False) -> tuple[int, str]:
    """Run with stdout (and stderr) a pipe whose reader is gone before the first byte."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([CMD, *argv], stdout=write,
                              stderr=write if stderr_too else subprocess.PIPE,
                              text=True, timeout=60, check=False, cwd="/")
    finally:
        os.close(write)
    return proc.returncode, proc.stderr or ""


@pytest.mark.parametrize("argv", [
    ("-c", LOCAL, "validate", "-o", "json", EXAMPLE),
    ("--version",),              # the console script's fast path
    ("-c", LOCAL, "--version"),  # argparse's version action
    ("--help",),
    ("plan", "--help"),
], ids=["validate-json", "version-fast", "version-argparse", "help", "plan-help"])
def test_a_closed_pipe_ends_quietly(argv: tuple[str, ...]) -> None:
    rc, err = _into_closed_pipe(*argv)
    assert (rc, err) == (141, ""), err


def test_a_closed_pipe_on_stdout_and_stderr_ends_quietly(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: rbd-reconciler/v1\nkind: Volume\n")
    rc, _ = _into_closed_pipe("-c", LOCAL, "validate", str(bad), stderr_too=True)
    assert rc == 141


@pytest.mark.ceph
def test_status_into_a_closed_pipe_ends_quietly(tmp_path: Path,
                                                ceph_cluster: DevCluster) -> None:
    config = _config(tmp_path, f"  conf: {ceph_cluster.conf}\n  user: {ceph_cluster.user}\n"
                               f"  keyring: {ceph_cluster.keyring}\n")
    rc, err = _into_closed_pipe("-c", config, "status")
    assert (rc, err) == (141, ""), err


@pytest.mark.parametrize("where", ["before", "after"])
def test_missing_and_unreadable_config_named_either_side_of_the_command(
        where: str, tmp_path: Path) -> None:
    for bad, said in ((tmp_path / "nope.yaml", "no such file"), (tmp_path, "cannot read")):
        argv = ["-c", str(bad), "plan"] if where == "before" else ["plan", "-c", str(bad)]
        rc, out, err = run(*argv)
        assert rc == 1 and not out
        line = one_line(err)
        assert str(bad) in line and said in line, line


def test_usage_errors_are_not_changes_pending() -> None:
    rc, out, err = run("plan", "--no-such-flag")
    assert rc == 64 and not out  # not 2: `plan` exits 2 for "changes pending"
    assert "unrecognized arguments: --no-such-flag" in err


def _config(tmp_path: Path, ceph: str) -> str:
    desired = tmp_path / "desired"
    desired.mkdir(exist_ok=True)
    (desired / "one.yaml").write_text(
        "apiVersion: rbd-reconciler/v1\nkind: Volume\nmetadata: {name: one}\n"
        "spec: {image: {pool: rbd, size: 64Mi}}\n")
    config = tmp_path / "config.yaml"
    config.write_text(f"desiredDir: {desired}\nstateDir: {tmp_path / 'state'}\n"
                      f"allowedRoots: [{tmp_path}]\nobserveTimeoutSeconds: 2\n"
                      f"ceph:\n{ceph}")
    return str(config)


def _reason(out: str) -> str:
    """The one reason line `status` gives for the volume."""
    return one_line("\n".join(line for line in out.splitlines() if "cannot reach Ceph" in line))


@pytest.mark.ceph
def test_missing_ceph_conf_and_keyring_are_named(tmp_path: Path,
                                                 ceph_cluster: DevCluster) -> None:
    missing = tmp_path / "no-such.conf"
    rc, out, _ = run("-c", _config(tmp_path, f"  conf: {missing}\n"), "status")
    assert rc == 1
    assert f"Ceph conf {missing}: not found" in _reason(out)

    keyring = tmp_path / "no-such.keyring"
    rc, out, _ = run("-c", _config(tmp_path, f"  conf: {ceph_cluster.conf}\n"
                                             f"  keyring: {keyring}\n"), "status")
    assert rc == 1
    assert f"keyring {keyring}: not found" in _reason(out)


def test_ceph_unreachable_names_the_monitor(tmp_path: Path) -> None:
    conf = tmp_path / "ceph.conf"
    conf.write_text("[global]\nmon host = 127.0.0.1:1\n")  # nothing listens on port 1
    rc, out, _ = run("-c", _config(tmp_path, f"  conf: {conf}\n"), "status")
    assert rc == 1
    reason = _reason(out)
    assert "no answer within 2 s" in reason and "mon host 127.0.0.1:1" in reason, reason


@pytest.mark.parametrize("argv", [
    ("-c", LOCAL, "validate", EXAMPLE),
    ("--version",),              # the console script's fast path
    ("-c", LOCAL, "--version"),  # argparse's version action
], ids=["validate", "version-fast", "version-argparse"])
@pytest.mark.parametrize("how", ["console-script", "python-m"])
def test_a_closed_stdout_is_no_traceback(argv: tuple[str, ...], how: str) -> None:
    """`cmd >&-`: Python has no sys.stdout at all (None); what is printed
    goes nowhere, the exit code is the command's, never a traceback."""
    prefix = [CMD] if how == "console-script" else [sys.executable, "-m", "reconciler"]
    proc = subprocess.run(["sh", "-c", '"$@" >&-', "sh", *prefix, *argv],
                          stderr=subprocess.PIPE, text=True, timeout=60, check=False,
                          cwd=str(REPO))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
