"""Filesystems and mounts: probe, mkfs, mount, bind, grow, unmount.

Every operand (device, path) follows "--": no value can be read as an option.
mount, umount, blkid, mkfs.ext4, mkfs.xfs, e2fsck, resize2fs and xfs_growfs
all accept it there (measured on Debian 12's util-linux, e2fsprogs, xfsprogs).

Imported by apply/devicesteps.py, apply/runner.py; drivers/fusemapper.py,
drivers/kernelmapper.py; engine/orphans.py; observe/devprobe.py,
observe/node.py.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from reconciler.drivers import pagecache, procfs
from reconciler.drivers.run import CommandError, Runner
from reconciler.drivers.safepath import (
    O_PATH,
    UnsafePath,
    ensure_dir,
    ensure_file,
    fd_path,
    identity,
    mount_id,
    open_nofollow,
    opened,
    split,
)
from reconciler.facts.observed import Mount
from reconciler.facts.parsers import (
    EXT4_SB_OFFSET,
    Probe,
    Superblock,
    parse_blkid_export,
    parse_mountinfo,
    parse_superblock,
    xfs_live_size,
)
from reconciler.state.registry import CreatedPaths

# -m0: no root reserve on a data volume; nodiscard/lazy init: mkfs does not
# touch every block of a thin RBD image (fast, and stays thin).
MKFS_DEFAULTS = {
    "ext4": ["-q", "-m0", "-E", "nodiscard,lazy_itable_init=1,lazy_journal_init=1"],
    "xfs": ["-q", "-K"],
}


ONLINE_EXT4_GROW_TIMEOUT = 30.0


class OnlineGrowRefused(Exception):
    """The kernel refused an online grow (ext4 without CAP_SYS_RESOURCE here)."""


class DeviceUnreadable(Exception):
    """Reading the device failed: what it holds is unknown (never "blank")."""


PROBE_BYTES = 64 * 1024  # where ext4/xfs/partition-table signatures live
# Where blkid -p reads a device that carries nothing (util-linux 2.38, seen
# with strace): ~45 small reads within its first 4 MiB and its last 1.5 MiB.
BLKID_HEAD = (4 << 20) + 4096
BLKID_TAIL = 2 << 20
# A probe's read of a device that answers takes milliseconds; one that has
# not answered in this long waits on Ceph (observe reports it unknown).
PROBE_TIMEOUT_S = 30.0


def read_head(runner: Runner, device: str, length: int = PROBE_BYTES) -> bytes:
    """The first ``length`` bytes of ``device``, read with O_DIRECT (the page
    cache may still hold blocks of a device that no longer answers);
    DeviceUnreadable when that read fails or does not end in time.

    Read by a child (dd), never by this process: a read of a device whose
    Ceph does not answer sleeps in the kernel (D state, ``submit_bio_wait``)
    and cannot be interrupted. In a thread of ours it would keep the daemon
    from exiting until Ceph answers (measured in the VM: SIGTERM during a
    200 s cut left the daemon running 45 s on); a child is killed, or
    abandoned, at its deadline (drivers/run.py)."""
    try:
        out = runner.run(["dd", f"if={device}", "iflag=direct", f"bs={length}", "count=1",
                          "status=none"], timeout=min(runner.timeout, PROBE_TIMEOUT_S),
                         max_stdout=length)
    except CommandError as exc:
        raise DeviceUnreadable(_unreadable(device, exc.stderr.strip() or str(exc))) from None
    if not out.raw:
        raise DeviceUnreadable(_unreadable(device, "short read"))
    return out.raw


def readahead_then(device: str, size: int, argv: list[str]) -> list[str]:
    """``argv`` (blkid) run after the kernel was asked for the regions blkid
    reads, in a few large requests, while the device is held open (its page
    cache is dropped at its last close). blkid asks for those bytes one small
    read at a time (~45: on krbd and rbd-nbd each a round trip to the OSDs,
    for rbd-nbd through its helper; ~0.5-1 s of blkid in the VM of the kernel
    tests) and now finds them in memory. Only a hint: a read that fails is
    silent (blkid's own read says it). All of it in the child (a shell that
    holds the device open on descriptor 3 and becomes blkid), so no read of
    the device ever waits in this process."""
    head = min(size, BLKID_HEAD) if size > 0 else BLKID_HEAD
    tail = max(BLKID_HEAD, size - BLKID_TAIL)
    # The device is the command's last operand (after blkid's "--"), and
    # only there: `for dev do :; done` leaves the last one in $dev. `command
    # exec`: a failed redirection of the special built-in `exec` would end
    # dash at once with 2, which is blkid's "blank".
    script = ('for dev do :; done; command exec 3<"$dev" || exit 126; '
              'dd if="$dev" of=/dev/null bs=1M iflag=count_bytes count="$1" status=none '
              '2>/dev/null; '
              'if [ "$3" -gt 0 ]; then dd if="$dev" of=/dev/null bs=1M '
              'iflag=skip_bytes,count_bytes skip="$2" count="$3" status=none 2>/dev/null; fi; '
              'shift 3; exec "$@"')
    if argv[-1] != device:
        raise ValueError(f"{argv}: the device must be the last operand")
    return ["sh", "-c", script, "sh", str(head), str(tail), str(max(0, size - tail)), *argv]


def _unreadable(device: str, why: str) -> str:
    return f"{device} cannot be read ({why}); its content is unknown"


def read_superblock(device: str, fs_type: str, runner: Runner, mounted: bool = False
                    ) -> Superblock | None:
    """ext4/xfs superblock through the page cache (as dumpe2fs reads it), by
    a child (see read_head). ``mounted``: the caller saw the device mounted;
    then it is first read here, if the page cache has it (a mounted ext4
    pins its superblock's buffer there; an xfs's stays once read), asked
    first with mincore (drivers/pagecache.py: a miss never starts I/O from
    this process). Only then:
    the last close of a block device drops its page cache and waits for
    reads still in flight (a child killed on a stalled device leaves some),
    and a mount keeps ours from being the last. OSError when the read fails."""
    length = EXT4_SB_OFFSET + 1024
    if mounted:
        with contextlib.suppress(OSError):
            data = pagecache.read_if_resident(device, length)
            if data is not None:
                return parse_superblock(data, fs_type)
    try:
        out = runner.run(["dd", f"if={device}", f"bs={length}", "count=1", "status=none"],
                         timeout=min(runner.timeout, PROBE_TIMEOUT_S), max_stdout=length)
    except CommandError as exc:
        raise OSError(errno.EIO, _unreadable(device, exc.stderr.strip() or str(exc))) from None
    return parse_superblock(out.raw, fs_type)


def fs_size_from(sb: Superblock, mount_point: str | None) -> int:
    """Bytes the filesystem spans. A mounted xfs keeps its live geometry in
    memory (the on-disk superblock lags an online grow): ask statvfs."""
    if sb.fs_type == "xfs" and mount_point is not None:
        st = os.statvfs(mount_point)
        return xfs_live_size(st.f_blocks, st.f_frsize, sb.log_blocks)
    return sb.size


class ForeignMount(Exception):
    """The top mount at a path is not ours: never unmounted."""


def is_ours(top: Mount, st: os.stat_result, rdev: tuple[int, int]) -> bool:
    """A filesystem mount of our device (its root), or a bind of its device node
    (devtmpfs binds show the node's name as root; the node itself has our rdev)."""
    if (top.major, top.minor) == rdev and top.root == "/":
        return True
    return stat.S_ISBLK(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == rdev


@dataclass
class Filesystems:
    runner: Runner
    created: CreatedPaths | None = None  # mount points we made (removed after unmount)

    def probe(self, device: str) -> Probe:
        """What signature the device carries. blkid exits 2 both for a blank
        device and for one it could not read (a dead rbd-fuse helper): a read
        that fails first makes the probe fail, never "blank"."""
        read_head(self.runner, device)
        return self.probe_read(device)

    def probe_read(self, device: str) -> Probe:
        """blkid on a device whose start the caller has just read back."""
        try:
            size = block_device_size(device)
        except (OSError, ValueError):
            size = 0
        argv = ["blkid", "-p", "-o", "export", "--", device]
        try:
            res = self.runner.run(readahead_then(device, size, argv), ok_codes=(0, 2),
                                  timeout=min(self.runner.timeout, PROBE_TIMEOUT_S))
        except CommandError as exc:  # said as blkid's: the shell around it is ours
            raise CommandError(argv, exc.returncode, exc.stderr) from None
        return parse_blkid_export(res.stdout, res.returncode)

    def fs_size(self, device: str, fs_type: str, mount_point: str | None = None) -> int | None:
        """Bytes the filesystem spans, from its superblock; for a mounted
        filesystem pass its mount point (xfs: the live geometry; both: a
        superblock in the page cache is read here). None: not that filesystem."""
        try:
            sb = read_superblock(device, fs_type, self.runner, mounted=mount_point is not None)
            if sb is None:
                return None
            return fs_size_from(sb, mount_point)
        except OSError:
            return None

    def mkfs(self, device: str, fs_type: str, options: tuple[str, ...],
             force: bool = False) -> None:
        """``force`` overwrites an existing signature: only for redoing our own
        interrupted mkfs (the caller decides, from image-meta)."""
        flag = ["-F" if fs_type == "ext4" else "-f"] if force else []
        self.runner.run([f"mkfs.{fs_type}", *MKFS_DEFAULTS[fs_type], *flag, *options, "--", device],
                        timeout=self.runner.long_timeout, max_stdout=None)  # a report

    def _mountpoint(self, path: str, kind: str) -> None:
        """Create the mount point (no symlink followed); remember it if we made it."""
        made = ensure_dir(path) if kind == "dir" else ensure_file(path)
        if made and self.created is not None:
            self.created.record_path(path, kind, identity(path))

    def mount(self, device: str, path: str, fs_type: str, options: tuple[str, ...]) -> None:
        self._mountpoint(path, "dir")
        with opened(path, O_PATH | os.O_DIRECTORY) as fd:
            argv = ["mount", "--no-canonicalize", "-t", fs_type]
            if options:
                argv += ["-o", ",".join(options)]
            self.runner.run([*argv, "--", device, fd_path(fd)], pass_fds=(fd,))

    def expose_device(self, device: str, path: str, options: tuple[str, ...] = ()) -> None:
        """Block mode: bind the device node onto a file at ``path`` (with
        ``options``: nosuid, never nodev, which would stop it opening)."""
        self._mountpoint(path, "file")
        with opened(path) as fd:
            self.runner.run(["mount", "--no-canonicalize", "--bind", "--", device, fd_path(fd)],
                            pass_fds=(fd,))
        if options and not bound_as(path, False, options):
            try:
                self.remount_bind(path, False, options)
            except CommandError:
                self.unmount(path, None)
                raise

    def bind(self, source: str, path: str, block: bool, read_only: bool,
             options: tuple[str, ...], rdev: tuple[int, int] | None = None) -> None:
        """Bind ``source`` (the staging mount, checked by the caller) at ``path``.
        Both are opened without following symlinks; the bind uses the descriptors."""
        self._mountpoint(path, "file" if block else "dir")
        with opened(source) as sfd, opened(path) as tfd:
            self.runner.run(["mount", "--no-canonicalize", "--bind", "--", fd_path(sfd),
                             fd_path(tfd)], pass_fds=(sfd, tfd))
        # A bind inherits the source's flags; ro and options (nosuid,nodev at
        # least: the planner always gives them) need a remount, unless the
        # bind already shows exactly what it would set (a staging mount made
        # with the same flags: each mount command costs ~0.3 s in the VM).
        # If it fails the target must not stay mounted with the wrong mode or flags.
        if (read_only or options) and not bound_as(path, read_only, options):
            try:
                self.remount_bind(path, read_only, options)
            except CommandError:
                self.unmount(path, rdev)
                raise

    def remount_bind(self, path: str, read_only: bool, options: tuple[str, ...]) -> None:
        """Every per-mount flag not in ``options`` (nosuid, nodev, noexec) is
        cleared: the kernel sets them anew, and mount(8) adds nothing of the
        old ones for a /proc/self/fd target. The caller says them all."""
        opts = ["remount", "bind", "ro" if read_only else "rw", *options]
        with opened(path) as fd:
            self.runner.run(["mount", "--no-canonicalize", "-o", ",".join(opts), "--", fd_path(fd)],
                            pass_fds=(fd,))

    def remount(self, path: str, options: tuple[str, ...]) -> None:
        """As remount_bind: the mount's flags are those in ``options`` after it."""
        with opened(path) as fd:
            self.runner.run(["mount", "--no-canonicalize", "-o",
                             ",".join(["remount", *options]), "--", fd_path(fd)],
                            pass_fds=(fd,))

    def unmount(self, path: str, rdev: tuple[int, int] | None) -> bool:
        """Unmount the top mount at ``path`` when it is ours: a mount of device
        ``rdev`` (its root) or a bind of that device's node. Anything else on
        top (someone's tmpfs) is refused, never unmounted. Then the mount point
        is removed if we created it. False: nothing was mounted there.
        ``rdev`` None: the caller has just made this mount itself (undo)."""
        parent, name = split(path)
        try:
            pfd = open_nofollow(parent, O_PATH | os.O_DIRECTORY)
        except FileNotFoundError:
            return False
        try:
            try:
                fd = os.open(name, O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pfd)
            except FileNotFoundError:
                return False
            try:
                mid, st = mount_id(fd), os.fstat(fd)
            finally:
                os.close(fd)  # an open descriptor would keep the mount busy
            if stat.S_ISLNK(st.st_mode):
                raise UnsafePath(f"{path} is a symlink; refusing to follow it")
            top = {m.mount_id: m for m in parse_mountinfo(
                procfs.mountinfo())}.get(mid)
            if top is None or top.mount_point != path:
                self._remove_created(pfd, name, path)
                return False
            if rdev is not None and not is_ours(top, st, rdev):
                raise ForeignMount(
                    f"{path}: the top mount there is not ours ({top.fs_type} {top.source}, "
                    f"root {top.root}, device {top.major}:{top.minor}); refusing to unmount "
                    "someone else's mount (unmount it by hand first)")
            self.runner.run(["umount", "--no-canonicalize", "--", fd_path(pfd, name)],
                            pass_fds=(pfd,))
            self._remove_created(pfd, name, path)
            return True
        finally:
            os.close(pfd)

    def _remove_created(self, pfd: int, name: str, path: str) -> None:
        """Remove the mount point only if we made it and it is still that inode."""
        if self.created is None or (rec := self.created.lookup(path)) is None:
            return
        kind, ident = rec
        try:
            st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
        except FileNotFoundError:
            self.created.forget(path)
            return
        if (st.st_dev, st.st_ino) == ident:
            with contextlib.suppress(OSError):  # not empty: someone put data there
                if kind == "dir" and stat.S_ISDIR(st.st_mode):
                    os.rmdir(name, dir_fd=pfd)
                elif kind == "file" and stat.S_ISREG(st.st_mode) and st.st_size == 0:
                    os.unlink(name, dir_fd=pfd)
        if not os.path.lexists(path) or (st.st_dev, st.st_ino) != ident:
            self.created.forget(path)

    def grow_online(self, device: str, path: str, fs_type: str) -> None:
        if fs_type == "xfs":
            self.runner.run(["xfs_growfs", "--", path])
            return
        try:
            # Online ext4 growth is quick or refused; seen hanging in a sandbox
            # without CAP_SYS_RESOURCE, so a short deadline counts as refused.
            self.runner.run(["resize2fs", "--", device],
                            timeout=min(ONLINE_EXT4_GROW_TIMEOUT, self.runner.timeout))
        except CommandError as exc:
            err = exc.stderr.lower()
            if exc.returncode == 124 or "permission denied" in err or "not permitted" in err:
                raise OnlineGrowRefused(str(exc)) from None
            raise

    def grow_offline(self, device: str, fs_type: str) -> None:
        """ext4 before mounting: e2fsck must pass first (resize2fs insists)."""
        assert fs_type == "ext4"
        # e2fsck -p exits 1 when it fixed something: still fine to resize.
        # Their stdout is a report nobody parses (e2fsck's can list every
        # problem it fixed): kept as head and tail, never a reason to kill.
        self.runner.run(["e2fsck", "-f", "-p", "--", device], ok_codes=(0, 1),
                        timeout=self.runner.long_timeout, max_stdout=None)
        self.runner.run(["resize2fs", "--", device], timeout=self.runner.long_timeout,
                        max_stdout=None)


# Per-mount flags a bind remount sets that mountinfo shows as given.
_PLAIN_FLAGS = frozenset({"nosuid", "nodev", "noexec"})


def remount_shows(read_only: bool, options: tuple[str, ...]) -> frozenset[str] | None:
    """The per-mount options mountinfo shows after a bind remount with
    ``options`` (each flag set anew; relatime, the kernel's default, when no
    atime option is given). None when that is not certain (any other
    option): the remount is then always made."""
    if not set(options) <= _PLAIN_FLAGS:
        return None
    return frozenset({"ro" if read_only else "rw", "relatime", *options})


def bound_as(path: str, read_only: bool, options: tuple[str, ...]) -> bool:
    """Whether the top mount at ``path`` (the bind just made there) shows
    exactly the per-mount flags a remount with ``options`` would set: then
    that remount would change nothing. Anything unsure is False."""
    want = remount_shows(read_only, options)
    if want is None:
        return False
    try:
        with opened(path) as fd:
            mid = mount_id(fd)
    except OSError:
        return False
    top = next((m for m in parse_mountinfo(procfs.mountinfo()) if m.mount_id == mid), None)
    return top is not None and top.mount_point == path and top.options == want


def block_device_size(path: str) -> int:
    """Bytes, from sysfs (the loop/rbd/nbd/dm driver's current idea of the
    size), found by the node's device number: /dev/mapper/NAME is a node of
    its own without udev, and its name is not the kernel's (dm-N)."""
    rdev = os.stat(path).st_rdev
    return int(Path(f"/sys/dev/block/{os.major(rdev)}:{os.minor(rdev)}/size").read_text()) * 512
