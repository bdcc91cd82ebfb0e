"""SIGKILL at every command boundary, forward and backward, then converge.

Each node command (mount, umount, losetup, mkfs, blkid, rbd-fuse...) goes
through a shim on PATH that counts calls and, at call number KILL_AT, kills
its parent (the `apply` or daemon process) with SIGKILL before the command
runs. The next, unharmed run must converge: nothing leaked (mounts, loop
devices), nothing formatted twice, the data's checksums unchanged.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import NodeUnderTest, _loops_under
from test_daemon import wait_for
from test_hardening import image_meta
from test_lifecycle import checksum_tree, fs_spec

from reconciler.drivers.reaper import reap_zombies
from reconciler.facts import meta

pytestmark = pytest.mark.ceph

SHIMMED = ("mount", "umount", "losetup", "mkfs.ext4", "blkid", "dumpe2fs", "e2fsck",
           "resize2fs", "rbd-fuse")
CLI = [sys.executable, "-m", "reconciler.cli.main"]


class Killer:
    def __init__(self, node: NodeUnderTest, shims: Path) -> None:
        self.node = node
        self.shims = shims
        self.counter = shims / "count"

    def env(self, kill_at: int) -> dict[str, str]:
        self.counter.write_text("0")
        return {**os.environ, "PATH": f"{self.shims}:{os.environ['PATH']}",
                "KILL_AT": str(kill_at), "PYTHONPATH": str(Path(__file__).resolve().parents[2])}

    def calls(self) -> int:
        return int(self.counter.read_text())

    def apply(self, kill_at: int = 0) -> int:
        proc = subprocess.run([*CLI, "--config", str(self.node.config), "apply"],
                              env=self.env(kill_at), capture_output=True, text=True,
                              timeout=300)
        reap_zombies()
        if kill_at == 0:
            assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.returncode

    def daemon(self, kill_at: int, until: str) -> int:
        """Run the daemon until SIGKILLed at ``kill_at`` or ``until`` is its phase."""
        name = self.node.name("f")
        status = self.node.state / "status" / f"{name}.json"
        status.unlink(missing_ok=True)
        proc = subprocess.Popen([*CLI, "--config", str(self.node.config), "run",
                                 "--log-format", "plain"], env=self.env(kill_at),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_for(lambda: proc.poll() is not None or
                     (status.exists() and f'"phase": "{until}"' in status.read_text()),
                     f"daemon to reach {until} or die", timeout=120)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            rc = proc.wait(timeout=60)
            reap_zombies()
        return rc


@pytest.fixture
def killer(node: NodeUnderTest, tmp_path: Path) -> Iterator[Killer]:
    shims = tmp_path / "shims"
    shims.mkdir()
    for cmd in SHIMMED:
        real = shutil.which(cmd)
        assert real, cmd
        (shims / cmd).write_text(
            "#!/bin/sh\n"
            f'n=$(( $(cat "{shims}/count") + 1 ))\n'
            f'echo "$n" > "{shims}/count"\n'
            'if [ "$n" -eq "${KILL_AT:-0}" ]; then kill -9 "$PPID"; exit 137; fi\n'
            f'exec {real} "$@"\n')
        (shims / cmd).chmod(0o755)
    yield Killer(node, shims)


def assert_clean(node: NodeUnderTest, mapped: bool) -> None:
    loops = _loops_under(node.root, node.tag)
    assert len(loops) == (1 if mapped else 0), loops


def test_sigkill_apply_forward_from_nothing(node: NodeUnderTest, killer: Killer) -> None:
    """Create, map, format, stage, publish: killed at each boundary, then converged."""
    n = 1
    while True:
        name = node.name(f"c{n}")
        app = node.srv / f"app{n}"
        node.write(name, fs_spec(node.cluster.pool, "32Mi", "ext4", [(app, False)],
                                 policy="Delete"))
        if killer.apply(kill_at=n) == 0:
            assert killer.calls() < n
            break
        assert killer.apply() == 0  # the unharmed run converges
        rc, _ = node.plan()
        assert rc == 0, f"not converged after a kill at command {n}"
        assert image_meta(node, name).get(meta.FORMATTED) == "ext4"
        assert meta.FORMATTING not in image_meta(node, name)
        (app / "f").write_text("ok")
        assert_clean(node, mapped=True)
        (node.desired / f"{name}.yaml").write_text(
            (node.desired / f"{name}.yaml").read_text().replace(
                "spec:\n", "spec:\n  state: absent\n"))
        assert killer.apply() == 0
        assert not node.image_exists(name)
        (node.desired / f"{name}.yaml").unlink()
        assert_clean(node, mapped=False)
        n += 1
    assert n > 5, "the forward chain runs more commands than that"


@pytest.mark.parametrize("actor", ["apply", "daemon"])
def test_sigkill_backward_and_forward_keeps_the_data(node: NodeUnderTest, killer: Killer,
                                                     actor: str) -> None:
    name = node.name("f")
    app, view = node.srv / "app", node.srv / "view"
    present = fs_spec(node.cluster.pool, "32Mi", "ext4", [(app, False), (view, True)])
    absent = "  state: absent\n" + present
    node.write(name, present)
    assert killer.apply() == 0
    for i in range(5):
        (app / f"d{i}").write_bytes(os.urandom(5000 * (i + 1)))
    before = checksum_tree(app)

    def run(kill_at: int, until: str) -> bool:
        """True if the run was killed (there was a command number ``kill_at``)."""
        if actor == "apply":
            return killer.apply(kill_at) != 0
        return killer.daemon(kill_at, until) == -signal.SIGKILL

    def converge(until: str) -> None:
        if actor == "apply":
            killer.apply()
        else:
            assert killer.daemon(0, until) == 0
        assert node.plan()[0] == 0

    for direction, spec, phase in (("backward", absent, "Created"),
                                   ("forward", present, "Published")):
        other = present if spec is absent else absent
        other_phase = "Published" if phase == "Created" else "Created"
        n = 1
        while True:
            node.write(name, spec)
            if not run(n, phase):
                break
            converge(phase)
            assert_clean(node, mapped=spec is present)
            if spec is present:
                assert checksum_tree(app) == before, f"{direction} kill at {n}"
            node.write(name, other)  # back to where this direction starts
            converge(other_phase)
            n += 1
        assert n > 2, f"{direction}: no command boundary was exercised"
    assert checksum_tree(app) == before
