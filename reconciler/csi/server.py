"""The gRPC server on a unix socket, inside the daemon's process."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import stat
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
from reconciler.spec.security import directory_problems
from reconciler.state.files import O_PATH, foreign, open_dir

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


class PrivateSocket:
    """The CSI socket, 0600 from the moment anyone can reach it, without
    touching the process umask (shared by every thread: a umask switched
    around the bind would give any file another thread creates meanwhile the
    wrong mode, or ours the other thread's).

    A unix socket's inode has no descriptor to fchmod before bind, and a
    chmod by path after it could be sent elsewhere. So gRPC binds it in a
    fresh 0700 directory of root's (reached as /proc/self/fd/N/..., N the
    parent's descriptor: nothing is resolved by path twice), where no one
    else can reach or swap it; its mode is set through an O_PATH descriptor
    of that very inode; then it is renamed into place, relative to the
    parent's descriptor (replacing a stale socket atomically). The parent
    must be root's and not writable by others, up to /: whoever could write
    there could put their own socket in its place and read every request.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._dir: int | None = None  # the parent, held for remove()
        self._ident: tuple[int, int] | None = None

    def bind(self, server: grpc.Server) -> None:
        pfd = open_dir(self.path.parent, create=True, mode=0o755)
        try:
            # The chain by path (as the desired dirs), and the directory we hold.
            problems = directory_problems(self.path.parent)
            if not problems and (why := foreign(os.fstat(pfd))) is not None:
                problems.append(f"directory {self.path.parent} is {why}")
            if problems:
                raise RuntimeError(f"refusing to serve CSI at {self.path}: "
                                   + "; ".join(problems))
            self._check_replaceable(pfd)
            private = f".{self.path.name}.{secrets.token_hex(8)}.d"
            os.mkdir(private, 0o700, dir_fd=pfd)
            try:
                self._bind_in(server, pfd, private)
            finally:
                with contextlib.suppress(OSError):  # there only if it never moved out
                    os.unlink(f"{private}/{self.path.name}", dir_fd=pfd)
                with contextlib.suppress(OSError):
                    os.rmdir(private, dir_fd=pfd)
        except BaseException:
            os.close(pfd)
            raise
        self._dir = pfd

    def _bind_in(self, server: grpc.Server, pfd: int, private: str) -> None:
        name = self.path.name
        server.add_insecure_port(f"unix://{fd_path(pfd)}/{private}/{name}")
        server.start()
        dfd = os.open(private, O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                      dir_fd=pfd)
        try:
            sfd = os.open(name, O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
            try:
                st = os.fstat(sfd)
                if not stat.S_ISSOCK(st.st_mode):
                    raise RuntimeError(f"{self.path}: gRPC made no socket")
                os.chmod(fd_path(sfd), 0o600)  # this inode: root talks to it, nobody else
            finally:
                os.close(sfd)
            self._check_replaceable(pfd)
            os.rename(name, name, src_dir_fd=dfd, dst_dir_fd=pfd)
        finally:
            os.close(dfd)
        self._ident = (st.st_dev, st.st_ino)

    def _check_replaceable(self, pfd: int) -> None:
        """A socket left by a killed predecessor (we hold the state lock, so
        it is not serving) is replaced; anything else there is not ours."""
        try:
            st = os.stat(self.path.name, dir_fd=pfd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise RuntimeError(f"{self.path} exists and is not a socket; refusing to replace it")

    def remove(self) -> None:
        """Unlink the socket, if the name is still ours (not a successor's)."""
        if self._dir is None:
            return
        try:
            with contextlib.suppress(FileNotFoundError):
                st = os.stat(self.path.name, dir_fd=self._dir, follow_symlinks=False)
                if (st.st_dev, st.st_ino) == self._ident:
                    os.unlink(self.path.name, dir_fd=self._dir)
        finally:
            os.close(self._dir)
            self._dir = None


def fd_path(fd: int) -> str:
    return f"/proc/self/fd/{fd}"


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
        self.socket = PrivateSocket(self.path)
        self.socket.bind(server)
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
