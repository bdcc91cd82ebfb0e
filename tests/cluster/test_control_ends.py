"""The command line beside the daemon always ends, and says ok only for
work done (issue 37): an ``apply`` typed while the daemon releases a volume
whose file was removed, and an ``apply`` whose chain a SIGTERM cuts short.

A stand-in earlier on the daemon's PATH holds one command on one volume
until the test opens its gate, so the race is made, not hoped for."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import NodeUnderTest
from test_daemon import ROOT, Daemon, set_resync, spec, start, wait_for  # noqa: F401
from test_stop import STOP_WITHIN_S, StandIn, daemons, stand_in, stop_within  # noqa: F401

pytestmark = pytest.mark.ceph

ENDS_WITHIN_S = 120.0  # a command that has not ended by then never will


class Gate:
    """``command`` waits, on the volume whose mount target is named
    ``target``, until the gate is opened (at most 120 s, then it goes on)."""

    def __init__(self, root: Path, command: str, target: str) -> None:
        self.dir = root / "gated"
        self.dir.mkdir(exist_ok=True)
        self.open_file = root / f"gate-{command}.open"
        self.held = root / f"gate-{command}.held"
        real = shutil.which(command)
        assert real is not None, command
        script = self.dir / command
        script.write_text(f"""#!/bin/sh
for last; do :; done
if [ "${{last##*/}}" = "{target}" ]; then
    : > {self.held}
    i=0
    while [ ! -e {self.open_file} ] && [ $i -lt 1200 ]; do sleep 0.1; i=$((i+1)); done
fi
exec {real} "$@"
""")
        script.chmod(0o755)

    def env(self) -> dict[str, str]:
        return {"PATH": f"{self.dir}:{os.environ['PATH']}"}

    def open(self) -> None:
        self.open_file.touch()


def cli(node: NodeUnderTest, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "reconciler", "--config", str(node.config),
                             *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT)


def ended(proc: subprocess.Popen[str], d: Daemon) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=ENDS_WITHIN_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"the command did not end within {ENDS_WITHIN_S:g} s; printed "
                             f"{out!r} {err!r}; daemon log:\n{d.log.read_text()[-4000:]}"
                             ) from None
    return proc.returncode, out, err


def test_apply_typed_while_a_removed_file_is_released_ends_with_that_release(
        node: NodeUnderTest, start: Callable[..., Daemon]) -> None:  # noqa: F811
    keep, gone = node.name("keep"), node.name("gone")
    node.write(keep, spec(node, target=keep))
    node.write(gone, spec(node, target=gone))
    set_resync(node, 3600)  # only events and the command line start passes
    gate = Gate(node.root, "umount", gone)
    d = start(extra_env=gate.env())
    d.wait_phase(keep, "Published")
    d.wait_phase(gone, "Published")
    try:
        (node.desired / f"{gone}.yaml").unlink()  # a `git pull` that drops a file
        wait_for(gate.held.exists, "the daemon's release of the removed volume to unmount")
        wait_for(lambda: " 1 releasing" in d.log.read_text(), "the pass that released it")
        before = d.passes()
        proc = cli(node, "apply")
        # The apply's pass has named its volumes, the release still held.
        wait_for(lambda: d.passes() > before, "the apply's pass")
    finally:
        gate.open()
    rc, out, err = ended(proc, d)
    assert rc == 0, (out, err)
    assert f"ok: [{keep}]" in out and f"changed: [{gone}]" in out, out
    assert out.rstrip().endswith("recap: ok=1 changed=1 failed=0"), out
    assert d.status(gone)["phase"] == "Released"
    assert d.stop() == 0


def test_apply_whose_chain_a_sigterm_cuts_short_exits_1_and_counts_it(
        node: NodeUnderTest, stand_in: StandIn,  # noqa: F811
        daemons: Callable[..., Daemon]) -> None:  # noqa: F811
    stuck = stand_in.image
    stand_in.install("mkfs.ext4")
    set_resync(node, 3600)
    d = daemons(extra_env=stand_in.env())
    wait_for(lambda: d.saw("READY=1"), "READY=1")
    node.write(stuck, spec(node, target=stuck))
    proc = cli(node, "apply", stuck)
    wait_for(stand_in.started, "mkfs to hang on the volume asked for")
    assert stop_within(d, STOP_WITHIN_S) == 0  # an upgrade's try-restart
    rc, out, err = ended(proc, d)
    # Not published: `apply v3 && start-app` must not start the app.
    assert rc == 1, (out, err)
    assert f"aborted: [{stuck}]" in out, out
    assert "aborted=1" in out.splitlines()[-1], out
