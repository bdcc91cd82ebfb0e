"""Gather the actual state in one pass: Ceph images, mappings, devices, mounts.

Imported by apply/chainstate.py, apply/devicesteps.py, apply/runner.py;
daemon/ (5 modules); engine/, engine/orphans.py, engine/release.py;
observe/leftovers.py.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from reconciler.drivers import procfs, scopes
from reconciler.drivers.bounded import Bounded, NoAnswer, StillStuck
from reconciler.drivers.crypt import Cryptsetup, Pbkdf
from reconciler.drivers.fs import DeviceUnreadable, Filesystems, block_device_size
from reconciler.drivers.fusemapper import FuseMapper
from reconciler.drivers.kernelmapper import KernelMapper
from reconciler.drivers.mappers import available_mappers
from reconciler.drivers.run import CommandError, Halt, Runner
from reconciler.drivers.safepath import first_symlink
from reconciler.facts.luks import CRYPT_UUID_PREFIX
from reconciler.facts.observed import CryptDevice, Device, Mapping, Mount, MountUser, Observed
from reconciler.facts.parsers import parse_mountinfo
from reconciler.facts.stall import stall_reason
from reconciler.observe.ceph import CephView, Session, observe_images
from reconciler.observe.deadfuse import dead_fuse_mappings, dead_fuse_users, loop_number
from reconciler.observe.devprobe import ProbeCache, Probed, probe_full, probe_mounted
from reconciler.observe.iowatch import IoWatch
from reconciler.spec.config import Config
from reconciler.spec.model import Volume, resolve_mapper
from reconciler.state.registry import CreatedPaths, Intents, NbdMappings, freezes_recorded

log = logging.getLogger("reconciler.observe")  # the name log lines have always carried


@dataclass
class Node:
    """The drivers for one node, built from its config."""

    config: Config
    runner: Runner
    fs: Filesystems
    fuse: FuseMapper
    krbd: KernelMapper
    nbd: KernelMapper
    crypt: Cryptsetup
    mappers_available: frozenset[str]
    # Kept across the daemon's passes: probes of unchanged, unmounted devices,
    # and the librados connection (replaced when it stops answering).
    probes: ProbeCache = field(default_factory=ProbeCache)
    ceph_session: Session = field(default_factory=Session)
    # Whether each mapped device's I/O completes (the daemon's sampler feeds it).
    io_watch: IoWatch = field(default_factory=lambda: IoWatch(10.0))

    @classmethod
    def from_config(cls, config: Config, runner: Runner | None = None,
                    halt: Halt | None = None, session: Session | None = None,
                    read_only: bool = False) -> Node:
        """``halt``: the daemon's, shared by the Nodes it builds (a reload
        makes a new one while chains of the old one still run). ``session``:
        one whose connect a command began already (``Session.begin``).
        ``read_only``: its looks write no record (``release --all --dry-run``,
        which takes no lock beside a running daemon)."""
        runner = runner or Runner(timeout=config.timeouts.command_seconds,
                                  long_timeout=config.timeouts.mkfs_seconds,
                                  halt=halt or Halt())
        # Built from the top down (observe's, then the drivers', then the
        # node's records): each part of the config goes down once.
        io_watch = IoWatch(config.events.io_stall_seconds)
        crypt = Cryptsetup(runner, Pbkdf(config.encryption.pbkdf, config.encryption.iter_time_ms,
                                         config.encryption.iterations,
                                         config.encryption.memory_kib))
        in_scopes = scopes.wanted(config.helper_scopes)
        nbd_records = NbdMappings(config.state_dir, writes=not read_only)
        return cls(
            config=config, runner=runner,
            fs=Filesystems(runner, CreatedPaths(config.state_dir / "created.json")),
            fuse=FuseMapper(config.ceph, config.state_dir / "fuse", runner, scopes=in_scopes),
            krbd=KernelMapper("krbd", config.ceph, runner),
            nbd=KernelMapper("nbd", config.ceph, runner, records=nbd_records, scopes=in_scopes),
            crypt=crypt,
            mappers_available=available_mappers(),
            io_watch=io_watch,
            ceph_session=session or Session(),
        )

    def anew(self, runner: Runner) -> Node:
        """This node's drivers built again over ``runner`` (``release --all``'s
        next look: the halt of the last one's runner must not refuse it)."""
        return Node.from_config(self.config, runner)

    def mapper(self, kind: str) -> FuseMapper | KernelMapper:
        return {"fuse": self.fuse, "krbd": self.krbd, "nbd": self.nbd}[kind]


# Probes fork blkid/dumpe2fs/xfs_info on the device: on a wedged OSD they sit
# in D state. At most this many run at once (written-off ones do not count).
_PROBES = Bounded(max_running=4, name="probe")


def _probe(node: Node, path: str, major: int, minor: int, size: int,
           mounts: dict[tuple[int, int], list[tuple[str, str, str]]],
           expected: tuple[str, str] | None, owner: str | None = None) -> Probed:
    """No fork when the device is mounted at its staging path as the wanted
    filesystem; else the full probe (cached across passes while unchanged)."""
    here = mounts.get((major, minor), [])
    if (expected is not None and (expected[0], expected[1], "/") in here
            and (fast := probe_mounted(node.fs, path, expected[1], expected[0])) is not None):
        return fast
    return probe_full(node.fs, node.probes, path, major, minor, size,
                      here[0][0] if here else None, owner)


def _devices(node: Node, paths: Iterable[str],
             mounts: dict[tuple[int, int], list[tuple[str, str, str]]],
             expected: dict[str, tuple[str, str]], timeout: float,
             stalled: dict[str, str] | None = None,
             owners: dict[str, str] | None = None) -> dict[str, Device]:
    """Probe each device in its own bounded call. One that fails is a device
    with a problem, one that does not answer is *unknown*: neither is blank.
    ``stalled``: devices whose I/O does not complete (path -> why): never
    opened nor probed (that would hang too), unknown."""
    stalled = stalled or {}
    found: dict[str, tuple[int, int, int]] = {}
    out: dict[str, Device] = {}
    for path in paths:
        if path in found or path in out:
            continue
        try:
            st = os.stat(path)
        except OSError:
            continue
        if not stat.S_ISBLK(st.st_mode):
            continue
        major, minor = os.major(st.st_rdev), os.minor(st.st_rdev)
        if path in stalled:
            out[path] = _unknown(path, major, minor, _sysfs_size(major, minor), "I/O stalled",
                                 stalled[path])
            continue
        try:
            size = block_device_size(path)
        except (OSError, ValueError):
            size = 0
        found[path] = (major, minor, size)
    deadline = time.monotonic() + 2 * timeout
    tasks = []
    for path, (major, minor, size) in found.items():
        try:
            tasks.append(_PROBES.submit((path, major, minor),
                                        functools.partial(_probe, node, path, major, minor,
                                                          size, mounts, expected.get(path),
                                                          (owners or {}).get(path))))
        except StillStuck as exc:
            out[path] = _unknown(path, major, minor, size, "probe timed out", str(exc))
    for task in tasks:
        path, major, minor = task.key  # type: ignore[misc]
        size = found[path][2]
        try:
            p = _PROBES.wait(task, timeout, deadline)
        except NoAnswer as exc:
            out[path] = _unknown(path, major, minor, size, "probe timed out", str(exc))
        except (CommandError, ValueError, OSError, DeviceUnreadable) as exc:
            # A failed probe is never "blank": report a signature we cannot name.
            log.warning("probe of %s failed: %s", path, exc)
            out[path] = Device(path, major, minor, size, None, None, "unknown (probe failed)",
                               problem=str(exc))
        else:
            out[path] = Device(path, major, minor, size, p.fs_type, p.uuid, p.signature,
                               p.fs_size, luks_offset=p.luks_offset)
    return out


def _sysfs_size(major: int, minor: int) -> int:
    """A device's size from sysfs (512-byte sectors): no open of the device."""
    try:
        return int(Path(f"/sys/dev/block/{major}:{minor}/size").read_text()) * 512
    except (OSError, ValueError):
        return 0


def _unknown(path: str, major: int, minor: int, size: int, what: str, why: str) -> Device:
    log.debug("%s of %s: %s", what, path, why)  # its volume reports it (UNKNOWN)
    return Device(path, major, minor, size, None, None, f"unknown ({what})",
                  unknown=f"{what}: {why}")


def observe(node: Node, volumes: Iterable[Volume], all_watchers: bool = False,
            ceph: bool = True) -> Observed:
    """``all_watchers``: every image's watchers (status, explain); else only
    those the planner may need (images not mapped here as wanted).
    ``ceph=False``: the node alone (a release: its teardown needs nothing of
    Ceph); every pool is then unlisted, so nothing of an image is known."""
    volumes = list(volumes)
    wanted = {(v.image.pool, v.image.name) for v in volumes if v.group is None}
    # A SnapshotGroup: its group and its members (their mounts are frozen around
    # the group snapshot); a restore from a group snapshot: that group.
    groups = {(v.image.pool, v.group.group) for v in volumes if v.group is not None}
    groups |= {(v.image.source.pool, v.image.source.group) for v in volumes
               if v.image.source is not None and v.image.source.group}
    wanted |= {m for v in volumes if v.group is not None for m in v.group.members}
    # A clone's source is looked at too (does its snapshot exist, how deep is it).
    wanted |= {(v.image.source.pool, v.image.source.image) for v in volumes
               if v.image.source is not None and v.image.source.pool}
    timeout = node.config.observe_timeout_seconds

    mountinfo = procfs.mountinfo()
    mounts = parse_mountinfo(mountinfo)
    mappings: list[Mapping] = list(node.fuse.list(mountinfo=mountinfo))
    unlisted: dict[str, str] = {}
    for kind in ("krbd", "nbd"):
        if kind in node.mappers_available:
            try:
                mappings += node.mapper(kind).list()
            except CommandError as exc:  # what it maps is unknown, not unmapped
                log.warning("listing %s mappings failed: %s", kind, exc)
                unlisted[kind] = str(exc)
    watchers_for = None if all_watchers else _watchers_needed(
        volumes, mappings, node.mappers_available)
    # Only the devices of wanted images: a stuck probe of another costs nothing.
    ours = [m for m in mappings if m.device and (m.pool, m.image) in wanted]
    raw = [m.device for m in ours if m.device]
    node.io_watch.sample(raw)
    # Ceph answers in the background while the devices are looked at; with
    # something of ours mapped here, its blocklist too (a fenced client).
    ceph_pass = _Background(
        lambda: observe_images(node.config.ceph, wanted, timeout, watchers_for,
                               node.ceph_session, groups, blocklist=bool(ours))) if ceph else None
    if (wait := node.io_watch.wait_needed(raw)) > 0:  # a CLI: is what is in flight moving?
        time.sleep(wait)
        node.io_watch.sample(raw)
    stalled = node.io_watch.stalled(raw)

    mounted: dict[tuple[int, int], list[tuple[str, str, str]]] = {}
    for m in mounts:
        mounted.setdefault((m.major, m.minor), []).append((m.mount_point, m.fs_type, m.root))
    crypts = open_crypts(raw)
    # A stalled device is never probed, nor is what is open over it.
    why = {d: stall_reason(s) for d, s in stalled.items()}
    why |= {c.path: why[r] for r, c in crypts.items() if r in why}
    # What each device is mapped for: a cached probe is of that mapping only.
    owners = {m.device: f"{m.kind}:{m.pool}/{m.image}" for m in ours if m.device}
    owners |= {c.path: f"crypt over {owners[r]}" for r, c in crypts.items() if r in owners}
    devices = _devices(node, raw + [c.path for c in crypts.values()], mounted,
                       _expected_mounts(volumes, ours, crypts), timeout, why, owners)
    node.probes.retain(devices)

    path_rdev = _device_node_binds(mounts, devices.values())
    by_point = {m.mount_point for m in mounts}
    symlinks: dict[str, str] = {}
    for v in volumes:
        paths = [t.path for t in v.publish] + ([v.stage.path] if v.stage else [])
        for p in paths:
            if (link := first_symlink(p)) is not None:
                symlinks[p] = link
        if v.stage is None or v.stage.mode != "block":
            continue
        for p in paths:
            if p in by_point and p not in path_rdev and p not in symlinks:
                with contextlib.suppress(OSError):
                    st = os.lstat(p)
                    if stat.S_ISBLK(st.st_mode):
                        path_rdev[p] = (os.major(st.st_rdev), os.minor(st.st_rdev))
    io_limits, io_errors = _io_limits(node, volumes, ours)
    mount_users = _dead_fuse_users(node, mappings, wanted, mounts, crypts)
    intents = Intents(node.config.state_dir).images()
    freezes = _left_frozen(node.config.state_dir)
    imgs = ceph_pass.result() if ceph_pass is not None else CephView()
    return Observed(images=imgs.images, pools_listed=frozenset(imgs.listed),
                    pool_errors=imgs.errors, image_errors=imgs.image_errors,
                    mappings=tuple(mappings), devices=devices, mounts=mounts,
                    path_rdev=path_rdev, symlinks=symlinks, intents=intents,
                    freezes=freezes, crypts=crypts, io_limits=io_limits, io_errors=io_errors,
                    groups=imgs.groups, group_errors=imgs.group_errors, stalled=stalled,
                    blocklist=imgs.blocklist, mount_users=mount_users,
                    mappings_unlisted=unlisted)


def _dead_fuse_users(node: Node, mappings: list[Mapping], wanted: set[tuple[str, str]],
                     mounts: tuple[Mount, ...], crypts: dict[str, CryptDevice]
                     ) -> dict[str, tuple[MountUser, ...]]:
    """Who uses each dead fuse-loop mapping of a wanted image (its device ->
    users); one whose loop device cannot be read is left out (unknown)."""
    out: dict[str, tuple[MountUser, ...]] = {}
    for m in dead_fuse_mappings(mappings, wanted):
        assert m.device is not None
        rdev = loop_number(m.device)
        if rdev is None:
            continue
        rdevs = [rdev] + [(c.major, c.minor) for c in crypts.values() if c.raw == m.device]
        # The dead mapping's own helpers (a zombie not yet reaped) are no users.
        helpers = [pid for mnt, pid in node.fuse.helper_pids().items() if mnt == m.fuse_mount]
        try:
            out[m.device] = dead_fuse_users(m, mounts, rdevs, ignore_pids=helpers)
        except OSError as exc:  # left out: its users unknown, it is not repaired
            log.warning("who uses %s could not be read: %s", m.device, exc)
    return out


def _left_frozen(state_dir: Path) -> frozenset[str]:
    """Mount points a dead run left frozen (nothing recorded: the freeze
    driver is not even loaded; every module costs a cold command)."""
    if not freezes_recorded(state_dir):
        return frozenset()
    from reconciler.drivers.freeze import left_frozen

    return frozenset(r.path for r in left_frozen(state_dir))


def _io_limits(node: Node, volumes: list[Volume], ours: list[Mapping]
               ) -> tuple[dict[str, dict[str, dict[str, int]]], dict[str, str]]:
    """io.max on the targets (units, cgroups) that mapped volumes name."""
    device = {(m.pool, m.image): m.device for m in ours if m.device}
    wanted: dict[str, list[str]] = {}
    for v in volumes:
        dev = device.get((v.image.pool, v.image.name))
        if not dev:
            continue
        targets = [p.io_cgroup for p in v.publish if p.io_cgroup]
        if v.qos is not None and v.qos.io_target:
            targets.append(v.qos.io_target)
        for target in targets:
            wanted.setdefault(target, []).append(dev)
    if not wanted:
        return {}, {}
    from reconciler.drivers import iolimits  # loaded only when a volume names a target

    limits, errors = {}, {}
    for target, devs in wanted.items():
        try:
            limits[target] = iolimits.read(node.runner, target, devs)
        except (iolimits.IoLimitError, OSError) as exc:
            errors[target] = str(exc)
    return limits, errors


def _watchers_needed(volumes: Iterable[Volume], mappings: Iterable[Mapping],
                     available: frozenset[str]) -> set[tuple[str, str]]:
    """Images the planner may need more of than the header read gives
    (watchers, snapshots, parent): to map one (another client has it open?),
    to delete one, to take or clone from a snapshot. A present volume is
    neither when it is mapped here once, alive, by the mapper it wants, or
    when it wants no mapping and nothing is mapped here for it (an image-only
    volume: every CSI volume until it is staged)."""
    here: dict[tuple[str, str], list[Mapping]] = {}
    for m in mappings:
        here.setdefault((m.pool, m.image), []).append(m)
    out = set()
    for v in volumes:
        if v.group is not None:
            continue  # its members' watchers are never needed
        key = (v.image.pool, v.image.name)
        src = v.image.source
        if src is not None and src.pool:
            out.add((src.pool, src.image))  # its snapshots and clone depth
        if v.snapshot is not None or src is not None or not _settled(
                v, here.get(key, []), available):
            out.add(key)
    return out


def _settled(v: Volume, here: list[Mapping], available: frozenset[str]) -> bool:
    if v.state != "present":
        return False
    if v.map is None:
        return not here  # anything mapped here for it is unmapped: watchers count
    return (len(here) == 1 and here[0].device is not None and here[0].problem is None
            and here[0].kind == resolve_mapper(v.map.mapper, available))


def _expected_mounts(volumes: Iterable[Volume], mappings: Iterable[Mapping],
                     crypts: dict[str, CryptDevice]) -> dict[str, tuple[str, str]]:
    """device -> (staging path, fs type) its volume wants there (an open LUKS2
    device over the mapped one, where there is one)."""
    stage = {(v.image.pool, v.image.name): v.stage for v in volumes}
    out = {}
    for m in mappings:
        st = stage.get((m.pool, m.image))
        if m.device and st is not None and st.mode == "filesystem" and st.fs_type:
            crypt = crypts.get(m.device)
            out[crypt.path if crypt else m.device] = (st.path, st.fs_type)
    return out


def open_crypts(devices: Iterable[str], sys_root: str = "/sys") -> dict[str, CryptDevice]:
    """The open LUKS2 devices over ``devices`` (by the device under each), from
    sysfs: a holder whose dm uuid says cryptsetup LUKS2 made it."""
    out: dict[str, CryptDevice] = {}
    for raw in devices:
        try:
            rdev = os.stat(raw).st_rdev
            holders = os.listdir(f"{sys_root}/dev/block/{os.major(rdev)}:{os.minor(rdev)}"
                                 "/holders")
        except OSError:
            continue
        for h in holders:
            base = f"{sys_root}/block/{h}"
            try:
                uuid = procfs.read_text(f"{base}/dm/uuid").strip()
                if not uuid.startswith(CRYPT_UUID_PREFIX):
                    continue
                name = procfs.read_text(f"{base}/dm/name").strip()
                major, minor = (int(x) for x in Path(f"{base}/dev").read_text().split(":"))
                size = int(Path(f"{base}/size").read_text()) * 512
            except (OSError, ValueError):
                continue
            out[raw] = CryptDevice(name, f"/dev/mapper/{name}", major, minor, size, raw)
    return out


class _Background:
    """``fn()`` in a thread; ``result()`` joins it. ``fn`` bounds its own time."""

    def __init__(self, fn: Callable[[], CephView]) -> None:
        self._fn = fn
        self._out: CephView | None = None
        self._exc: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="observe-ceph", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._out = self._fn()
        except BaseException as exc:  # re-raised in result()
            self._exc = exc

    def result(self) -> CephView:
        self._thread.join()
        if self._exc is not None:
            raise self._exc
        assert self._out is not None
        return self._out


def _device_node_binds(mounts: Iterable[Mount], devices: Iterable[Device]
                       ) -> dict[str, tuple[int, int]]:
    """Every bind of one of our device nodes, wherever it is (safety rule 9).

    A bind of /dev/loop3 is a mount of /dev's filesystem whose root field is
    "/loop3"; the node at the mount point then has the device's number. Found
    by identity, not by the paths the current spec names: a path the spec no
    longer lists still gets torn down.
    """
    wanted: dict[tuple[tuple[int, int], str], tuple[int, int]] = {}
    for d in devices:
        with contextlib.suppress(OSError):
            st = os.stat(d.path)
            devfs = (os.major(st.st_dev), os.minor(st.st_dev))
            wanted[(devfs, "/" + os.path.basename(d.path))] = (d.major, d.minor)
    out: dict[str, tuple[int, int]] = {}
    for m in mounts:
        rdev = wanted.get(((m.major, m.minor), m.root))
        if rdev is None:
            continue
        with contextlib.suppress(OSError):
            st = os.lstat(m.mount_point)
            if stat.S_ISBLK(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == rdev:
                out[m.mount_point] = rdev
    return out
