"""The kernel mappers, krbd and nbd: ``rbd device map`` (``-t nbd`` for
rbd-nbd), its unmap, the wait for a resize to reach the device, and the
listing of what is mapped (krbd from sysfs; nbd from ``rbd device list``
and our own records of what we mapped, so that a dead rbd-nbd is seen).

Imported by observe/node.py (``Node.mapper``) and the commands that build a
mapper; the common part is drivers/mappers.py.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from reconciler.drivers import procfs, scopes
from reconciler.drivers.fs import block_device_size
from reconciler.drivers.mappers import ceph_args
from reconciler.drivers.run import CommandError, Runner
from reconciler.facts.observed import Mapping
from reconciler.facts.parsers import RbdDevice, explain_map_failure, parse_rbd_device_list
from reconciler.spec.config import CephConfig
from reconciler.state.registry import NbdMappings

# rbd-nbd's kernel request timeout, set on purpose: none. Measured on Debian
# 12 (rbd-nbd 16.2, kernel 6.1): rbd-nbd sets none by itself either, and a
# request then waits for Ceph as long as a partition lasts (the kernel logs
# "Possible stuck request" every 30 s) and completes once it heals; with
# io-timeout=30 a 45 s partition failed the requests at 30 s, ext4 went
# read-only and the device was lost. librbd inside rbd-nbd waits without a
# limit as well (rados_osd_op_timeout 0), as krbd does (osd_request_timeout
# 0). map.options may set another (io-timeout=N). --reattach-timeout applies
# only to devices attached through netlink (try-netlink), which is not how
# they are mapped here: a dead rbd-nbd ends its device at once (DEGRADED).
NBD_IO_TIMEOUT = "io-timeout=0"
RESIZE_WAIT_S = 30.0  # krbd / rbd-nbd: a resize reaches the device this soon


def udev_running() -> bool:
    """Without a udev daemon, ``rbd device map``/``unmap`` of krbd wait forever
    for an event that never comes (the kernel made or removed the device
    already): pass ``noudev`` then, and only then. udevd's control socket is
    the sign it runs."""
    return Path("/run/udev/control").exists()


def nbd_connected(device: str | None) -> bool:
    """Whether an nbd device still has a connection (its pid file is there)."""
    return device is not None and Path(f"/sys/block/{os.path.basename(device)}/pid").exists()


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
        if self.kind == "nbd" and not any(o.partition("=")[0] in ("io-timeout", "timeout")
                                          for o in options):
            options = (*options, NBD_IO_TIMEOUT)
        if options:
            argv.append("--options=" + ",".join(options))
        if self.kind == "nbd" and self.scopes:
            return scopes.wrap(argv, self.kind, pool, image)
        return argv

    def map(self, pool: str, image: str, options: tuple[str, ...]) -> str:
        try:
            out = self.runner.run(self.map_command(pool, image, options)).stdout
        except CommandError as exc:
            raise explain_map_failure(self.kind, exc.returncode, exc.stderr) from None
        device = out.strip().splitlines()[-1] if out.strip() else ""
        if not device.startswith("/dev/"):
            raise explain_map_failure(self.kind, 0, f"unexpected output {out!r}")
        if self.kind == "nbd" and self.records is not None:
            self.records.record(device, {"pool": pool, "image": image})
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

    def refresh(self, device: str, size: int, wait: float = RESIZE_WAIT_S) -> None:
        """krbd and rbd-nbd follow an image resize by themselves (a header
        watch): wait, bounded, until the device shows at least ``size``."""
        deadline = time.monotonic() + wait
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
        dead = []
        for device, (pool, image) in sorted(self.records.images().items()):
            now = here.get(device)
            if now is not None:
                if (now.pool, now.image) != (pool, image):
                    self.records.forget(device)  # mapped again since, for another image
                continue
            # Ours, and no rbd-nbd serves it: dead until we unmap it (mounted
            # or not), as a dead rbd-fuse helper is.
            dead.append(Mapping("nbd", pool, image, device,
                                problem=f"rbd-nbd serving {device} is gone"))
        return live + dead

