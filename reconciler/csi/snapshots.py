"""CSI snapshots: CreateSnapshot / DeleteSnapshot / ListSnapshots become
``kind: Snapshot`` files in csi.dir, and a CreateVolume content source
becomes an ``image.source``. The engine takes, clones and deletes.

Imported by csi/controller.py.
"""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from reconciler.csi import csi_pb2 as pb
from reconciler.csi import ids
from reconciler.csi.cephinfo import CephInfo
from reconciler.csi.errors import CsiError, invalid, not_found, quoted, rpc, unanswered
from reconciler.csi.files import L_ORIGIN, L_REQUEST, L_SOURCE, VolumeFiles, new_snapshot_document
from reconciler.csi.groups import member_snapshot
from reconciler.csi.volumes import Volumes

MiB = 1 << 20


def _snapshot(sid: str, source_volume_id: str, size: int, created: float) -> pb.Snapshot:
    ts = Timestamp()
    ts.FromNanoseconds(int(created * 1e9))
    return pb.Snapshot(size_bytes=size, snapshot_id=sid, source_volume_id=source_volume_id,
                       creation_time=ts, ready_to_use=True)


def _is_present_snapshot(doc: dict[str, Any] | None) -> bool:
    return doc is not None and doc.get("kind") == "Snapshot" and \
        doc["spec"].get("state", "present") == "present"


class SnapshotRpcs:
    volumes: Volumes
    files: VolumeFiles
    ceph: CephInfo

    def _source_image(self, volume_id: str) -> tuple[str, str]:
        """(pool, image) of an existing volume, or NOT_FOUND."""
        parsed = ids.parse_volume_id(volume_id)
        if parsed is None:
            raise not_found(f"volume {quoted(volume_id)} does not exist")
        doc = self.volumes.read(ids.volume_name(*parsed))
        present = doc is not None and doc["spec"].get("state", "present") == "present"
        if not present and self.ceph.image_size(*parsed) is None:
            raise not_found(f"volume {quoted(volume_id)} does not exist")
        return parsed

    def snapshots_of(self, pool: str, image: str) -> list[str]:
        """The adapter's snapshot files (present) taken of ``pool/image``, and
        its group snapshot files that hold it (its RBD group holds it)."""
        out = []
        for name in self.volumes.names():
            if ids.is_group_name(name):
                try:
                    doc = self.volumes.read(name)
                except CsiError:
                    continue
                if doc is not None and doc.get("kind") == "SnapshotGroup" and \
                        {"pool": pool, "name": image} in doc["spec"].get("images", []):
                    out.append(name)
                continue
            if not ids.is_snapshot_name(name):
                continue
            try:
                doc = self.volumes.read(name)
            except CsiError as exc:
                if exc.code == grpc.StatusCode.ABORTED:
                    out.append(name)  # being created (perhaps of this volume): wait for it
                continue
            if _is_present_snapshot(doc) and doc is not None and \
                    doc["spec"]["source"].get("image") == {"pool": pool, "name": image}:
                out.append(name)
        return out

    @rpc
    def CreateSnapshot(self, request: pb.CreateSnapshotRequest,
                       context: grpc.ServicerContext) -> pb.CreateSnapshotResponse:
        if not request.name:
            raise invalid("name is required")
        if not request.source_volume_id:
            raise invalid("source_volume_id is required")
        pool, image = self._source_image(request.source_volume_id)
        name = ids.snapshot_for_request(request.name)
        try:
            sid = ids.snapshot_id(pool, image, name)
        except ValueError as exc:
            raise invalid(str(exc)) from None
        deadline = self.volumes.deadline(context)
        def same(have: dict[str, Any]) -> None:
            if have["spec"].get("source", {}).get("image") != {"pool": pool, "name": image}:
                raise CsiError(grpc.StatusCode.ALREADY_EXISTS,
                               f"a snapshot named {quoted(request.name)} already exists for "
                               "another volume "
                               f"({have['metadata'].get('labels', {}).get(L_SOURCE)})")

        labels = {L_REQUEST: request.name, L_ORIGIN: "controller",
                  L_SOURCE: request.source_volume_id}
        with self.volumes.operation(name):
            self.volumes.create(name, new_snapshot_document(name, labels, pool, image),
                                deadline, same,
                                gone=lambda: self.ceph.snapshot(pool, image, name) is None)
        found = self.ceph.snapshot(pool, image, name)
        if found is None:
            raise CsiError(grpc.StatusCode.INTERNAL, f"snapshot {sid} was not found after it "
                                                     "was taken")
        return pb.CreateSnapshotResponse(snapshot=_snapshot(sid, request.source_volume_id,
                                                            *found))

    @rpc
    def DeleteSnapshot(self, request: pb.DeleteSnapshotRequest,
                       context: grpc.ServicerContext) -> pb.DeleteSnapshotResponse:
        if not request.snapshot_id:
            raise invalid("snapshot_id is required")
        if ids.parse_member_id(request.snapshot_id) is not None:
            # The spec: a member of a group snapshot is never deleted alone.
            raise invalid(f"snapshot {quoted(request.snapshot_id)} is part of a group snapshot: "
                          "delete the group snapshot (DeleteVolumeGroupSnapshot)")
        parsed = ids.parse_snapshot_id(request.snapshot_id)
        if parsed is None:
            return pb.DeleteSnapshotResponse()  # never ours: nothing to delete
        name = parsed[2]
        deadline = self.volumes.deadline(context)
        def absent(doc: dict[str, Any]) -> None:
            doc["spec"]["state"] = "absent"

        pool, image = parsed[0], parsed[1]

        def adopt() -> dict[str, Any] | None:
            """No record (removed by hand): the snapshot Ceph holds under our
            name is deleted, not left behind (the engine's owner check stands)."""
            if self.volumes.records is None:
                return None
            try:
                found = self.ceph.snapshot(pool, image, name)
            except Exception as exc:
                raise unanswered(f"snapshot {name} has no controller record", exc) from None
            if found is None:
                return None
            labels = {L_ORIGIN: "controller", L_SOURCE: ids.volume_id(pool, image)}
            return new_snapshot_document(name, labels, pool, image)

        with self.volumes.operation(name):
            # Refused by the engine all the same (a clone appeared since): it
            # stays as it was.
            self.volumes.delete(name, deadline, lambda doc: self._refuse_if_cloned(name, doc),
                                absent, adopt)
        return pb.DeleteSnapshotResponse()

    def _refuse_if_cloned(self, name: str, doc: dict[str, Any]) -> None:
        """Clones depend on the snapshot and the node config does not let the
        engine flatten them first: refuse before the file is touched."""
        if self.volumes.config.clone.flatten_on_delete:
            return  # flattening is online: a clone in use keeps its data
        src = doc["spec"].get("source", {}).get("image") or {}
        if not src.get("pool") or not src.get("name"):
            return
        try:
            children = self.ceph.snapshot_children(src["pool"], src["name"], name)
        except Exception as exc:
            raise CsiError(grpc.StatusCode.UNAVAILABLE,
                           f"snapshot {name}: cannot ask Ceph for its clones ({exc}); "
                           "nothing was changed, retry later") from None
        if children:
            raise CsiError(grpc.StatusCode.FAILED_PRECONDITION,
                           f"snapshot {name} is in use: clones depend on it "
                           f"({', '.join(children)}); delete or flatten them first, or set "
                           "clone.flattenOnDelete: true in the node config; nothing was "
                           "changed")

    @rpc
    def ListSnapshots(self, request: pb.ListSnapshotsRequest,
                      context: grpc.ServicerContext) -> pb.ListSnapshotsResponse:
        if request.max_entries < 0:
            raise invalid("max_entries must not be negative")
        start = request.starting_token
        if start and not ids.is_snapshot_name(start):
            raise CsiError(grpc.StatusCode.ABORTED,
                           f"starting_token {quoted(start)} was not handed out by ListSnapshots")
        only: str | None = None
        if request.snapshot_id:
            parsed = ids.parse_snapshot_id(request.snapshot_id)
            if parsed is None:
                return pb.ListSnapshotsResponse()
            only = parsed[2]
        names = [n for n in self.volumes.names() if ids.is_snapshot_name(n)
                 and (only is None or n == only) and (not start or n >= start)]
        entries, next_token = [], ""
        for name in names:
            try:
                doc = self.volumes.read(name)
            except CsiError:
                continue  # a file broken by hand: `rbd-reconciler validate` names it
            if not _is_present_snapshot(doc):
                continue
            assert doc is not None
            src = doc["metadata"].get("labels", {}).get(L_SOURCE, "")
            if request.source_volume_id and src != request.source_volume_id:
                continue
            img = doc["spec"]["source"].get("image") or {}
            if request.max_entries and len(entries) == request.max_entries:
                next_token = name
                break
            found = self.ceph.snapshot(img.get("pool", ""), img.get("name", ""), name)
            if found is None:
                continue  # not cut yet (or gone): never listed
            sid = ids.snapshot_id(img["pool"], img["name"], name)
            entries.append(pb.ListSnapshotsResponse.Entry(snapshot=_snapshot(sid, src, *found)))
        return pb.ListSnapshotsResponse(entries=entries, next_token=next_token)

    @rpc
    def GetSnapshot(self, request: pb.GetSnapshotRequest,
                    context: grpc.ServicerContext) -> pb.GetSnapshotResponse:
        if not request.snapshot_id:
            raise invalid("snapshot_id is required")
        if (member := ids.parse_member_id(request.snapshot_id)) is not None:
            return pb.GetSnapshotResponse(snapshot=self._member(request.snapshot_id, *member))
        parsed = ids.parse_snapshot_id(request.snapshot_id)
        found = self.ceph.snapshot(*parsed) if parsed else None
        if parsed is None or found is None:
            raise not_found(f"snapshot {quoted(request.snapshot_id)} does not exist")
        pool, image, name = parsed
        try:
            doc = self.volumes.read(name)
        except CsiError:
            doc = None  # a file broken by hand: the id alone says where it came from
        src = (doc or {}).get("metadata", {}).get("labels", {}).get(L_SOURCE) or \
            ids.volume_id(pool, image)
        return pb.GetSnapshotResponse(snapshot=_snapshot(request.snapshot_id, src, *found))

    def _member(self, sid: str, pool: str, group: str, image: str) -> pb.Snapshot:
        """A member of a group snapshot, or NOT_FOUND."""
        members = self.ceph.group_snapshot(pool, group)
        if members is None or image not in members:
            raise not_found(f"snapshot {quoted(sid)} does not exist")
        return member_snapshot(pool, group, image, *members[image])

    # -- CreateVolume from a snapshot or a volume ----------------------------------
    def content_source(self, request: pb.CreateVolumeRequest) -> tuple[dict[str, Any], int]:
        """The file's ``image.source`` and the least size the new volume may have."""
        src = request.volume_content_source
        if src.HasField("snapshot") and \
                (member := ids.parse_member_id(src.snapshot.snapshot_id)) is not None:
            found = self._member(src.snapshot.snapshot_id, *member)
            pool, group, image = member
            return {"groupSnapshot": {"pool": pool, "group": group, "image": image}}, \
                found.size_bytes
        if src.HasField("snapshot"):
            sid = src.snapshot.snapshot_id
            parsed = ids.parse_snapshot_id(sid)
            found = self.ceph.snapshot(*parsed) if parsed else None
            if parsed is None or found is None:
                raise not_found(f"snapshot {quoted(sid)} does not exist")
            pool, image, snap = parsed
            return {"image": {"pool": pool, "name": image, "snapshot": snap}}, found[0]
        if src.HasField("volume"):
            pool, image = self._source_image(src.volume.volume_id)
            return {"image": {"pool": pool, "name": image}}, self.ceph.image_size(pool,
                                                                                  image) or 0
        raise invalid("volume_content_source: a snapshot or a volume")


def source_image(source: dict[str, Any]) -> tuple[str, str]:
    """(pool, image) a file's ``image.source`` reads from."""
    if "groupSnapshot" in source:
        g = source["groupSnapshot"]
        return g["pool"], g["image"]
    return source["image"]["pool"], source["image"]["name"]


def content_source_of(doc: dict[str, Any]) -> pb.VolumeContentSource | None:
    """What a CSI volume file was created from, for CreateVolume's answer."""
    if g := doc["spec"]["image"].get("source", {}).get("groupSnapshot"):
        return pb.VolumeContentSource(snapshot=pb.VolumeContentSource.SnapshotSource(
            snapshot_id=ids.member_id(g["pool"], g["group"], g["image"])))
    src = doc["spec"]["image"].get("source", {}).get("image")
    if not src:
        return None
    if "snapshot" in src:
        return pb.VolumeContentSource(snapshot=pb.VolumeContentSource.SnapshotSource(
            snapshot_id=ids.snapshot_id(src["pool"], src["name"], src["snapshot"])))
    return pb.VolumeContentSource(volume=pb.VolumeContentSource.VolumeSource(
        volume_id=ids.volume_id(src["pool"], src["name"])))
