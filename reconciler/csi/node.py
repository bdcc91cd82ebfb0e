"""CSI Node: stage and publish become the stage section and publish entries of
the volume's file; the engine maps, formats, mounts and binds.

Kubelet's paths: a mount volume stages on the directory kubelet made and
publishes on a directory we create; a block volume stages on a directory
(the device node goes on a file inside it) and publishes on a file we create.

Imported by csi/server.py.
"""

from __future__ import annotations

import os
import stat
from typing import Any

import grpc

from reconciler.csi import capability, csi_pb2_grpc, ids, podcgroup
from reconciler.csi import csi_pb2 as pb
from reconciler.csi.cephinfo import CephInfo
from reconciler.csi.errors import CsiError, invalid, not_found, precondition, quoted, rpc
from reconciler.csi.files import (
    L_ENCRYPTION,
    L_FSTYPE,
    L_MAPPER,
    L_ORIGIN,
    encryption_spec,
    new_document,
)
from reconciler.csi.volumes import Volumes
from reconciler.drivers import procfs
from reconciler.facts.observed import Mount, top_mounts
from reconciler.facts.parsers import parse_mountinfo
from reconciler.spec.config import MountPrivileges
from reconciler.spec.mountopts import check_mount_options

BLOCK_DEVICE_FILE = "rbd-device"  # the device node's bind inside kubelet's staging dir
NAME_MAX = 255  # bytes in one path component (Linux)
PATH_MAX = 4096  # bytes in a path, its terminating NUL included


def _path(value: str, what: str) -> str:
    if not value:
        raise invalid(f"{what} is required")
    if not os.path.isabs(value) or os.path.normpath(value) != value:
        raise invalid(f"{what} {quoted(value)} must be an absolute, normalised path")
    size = len(os.fsencode(value))
    if size >= PATH_MAX:
        raise invalid(f"{what} {quoted(value)} is {size} bytes long; a path holds at most "
                      f"{PATH_MAX - 1}")
    for part in value.split("/"):
        if len(os.fsencode(part)) > NAME_MAX:
            raise invalid(f"{what} {quoted(value)}: its component {quoted(part, 40)} is "
                          f"{len(os.fsencode(part))} bytes long; a name holds at most {NAME_MAX}")
    return value


def _usable(path: str, what: str, last: str) -> None:
    """The engine's checks on a path it mounts on (and creates what is
    missing of), made before the volume's file is written: no symlink in it
    (safety rule 8), every existing component a directory, and the last one,
    if it exists, a ``last`` ("directory" or "file")."""
    parts = [p for p in path.split("/") if p]
    here = ""
    for i, part in enumerate(parts):
        here += "/" + part
        try:
            st = os.lstat(here)
        except FileNotFoundError:
            return  # the engine makes the rest
        except OSError as exc:
            raise precondition(f"{what} {quoted(path)}: cannot look at {quoted(here)}: "
                               f"{exc.strerror or exc}") from None
        if stat.S_ISLNK(st.st_mode):
            where = "is" if here == path else "passes through"
            raise precondition(f"{what} {quoted(path)} {where} the symlink {quoted(here)}; "
                               "no symlink is followed")
        if i < len(parts) - 1 or last == "directory":
            if not stat.S_ISDIR(st.st_mode):
                raise precondition(f"{what} {quoted(path)}: {quoted(here)} exists and is "
                                   "not a directory")
        elif stat.S_ISDIR(st.st_mode):
            raise precondition(f"{what} {quoted(path)} is a directory; a block volume is "
                               "bound onto a file")


def _foreign_mount(target: str, source: str) -> Mount | None:
    """The top mount at ``target`` when it is not a bind of the top mount at
    ``source`` (the volume's staging mount or device node): something else is
    mounted there. With nothing at ``source`` to compare, None: the engine
    decides (by the device) and a refusal puts the file back."""
    tops = top_mounts(procfs.mounts())
    there, ours = tops.get(target), tops.get(source)
    if there is None or ours is None:
        return None
    if (there.major, there.minor, there.root) == (ours.major, ours.minor, ours.root):
        return None
    return there


def _check_mount_flags(access: capability.Access, fs_type: str, staging: str,
                       privileges: MountPrivileges) -> None:
    """The capability's mount flags become the stage's mountOptions: the same
    allow-list as an operator's file (and suid/dev only where the node config
    allows), refused before anything is written."""
    problems = check_mount_options(access.mount_options, fs_type=fs_type, publish=False,
                                   block=False, path=staging, privileges=privileges)
    if problems:
        raise invalid("volume_capability.mount.mount_flags: "
                      + "; ".join(msg for _, msg in problems))


def _staged_at(stage: dict[str, Any] | None, staging: str) -> bool:
    if not stage:
        return False
    path = stage.get("path") or ""
    if stage.get("mode") == "block":
        return os.path.dirname(path) == staging
    return path == staging


def _present(doc: dict[str, Any] | None) -> bool:
    return doc is not None and doc["spec"].get("state", "present") == "present"


class NodeServicer(csi_pb2_grpc.NodeServicer):
    def __init__(self, volumes: Volumes, ceph: CephInfo) -> None:
        self.volumes = volumes
        self.files = volumes.files
        self.ceph = ceph

    def _name(self, volume_id: str) -> tuple[str, str, str]:
        parsed = ids.parse_volume_id(volume_id)
        if parsed is None:
            raise not_found(f"volume {quoted(volume_id)} does not exist (not an id we handed out)")
        return ids.volume_name(*parsed), *parsed

    # -- stage -----------------------------------------------------------------
    @rpc
    def NodeStageVolume(self, request: pb.NodeStageVolumeRequest,
                        context: grpc.ServicerContext) -> pb.NodeStageVolumeResponse:
        if not request.volume_id:
            raise invalid("volume_id is required")
        staging = _path(request.staging_target_path, "staging_target_path")
        if not request.HasField("volume_capability"):
            raise invalid("volume_capability is required")
        access = capability.parse(request.volume_capability)
        name, pool, image = self._name(request.volume_id)
        deadline = self.volumes.deadline(context)
        with self.volumes.operation(name):
            doc = self.volumes.node_file(name)
            if not _present(doc):
                # Created elsewhere (or by hand): stage it by its id alone.
                if self.ceph.image_size(pool, image) is None:
                    raise not_found(f"volume {quoted(request.volume_id)} does not exist")
                # What the controller recorded of it (csi.statePool) says how
                # it maps, formats and opens: its mapper, fs type, encryption.
                doc = new_document(name, {L_ORIGIN: "node", **self.volumes.recorded_labels(name)},
                                   {"pool": pool, "name": image})
            assert doc is not None
            labels = doc["metadata"].setdefault("labels", {})
            if access.block:
                want = {"mode": "block", "path": os.path.join(staging, BLOCK_DEVICE_FILE)}
            else:
                want = {"mode": "filesystem",
                        "fsType": access.fs_type or labels.get(L_FSTYPE) or "ext4",
                        "path": staging}
                _check_mount_flags(access, want["fsType"], staging,
                                   self.volumes.config.mount_privileges)
                if access.mount_options:
                    want["mountOptions"] = list(access.mount_options)
            spec = doc["spec"]
            if spec.get("stage") == want:
                self.volumes.settle(name, deadline, bring_up=True)
                return pb.NodeStageVolumeResponse()
            if spec.get("stage"):
                raise CsiError(grpc.StatusCode.ALREADY_EXISTS,
                               f"volume {name} is already staged at {spec['stage']['path']} "
                               f"({spec['stage'].get('mode', 'filesystem')}); unstage it first")
            _usable(want["path"], "staging_target_path", "file" if access.block else "directory")
            spec["map"] = {"mapper": labels[L_MAPPER]} if L_MAPPER in labels else {}
            if L_ENCRYPTION in labels:
                spec["encryption"] = encryption_spec(labels[L_ENCRYPTION])
            spec["stage"] = want
            self.volumes.converge(name, doc, deadline, bring_up=True)
        return pb.NodeStageVolumeResponse()

    @rpc
    def NodeUnstageVolume(self, request: pb.NodeUnstageVolumeRequest,
                          context: grpc.ServicerContext) -> pb.NodeUnstageVolumeResponse:
        if not request.volume_id:
            raise invalid("volume_id is required")
        staging = _path(request.staging_target_path, "staging_target_path")
        parsed = ids.parse_volume_id(request.volume_id)
        if parsed is None:
            return pb.NodeUnstageVolumeResponse()  # never staged by us
        name = ids.volume_name(*parsed)
        deadline = self.volumes.deadline(context)
        with self.volumes.operation(name):
            doc = self.volumes.node_file(name)
            if doc is None:
                return pb.NodeUnstageVolumeResponse()
            spec = doc["spec"]
            if not _staged_at(spec.get("stage"), staging):
                if not spec.get("stage"):
                    self.volumes.settle(name, deadline)  # a retry: confirm it is done
                return pb.NodeUnstageVolumeResponse()
            if spec.get("publish"):
                paths = ", ".join(p["path"] for p in spec["publish"])
                raise precondition(f"volume {name} is still published at {paths}; "
                                   "unpublish it first")
            spec.pop("stage", None)
            spec.pop("map", None)
            spec.pop("encryption", None)  # closed with the unstage; needs a map to be said
            spec.pop("publish", None)
            self.volumes.converge(name, doc, deadline)
            if doc["metadata"].get("labels", {}).get(L_ORIGIN) == "node":
                self.files.remove(name)  # it only existed to stage the id here
            else:
                self.volumes.let_go(name, doc)  # with records in Ceph: theirs now
        return pb.NodeUnstageVolumeResponse()

    # -- publish ---------------------------------------------------------------
    @rpc
    def NodePublishVolume(self, request: pb.NodePublishVolumeRequest,
                          context: grpc.ServicerContext) -> pb.NodePublishVolumeResponse:
        if not request.volume_id:
            raise invalid("volume_id is required")
        target = _path(request.target_path, "target_path")
        if not request.HasField("volume_capability"):
            raise invalid("volume_capability is required")
        access = capability.parse(request.volume_capability)
        staging = _path(request.staging_target_path, "staging_target_path")
        name, _, _ = self._name(request.volume_id)
        deadline = self.volumes.deadline(context)
        with self.volumes.operation(name):
            doc = self.volumes.node_file(name)
            if not _present(doc):
                raise not_found(f"volume {quoted(request.volume_id)} does not exist")
            assert doc is not None
            spec = doc["spec"]
            if not _staged_at(spec.get("stage"), staging):
                raise precondition(f"volume {name} is not staged at {quoted(staging)}; "
                                   "call NodeStageVolume first")
            if (spec["stage"].get("mode") == "block") != access.block:
                raise invalid(f"volume {name} is staged as "
                              f"{spec['stage'].get('mode', 'filesystem')}; the capability asks "
                              f"for {'block' if access.block else 'mount'}")
            if not access.block:
                # The flags took effect at the stage (the bind carries its flags);
                # still, a flag the stage would refuse is refused here too.
                _check_mount_flags(access, spec["stage"].get("fsType") or "ext4", staging,
                                   self.volumes.config.mount_privileges)
            read_only = request.readonly or access.read_only
            publish = spec.setdefault("publish", [])
            for entry in publish:
                if entry["path"] == target:
                    if bool(entry.get("readOnly")) != read_only:
                        raise CsiError(grpc.StatusCode.ALREADY_EXISTS,
                                       f"{quoted(target)} is already published "
                                       f"{'read-only' if entry.get('readOnly') else 'read-write'}")
                    self.volumes.settle(name, deadline, bring_up=True)
                    return pb.NodePublishVolumeResponse()
            if access.single_writer and publish:
                raise precondition(f"volume {name} is SINGLE_NODE_SINGLE_WRITER and already "
                                   f"published at {', '.join(p['path'] for p in publish)}; "
                                   "unpublish it there first")
            _usable(target, "target_path", "file" if access.block else "directory")
            if (there := _foreign_mount(target, spec["stage"]["path"])) is not None:
                raise precondition(f"target_path {quoted(target)} already has a mount of "
                                   f"something else ({quoted(there.source)}, "
                                   f"{quoted(there.fs_type)}); refusing to stack on it")
            entry: dict[str, Any] = {"path": target, "readOnly": read_only}
            if (cgroup := podcgroup.find(target)) is not None:
                entry["ioCgroup"] = cgroup  # io.max for the pod: the volume's QoS
            publish.append(entry)
            self.volumes.converge(name, doc, deadline, bring_up=True)
        return pb.NodePublishVolumeResponse()

    @rpc
    def NodeUnpublishVolume(self, request: pb.NodeUnpublishVolumeRequest,
                            context: grpc.ServicerContext) -> pb.NodeUnpublishVolumeResponse:
        if not request.volume_id:
            raise invalid("volume_id is required")
        target = _path(request.target_path, "target_path")
        parsed = ids.parse_volume_id(request.volume_id)
        if parsed is None:
            return pb.NodeUnpublishVolumeResponse()
        name = ids.volume_name(*parsed)
        deadline = self.volumes.deadline(context)
        with self.volumes.operation(name):
            doc = self.volumes.node_file(name)
            if doc is None:
                return pb.NodeUnpublishVolumeResponse()
            publish = doc["spec"].get("publish", [])
            kept = [p for p in publish if p["path"] != target]
            if len(kept) == len(publish):
                if doc["spec"].get("stage"):
                    self.volumes.settle(name, deadline)  # a retry: confirm it is done
                return pb.NodeUnpublishVolumeResponse()
            if kept:
                doc["spec"]["publish"] = kept
            else:
                doc["spec"].pop("publish")
            self.volumes.converge(name, doc, deadline)
        return pb.NodeUnpublishVolumeResponse()

    # -- stats and expansion ---------------------------------------------------
    @rpc
    def NodeGetVolumeStats(self, request: pb.NodeGetVolumeStatsRequest,
                           context: grpc.ServicerContext) -> pb.NodeGetVolumeStatsResponse:
        if not request.volume_id:
            raise invalid("volume_id is required")
        if not request.volume_path:
            raise invalid("volume_path is required")
        name, _, _ = self._name(request.volume_id)
        doc = self.volumes.node_file(name)
        if not _present(doc):
            raise not_found(f"volume {quoted(request.volume_id)} does not exist")
        assert doc is not None
        path = request.volume_path
        stage = doc["spec"].get("stage") or {}
        known = {p["path"] for p in doc["spec"].get("publish", [])}
        if stage:
            known |= {stage["path"], os.path.dirname(stage["path"])
                      if stage.get("mode") == "block" else stage["path"]}
        if path not in known:
            raise not_found(f"volume {name} is not staged or published at {quoted(path)}")
        if stage.get("mode") == "block":
            device = stage["path"] if path == os.path.dirname(stage["path"]) else path
            return self._block_stats(device)
        return self._fs_stats(path)

    def _block_stats(self, path: str) -> pb.NodeGetVolumeStatsResponse:
        try:
            # The node itself (a symlink is never followed), checked before it is opened.
            if not stat.S_ISBLK(os.lstat(path).st_mode):
                raise OSError(f"{path} is not a block device node")
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                size = os.lseek(fd, 0, os.SEEK_END)
            finally:
                os.close(fd)
        except OSError as exc:
            return pb.NodeGetVolumeStatsResponse(volume_condition=pb.VolumeCondition(
                abnormal=True, message=f"the device is not there: {exc}"))
        return pb.NodeGetVolumeStatsResponse(
            usage=[pb.VolumeUsage(total=size, unit=pb.VolumeUsage.BYTES)],
            volume_condition=pb.VolumeCondition(abnormal=False, message="device present"))

    def _fs_stats(self, path: str) -> pb.NodeGetVolumeStatsResponse:
        mounted = {m.mount_point for m in parse_mountinfo(
            procfs.mountinfo())}
        if path not in mounted:
            return pb.NodeGetVolumeStatsResponse(volume_condition=pb.VolumeCondition(
                abnormal=True, message=f"nothing is mounted at {path}"))
        try:
            st = os.statvfs(path)
        except OSError as exc:
            return pb.NodeGetVolumeStatsResponse(volume_condition=pb.VolumeCondition(
                abnormal=True, message=f"the filesystem does not answer: {exc}"))
        usage = [
            pb.VolumeUsage(total=st.f_blocks * st.f_frsize, available=st.f_bavail * st.f_frsize,
                           used=(st.f_blocks - st.f_bfree) * st.f_frsize,
                           unit=pb.VolumeUsage.BYTES),
            pb.VolumeUsage(total=st.f_files, available=st.f_favail,
                           used=st.f_files - st.f_ffree, unit=pb.VolumeUsage.INODES),
        ]
        return pb.NodeGetVolumeStatsResponse(usage=usage, volume_condition=pb.VolumeCondition(
            abnormal=False, message="mounted"))

    @rpc
    def NodeExpandVolume(self, request: pb.NodeExpandVolumeRequest,
                         context: grpc.ServicerContext) -> pb.NodeExpandVolumeResponse:
        if not request.volume_id:
            raise invalid("volume_id is required")
        if not request.volume_path:
            raise invalid("volume_path is required")
        name, pool, image = self._name(request.volume_id)
        deadline = self.volumes.deadline(context)
        with self.volumes.operation(name):
            doc = self.volumes.node_file(name)
            if not _present(doc):
                raise not_found(f"volume {quoted(request.volume_id)} does not exist")
            # The engine grows the mapping and the filesystem whenever the
            # image is larger: a pass on the file as it is does the work.
            status = self.volumes.settle(name, deadline)
        pending = [n for n in status.get("notes") or [] if "grows offline" in n]
        if pending:
            raise precondition(f"volume {name}: {pending[0]}")
        size = self.ceph.image_size(pool, image) or 0
        return pb.NodeExpandVolumeResponse(capacity_bytes=size)

    # -- about this node -------------------------------------------------------
    @rpc
    def NodeGetCapabilities(self, request: pb.NodeGetCapabilitiesRequest,
                            context: grpc.ServicerContext) -> pb.NodeGetCapabilitiesResponse:
        rpc_ = pb.NodeServiceCapability.RPC
        kinds = (rpc_.STAGE_UNSTAGE_VOLUME, rpc_.GET_VOLUME_STATS, rpc_.EXPAND_VOLUME,
                 rpc_.VOLUME_CONDITION, rpc_.SINGLE_NODE_MULTI_WRITER)
        return pb.NodeGetCapabilitiesResponse(capabilities=[
            pb.NodeServiceCapability(rpc=rpc_(type=k)) for k in kinds])

    @rpc
    def NodeGetInfo(self, request: pb.NodeGetInfoRequest,
                    context: grpc.ServicerContext) -> pb.NodeGetInfoResponse:
        return pb.NodeGetInfoResponse(node_id=self.volumes.config.node_name)
