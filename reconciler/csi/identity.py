"""CSI Identity: who we are, what we offer, whether we are ready.

Imported by csi/server.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc
from google.protobuf.wrappers_pb2 import BoolValue

from reconciler import __version__
from reconciler.csi import csi_pb2 as pb
from reconciler.csi import csi_pb2_grpc
from reconciler.csi.cephinfo import CephInfo
from reconciler.csi.errors import rpc

if TYPE_CHECKING:
    from reconciler.engine import Served


class IdentityServicer(csi_pb2_grpc.IdentityServicer):
    def __init__(self, engine: Served, ceph: CephInfo) -> None:
        self.engine = engine
        self.ceph = ceph

    @rpc
    def GetPluginInfo(self, request: pb.GetPluginInfoRequest,
                      context: grpc.ServicerContext) -> pb.GetPluginInfoResponse:
        return pb.GetPluginInfoResponse(name=self.engine.config.csi.driver_name,
                                        vendor_version=__version__)

    @rpc
    def GetPluginCapabilities(self, request: pb.GetPluginCapabilitiesRequest,
                              context: grpc.ServicerContext) -> pb.GetPluginCapabilitiesResponse:
        cap = pb.PluginCapability
        return pb.GetPluginCapabilitiesResponse(capabilities=[
            cap(service=cap.Service(type=cap.Service.CONTROLLER_SERVICE)),
            cap(service=cap.Service(type=cap.Service.GROUP_CONTROLLER_SERVICE)),
            cap(volume_expansion=cap.VolumeExpansion(type=cap.VolumeExpansion.ONLINE)),
        ])

    @rpc
    def Probe(self, request: pb.ProbeRequest,
              context: grpc.ServicerContext) -> pb.ProbeResponse:
        # Ready once the first pass is done and while Ceph answers; a Ceph
        # outage is "not ready", not an error (restarting us would not help).
        ready = self.engine.ready and self.ceph.problem() is None
        return pb.ProbeResponse(ready=BoolValue(value=ready))
