"""CSI Controller: CreateVolume / DeleteVolume / expand become edits of a
volume file's image section; the engine creates, grows and deletes.

Imported by csi/server.py.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

import grpc

from reconciler.csi import capability, csi_pb2_grpc, ids, mutable
from reconciler.csi import csi_pb2 as pb
from reconciler.csi.adopt import adopted_document, labels_meta
from reconciler.csi.cephinfo import CephInfo
from reconciler.csi.errors import CsiError, invalid, not_found, quoted, rpc, unanswered
from reconciler.csi.files import (
    L_ACCESS,
    L_ENCRYPTION,
    L_FSTYPE,
    L_MAPPER,
    L_ORIGIN,
    L_REQUEST,
    new_document,
)
from reconciler.csi.snapshots import SnapshotRpcs, content_source_of, source_image
from reconciler.csi.volumes import Volumes
from reconciler.drivers.rbdbase import CephError
from reconciler.spec.model import DEFAULT_FEATURES
from reconciler.spec.security import key_path_problem
from reconciler.spec.units import MAX_OBJECT_MAP_SIZE, format_size

log = logging.getLogger("rbd-reconciler.csi")

MiB = 1 << 20
DEFAULT_SIZE = 1 << 30  # a CreateVolume without a capacity range
PARAMETERS = ("pool", "imageFeatures", "mapper", "fsType", "encrypted", "encryptionKey")
KEY_KINDS = ("file", "wrappedBy")
# external-provisioner's own keys (PVC/PV names with --extra-create-metadata).
CO_PREFIX = "csi.storage.k8s.io/"
_TOKEN = re.compile(r"csi-(x|snap-)?[0-9a-f]{32}")
# The answer's capacity_bytes is an int64, and so is the size a mapped device
# (loff_t) can have: the largest whole-MiB size below 2^63.
MAX_REPLY_SIZE = ((1 << 63) - 1) // MiB * MiB
IN_USE_PHASES = ("Mapped", "Staged", "Published", "Degraded")  # the daemon's status phases


def max_size(features: list[str] | tuple[str, ...] | None) -> int:
    """The largest volume an image with ``features`` can be: what the reply
    and the mapper hold, and with object-map what the loader allows."""
    feats = DEFAULT_FEATURES if features is None else features
    return min(MAX_REPLY_SIZE, MAX_OBJECT_MAP_SIZE) if "object-map" in feats else MAX_REPLY_SIZE


def _size(rng: pb.CapacityRange | None, most: int = MAX_REPLY_SIZE) -> int:
    """Bytes for a capacity range: required rounded up to whole MiB, at most
    ``most`` (checked before rounding: rounding never overflows)."""
    req = rng.required_bytes if rng is not None else 0
    lim = rng.limit_bytes if rng is not None else 0
    if req < 0 or lim < 0:
        raise invalid("capacity_range: bytes must not be negative")
    if lim and req > lim:
        raise invalid(f"capacity_range: required_bytes {req} exceeds limit_bytes {lim}")
    if req > most:
        raise CsiError(grpc.StatusCode.OUT_OF_RANGE,
                       f"capacity_range: required_bytes {req} is more than a volume of these "
                       f"features can hold ({most} bytes, {format_size(most)}"
                       + (": the object map's limit; drop object-map and fast-diff from "
                          "imageFeatures for more)" if most == MAX_OBJECT_MAP_SIZE else ")"))
    size = -(-req // MiB) * MiB if req else min(DEFAULT_SIZE, lim // MiB * MiB if lim else
                                                DEFAULT_SIZE)
    if size < MiB or (lim and size > lim):
        raise CsiError(grpc.StatusCode.OUT_OF_RANGE,
                       f"capacity_range (required {req}, limit {lim}): volumes come in whole "
                       "MiB, at least 1 MiB")
    return size


def _parameters(params: dict[str, str]) -> dict[str, str]:
    out = {}
    for key, value in params.items():
        if key.startswith(CO_PREFIX):
            continue
        if key not in PARAMETERS:
            raise invalid(f"parameter {quoted(key)} is not known (known: {', '.join(PARAMETERS)})")
        out[key] = value
    if "pool" not in out:
        raise invalid("parameter 'pool' is required (the StorageClass names the RBD pool)")
    if out.get("fsType", "ext4") not in capability.FS_TYPES:
        raise invalid(f"parameter fsType {quoted(out['fsType'])}: ext4 or xfs")
    if out.get("encrypted", "false") not in ("true", "false"):
        raise invalid(f"parameter encrypted {quoted(out['encrypted'])}: \"true\" or \"false\"")
    if "encryptionKey" in out:
        kind, _, path = out["encryptionKey"].partition(":")
        if out.get("encrypted") != "true":
            raise invalid("parameter encryptionKey needs encrypted: \"true\"")
        if kind not in KEY_KINDS or not path.startswith("/"):
            raise invalid(f"parameter encryptionKey {quoted(out['encryptionKey'])}: file:/PATH or "
                          "wrappedBy:/PATH (a key file under the node config's "
                          "encryption.keyRoot)")
    return out


def _encryption(params: dict[str, str], key_root: str) -> str | None:
    """The key source ("KIND:PATH") of an encrypted StorageClass; the default
    is the node key ``<keyRoot>/node.key`` wrapping a per-volume passphrase."""
    if params.get("encrypted") != "true":
        return None
    root = key_root.rstrip("/")
    source = params.get("encryptionKey") or f"wrappedBy:{root}/node.key"
    path = source.partition(":")[2]
    if key_path_problem(path, root) is not None:
        raise invalid(f"parameter encryptionKey {quoted(source)}: the key file must lie under "
                      f"{root} (encryption.keyRoot of the node config)")
    return source


def _features(params: dict[str, str]) -> list[str] | None:
    """The StorageClass's imageFeatures as a list; None: the defaults."""
    if "imageFeatures" not in params:
        return None
    return [f.strip() for f in params["imageFeatures"].split(",") if f.strip()]


def _qos_of(limits: dict[str, int | None]) -> dict[str, int]:
    """The ``qos`` a CreateVolume with these mutable parameters makes."""
    spec: dict[str, Any] = {}
    mutable.apply(spec, limits)
    return spec.get("qos") or {}


def _volume(doc: dict[str, Any]) -> pb.Volume:
    img = doc["spec"]["image"]
    return pb.Volume(capacity_bytes=int(img["size"]),
                     volume_id=ids.volume_id(img["pool"], img["name"]),
                     volume_context={"pool": img["pool"], "image": img["name"]},
                     content_source=content_source_of(doc))


class ControllerServicer(SnapshotRpcs, csi_pb2_grpc.ControllerServicer):
    def __init__(self, volumes: Volumes, ceph: CephInfo) -> None:
        self.volumes = volumes
        self.files = volumes.files
        self.ceph = ceph

    # -- create / delete -------------------------------------------------------
    @rpc
    def CreateVolume(self, request: pb.CreateVolumeRequest,
                     context: grpc.ServicerContext) -> pb.CreateVolumeResponse:
        if not request.name:
            raise invalid("name is required")
        access = capability.parse_all(list(request.volume_capabilities))
        params = _parameters(dict(request.parameters))
        limits = mutable.parse(dict(request.mutable_parameters))
        features = _features(params)
        most = max_size(features)
        source, least = None, 0
        if request.HasField("volume_content_source"):
            source, least = self.content_source(request)
        if source is not None and not request.HasField("capacity_range"):
            size = max(MiB, -(-least // MiB) * MiB)  # as large as its source
            if size > most:
                raise CsiError(grpc.StatusCode.OUT_OF_RANGE,
                               f"the source ({least} bytes) is larger than a volume of these "
                               f"features can hold ({most} bytes)")
        else:
            size = _size(request.capacity_range if request.HasField("capacity_range")
                         else None, most)
        if size < least:
            raise CsiError(grpc.StatusCode.OUT_OF_RANGE,
                           f"capacity_range: {size} bytes is smaller than the source "
                           f"({least} bytes); a clone may grow, never shrink")
        fs_type = params.get("fsType") or next((a.fs_type for a in access if a.fs_type), "ext4")
        if fs_type == "xfs" and size < 300 * MiB:
            raise CsiError(grpc.StatusCode.OUT_OF_RANGE, "xfs needs at least 300 MiB")
        pool, image = params["pool"], ids.image_for_request(request.name)
        try:
            ids.volume_id(pool, image)
        except ValueError as exc:
            raise invalid(str(exc)) from None
        name = ids.volume_name(pool, image)
        img: dict[str, Any] = {"pool": pool, "name": image, "size": size,
                               "reclaimPolicy": "Delete"}
        if features is not None:
            img["features"] = features
        if source is not None:
            img["source"] = source
        labels = {L_REQUEST: request.name, L_ORIGIN: "controller", L_FSTYPE: fs_type,
                  L_ACCESS: "block" if all(a.block for a in access) else "mount"}
        if "mapper" in params:
            labels[L_MAPPER] = params["mapper"]
        key = _encryption(params, self.volumes.config.encryption.key_root)
        if key is not None:
            labels[L_ENCRYPTION] = key
        elif source is not None and self.ceph.encrypted(*source_image(source)):
            raise invalid("the content source is encrypted (LUKS2): the StorageClass of the "
                          "new volume must set encrypted: \"true\" (with the source's key, "
                          "which a clone opens with)")
        deadline = self.volumes.deadline(context)
        doc = new_document(name, labels, img)
        mutable.apply(doc["spec"], limits)
        with self.volumes.operation(name):
            doc = self.volumes.create(
                name, doc, deadline,
                lambda have: self._same_request(have, request, img, labels, limits),
                gone=lambda: self._size_now(pool, image) is None)
        try:
            self.ceph.record_name(pool, image, request.name, labels_meta(labels))
        except Exception as exc:  # a missing note for humans never fails the call
            log.warning("%s: could not record the CSI name in image-meta: %s", name, exc)
        return pb.CreateVolumeResponse(volume=_volume(doc))

    def _same_request(self, doc: dict[str, Any], request: pb.CreateVolumeRequest,
                      img: dict[str, Any], labels: dict[str, str],
                      limits: dict[str, int | None]) -> None:
        have = doc["spec"]["image"]
        old = doc["metadata"].get("labels", {})
        rng = request.capacity_range
        size = int(have.get("size") or 0)
        fits = size >= rng.required_bytes and (not rng.limit_bytes or size <= rng.limit_bytes)
        if not fits:
            raise CsiError(grpc.StatusCode.ALREADY_EXISTS,
                           f"a volume named {quoted(request.name)} already exists with another "
                           f"capacity ({size} bytes)")
        differ = [what for what, a, b in (
            ("name", old.get(L_REQUEST), request.name),
            ("pool", have.get("pool"), img["pool"]),
            ("imageFeatures", have.get("features"), img.get("features")),
            ("content source", have.get("source"), img.get("source")),
            ("fsType", old.get(L_FSTYPE), labels[L_FSTYPE]),
            ("access type", old.get(L_ACCESS), labels[L_ACCESS]),
            ("mapper", old.get(L_MAPPER), labels.get(L_MAPPER)),
            ("encryption", old.get(L_ENCRYPTION), labels.get(L_ENCRYPTION)),
            ("mutable_parameters", doc["spec"].get("qos") or {}, _qos_of(limits))) if a != b]
        if differ:
            raise CsiError(grpc.StatusCode.ALREADY_EXISTS,
                           f"a volume named {quoted(request.name)} already exists with another "
                           f"{', '.join(differ)}")

    @rpc
    def DeleteVolume(self, request: pb.DeleteVolumeRequest,
                     context: grpc.ServicerContext) -> pb.DeleteVolumeResponse:
        if not request.volume_id:
            raise invalid("volume_id is required")
        parsed = ids.parse_volume_id(request.volume_id)
        if parsed is None:
            return pb.DeleteVolumeResponse()  # never ours: nothing to delete
        name = ids.volume_name(*parsed)
        deadline = self.volumes.deadline(context)
        def check(doc: dict[str, Any]) -> None:
            if doc["metadata"].get("labels", {}).get(L_ORIGIN) != "controller":
                raise CsiError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"volume {name} was not created through CreateVolume here; "
                               "its image is not deleted")
            if snaps := self.snapshots_of(*parsed):
                # The engine would delete our snapshots with the image; a CO's
                # snapshots outlive the volume they were taken of, so: refuse.
                raise CsiError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"volume {name} has snapshots ({', '.join(snaps)}); delete "
                               "them first")
            if why := self._in_use(name, doc, *parsed):
                # A controller call never tears down node-side state: the
                # node's own calls (unpublish, unstage) do, then the CO retries.
                raise CsiError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"volume {name} is in use: {why}; nothing was changed")

        def absent(doc: dict[str, Any]) -> None:
            doc["spec"]["state"] = "absent"
            doc["spec"]["image"]["reclaimPolicy"] = "Delete"

        with self.volumes.operation(name):
            # Refused (still open elsewhere, not ours): the volume stays as it was.
            self.volumes.delete(name, deadline, check, absent, self._adopter(name, *parsed))
        return pb.DeleteVolumeResponse()

    def _adopter(self, name: str, pool: str, image: str
                 ) -> Callable[[], dict[str, Any] | None]:
        """What Ceph holds of volume ``name`` when it has no record (see
        csi/adopt.py); unknown is not "nothing": UNAVAILABLE."""
        def adopt() -> dict[str, Any] | None:
            if self.volumes.records is None:
                return None
            try:
                found = self.ceph.image_with_meta(pool, image)
            except Exception as exc:
                raise unanswered(f"volume {name} has no controller record", exc) from None
            if found is None:
                return None
            return adopted_document(name, pool, image, found[0], found[1],
                                    self.volumes.config.encryption.key_root)
        return adopt

    def _size_now(self, pool: str, image: str) -> int | None:
        try:
            return self.ceph.image_size(pool, image)
        except Exception as exc:  # unknown is neither gone nor a size
            raise CsiError(grpc.StatusCode.UNAVAILABLE,
                           f"cannot ask Ceph about {pool}/{image} ({exc}); nothing was "
                           "changed, retry later") from None

    def _catch_up(self, doc: dict[str, Any], pool: str, image: str) -> bool:
        """The image may be larger than the document says: a grow that
        converged but was never recorded (its call was cut off; the CO
        retries it). A change never converges a smaller size (the engine
        refuses to shrink): the size in force is taken as it is."""
        img = doc["spec"]["image"]
        actual = self._size_now(pool, image)
        if actual is None or actual <= int(img.get("size") or 0):
            return False
        img["size"] = actual
        return True

    def _in_use(self, name: str, doc: dict[str, Any], pool: str, image: str) -> str | None:
        """Why the volume is in use (None: it is not): a stage or publish on
        record in its file, this node's status showing it mapped, staged or
        published, or a client with the image open (another node)."""
        spec = doc["spec"]
        if spec.get("publish"):
            return "published at " + ", ".join(p["path"] for p in spec["publish"])
        if spec.get("stage"):
            return f"staged at {spec['stage'].get('path')}"
        if "map" in spec:
            return "mapped on this node"
        status = self.volumes.engine.status(name)
        if status.get("phase") in IN_USE_PHASES or status.get("device") or \
                status.get("staging") or status.get("published"):
            return (f"this node reports it {str(status.get('phase', '')).lower()} "
                    f"(device {status.get('device') or '-'})")
        try:
            watchers = self.ceph.watchers(pool, image)
        except Exception as exc:  # unknown is not "free": the CO retries
            raise CsiError(grpc.StatusCode.UNAVAILABLE,
                           f"volume {name}: cannot ask Ceph who has it open ({exc}); "
                           "nothing was changed, retry later") from None
        if watchers:
            return f"image {pool}/{image} is open by {', '.join(watchers)}"
        return None

    # -- questions -------------------------------------------------------------
    @rpc
    def ValidateVolumeCapabilities(
            self, request: pb.ValidateVolumeCapabilitiesRequest,
            context: grpc.ServicerContext) -> pb.ValidateVolumeCapabilitiesResponse:
        if not request.volume_id:
            raise invalid("volume_id is required")
        if not request.volume_capabilities:
            raise invalid("volume_capabilities is required")
        parsed = ids.parse_volume_id(request.volume_id)
        if parsed is None:
            raise not_found(f"volume {quoted(request.volume_id)} does not exist")
        # A claim is no volume yet (a dead one's image may never be made):
        # then, as with no record, Ceph says whether the image exists.
        doc = self.volumes.read(ids.volume_name(*parsed), made=True)
        if doc is None and self.ceph.image_size(*parsed) is None:
            raise not_found(f"volume {quoted(request.volume_id)} does not exist")
        try:
            capability.parse_all(list(request.volume_capabilities))
        except CsiError as exc:
            return pb.ValidateVolumeCapabilitiesResponse(message=exc.message)
        try:
            mutable.parse(dict(request.mutable_parameters))
        except CsiError as exc:
            return pb.ValidateVolumeCapabilitiesResponse(message=exc.message)
        confirmed = pb.ValidateVolumeCapabilitiesResponse.Confirmed(
            volume_context=request.volume_context,
            volume_capabilities=request.volume_capabilities,
            parameters=request.parameters, mutable_parameters=request.mutable_parameters)
        return pb.ValidateVolumeCapabilitiesResponse(confirmed=confirmed)

    @rpc
    def ListVolumes(self, request: pb.ListVolumesRequest,
                    context: grpc.ServicerContext) -> pb.ListVolumesResponse:
        if request.max_entries < 0:
            raise invalid("max_entries must not be negative")
        start = request.starting_token
        if start and not _TOKEN.fullmatch(start):
            raise CsiError(grpc.StatusCode.ABORTED,
                           f"starting_token {quoted(start)} was not handed out by ListVolumes")
        entries, next_token = [], ""
        for name in self.volumes.names():
            if start and name < start:
                continue
            try:
                doc = self.volumes.read(name, made=True)
            except CsiError:
                continue  # a file broken by hand: `rbd-reconciler validate` names it
            if (doc is None or doc.get("kind", "Volume") != "Volume"
                    or doc["spec"].get("state", "present") != "present"
                    or doc["metadata"].get("labels", {}).get(L_ORIGIN) != "controller"):
                continue
            if request.max_entries and len(entries) == request.max_entries:
                next_token = name
                break
            entries.append(pb.ListVolumesResponse.Entry(volume=_volume(doc)))
        return pb.ListVolumesResponse(entries=entries, next_token=next_token)

    @rpc
    def GetCapacity(self, request: pb.GetCapacityRequest,
                    context: grpc.ServicerContext) -> pb.GetCapacityResponse:
        if request.volume_capabilities:
            capability.parse_all(list(request.volume_capabilities))
        pool = None
        if request.parameters:
            pool = _parameters(dict(request.parameters))["pool"]
        try:
            available = self.ceph.available(pool)
        except CephError as exc:
            raise invalid(str(exc)) from None
        except Exception as exc:
            raise CsiError(grpc.StatusCode.UNAVAILABLE, f"Ceph did not answer: {exc}") from None
        return pb.GetCapacityResponse(available_capacity=max(0, available))

    @rpc
    def ControllerGetCapabilities(
            self, request: pb.ControllerGetCapabilitiesRequest,
            context: grpc.ServicerContext) -> pb.ControllerGetCapabilitiesResponse:
        rpc_ = pb.ControllerServiceCapability.RPC
        kinds = (rpc_.CREATE_DELETE_VOLUME, rpc_.EXPAND_VOLUME, rpc_.LIST_VOLUMES,
                 rpc_.GET_CAPACITY, rpc_.CREATE_DELETE_SNAPSHOT, rpc_.LIST_SNAPSHOTS,
                 rpc_.GET_SNAPSHOT, rpc_.CLONE_VOLUME, rpc_.SINGLE_NODE_MULTI_WRITER,
                 rpc_.MODIFY_VOLUME)
        return pb.ControllerGetCapabilitiesResponse(capabilities=[
            pb.ControllerServiceCapability(rpc=rpc_(type=k)) for k in kinds])

    # -- expand ----------------------------------------------------------------
    @rpc
    def ControllerExpandVolume(
            self, request: pb.ControllerExpandVolumeRequest,
            context: grpc.ServicerContext) -> pb.ControllerExpandVolumeResponse:
        if not request.volume_id:
            raise invalid("volume_id is required")
        if not request.HasField("capacity_range"):
            raise invalid("capacity_range is required")
        rng = request.capacity_range
        _size(rng)  # the arguments alone first: INVALID_ARGUMENT before NOT_FOUND
        parsed = ids.parse_volume_id(request.volume_id)
        if parsed is None:
            raise not_found(f"volume {quoted(request.volume_id)} does not exist")
        name = ids.volume_name(*parsed)
        deadline = self.volumes.deadline(context)
        # Staged or published is no reason to refuse: we advertise ONLINE
        # expansion, and growing never tears anything down on the node.
        def grow(doc: dict[str, Any] | None) -> bool:
            if doc is None or doc["spec"].get("state", "present") != "present":
                raise not_found(f"volume {quoted(request.volume_id)} does not exist")
            caught_up = self._catch_up(doc, *parsed)
            img = doc["spec"]["image"]
            size = _size(rng, max_size(img.get("features")))
            current = int(img.get("size") or 0)
            if rng.limit_bytes and current > rng.limit_bytes:
                raise CsiError(grpc.StatusCode.OUT_OF_RANGE,
                               f"volume {name} is already {current} bytes, more than "
                               f"limit_bytes {rng.limit_bytes}; volumes never shrink")
            if size <= current:
                return caught_up
            img["size"] = size
            return True

        with self.volumes.operation(name):
            doc = self.volumes.update(name, grow, deadline, self._adopter(name, *parsed))
        size = int(doc["spec"]["image"].get("size") or 0)
        stage = doc["spec"].get("stage") or {}
        block = stage.get("mode") == "block" or (
            not stage and doc["metadata"].get("labels", {}).get(L_ACCESS) == "block")
        return pb.ControllerExpandVolumeResponse(capacity_bytes=size,
                                                 node_expansion_required=not block)

    # -- modify (VolumeAttributesClass) --------------------------------------------
    @rpc
    def ControllerModifyVolume(
            self, request: pb.ControllerModifyVolumeRequest,
            context: grpc.ServicerContext) -> pb.ControllerModifyVolumeResponse:
        """QoS limits changed in place: the engine sets librbd's keys on the
        image (live for librbd clients) and io.max where a unit is named;
        nothing is remapped, so a staged or published volume stays in use."""
        if not request.volume_id:
            raise invalid("volume_id is required")
        changes = mutable.parse(dict(request.mutable_parameters))
        parsed = ids.parse_volume_id(request.volume_id)
        if parsed is None:
            raise not_found(f"volume {quoted(request.volume_id)} does not exist")
        name = ids.volume_name(*parsed)
        deadline = self.volumes.deadline(context)
        def modify(doc: dict[str, Any] | None) -> bool:
            if doc is None or doc.get("kind", "Volume") != "Volume" or \
                    doc["spec"].get("state", "present") != "present":
                raise not_found(f"volume {quoted(request.volume_id)} does not exist")
            changed = mutable.apply(doc["spec"], changes)
            return self._catch_up(doc, *parsed) or changed

        with self.volumes.operation(name):
            self.volumes.update(name, modify, deadline, self._adopter(name, *parsed))
        return pb.ControllerModifyVolumeResponse()
