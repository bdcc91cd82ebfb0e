"""The daemon as a real process on the real cluster: files in, mounts out."""

from __future__ import annotations

import contextlib
import json
import os
import re
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
ROOT = Path(__file__).resolve().parents[2]
DEADLINE = 120.0  # generous: a loaded 2-core machine is slow, a healthy run is not


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

    def wait_phase(self, name: str, phase: str, generation: str | None = None,
                   timeout: float = DEADLINE) -> dict:
        def ok() -> dict | None:
            s = self.status(name)
            if s.get("phase") == phase and (generation is None or
                                            s.get("observedGeneration") != generation):
                return s
            assert self.proc.poll() is None, self.log.read_text()
            return None
        try:
            return wait_for(ok, f"{name} to be {phase}", timeout)  # type: ignore[return-value]
        except AssertionError as exc:
            # The log as it is now (not as it was when the wait began), and
            # every thread's stack (faulthandler on SIGUSR1): why it is stuck.
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGUSR1)
                with contextlib.suppress(AssertionError):
                    wait_for(lambda: "Thread 0x" in self.log.read_text()
                             or "Current thread" in self.log.read_text(), "the stack dump", 10)
            raise AssertionError(f"{exc}; status {self.status(name)}; log:\n"
                                 f"{self.log.read_text()[-6000:]}") from None

    def passes(self) -> int:
        """Passes logged so far (one info line per pass)."""
        return len(re.findall(r" pass \d+: ", self.log.read_text()))

    def wait_passes(self, n: int) -> None:
        """Wait until ``n`` more passes have run."""
        target = self.passes() + n
        wait_for(lambda: self.passes() >= target, f"{n} more passes")

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


def set_observe_timeout(node: NodeUnderTest, seconds: float) -> None:
    node.config.write_text(node.config.read_text() + f"observeTimeoutSeconds: {seconds}\n")


def test_files_in_mounts_out(node: NodeUnderTest, start: Callable[..., Daemon]) -> None:
    a, b, keep = node.name("a"), node.name("b"), node.name("keep")
    node.write(a, spec(node, target="a"))
    d = start()
    wait_for(lambda: d.saw("READY=1"), "READY=1")
    # READY=1 comes once the first pass's volumes are up: what is ordered
    # After= the unit (an application) finds them mounted at boot.
    assert str(node.srv / "a") in node.mounts()
    d.wait_phase(a, "Published")

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


def test_the_daemon_dumps_no_core(node: NodeUnderTest, start: Callable[..., Daemon]) -> None:
    """It holds node keys and unsealed passphrases: RLIMIT_CORE 0 (and
    non-dumpable, which tests/unit/cli/test_nodump.py reads with
    PR_GET_DUMPABLE on the same start-up path), whatever the unit says."""
    d = start()
    wait_for(lambda: d.saw("READY=1"), "READY=1")
    limits = Path(f"/proc/{d.proc.pid}/limits").read_text()
    core = next(line for line in limits.splitlines() if line.startswith("Max core file size"))
    assert core.split()[4:6] == ["0", "0"], core
    assert d.stop() == 0


def test_unit_files_verify(tmp_path: Path) -> None:
    unit = (ROOT / "systemd" / "rbd-reconciler.service").read_text()
    # Only what every Debian 12 has: /bin/kill is procps's, which minimal
    # images leave out (systemd-analyze verify there: "not executable").
    execs = [line for line in unit.splitlines() if line.startswith("Exec")]
    assert not [e for e in execs if "/bin/kill" in e], execs
    assert "ExecReload=/bin/sh -c 'kill -HUP \"$MAINPID\"'" in execs, execs
    exe = shutil.which("rbd-reconciler") or str(ROOT / ".venv" / "bin" / "rbd-reconciler")
    (tmp_path / "rbd-reconciler.service").write_text(
        unit.replace("/usr/bin/rbd-reconciler", exe))
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


# --- issue 7, items 11, 12, 15, 17 -------------------------------------------


def test_dead_pool_holds_up_nobody(node: NodeUnderTest, start: Callable[..., Daemon],
                                   dead_pool: str) -> None:
    """A pool whose PGs map to no OSD: its volume is Unknown (never Absent, never
    acted on); healthy volumes publish and `status` answers meanwhile."""
    set_resync(node, 1)
    set_observe_timeout(node, 2)
    dead, ok, new = node.name("dead"), node.name("ok"), node.name("new")
    fdead = node.write(dead, spec(node, target="dead").replace(node.cluster.pool, dead_pool))
    node.write(ok, spec(node, target="ok"))
    d = start()
    # librados would wait 30 s (its op timeout) on the dead pool: 20 s is "at all".
    d.wait_phase(ok, "Published", timeout=20)
    s = d.wait_phase(dead, "Unknown", timeout=20)
    assert dead_pool in s["message"] and "unknown, not absent" in s["message"]
    node.write(new, spec(node, target="new"))
    d.wait_phase(new, "Published", timeout=20)

    t0 = time.monotonic()
    rc, doc = node.cli_json("status")
    assert time.monotonic() - t0 < 20  # answered at all (the dead pool alone takes 30 s)
    phases = {r["name"]: r["phase"] for r in doc["volumes"]}
    assert phases == {dead: "UNKNOWN", ok: "PUBLISHED", new: "PUBLISHED"}, doc
    assert rc == 1
    assert d.status(dead)["phase"] == "Unknown"
    assert str(node.srv / "dead") not in node.mounts()
    d.wait_passes(3)  # a lasting condition is logged once, not every pass
    assert d.log.read_text().count(f"{dead}: unknown: ") == 1
    fdead.unlink()
    assert d.stop() == 0


class FakeBlkid:
    """A `blkid` first on PATH that blocks for chosen devices, as blkid on a
    wedged OSD sits in D state (a real wedged OSD would break the shared
    cluster); other devices go to the real one. Every call is logged."""

    def __init__(self, root: Path) -> None:
        self.bin = root / "fakebin"
        self.bin.mkdir()
        self.calls_log, self.stalled, self.released = (
            root / "blkid.calls", root / "blkid.stall", root / "blkid.release")
        self.stalled.touch()
        real = shutil.which("blkid")
        script = self.bin / "blkid"
        script.write_text(
            "#!/bin/sh\n"
            'for dev; do :; done\n'  # the last argument: the device
            f'echo "$dev" >> {self.calls_log}\n'
            f'if grep -qxF "$dev" {self.stalled}; then\n'
            f'  while [ ! -e {self.released} ]; do sleep 0.05; done\n'
            "fi\n"
            f'exec {real} "$@"\n')
        script.chmod(0o755)
        self.path = f"{self.bin}:{os.environ['PATH']}"

    def stall(self, device: str) -> None:
        self.stalled.write_text(device + "\n")

    def release(self) -> None:
        self.released.touch()

    def calls(self, device: str) -> int:
        return self.calls_log.read_text().split().count(device) if self.calls_log.exists() else 0


def test_stalled_probe_holds_up_nobody(node: NodeUnderTest, start: Callable[..., Daemon],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    set_resync(node, 0.5)
    set_observe_timeout(node, 1)
    fake = FakeBlkid(node.root)
    slow, other = node.name("slow"), node.name("other")
    # Mapped only: a device mounted at its staging path is never probed (the
    # mount proves its filesystem), an unmounted one is.
    node.write(slow, f"  image: {{pool: {node.cluster.pool}, size: 64Mi}}\n"
                     "  map: {mapper: fuse}\n")
    d = start(extra_env={"PATH": fake.path, "WATCHDOG_USEC": "400000"})
    try:
        d.wait_phase(slow, "Mapped")
        device = str(wait_for(lambda: d.status(slow).get("device"), "a converged status"))
        fake.stall(device)
        # A write at its start: the cached probe no longer holds, it is probed again.
        subprocess.run(["dd", "if=/dev/urandom", f"of={device}", "bs=4096", "count=1",
                        "seek=8", "oflag=direct", "conv=notrunc", "status=none"], check=True)
        s = d.wait_phase(slow, "Unknown")
        assert "probe timed out" in s["message"] and device in s["message"]
        stuck_calls = fake.calls(device)
        # The main loop is not inside the pass: the watchdog is still pinged...
        d.drain()
        d.messages.clear()
        wait_for(lambda: d.saw("WATCHDOG=1"), "a watchdog ping while a probe is stuck")
        # ...a new volume converges, and passes go on without re-probing the
        # stuck device (one stuck thread per device at most).
        node.write(other, spec(node, target="other"))
        d.wait_phase(other, "Published")
        d.wait_passes(3)
        assert fake.calls(device) == stuck_calls
        assert d.status(slow)["phase"] == "Unknown"
        assert Path(device).is_block_device()  # nothing was done to it

        # The CLI answers too, with UNKNOWN for what it could not see.
        monkeypatch.setenv("PATH", fake.path)
        rc, doc = node.cli_json("status")
        rows = {r["name"]: r for r in doc["volumes"]}
        assert rc == 1 and rows[other]["phase"] == "PUBLISHED"
        assert rows[slow]["phase"] == "UNKNOWN" and "probe" in rows[slow]["unknown"]
        rc, out = node.cli("explain", slow)
        assert rc == 1 and "UNKNOWN" in out
        rc, doc = node.plan()
        assert rc == 1
        assert {v["name"]: v["phase"] for v in doc["volumes"]}[slow] == "UNKNOWN"
    finally:
        fake.release()
    d.wait_phase(slow, "Mapped")
    assert d.stop() == 0


def test_rename_and_break_in_one_change_releases_nothing(
        node: NodeUnderTest, start: Callable[..., Daemon]) -> None:
    set_resync(node, 0.5)
    a, b = node.name("ren"), node.name("other")
    fa = node.write(a, spec(node, target="a"))
    node.write(b, spec(node, target="b"))
    d = start()
    d.wait_phase(a, "Published")
    d.wait_phase(b, "Published")
    good = fa.read_text()
    renamed = node.desired / "renamed.yaml"
    renamed.write_text(good + "  broken: [\n")  # a YAML error hides the name
    fa.unlink()
    s = d.wait_phase(a, "Frozen")
    assert s["message"] == f"removal held: {renamed} fails to load", s
    assert "removal held" in node.cli("explain", a)[1]  # the daemon's word, by name
    d.wait_passes(3)
    assert d.status(a)["phase"] == "Frozen"
    assert str(node.srv / "a") in node.mounts()
    renamed.write_text(good)  # fixed under its new name: the same volume, untouched
    wait_for(lambda: d.status(a).get("phase") == "Published", "the thaw")
    assert str(node.srv / "a") in node.mounts()
    # Its first publish is the only chain it ever ran: never released.
    assert len(re.findall(rf"{a}: \d+ step\(s\) start", d.log.read_text())) == 1
    assert d.stop() == 0


def test_removal_while_another_file_fails_is_held_then_done(
        node: NodeUnderTest, start: Callable[..., Daemon]) -> None:
    """Removing 1 of 2 files while the other fails to load: held (it might be
    declared there), not refused as a mass removal; released once it loads."""
    set_resync(node, 0.5)
    a, b = node.name("gone"), node.name("broken")
    fa = node.write(a, spec(node, target="a"))
    fb = node.write(b, spec(node, target="b"))
    d = start()
    d.wait_phase(a, "Published")
    d.wait_phase(b, "Published")
    good = fb.read_text()
    fb.write_text(good.replace("size: 64Mi", "size: 64 megs"))
    d.wait_phase(b, "Frozen")
    fa.unlink()
    s = d.wait_phase(a, "Frozen")
    assert s["reason"] == "RemovalHeld" and str(fb) in s["message"]
    assert str(node.srv / "a") in node.mounts()
    fb.write_text(good)
    d.wait_phase(a, "Released")
    d.wait_phase(b, "Published")
    assert str(node.srv / "a") not in node.mounts()
    assert "vanished in one pass" not in d.log.read_text()
    assert d.stop() == 0


def test_allow_removal_without_restart_and_logged_once(
        node: NodeUnderTest, start: Callable[..., Daemon]) -> None:
    set_resync(node, 0.3)
    names = [node.name(f"m{i}") for i in range(2)]
    for n in names:
        node.write(n, spec(node, target=n))
    d = start()
    for n in names:
        d.wait_phase(n, "Published")
    for p in list(node.desired.iterdir()):
        p.unlink()
    wait_for(lambda: "vanished in one pass" in d.log.read_text(), "the guard to speak")
    d.wait_passes(5)
    assert d.log.read_text().count("vanished in one pass") == 1  # once, not every pass

    rc, out = node.cli("allow-removal", names[0])
    assert rc == 0, out
    d.wait_phase(names[0], "Released")
    assert str(node.srv / names[0]) not in node.mounts()
    assert str(node.srv / names[1]) in node.mounts()  # still guarded: all of it vanished
    assert not (node.state / "allow-removal.json").exists()  # consumed

    rc, out = node.cli("allow-removal", "--all")
    assert rc == 0, out
    d.wait_phase(names[1], "Released")
    assert str(node.srv / names[1]) not in node.mounts()
    wait_for(lambda: "no longer: " in d.log.read_text(), "the end of the condition logged")
    assert node.cli("allow-removal", "nosuch")[0] == 1
    # One info line per pass, with its duration and counts.
    seq = [int(x) for x in re.findall(r" pass (\d+): .* pass \d+ ms", d.log.read_text())]
    assert seq and seq == sorted(set(seq)), seq
    assert d.stop() == 0


def test_watchdog_liveness_looks_at_the_pass_thread_only(tmp_path: Path) -> None:
    from dataclasses import replace

    from reconciler.daemon.service import Daemon as RunLoop
    from reconciler.spec.config import default_config

    loop = RunLoop(replace(default_config(), state_dir=tmp_path, resync_seconds=1), None)
    assert loop._alive()  # waiting for the next pass
    loop.busy_since = time.monotonic()
    assert loop._alive()  # inside a pass: bounded by the observe deadlines
    loop.busy_since = time.monotonic() - 3600
    assert not loop._alive()  # stuck past any deadline: let systemd restart it
    loop.pool.shutdown()
