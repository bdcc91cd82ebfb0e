"""The kernel mappers, krbd and nbd: ``rbd device map`` (``-t nbd`` for
rbd-nbd), its unmap, the wait for a resize to reach the device, and the
listing of what is mapped (krbd from sysfs; nbd from ``rbd device list``
and our own records of what we mapped, so that a dead rbd-nbd is seen).

Imported by observe/node.py (``Node.mapper``) and the commands that build a
mapper; the common part is drivers/mappers.py.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from reconciler.drivers import nbdhelper, nbdnetlink, procfs, scopes
from reconciler.drivers.fs import block_device_size
from reconciler.drivers.mappers import ceph_args
from reconciler.drivers.run import CommandError, Runner
from reconciler.facts.observed import Mapping
from reconciler.facts.parsers import (
    MapError,
    RbdDevice,
    explain_map_failure,
    parse_rbd_device_list,
)
from reconciler.spec.config import CephConfig
from reconciler.state.registry import NbdMappings

# rbd-nbd's kernel request timeout, set on purpose: none. Measured on Debian
# 12 (rbd-nbd 16.2, kernel 6.1): rbd-nbd sets none by itself either, and a
# request then waits for Ceph as long as a partition lasts (the kernel logs
# "Possible stuck request" every 30 s) and completes once it heals; with
# io-timeout=30 a 45 s partition failed the requests at 30 s, ext4 went
# read-only and the device was lost. librbd inside rbd-nbd waits without a
# limit as well (rados_osd_op_timeout 0), as krbd does (osd_request_timeout
# 0). map.options may set another (io-timeout=N).
#
# Attached through netlink with a re-attach timeout, the kernel keeps a
# device whose rbd-nbd died, with its queued I/O, for that long: a new
# rbd-nbd attached to it (``rbd device attach``, the device's cookie) serves
# it on, with no error to the application (measured in the VM: a kill -9
# under an O_DIRECT writer, zero errors). ceph-csi uses 300 s as well. A
# request that was in flight on the dead connection is sent again only when
# its block-layer timer fires: 30 s by default with io-timeout 0 (measured:
# a 32 s pause). The timer is set to NBD_REQUEUE_MS instead (the queue's
# io_timeout; io-timeout stays 0, so a timer that fires never fails a
# request or drops the connection: the kernel logs "Possible stuck request"
# and waits on). Shorter is a shorter pause after a re-attach, and one such
# kernel line per stuck request that often while Ceph does not answer.
NBD_REQUEUE_MS = 5000
# librbd's cache inside rbd-nbd is writeback by default (after the first
# flush): a write is acknowledged once it is in that process's memory, and a
# rbd-nbd that dies takes it along. A flush the kernel then sends again to
# the re-attached rbd-nbd finds nothing to flush and succeeds: an fsync
# answered OK for data that never reached Ceph (measured in the VM: a record
# written and fsynced before the kill read back as it was before). Writes
# go through to the OSDs before they are acknowledged; reads stay cached.
NBD_CACHE = "rbd_cache_policy=writethrough"
NBD_IO_TIMEOUT = "io-timeout=0"
NBD_REATTACH_S = 300
NBD_NETLINK = ("try-netlink", f"reattach-timeout={NBD_REATTACH_S}")
RESIZE_WAIT_S = 30.0  # krbd / rbd-nbd: a resize reaches the device this soon
ROLL_ATTEMPTS = 3  # attaches tried after a roll's detach before the re-attach path takes over


def udev_running() -> bool:
    """Without a udev daemon, ``rbd device map``/``unmap`` of krbd wait forever
    for an event that never comes (the kernel made or removed the device
    already): pass ``noudev`` then, and only then. udevd's control socket is
    the sign it runs."""
    return Path("/run/udev/control").exists()


def nbd_connected(device: str | None) -> bool:
    """Whether an nbd device is still configured (its pid file is there): served,
    or kept by the kernel for a re-attach after its rbd-nbd died."""
    return device is not None and Path(f"/sys/block/{os.path.basename(device)}/pid").exists()


def nbd_cookie(device: str, sys_root: Path = Path("/sys")) -> str | None:
    """The cookie (``backend``) of a configured nbd device; None when it is
    not configured or has none (not attached through netlink)."""
    block = sys_root / "block" / os.path.basename(device)
    try:
        if not (block / "pid").exists():
            return None
        return procfs.read_text(block / "backend").strip() or None
    except OSError:
        return None


def krbd_devices(sys_root: Path = Path("/sys")) -> tuple[RbdDevice, ...]:
    """What ``rbd device list`` prints for krbd, read where rbd reads it
    (Ceph's src/krbd.cc): each device on the rbd bus, its ``pool``,
    ``pool_ns``, ``name`` and ``current_snap`` attributes (one without pool,
    name or current_snap is skipped, as rbd skips it), its node
    ``/dev/rbd<id>``. No process: an ``rbd`` start costs ~1 s in the VM of
    the kernel tests, and this list is read by every observation."""
    bus = sys_root / "bus" / "rbd" / "devices"
    try:
        ids = sorted(os.listdir(bus))  # as rbd lists them (udev sorts by path)
    except FileNotFoundError:  # no rbd module: nothing mapped by krbd
        return ()
    out = []
    for dev_id in ids:
        def attr(name: str, d: Path = bus / dev_id) -> str:
            return procfs.read_text(d / name).removesuffix("\n")

        try:
            pool, image, snap = attr("pool"), attr("name"), attr("current_snap")
        except OSError:  # unmapped meanwhile, or not a mapping rbd would list
            continue
        try:
            namespace = attr("pool_ns")
        except OSError:  # a kernel without namespaces
            namespace = ""
        out.append(RbdDevice(pool=pool, namespace=namespace, image=image,
                             snap=None if snap in ("", "-") else snap,
                             device=f"/dev/rbd{dev_id}"))
    return tuple(out)


def nbd_any_connected(sys_root: Path = Path("/sys")) -> bool:
    """Whether any nbd device has a connection (its ``pid`` file). rbd-nbd's
    own list (``rbd device list -t nbd``) shows only those: with none, it
    prints nothing, and it is not started (~1.5 s in the VM, two processes)."""
    try:
        names = os.listdir(sys_root / "block")
    except FileNotFoundError:
        return False
    return any((sys_root / "block" / n / "pid").exists() for n in names
               if n.startswith("nbd"))



def _device(device: str) -> str:
    """A device node we found (rbd's listing, sysfs, our nbd records): rbd
    hands its arguments on to rbd-nbd, which takes no "--" (measured: "unknown
    command: --"), so a value that could be an option is refused instead."""
    if not device.startswith("/dev/"):
        raise ValueError(f"{device!r} is not a device node under /dev")
    return device


@dataclass
class KernelMapper:
    """krbd and nbd differ only in ``-t nbd``; both go through ``rbd device``."""

    kind: str  # krbd | nbd
    ceph: CephConfig
    runner: Runner
    udev: Callable[[], bool] = udev_running
    records: NbdMappings | None = None  # nbd: what we mapped (a dead rbd-nbd is seen)
    connected: Callable[[str], bool] = field(default=lambda d: nbd_connected(d))
    # nbd: `rbd device map` (and the rbd-nbd it daemonizes) in a systemd
    # scope of its own, out of the daemon unit's cgroup (drivers/scopes.py).
    scopes: bool = False
    sys_root: Path = Path("/sys")  # where the kernel's devices are listed
    # nbd: the binary a new rbd-nbd runs and its version, recorded with it.
    binary: Callable[[], dict[str, object]] = nbdhelper.started

    def _type(self) -> list[str]:
        return ["-t", "nbd"] if self.kind == "nbd" else []

    def _noudev(self) -> bool:
        return self.kind == "krbd" and not self.udev()

    def map_command(self, pool: str, image: str, options: tuple[str, ...]) -> list[str]:
        # --pool=/--image=, not a pool/image operand: rbd passes "--" on to
        # rbd-nbd, which refuses it (measured).
        argv = ["rbd", "device", "map", *self._type(), f"--pool={pool}", f"--image={image}",
                *ceph_args(self.ceph)]
        if self._noudev() and "noudev" not in options:
            options = (*options, "noudev")
        if self.kind == "nbd":
            argv.append("--show-cookie")
            options = nbd_options(options)
        if options:
            argv.append("--options=" + ",".join(options))
        if self.kind == "nbd" and self.scopes:
            return scopes.wrap(argv, self.kind, pool, image)
        return argv

    def attach_command(self, pool: str, image: str, device: str, cookie: str,
                       options: tuple[str, ...]) -> list[str]:
        argv = ["rbd", "device", "attach", "-t", "nbd", f"--device={_device(device)}",
                f"--cookie={cookie}", f"--pool={pool}", f"--image={image}",
                *ceph_args(self.ceph), "--options=" + ",".join(nbd_options(options))]
        return scopes.wrap(argv, self.kind, pool, image) if self.scopes else argv

    def attach(self, pool: str, image: str, device: str, cookie: str,
               options: tuple[str, ...]) -> None:
        """A new rbd-nbd for ``device``, which the kernel kept after its last
        one died: the device, its mounts and its queued I/O carry on. Only a
        device whose cookie is still the one we recorded (not mapped again
        since, by anyone)."""
        now = nbd_cookie(device, self.sys_root)
        if now != cookie:
            raise CommandError(["attach", device], 1,
                               f"{device} is no longer the device we mapped (cookie "
                               f"{now or 'none'}, recorded {cookie}); not re-attached")
        binary = self.binary()
        try:
            self.runner.run(self.attach_command(pool, image, device, cookie, options))
        except CommandError as exc:
            raise explain_map_failure(self.kind, exc.returncode, exc.stderr) from None
        _requeue_timer(device, options, self.sys_root)
        if self.records is not None:
            self.records.amend(device, binary)

    def roll(self, pool: str, image: str, device: str, cookie: str, pid: int,
             options: tuple[str, ...]) -> bool:
        """The rbd-nbd serving ``device`` replaced by one of the binary now on
        disk: detached (it exits; the kernel keeps the device, netlink), then
        attached with our cookie, as a re-attach. Only our device (cookie),
        still served by the helper ``pid`` the plan saw; False: nothing done
        (it runs the binary on disk now, or its binary cannot be compared).
        An attach that fails is tried again, ROLL_ATTEMPTS in all; failing
        still, the device is left kept by the kernel, which the next pass
        re-attaches (our record and cookie stand): never left unserved
        longer than that."""
        now = nbd_cookie(device, self.sys_root)
        if now != cookie:
            raise CommandError(["roll", device], 1,
                               f"{device} is no longer the device we mapped (cookie "
                               f"{now or 'none'}, recorded {cookie}); not rolled")
        if not nbdhelper.is_rbd_nbd(pid):
            raise CommandError(["roll", device], 1,
                               f"rbd-nbd {pid} no longer serves {device}; not rolled")
        # Looked at again right before: another roll (a chain that held the
        # lock before this one) may have made it current already.
        exe, binary = nbdhelper.exe_ident(pid), nbdhelper.binary_ident()
        if exe is None or binary is None or exe == binary:
            return False
        self.detach(device)
        # The kernel takes a new connection only in place of a dead one: one
        # it has not yet seen die (the old rbd-nbd exits at the detach) is
        # refused, and so is the attach; tried again, a few times.
        for _ in range(ROLL_ATTEMPTS - 1):
            with contextlib.suppress(CommandError, MapError):
                self.attach(pool, image, device, cookie, options)
                return True
        self.attach(pool, image, device, cookie, options)  # the last: its error is the step's
        return True

    def map(self, pool: str, image: str, options: tuple[str, ...]) -> str:
        # The binary the new rbd-nbd runs, asked just before it starts.
        binary = self.binary() if self.kind == "nbd" and self.records is not None else {}
        try:
            out = self.runner.run(self.map_command(pool, image, options)).stdout
        except CommandError as exc:
            raise explain_map_failure(self.kind, exc.returncode, exc.stderr) from None
        last = out.strip().splitlines()[-1].split() if out.strip() else []
        # nbd (--show-cookie): "/dev/nbd0 COOKIE"; krbd: "/dev/rbd0"
        device = last[0] if last else ""
        if not device.startswith("/dev/"):
            raise explain_map_failure(self.kind, 0, f"unexpected output {out!r}")
        if self.kind == "nbd":
            _requeue_timer(device, options, self.sys_root)
        if self.kind == "nbd" and self.records is not None:
            cookie = last[1] if len(last) > 1 else None
            self.records.record(device, {"pool": pool, "image": image, **binary,
                                         **({"cookie": cookie} if cookie else {})})
        return device

    def unmap(self, mapping: Mapping, force: bool = False) -> None:
        """``force``: krbd's ``-o force`` (a fenced device: its client is
        blocklisted; recover makes sure nothing uses it first)."""
        options = [o for o, on in (("force", force and self.kind == "krbd"),
                                   ("noudev", self._noudev())) if on]
        if self.kind != "nbd" or mapping.device is None or self.connected(mapping.device):
            self.runner.run(["rbd", "device", "unmap", *self._type(),
                             *([f"--options={','.join(options)}"] if options else []),
                             *([_device(mapping.device)] if mapping.device else
                               [f"--pool={mapping.pool}", f"--image={mapping.image}"]),
                             *ceph_args(self.ceph)])
        # else: its rbd-nbd is gone and the kernel dropped the connection: nothing to undo
        if self.kind == "nbd" and self.records is not None and mapping.device:
            self.records.forget(mapping.device)

    def detach(self, device: str) -> None:
        """Stop the rbd-nbd serving ``device`` and keep the device (netlink):
        what a re-attach that must not stand leaves, as it found it."""
        self.runner.run(["rbd", "device", "detach", "-t", "nbd", _device(device),
                         *ceph_args(self.ceph)])

    def refresh(self, device: str, size: int, wait: float = RESIZE_WAIT_S) -> None:
        """krbd and rbd-nbd follow an image resize by themselves (a header
        watch): wait, bounded, until the device shows at least ``size``, the
        image's size. An nbd device attached with a cookie is resized here:
        rbd-nbd 16.2's own request leaves the cookie out and the kernel
        refuses it (drivers/nbdnetlink.py)."""
        deadline = time.monotonic() + wait
        if self.kind == "nbd" and block_device_size(device) < size:
            # Only with the cookie we recorded when we mapped it: the kernel
            # compares it with the device's own, so a device mapped again
            # since (by anyone, for another image) is never grown to our
            # image's size. The device's current cookie would match any device.
            cookie = self.records.cookies().get(device) if self.records is not None else None
            if cookie is not None and nbd_cookie(device, self.sys_root) == cookie:
                try:
                    nbdnetlink.resize(device, size, cookie)
                except (OSError, ValueError) as exc:
                    raise CommandError(["nbd", "reconfigure", device], 1,
                                       f"the kernel refused to grow {device} to {size} "
                                       f"bytes: {exc}") from None
        while (now := block_device_size(device)) < size:
            if time.monotonic() > deadline:
                raise CommandError(["refresh", device], 1,
                                   f"{device} still shows {now} bytes {wait:g} s after the image "
                                   f"grew to {size}: the {self.kind} client did not follow")
            time.sleep(0.05)

    def listed(self) -> tuple[RbdDevice, ...]:
        """Every mapping of this kind, as ``rbd device list`` shows it."""
        if self.kind == "krbd":
            return krbd_devices(self.sys_root)
        if not nbd_any_connected(self.sys_root):
            return ()
        argv = ["rbd", "device", "list", *self._type(), "--format", "json",
                *ceph_args(self.ceph)]
        out = self.runner.run(argv)
        try:
            return parse_rbd_device_list(out.stdout)
        except ValueError as exc:  # as if the command had failed: the caller says so
            raise CommandError(argv, 0, f"output that is not rbd's JSON ({exc})") from None

    def list(self) -> list[Mapping]:
        listed = self.listed()
        live = [Mapping(self.kind, d.pool, d.image, d.device)
                for d in listed if d.snap is None and not d.namespace]
        if self.kind != "nbd" or self.records is None:
            return live
        here = {m.device: m for m in live}
        pids = {d.device: d.pid for d in listed}
        dead = []
        cookies = self.records.cookies()
        binary = nbdhelper.binary_ident() if live else None
        for device, (pool, image) in sorted(self.records.images().items()):
            now = here.get(device)
            if now is not None:
                if (now.pool, now.image) != (pool, image):
                    self.records.forget(device)  # mapped again since, for another image
                elif (pid := pids.get(device)) is not None and now.device is not None:
                    # Ours and served: by which rbd-nbd, of which binary.
                    here[device] = replace(now, helper=nbdhelper.helper(
                        pid, self.records.record_of(device), cookies.get(device),
                        binary=binary))
                continue
            # Ours, and no rbd-nbd serves it. Kept by the kernel with the
            # cookie we recorded (this boot's record): re-attachable, nothing
            # lost. Else dead until we unmap it (mounted or not), as a dead
            # rbd-fuse helper is.
            cookie = cookies.get(device)
            if cookie is not None and nbd_cookie(device, self.sys_root) == cookie:
                dead.append(Mapping("nbd", pool, image, device, reattach=cookie,
                                    problem=f"rbd-nbd serving {device} is gone; the kernel "
                                            f"keeps the device for {NBD_REATTACH_S} s to "
                                            "re-attach"))
                continue
            dead.append(Mapping("nbd", pool, image, device,
                                problem=f"rbd-nbd serving {device} is gone"))
        return [here.get(m.device, m) if m.device else m for m in live] + dead


def _requeue_timer(device: str, options: tuple[str, ...], sys_root: Path) -> None:
    """NBD_REQUEUE_MS as the device's block-layer timer, unless the volume set
    its own request timeout. Best effort: a kernel without the file keeps 30 s."""
    if any(o.partition("=")[0] in ("io-timeout", "timeout") for o in options):
        return
    path = sys_root / "block" / os.path.basename(device) / "queue" / "io_timeout"
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW)
        try:
            os.write(fd, str(NBD_REQUEUE_MS).encode())
        finally:
            os.close(fd)


def nbd_options(options: tuple[str, ...]) -> tuple[str, ...]:
    """rbd-nbd's options: the volume's, then netlink and its re-attach
    timeout, and no request timeout, unless the volume set them."""
    keys = {o.partition("=")[0] for o in options}
    extra = [o for o in (*NBD_NETLINK, NBD_IO_TIMEOUT, NBD_CACHE)
             if o.partition("=")[0] not in keys
             and not (o.startswith("io-timeout") and "timeout" in keys)]
    return (*options, *extra)

