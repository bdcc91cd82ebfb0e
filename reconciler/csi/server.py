"""The gRPC server on a unix socket, inside the daemon's process.

Imported by cli/run.py.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from reconciler.csi import csi_pb2_grpc
from reconciler.csi.cephinfo import CephInfo
from reconciler.csi.controller import ControllerServicer
from reconciler.csi.groups import GroupControllerServicer
from reconciler.csi.identity import IdentityServicer
from reconciler.csi.node import NodeServicer
from reconciler.csi.records import Records
from reconciler.csi.volumes import Volumes
from reconciler.drivers.privsock import Listen, PrivateSocket

if TYPE_CHECKING:
    from reconciler.engine import FrontDoorMetrics, Served

log = logging.getLogger("rbd-reconciler.csi")
WORKERS = 128  # calls mostly wait on the engine; 100 concurrent CreateVolume must not queue
STOP_GRACE_S = 2.0


def socket_path(endpoint: str) -> Path:
    if not endpoint.startswith("unix:///"):
        raise ValueError(f"CSI endpoint {endpoint!r}: expected unix:///absolute/path")
    return Path(endpoint[len("unix://"):])


def implemented(servicer: object) -> list[str]:
    """The RPCs a servicer (or a mixin of it) overrides: the generated base
    class answers the others UNIMPLEMENTED."""
    mro = type(servicer).__mro__
    [base] = [c for c in mro if c.__module__ == csi_pb2_grpc.__name__]
    ours = mro[:mro.index(base)]
    return sorted({name for cls in ours for name in vars(cls)
                   if name[:1].isupper() and hasattr(base, name)})


def grpc_listen(server: grpc.Server) -> Listen:
    """gRPC's server listening (and serving) at the path PrivateSocket gives."""
    def listen(path: str) -> None:
        server.add_insecure_port(f"unix://{path}")
        server.start()
    return listen


class CsiServer:
    def __init__(self, engine: Served, endpoint: str) -> None:
        self.engine = engine
        self.path = socket_path(endpoint)
        self.server: grpc.Server | None = None
        self.ceph: CephInfo | None = None
        self.socket: PrivateSocket | None = None

    def start(self) -> None:
        config = self.engine.config
        volumes = Volumes(self.engine)
        volumes.files.ensure_dir()
        ceph = self.ceph = CephInfo(config.ceph)  # one librados connection for every request
        if config.csi.state_pool:
            # One holder per replica, the same across its restarts: a claim it
            # made before a crash is still its own to finish.
            holder = f"{config.node_name}@{socket.gethostname()}:{config.state_dir}"
            volumes.records = Records(ceph, config.csi.state_pool, holder,
                                      stale_s=2 * config.csi.timeout_seconds + 60)
            # Files of records that moved on while this replica was away never
            # act: dropped now, and every step of a chain asks again.
            volumes.sweep()
            self.engine.set_gate(volumes.gate)
        server = grpc.server(ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="csi"),
                             interceptors=[MetricsInterceptor(self.engine.metrics)])
        servicers = (IdentityServicer(self.engine, ceph), ControllerServicer(volumes, ceph),
                     NodeServicer(volumes, ceph), GroupControllerServicer(volumes, ceph))
        csi_pb2_grpc.add_IdentityServicer_to_server(servicers[0], server)
        csi_pb2_grpc.add_ControllerServicer_to_server(servicers[1], server)
        csi_pb2_grpc.add_NodeServicer_to_server(servicers[2], server)
        csi_pb2_grpc.add_GroupControllerServicer_to_server(servicers[3], server)
        self.engine.metrics.csi_served(m for s in servicers for m in implemented(s))
        self.socket = PrivateSocket(self.path, "CSI")
        self.socket.bind(grpc_listen(server))
        self.server = server
        log.info("CSI %s serving on unix://%s (volume files in %s)", config.csi.driver_name,
                 self.path, config.csi_dir)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(STOP_GRACE_S).wait()
            self.server = None
        if self.ceph is not None:
            self.ceph.close()
            self.ceph = None
        if self.socket is not None:
            self.socket.remove()
            self.socket = None
        log.info("CSI server stopped")


class MetricsInterceptor(grpc.ServerInterceptor):
    """Counts every CSI call by method and final status code, and times it.
    Only methods with a handler are labelled: a client cannot invent label
    values by calling made-up method names (those answer UNIMPLEMENTED)."""

    def __init__(self, metrics: FrontDoorMetrics) -> None:
        self.metrics = metrics

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = continuation(details)
        if handler is None or handler.unary_unary is None:
            return handler  # unknown method, or a streaming one (CSI has none)
        method = details.method.rsplit("/", 1)[-1]
        inner, m = handler.unary_unary, self.metrics

        def timed(request: Any, context: grpc.ServicerContext) -> Any:
            t0 = time.monotonic()
            code = grpc.StatusCode.UNKNOWN  # gRPC's answer to an uncaught exception
            try:
                response = inner(request, context)
                code = context.code() or grpc.StatusCode.OK
                return response
            except Exception:
                code = context.code() or grpc.StatusCode.UNKNOWN  # abort() set it
                raise
            finally:
                m.csi_call(method, code.name, time.monotonic() - t0)

        return grpc.unary_unary_rpc_method_handler(
            timed, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)
