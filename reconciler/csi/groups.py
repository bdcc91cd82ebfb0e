"""The CSI GroupController: a volume group snapshot is a ``kind:
SnapshotGroup`` file in csi.dir (named from the request name's hash, like a
Snapshot's), converged by the engine: one RBD group snapshot of every source
volume, their mounted filesystems on this node frozen around it.

Ids describe themselves (``ids.group_id``, ``ids.member_id``), so a member
snapshot id is enough to restore from (CreateVolume: a full copy, as Pacific
cannot clone a group snapshot) or to look up (GetSnapshot).

Imported by csi/server.py, csi/snapshots.py.
"""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from reconciler.csi import csi_pb2 as pb
from reconciler.csi import csi_pb2_grpc, ids
from reconciler.csi.cephinfo import CephInfo
from reconciler.csi.errors import CsiError, invalid, not_found, quoted, rpc
from reconciler.csi.files import L_ORIGIN, L_REQUEST, VolumeFiles
from reconciler.csi.volumes import Volumes
from reconciler.spec.model import API_VERSION


def _timestamp(seconds: float) -> Timestamp:
    ts = Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


def group_document(name: str, labels: dict[str, str], pool: str,
                   images: list[str]) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": "SnapshotGroup",
            "metadata": {"name": name, "labels": labels},
            "spec": {"state": "present", "pool": pool,
                     "images": [{"pool": pool, "name": i} for i in images]}}


def member_snapshot(pool: str, group: str, image: str, size: int, created: float
                    ) -> pb.Snapshot:
    return pb.Snapshot(size_bytes=size, snapshot_id=ids.member_id(pool, group, image),
                       source_volume_id=ids.volume_id(pool, image),
                       creation_time=_timestamp(created), ready_to_use=True,
                       group_snapshot_id=ids.group_id(pool, group))


def group_snapshot(pool: str, group: str, members: dict[str, tuple[int, float]]
                   ) -> pb.VolumeGroupSnapshot:
    snaps = [member_snapshot(pool, group, image, size, created)
             for image, (size, created) in sorted(members.items())]
    created = min((c for _, c in members.values()), default=0.0)
    return pb.VolumeGroupSnapshot(group_snapshot_id=ids.group_id(pool, group), snapshots=snaps,
                                  creation_time=_timestamp(created), ready_to_use=True)


class GroupControllerServicer(csi_pb2_grpc.GroupControllerServicer):
    def __init__(self, volumes: Volumes, ceph: CephInfo) -> None:
        self.volumes = volumes
        self.files: VolumeFiles = volumes.files
        self.ceph = ceph

    @rpc
    def GroupControllerGetCapabilities(
            self, request: pb.GroupControllerGetCapabilitiesRequest,
            context: grpc.ServicerContext) -> pb.GroupControllerGetCapabilitiesResponse:
        cap = pb.GroupControllerServiceCapability
        return pb.GroupControllerGetCapabilitiesResponse(capabilities=[cap(rpc=cap.RPC(
            type=cap.RPC.CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT))])

    def _sources(self, volume_ids: list[str]) -> tuple[str, list[str]]:
        """(pool, sorted images) of existing volumes, all in one pool."""
        found: list[tuple[str, str]] = []
        for vid in volume_ids:
            parsed = ids.parse_volume_id(vid)
            doc = self.volumes.read(ids.volume_name(*parsed)) if parsed else None
            present = doc is not None and doc["spec"].get("state", "present") == "present"
            if parsed is None or (not present and self.ceph.image_size(*parsed) is None):
                raise not_found(f"volume {quoted(vid)} does not exist")
            found.append(parsed)
        pools = {p for p, _ in found}
        if len(pools) != 1:
            raise CsiError(grpc.StatusCode.FAILED_PRECONDITION,
                           f"the volumes are in several pools ({', '.join(sorted(pools))}): "
                           "an RBD group holds images of one pool only")
        images = sorted({i for _, i in found})
        if len(images) != len(found):
            raise invalid("source_volume_ids names a volume twice")
        return pools.pop(), images

    @rpc
    def CreateVolumeGroupSnapshot(
            self, request: pb.CreateVolumeGroupSnapshotRequest,
            context: grpc.ServicerContext) -> pb.CreateVolumeGroupSnapshotResponse:
        if not request.name:
            raise invalid("name is required")
        if not request.source_volume_ids:
            raise invalid("source_volume_ids is required")
        pool, images = self._sources(list(request.source_volume_ids))
        name = ids.group_for_request(request.name)
        try:
            ids.group_id(pool, name)
        except ValueError as exc:
            raise invalid(str(exc)) from None
        deadline = self.volumes.deadline(context)
        def same(have: dict[str, Any]) -> None:
            members = sorted(i["name"] for i in have["spec"].get("images", []))
            if have["spec"].get("pool") != pool or members != images:
                raise CsiError(grpc.StatusCode.ALREADY_EXISTS,
                               f"a group snapshot named {quoted(request.name)} already exists "
                               "with other source volumes")

        labels = {L_REQUEST: request.name, L_ORIGIN: "controller"}
        with self.volumes.operation(name):
            self._refuse_overlap(name, pool, images)
            self.volumes.create(name, group_document(name, labels, pool, images), deadline,
                                same)
        members = self.ceph.group_snapshot(pool, name)
        if members is None or sorted(members) != images:
            raise CsiError(grpc.StatusCode.INTERNAL, f"group snapshot {pool}/{name} was not "
                                                     "found complete after it was taken")
        return pb.CreateVolumeGroupSnapshotResponse(
            group_snapshot=group_snapshot(pool, name, members))

    def _refuse_overlap(self, name: str, pool: str, images: list[str]) -> None:
        """An RBD image belongs to one group at most: a volume already in
        another group snapshot (by Kubernetes' label selectors, overlaps
        happen) is refused before anything is made."""
        for image in images:
            group = self.ceph.image_group(pool, image)
            if group is not None and group != f"{pool}/{name}":
                raise CsiError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"volume {ids.volume_id(pool, image)} is already in RBD group "
                               f"{group} (another group snapshot's; an image belongs to one "
                               "group at most): delete that group snapshot first; nothing "
                               "was changed")
        for other in self.volumes.names():
            if other == name or not ids.is_group_name(other):
                continue
            try:
                doc = self.volumes.read(other)
            except CsiError:
                continue  # its own error, for its own name
            if doc is None or doc.get("kind") != "SnapshotGroup" or \
                    doc["spec"].get("state", "present") != "present":
                continue
            taken = {(i.get("pool"), i.get("name")) for i in doc["spec"].get("images", [])}
            if both := sorted(i for i in images if (pool, i) in taken):
                raise CsiError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"volume(s) {', '.join(both)} already belong to group "
                               f"snapshot {other} (an image belongs to one group at most): "
                               "delete that group snapshot first; nothing was changed")

    @rpc
    def GetVolumeGroupSnapshot(
            self, request: pb.GetVolumeGroupSnapshotRequest,
            context: grpc.ServicerContext) -> pb.GetVolumeGroupSnapshotResponse:
        if not request.group_snapshot_id:
            raise invalid("group_snapshot_id is required")
        parsed = ids.parse_group_id(request.group_snapshot_id)
        members = self.ceph.group_snapshot(*parsed) if parsed else None
        if parsed is None or members is None:
            raise not_found(f"group snapshot {quoted(request.group_snapshot_id)} does not exist")
        answer = group_snapshot(*parsed, members)
        self._check_ids(answer, list(request.snapshot_ids))
        return pb.GetVolumeGroupSnapshotResponse(group_snapshot=answer)

    @staticmethod
    def _check_ids(answer: pb.VolumeGroupSnapshot, given: list[str]) -> None:
        """The spec: a mismatch in snapshot_ids, when detected, is INVALID_ARGUMENT."""
        have = sorted(s.snapshot_id for s in answer.snapshots)
        if given and sorted(given) != have:
            raise invalid(f"snapshot_ids do not match the members of group snapshot "
                          f"{answer.group_snapshot_id} ({', '.join(have)})")

    @rpc
    def DeleteVolumeGroupSnapshot(
            self, request: pb.DeleteVolumeGroupSnapshotRequest,
            context: grpc.ServicerContext) -> pb.DeleteVolumeGroupSnapshotResponse:
        if not request.group_snapshot_id:
            raise invalid("group_snapshot_id is required")
        parsed = ids.parse_group_id(request.group_snapshot_id)
        if parsed is None:
            return pb.DeleteVolumeGroupSnapshotResponse()  # never ours: nothing to delete
        pool, name = parsed
        deadline = self.volumes.deadline(context)
        def check(doc: dict[str, Any]) -> None:
            if request.snapshot_ids:
                want = sorted(ids.member_id(pool, name, i["name"])
                              for i in doc["spec"].get("images", []))
                if sorted(request.snapshot_ids) != want:
                    raise invalid(f"snapshot_ids do not match the members of group snapshot "
                                  f"{quoted(request.group_snapshot_id)} ({', '.join(want)}); "
                                  "nothing was changed")

        def absent(doc: dict[str, Any]) -> None:
            doc["spec"]["state"] = "absent"

        with self.volumes.operation(name):
            self.volumes.delete(name, deadline, check, absent)
        return pb.DeleteVolumeGroupSnapshotResponse()
