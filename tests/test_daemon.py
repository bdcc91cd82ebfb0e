"""The daemon as a real process on the real cluster: files in, mounts out."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import NodeUnderTest

pytestmark = pytest.mark.ceph
ROOT = Path(__file__).resolve().parent.parent
DEADLINE = 60.0


def wait_for(cond: Callable[[], object], what: str, timeout: float = DEADLINE) -> object:
    """Poll a condition with a deadline (never a bare sleep as synchronisation)."""
    end = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


class Daemon:
    def __init__(self, node: NodeUnderTest, extra_env: dict[str, str] | None = None,
                 args: tuple[str, ...] = ()) -> None:
        self.node = node
        self.notify_path = node.root / f"notify-{time.monotonic_ns()}.sock"
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(str(self.notify_path))
        self.notify.setblocking(False)  # drain() takes what is there, never waits
        self.messages: list[str] = []
        self.log = node.root / f"daemon-{time.monotonic_ns()}.log"
        env = {**os.environ, "NOTIFY_SOCKET": str(self.notify_path), **(extra_env or {})}
        self.logf = open(self.log, "ab")  # noqa: SIM115 - closed in stop()
        # setpriv --pdeathsig: a killed test run takes its daemon along.
        self.proc = subprocess.Popen(
            ["setpriv", "--pdeathsig", "KILL", sys.executable, "-m", "reconciler",
             "--config", str(node.config), "run", "--log-format", "plain", *args],
            env=env, stdout=self.logf, stderr=self.logf, cwd=ROOT)

    def drain(self) -> list[str]:
        while self.notify.fileno() != -1:
            try:
                self.messages.append(self.notify.recv(4096).decode())
            except BlockingIOError:
                break
        return self.messages

    def saw(self, prefix: str) -> bool:
        return any(m.startswith(prefix) for m in self.drain())

    def status(self, name: str) -> dict:
        try:
            return json.loads((self.node.state / "status" / f"{name}.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def wait_phase(self, name: str, phase: str, generation: str | None = None) -> dict:
        def ok() -> dict | None:
            s = self.status(name)
            if s.get("phase") == phase and (generation is None or
                                            s.get("observedGeneration") != generation):
                return s
            assert self.proc.poll() is None, self.log.read_text()
            return None
        return wait_for(ok, f"{name} to be {phase}; log:\n{self.log.read_text()[-3000:]}")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGUSR1)  # faulthandler: every stack, to the log
            time.sleep(1)
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(
                f"daemon ignored SIGTERM:\n{self.log.read_text()[-6000:]}") from None
        finally:
            self.drain()
            self.notify.close()
            self.logf.close()
        return rc


@pytest.fixture
def start(node: NodeUnderTest) -> Iterator[Callable[..., Daemon]]:
    started: list[Daemon] = []

    def _start(**kw: object) -> Daemon:
        d = Daemon(node, **kw)  # type: ignore[arg-type]
        started.append(d)
        return d

    yield _start
    for d in started:
        if d.proc.poll() is None:
            d.stop()


def spec(node: NodeUnderTest, size: str = "64Mi", target: str = "app", extra: str = "") -> str:
    return (f"{extra}  image: {{pool: {node.cluster.pool}, size: {size}}}\n"
            f"  map: {{mapper: fuse}}\n  stage: {{fsType: ext4}}\n"
            f"  publish:\n    - path: {node.srv / target}\n")


def set_resync(node: NodeUnderTest, seconds: float) -> None:
    node.config.write_text(node.config.read_text() + f"resyncSeconds: {seconds}\n")


def test_files_in_mounts_out(node: NodeUnderTest, start: Callable[..., Daemon]) -> None:
    a, b, keep = node.name("a"), node.name("b"), node.name("keep")
    node.write(a, spec(node, target="a"))
    d = start()
    wait_for(lambda: d.saw("READY=1"), "READY=1")
    d.wait_phase(a, "Published")
    assert str(node.srv / "a") in node.mounts()

    # A new file: converged without a restart.
    fb = node.write(b, spec(node, size="320Mi", target="b").replace("ext4", "xfs"))
    node.write(keep, spec(node, target="k", extra="  onRemove: keep\n"))
    d.wait_phase(b, "Published")
    d.wait_phase(keep, "Published")

    # Edit: grow. The status moves to the new generation.
    gen = d.status(b)["observedGeneration"]
    fb.write_text(fb.read_text().replace("320Mi", "400Mi"))
    d.wait_phase(b, "Published", generation=gen)
    assert d.status(b)["lastResult"] == "changed"

    # Removed file: released (image kept); onRemove: keep leaves it mounted.
    fb.unlink()
    d.wait_phase(b, "Released")
    assert str(node.srv / "b") not in node.mounts() and node.image_exists(b)
    (node.desired / f"{keep}.yaml").unlink()
    d.wait_phase(keep, "Released")
    assert str(node.srv / "k") in node.mounts()
    assert d.stop() == 0
    # 'keep' is no longer managed: give it back by hand for the leak check.
    node.write(keep, spec(node, target="k"))


def test_mass_removal_is_refused(node: NodeUnderTest, start: Callable[..., Daemon]) -> None:
    names = [node.name(f"m{i}") for i in range(2)]
    for n in names:
        node.write(n, spec(node, target=n))
    d = start()
    for n in names:
        d.wait_phase(n, "Published")
    saved = {p.name: p.read_text() for p in node.desired.iterdir()}
    for p in list(node.desired.iterdir()):
        p.unlink()
    wait_for(lambda: "vanished in one pass" in d.log.read_text(), "the guard to speak")
    assert all(str(node.srv / n) in node.mounts() for n in names)
    assert all(d.status(n)["phase"] == "Published" for n in names)
    assert d.stop() == 0
    for name, text in saved.items():
        (node.desired / name).write_text(text)


def test_drift_repaired_at_resync(node: NodeUnderTest, start: Callable[..., Daemon]) -> None:
    set_resync(node, 0.5)
    name = node.name("drift")
    node.write(name, spec(node))
    d = start()
    d.wait_phase(name, "Published")
    subprocess.run(["umount", str(node.srv / "app")], check=True)
    wait_for(lambda: str(node.srv / "app") in node.mounts(), "the resync to republish")
    assert d.stop() == 0


def test_invalid_file_freezes_then_recovers(node: NodeUnderTest,
                                            start: Callable[..., Daemon]) -> None:
    name = node.name("frz")
    f = node.write(name, spec(node))
    d = start()
    d.wait_phase(name, "Published")
    good = f.read_text()
    f.write_text(good.replace("size: 64Mi", "size: 64 megs"))
    d.wait_phase(name, "Frozen")
    assert str(node.srv / "app") in node.mounts()
    f.write_text(good.replace("64Mi", "96Mi"))
    d.wait_phase(name, "Published")
    wait_for(lambda: d.status(name).get("lastResult") == "changed", "the grow after thaw")
    assert d.stop() == 0


def test_symlink_swap_of_the_whole_directory(node: NodeUnderTest,
                                             start: Callable[..., Daemon]) -> None:
    # git-sync --link style: desiredDir is a symlink swapped atomically.
    a, b = node.name("sa"), node.name("sb")
    v1, v2 = node.root / "v1", node.root / "v2"
    node.write(a, spec(node, target="a"))
    shutil.copytree(node.desired, v1)
    shutil.copytree(node.desired, v2)
    node.desired.rename(node.root / "desired.orig")
    link = node.desired
    link.symlink_to(v1)
    d = start()
    d.wait_phase(a, "Published")
    node.desired = v2  # write b into v2 only
    node.write(b, spec(node, target="b"))
    node.desired = link
    tmp = node.root / "desired.tmp"
    tmp.symlink_to(v2)
    os.replace(tmp, link)
    d.wait_phase(b, "Published")
    assert d.status(a)["phase"] == "Published"
    assert d.stop() == 0


def test_sigkill_mid_stage_then_restart_converges(node: NodeUnderTest,
                                                  start: Callable[..., Daemon]) -> None:
    name = node.name("kill")
    node.write(name, spec(node, size="320Mi").replace("fsType: ext4", "fsType: xfs"))
    d = start()
    wait_for(lambda: "step(s) start" in d.log.read_text(), "the first step")
    d.stop(signal.SIGKILL)
    d2 = start()
    d2.wait_phase(name, "Published")
    mounts = node.mounts()
    fuse = [m for m in mounts if "/fuse/" in m]
    assert len(fuse) == 1, mounts  # no second rbd-fuse for the same image
    (node.srv / "app" / "x").write_text("data")
    assert d2.stop() == 0
    assert (node.srv / "app" / "x").read_text() == "data"  # mounts outlive the daemon


def test_sigterm_leaves_mounts_and_restart_changes_nothing(
        node: NodeUnderTest, start: Callable[..., Daemon]) -> None:
    name = node.name("term")
    node.write(name, spec(node))
    d = start(extra_env={"WATCHDOG_USEC": "200000"})
    d.wait_phase(name, "Published")
    wait_for(lambda: d.saw("WATCHDOG=1"), "a watchdog ping")
    t0 = time.monotonic()
    assert d.stop() == 0
    assert time.monotonic() - t0 < 30
    assert d.saw("STOPPING=1")
    assert str(node.srv / "app") in node.mounts()
    assert node.plan()[0] == 0
    d2 = start()
    wait_for(lambda: d2.saw("READY=1"), "READY=1 after restart")
    wait_for(lambda: d2.status(name).get("updated"), "a status write")
    assert "step(s) start" not in d2.log.read_text()
    assert d2.stop() == 0


def test_refuses_a_world_writable_directory(node: NodeUnderTest,
                                            start: Callable[..., Daemon]) -> None:
    node.desired.chmod(0o777)
    try:
        d = start()
        assert d.proc.wait(timeout=30) == 1
        assert "writable by group or others" in d.log.read_text()
    finally:
        node.desired.chmod(0o755)


def test_refuses_a_symlink_out_of_the_directory(node: NodeUnderTest,
                                                start: Callable[..., Daemon]) -> None:
    outside = node.root / "elsewhere.yaml"
    outside.write_text("")
    (node.desired / "evil.yaml").symlink_to(outside)
    d = start()
    assert d.proc.wait(timeout=30) == 1
    assert "outside" in d.log.read_text()
    (node.desired / "evil.yaml").unlink()


def test_one_instance_per_state_dir(node: NodeUnderTest, start: Callable[..., Daemon]) -> None:
    d = start()
    wait_for(lambda: d.saw("READY=1"), "READY=1")
    d2 = start()
    assert d2.proc.wait(timeout=30) == 1
    assert "in use by another" in d2.log.read_text()
    assert d.stop() == 0


def test_unit_files_verify(tmp_path: Path) -> None:
    unit = (ROOT / "systemd" / "rbd-reconciler.service").read_text()
    exe = shutil.which("rbd-reconciler") or str(ROOT / ".venv" / "bin" / "rbd-reconciler")
    (tmp_path / "rbd-reconciler.service").write_text(
        unit.replace("/usr/local/bin/rbd-reconciler", exe))
    proc = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "rbd-reconciler.service")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "rbd-reconciler.service" not in proc.stderr, proc.stderr  # no warnings about it
    root = tmp_path / "root"
    root.mkdir()
    proc = subprocess.run(["systemd-tmpfiles", "--create", f"--root={root}",
                           str(ROOT / "systemd" / "rbd-reconciler.tmpfiles.conf")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert oct((root / "var/lib/rbd-reconciler").stat().st_mode & 0o777) == "0o700"
    assert (root / "etc/rbd-reconciler/volumes.d").is_dir()
