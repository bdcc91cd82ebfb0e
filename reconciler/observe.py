"""Gather the actual state in one pass: Ceph images, mappings, devices, mounts."""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .config import Config
from .drivers import ceph
from .drivers.fs import DeviceUnreadable, Filesystems, block_device_size
from .drivers.mappers import FuseMapper, KernelMapper, available_mappers
from .drivers.run import CommandError, Runner
from .observed import Device, Mapping, Mount, Observed
from .parsers import parse_mountinfo
from .registry import CreatedPaths, Registry
from .safepath import first_symlink
from .spec import Volume

log = logging.getLogger(__name__)


@dataclass
class Node:
    """The drivers for one node, built from its config."""

    config: Config
    runner: Runner
    fs: Filesystems
    fuse: FuseMapper
    krbd: KernelMapper
    nbd: KernelMapper
    mappers_available: frozenset[str]

    @classmethod
    def from_config(cls, config: Config, runner: Runner | None = None) -> Node:
        runner = runner or Runner()
        return cls(
            config=config, runner=runner,
            fs=Filesystems(runner, CreatedPaths(config.state_dir / "created.json")),
            fuse=FuseMapper(config.ceph, config.state_dir / "fuse", runner),
            krbd=KernelMapper("krbd", config.ceph, runner),
            nbd=KernelMapper("nbd", config.ceph, runner),
            mappers_available=available_mappers(),
        )

    def mapper(self, kind: str) -> FuseMapper | KernelMapper:
        return {"fuse": self.fuse, "krbd": self.krbd, "nbd": self.nbd}[kind]


def _device(node: Node, path: str, mounts: dict[tuple[int, int], str]) -> Device | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISBLK(st.st_mode):
        return None
    try:
        size = block_device_size(path)
    except (OSError, ValueError):
        size = 0
    try:
        probe = node.fs.probe(path)
    except (CommandError, ValueError, DeviceUnreadable) as exc:
        # A failed probe is never "blank": report a signature we cannot name.
        log.warning("probe of %s failed: %s", path, exc)
        return Device(path, os.major(st.st_rdev), os.minor(st.st_rdev), size, None, None,
                      "unknown (probe failed)", problem=str(exc))
    rdev = (os.major(st.st_rdev), os.minor(st.st_rdev))
    fs_size = (node.fs.fs_size(path, probe.fs_type, mounts.get(rdev))
               if probe.fs_type in ("ext4", "xfs") else None)
    return Device(path, *rdev, size, probe.fs_type,
                  probe.uuid, probe.signature, fs_size)


def observe(node: Node, volumes: Iterable[Volume]) -> Observed:
    volumes = list(volumes)
    wanted = {(v.image.pool, v.image.name) for v in volumes}
    try:
        with ceph.connect(node.config.ceph) as cluster:
            imgs = ceph.observe_images(cluster, wanted)
        images, listed, pool_errors = imgs.images, frozenset(imgs.listed), imgs.errors
    except ceph.CephError as exc:
        images, listed = {}, frozenset()
        pool_errors = {pool: str(exc) for pool, _ in wanted}

    mountinfo = Path("/proc/self/mountinfo").read_text()
    mounts = parse_mountinfo(mountinfo)
    mappings: list[Mapping] = list(node.fuse.list(mountinfo=mountinfo))
    for kind in ("krbd", "nbd"):
        if kind in node.mappers_available:
            try:
                mappings += node.mapper(kind).list()
            except CommandError as exc:
                log.warning("listing %s mappings failed: %s", kind, exc)

    mounted = {(m.major, m.minor): m.mount_point for m in mounts}
    devices = {}
    for m in mappings:
        if m.device and m.device not in devices and (d := _device(node, m.device, mounted)):
            devices[m.device] = d

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
    intents = set()
    for key in Registry(node.config.state_dir / "intents.json").all():
        pool, _, image = key.partition("/")
        intents.add((pool, image))
    return Observed(images=images, pools_listed=listed, pool_errors=pool_errors,
                    mappings=tuple(mappings), devices=devices, mounts=mounts,
                    path_rdev=path_rdev, symlinks=symlinks, intents=frozenset(intents))


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
