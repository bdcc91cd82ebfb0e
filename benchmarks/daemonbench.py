"""What the daemon benchmarks (P3, P12, P13, P15, P16) share besides
harness.py: the config written beside a fresh dev cluster, a wait for a
condition with a deadline while the daemon must stay alive, and, at the
end, the daemon stopped and what it left released through the CLI.

Imported by those benchmarks, never by the product."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from harness import BenchError, DaemonProc, find_cli, fuse_pids_under, run, wait_exit

from reconciler.testing.devcluster import DevCluster


def write_config(root: Path, cluster: DevCluster, template: str, subdirs: Iterable[str],
                 **fields: object) -> Path:
    """Make ``root``'s ``subdirs`` and ``root/config.yaml`` from ``template``:
    desired, state and srv under ``root``, the cluster's conf, user and
    keyring, and ``fields`` (which may name any of them otherwise)."""
    for sub in subdirs:
        (root / sub).mkdir(mode=0o755)
    config = root / "config.yaml"
    config.write_text(template.format(**{
        "desired": root / "desired", "state": root / "state", "srv": root / "srv",
        "conf": cluster.conf, "user": cluster.user, "keyring": cluster.keyring, **fields}))
    return config


def wait_for(daemon: DaemonProc, ok: Callable[[], bool], timeout: float,
             failed: Callable[[], str], poll: float = 0.01, t0: float | None = None) -> float:
    """Poll ``ok`` until it holds; seconds from ``t0`` (default now). Past
    ``timeout`` a BenchError says ``failed()`` with the daemon's log; a
    daemon that exits meanwhile is one too."""
    t0 = time.monotonic() if t0 is None else t0
    while not ok():
        if time.monotonic() - t0 > timeout:
            raise BenchError(f"{failed()}; log:\n{daemon.tail()}")
        daemon.check_alive()
        time.sleep(poll)
    return time.monotonic() - t0


def stop_daemon(daemon: DaemonProc | None, problems: list[str]) -> None:
    """Stop the daemon under test, if it started; an exit other than 0 is a problem."""
    if daemon is not None:
        rc = daemon.stop()
        if rc not in (0, None):
            problems.append(f"daemon exited {rc}")


def release_with_cli(root: Path, files: list[Path] | None, problems: list[str]) -> None:
    """Give back what the daemon left, the reconciler's own way: ``release``
    of ``files`` (copied to root/release), or of every desired volume
    (None); then wait for their rbd-fuse helpers to exit."""
    argv = [str(find_cli()), "--config", str(root / "config.yaml"), "release"]
    if files is not None:
        rel = root / "release"
        rel.mkdir(exist_ok=True)
        for f in files:
            shutil.copy(f, rel / f.name)
        argv.append(str(rel))
    fuse = fuse_pids_under(root)
    try:
        r = run(argv, check=False)
        if r.returncode:
            problems.append(f"release exited {r.returncode}: {r.stdout}{r.stderr}")
    except (BenchError, subprocess.TimeoutExpired) as e:
        problems.append(f"release: {e}")
    for pid in fuse:
        wait_exit(pid)
