"""The daemon's step log on the real cluster: one line per step, with the
volume, step, target, result and duration as fields, for a chain that fails
(mkfs made to fail) and for its retry that converges."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import NodeUnderTest
from test_daemon import Daemon, set_resync, spec, start, wait_for

pytestmark = pytest.mark.ceph
__all__ = ["start"]  # the daemon fixture, shared with test_daemon
ZONED = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d\d:\d\d"


def volume_lines(log: Path, volume: str) -> list[dict]:
    docs = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    return [d for d in docs if d.get("volume") == volume]


def step_lines(log: Path, volume: str) -> list[dict]:
    return [d for d in volume_lines(log, volume) if "step" in d]


def mkfs_shim(tmp_path: Path, when_flagged: str) -> tuple[Path, Path]:
    """mkfs.ext4 that runs ``when_flagged`` (shell) while ``flag`` exists."""
    shims, flag = tmp_path / "shims", tmp_path / "mkfs-flag"
    shims.mkdir()
    real = shutil.which("mkfs.ext4")
    assert real
    (shims / "mkfs.ext4").write_text(
        "#!/bin/sh\n"
        f'if [ -e "{flag}" ]; then {when_flagged}; fi\n'
        f'exec {real} "$@"\n')
    (shims / "mkfs.ext4").chmod(0o755)
    flag.touch()
    return shims, flag


def failing_mkfs(tmp_path: Path) -> tuple[Path, Path]:
    """Fails, writing nothing."""
    return mkfs_shim(tmp_path, 'echo "mkfs.ext4: injected failure" >&2; exit 1')


def test_each_step_logged_with_its_fields(node: NodeUnderTest, start: Callable[..., Daemon],
                                          tmp_path: Path) -> None:
    shims, flag = failing_mkfs(tmp_path)
    set_resync(node, 0.5)  # the retry comes at the first pass after the backoff
    name = node.name("log")
    node.write(name, spec(node))
    d = start(extra_env={"PATH": f"{shims}:{os.environ['PATH']}"},
              args=("--log-format", "json"))
    d.wait_phase(name, "Failed")

    lines = step_lines(d.log, name)
    by_step = {line["step"]: line for line in lines}
    assert {k: by_step[k]["result"] for k in ("create_image", "map", "format", "stage",
                                              "publish")} == {
        "create_image": "changed", "map": "changed", "format": "failed", "stage": "aborted",
        "publish": "aborted"}, lines
    fmt = by_step["format"]
    assert fmt["level"] == "warning" and "injected failure" in fmt["message"]
    assert fmt["target"] and fmt["target"] in fmt["message"]
    assert by_step["stage"]["target"] == str(node.state / "staging" / name)
    assert by_step["publish"]["target"] == str(node.srv / "app")
    assert by_step["stage"]["duration_ms"] == 0 and "not run" in by_step["stage"]["message"]
    for line in lines:
        assert re.fullmatch(ZONED, line["time"]), line
        assert isinstance(line["duration_ms"], int) and line["duration_ms"] >= 0
        assert line["message"].startswith(f"{name}: ") and \
            f": {line['result']} in {line['duration_ms']} ms" in line["message"], line

    # The chain's outcome is the volume's too, with its result.
    assert [x for x in volume_lines(d.log, name)
            if "step" not in x and x.get("result") == "failed" and "next try in" in x["message"]]

    # mkfs works again: the retry (after its backoff) converges, each step logged.
    flag.unlink()
    seen = len(lines)
    d.wait_phase(name, "Published")
    retry = {line["step"]: line["result"] for line in step_lines(d.log, name)[seen:]}
    assert {k: retry.get(k) for k in ("format", "stage", "publish")} == {
        "format": "changed", "stage": "changed", "publish": "changed"}, retry
    assert [x for x in volume_lines(d.log, name)
            if "step" not in x and x.get("result") == "changed"]
    assert d.stop() == 0


def test_steps_cut_short_by_a_stop_are_logged_aborted(
        node: NodeUnderTest, start: Callable[..., Daemon], tmp_path: Path) -> None:
    """SIGTERM while mkfs hangs: mkfs is killed after the stop grace and its
    step logged aborted, the steps after it aborted as never run."""
    hanging = tmp_path / "mkfs-hanging"
    shims, _ = mkfs_shim(tmp_path, f'touch "{hanging}"; exec sleep 1000')
    node.config.write_text(node.config.read_text()
                           + "timeouts:\n  stopGraceSeconds: 1\n  stopSeconds: 10\n")
    name = node.name("stop")
    node.write(name, spec(node))
    d = start(extra_env={"PATH": f"{shims}:{os.environ['PATH']}"},
              args=("--log-format", "json"))
    wait_for(hanging.exists, "mkfs to hang")
    assert d.stop() == 0
    by_step = {line["step"]: line for line in step_lines(d.log, name)}
    assert {k: by_step[k]["result"] for k in ("map", "format", "stage", "publish")} == {
        "map": "changed", "format": "aborted", "stage": "aborted", "publish": "aborted"}
    assert by_step["format"]["duration_ms"] >= 1000  # it ran until killed after the grace
    assert by_step["stage"]["message"].endswith("(not run: format aborted)")
    assert [x for x in volume_lines(d.log, name)
            if "step" not in x and x.get("result") == "aborted"]
