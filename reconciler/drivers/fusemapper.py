"""The fuse-loop mapper: ``rbd-fuse`` serves the image as a file in a
private FUSE mount (one directory per image under <stateDir>/fuse), and a
loop device (``losetup --direct-io=on``) makes the file a block device.
Teardown order matters: loop device first, then the FUSE mount. Also the
rbd-fuse helpers we started (reaped here), the ones serving a mount (found
by their arguments in /proc), and loop devices read from sysfs.

Imported by observe/node.py (``Node.mapper``), engine/unwedge.py and the
commands that build a mapper; the common part is drivers/mappers.py.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from reconciler.drivers import procfs, scopes
from reconciler.drivers.fs import block_device_size
from reconciler.drivers.mappers import ceph_args
from reconciler.drivers.reaper import reap_later
from reconciler.drivers.run import TIMED_OUT, CommandError, Runner, last_lines
from reconciler.facts.observed import Mapping
from reconciler.facts.parsers import LoopDevice, parse_losetup_json, parse_mountinfo
from reconciler.spec.config import CephConfig

TYPE_CHECKING = False
if TYPE_CHECKING:  # loaded only to end a FUSE connection that does not answer
    from reconciler.drivers import fuseforce

FUSE_FSTYPE = "fuse.rbd-fuse"
FUSE_START_TIMEOUT = 30.0
HELPER_EXIT_S = 30.0  # after its unmount, an rbd-fuse helper exits by itself this soon
# rbd-fuse children we started, by mount point, so we can reap them.
_fuse_children: dict[str, subprocess.Popen[bytes]] = {}


@dataclass
class FuseMapper:
    ceph: CephConfig
    root: Path  # <stateDir>/fuse: one private mount directory per image
    runner: Runner
    kind: str = "fuse"
    # rbd-fuse in a systemd scope of its own (drivers/scopes.py).
    scopes: bool = False
    _helpers: dict[str, int] = field(default_factory=dict, repr=False)  # mount -> pid

    def mount_point(self, pool: str, image: str) -> Path:
        # '@' is in neither pool nor image names (the schema forbids it).
        return self.root / f"{pool}@{image}"

    def map(self, pool: str, image: str, options: tuple[str, ...]) -> str:
        mnt = self.mount_point(pool, image)
        mnt.mkdir(parents=True, exist_ok=True)
        if not _is_mounted(str(mnt)):
            self._start_fuse(pool, image, mnt)
        try:
            out = self.runner.run(["losetup", "--find", "--show", "--direct-io=on", "--",
                                   str(mnt / image)])
        except CommandError:
            self._stop_fuse(mnt)
            raise
        return out.stdout.strip()

    def fuse_command(self, pool: str, image: str, mnt: Path) -> list[str]:
        # attr_timeout=0: the kernel asks rbd-fuse for the file size each time,
        # so a resize is seen by the next `losetup -c`, not a second later.
        # rbd-fuse takes no "--" before the mount point (it appends its own
        # -o after it: measured), so that is our own absolute path, checked.
        if not mnt.is_absolute():
            raise ValueError(f"{mnt}: the FUSE mount point must be an absolute path")
        return ["rbd-fuse", *ceph_args(self.ceph), f"--poolname={pool}", f"--image={image}",
                "-o", "attr_timeout=0", str(mnt), "-f"]

    def start_command(self, pool: str, image: str, mnt: Path) -> list[str]:
        """What starts the helper: rbd-fuse, in a scope of its own if so set
        (systemd-run execs it: the pid we get is rbd-fuse's)."""
        argv = self.fuse_command(pool, image, mnt)
        return scopes.wrap(argv, self.kind, pool, image) if self.scopes else argv

    def _start_fuse(self, pool: str, image: str, mnt: Path) -> None:
        logfile = mnt.with_suffix(".log")
        argv = self.start_command(pool, image, mnt)
        self.runner.history.append(argv)
        # O_NOFOLLOW: a symlink here is never appended through (the state dir is root's).
        with os.fdopen(os.open(logfile, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW
                               | os.O_CLOEXEC, 0o600), "ab") as out:
            # Own session: a Ctrl-C at the CLI must not kill the volume's I/O path.
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                    start_new_session=True)
        _fuse_children[str(mnt)] = proc
        deadline = time.monotonic() + FUSE_START_TIMEOUT
        while not _is_mounted(str(mnt)):
            if proc.poll() is not None:
                _fuse_children.pop(str(mnt), None)
                raise CommandError(argv, proc.returncode, _tail(logfile))
            if time.monotonic() > deadline:
                proc.kill()
                reap_later(proc, 1.0)  # one stuck mounting in the kernel is not waited for
                _fuse_children.pop(str(mnt), None)
                raise CommandError(argv, 124, "rbd-fuse did not mount in time; "
                                   + _tail(logfile))
            time.sleep(0.005)  # rbd-fuse mounts in ~30 ms; do not add a tick to it

    def _stop_fuse(self, mnt: Path) -> None:
        if _is_mounted(str(mnt)):
            try:
                _retry_busy(lambda: self.runner.run(["umount", "--", str(mnt)]))
            except CommandError as exc:
                if exc.returncode != TIMED_OUT:
                    raise
                # Its umount ran into its deadline: the helper does not answer,
                # and that umount (killed, in D state) waits on it for ever.
                from reconciler.drivers import fuseforce

                forced = self.force_off(str(mnt))
                if forced is None:
                    raise
                if forced.left is None:
                    with contextlib.suppress(OSError):
                        mnt.rmdir()
                raise fuseforce.ForcedOff(f"{exc}; its rbd-fuse helper does not answer: "
                                          f"{forced.describe()}") from None
        proc = _fuse_children.pop(str(mnt), None)
        if proc is not None and not reap_later(proc, HELPER_EXIT_S):
            proc.kill()  # reaped by the thread reap_later started
        with contextlib.suppress(FileNotFoundError):
            mnt.rmdir()

    def force_off(self, mount_point: str, runner: Runner | None = None, *,
                  only_if_waiting: bool = False, unmount: bool = True
                  ) -> fuseforce.Forced | None:
        """End the FUSE connection of our mount at ``mount_point`` whose helper
        does not answer (drivers/fuseforce.py). None when no mount there is
        provably ours (an rbd-fuse mount in our own directory), or, with
        ``only_if_waiting``, when none of its requests waits for an answer.
        ``runner``: one a deadline has not halted, if ``self.runner``'s has."""
        from reconciler.drivers import fuseforce

        if not mount_point.startswith(str(self.root) + "/"):
            return None
        top = fuseforce.top_mount(mount_point)
        if top is None or top.fs_type != FUSE_FSTYPE:
            return None
        return fuseforce.force_off(
            top, helpers_serving(mount_point),
            lambda pid: mount_point in _helper_args(Path(f"/proc/{pid}")),
            runner or self.runner, only_if_waiting=only_if_waiting, unmount=unmount)

    def unmap(self, mapping: Mapping, force: bool = False) -> None:
        mnt = Path(mapping.fuse_mount) if mapping.fuse_mount else self.mount_point(
            mapping.pool, mapping.image)
        if mapping.device:
            # --detach=X: with "-d -- X", losetup takes "--" as the device (measured).
            self.runner.run(["losetup", f"--detach={mapping.device}"])
        self._stop_fuse(mnt)

    def refresh(self, device: str, size: int, timeout: float = 15.0) -> None:
        """Make the loop device see the resized image. The kernel caches the
        FUSE file's attributes (about 1 s), so ``losetup -c`` right after a
        resize can read the old size: repeat until the device is ``size``."""
        deadline = time.monotonic() + timeout
        while True:
            self.runner.run(["losetup", f"--set-capacity={device}"])
            now = block_device_size(device)
            if now >= size:
                return
            if time.monotonic() > deadline:
                raise CommandError(["losetup", "-c", device], 1,
                                   f"{device} is still {now} bytes, expected {size}")
            time.sleep(0.1)

    def list(self, mountinfo: str | None = None, losetup_json: str | None = None,
             helpers: set[str] | None = None) -> list[Mapping]:
        mounts = parse_mountinfo(mountinfo if mountinfo is not None else procfs.mountinfo())
        found = (parse_losetup_json(losetup_json) if losetup_json is not None
                 else loop_devices())
        loops = {lo.back_file: lo.name for lo in found}
        prefix = str(self.root) + "/"
        ours = []
        for m in mounts:
            if m.fs_type != FUSE_FSTYPE or not m.mount_point.startswith(prefix):
                continue
            pool, _, image = m.mount_point[len(prefix):].partition("@")
            if image and "/" not in image:
                ours.append((m, pool, image))
        if helpers is None and ours:
            helpers = self.helper_mounts()
            if any(m.mount_point not in helpers for m, _, _ in ours):
                self.scan_helpers()  # a helper started since, or really gone
                helpers = self.helper_mounts()
        out = []
        for m, pool, image in ours:
            assert helpers is not None
            problem = None if m.mount_point in helpers else (
                "its rbd-fuse helper is gone: the FUSE mount answers ENOTCONN and every "
                "read or write of the device fails")
            out.append(Mapping("fuse", pool, image, loops.get(f"{m.mount_point}/{image}"),
                               fuse_mount=m.mount_point, problem=problem))
        return out

    def helper_mounts(self, proc: Path = Path("/proc")) -> set[str]:
        """Mount points served by a live rbd-fuse process (its path arguments).
        A process table scan, not a stat of the mount: a stat would wait on a
        helper that is alive but stalled on Ceph. The pids found are kept, so
        a later pass re-checks each one (two small reads) and scans the whole
        table only when a mount has no live helper on record."""
        alive = {mnt: pid for mnt, pid in self._helpers.items()
                 if mnt in _helper_args(proc / str(pid))}
        self._helpers = alive
        return set(alive)

    def helper_pids(self) -> dict[str, int]:
        """Mount point -> pid of the rbd-fuse helpers known to be serving it:
        those started here and those found by the last listing."""
        return {**self._helpers, **fuse_pids()}

    def scan_helpers(self, proc: Path = Path("/proc")) -> None:
        found: dict[str, int] = {}
        for pid_dir in proc.glob("[0-9]*"):
            for mnt in _helper_args(pid_dir):
                found[mnt] = int(pid_dir.name)
        self._helpers = found

def helpers_serving(mount_point: str, proc: Path = Path("/proc")) -> list[int]:
    """Every live rbd-fuse process serving ``mount_point`` (by its arguments)."""
    return sorted(int(d.name) for d in proc.glob("[0-9]*") if mount_point in _helper_args(d))


def _helper_args(pid_dir: Path) -> set[str]:
    """The path arguments of a live (not zombie) rbd-fuse process, else empty."""
    try:
        # comm first: a cmdline read takes the process's mm lock, which one
        # stuck in a page fault on a stalled device can hold up for as long.
        # (A comm that cannot be read says nothing: the command line decides.)
        with contextlib.suppress(OSError):
            if procfs.read_text(pid_dir / "comm").rstrip("\n") != "rbd-fuse":
                return set()
        args = (pid_dir / "cmdline").read_bytes().split(b"\0")
        if not args or not args[0].endswith(b"rbd-fuse"):
            return set()
        state = procfs.stat_fields(pid_dir / "stat")[1][0]
    except (OSError, ValueError, IndexError):
        return set()
    if state in ("Z", "X"):
        return set()  # exited, not yet reaped: it serves nothing
    return {os.fsdecode(a) for a in args[1:] if a.startswith(b"/")}


def loop_devices(sys_block: Path = Path("/sys/block")) -> tuple[LoopDevice, ...]:
    """Loop devices and their backing files, from sysfs.

    Not ``losetup --list``: it stats every backing file, and one on a FUSE
    mount whose rbd-fuse hangs (Ceph down) hangs it in the kernel for good.
    """
    out = []
    for backing in sorted(sys_block.glob("loop*/loop/backing_file")):
        with contextlib.suppress(OSError):
            path = procfs.read_text(backing).rstrip("\n").removesuffix(" (deleted)")
            out.append(LoopDevice(name=f"/dev/{backing.parent.parent.name}", back_file=path))
    return tuple(out)


def _is_mounted(path: str) -> bool:
    return any(m.mount_point == path
               for m in procfs.mounts())


def _retry_busy(fn: Callable[[], object], timeout: float = 10.0) -> None:
    """umount right after ``losetup -d`` can see EBUSY while the kernel lets go."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            fn()
            return
        except CommandError as exc:
            if "busy" not in exc.stderr.lower() or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


LOG_TAIL = 64 * 1024  # read of a helper's log: its end only (appended across starts)


def _tail(path: Path, lines: int = 5) -> str:
    try:
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - LOG_TAIL))
            text = f.read(LOG_TAIL).decode(errors="replace")
    except OSError:
        return ""
    return last_lines(text, lines)


def reap_fuse_children() -> None:
    """Collect rbd-fuse processes that exited (their mount went away)."""
    for mnt, proc in list(_fuse_children.items()):
        if proc.poll() is not None:
            del _fuse_children[mnt]


def fuse_pids() -> dict[str, int]:
    return {mnt: p.pid for mnt, p in _fuse_children.items()}
