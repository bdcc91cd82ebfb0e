"""A daemon serving CSI on a unix socket, and a real gRPC client for it."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import rbd
import yaml
from conftest import NodeUnderTest
from test_daemon import Daemon, wait_for

from reconciler.csi import csi_pb2 as pb
from reconciler.csi import csi_pb2_grpc

Mode = pb.VolumeCapability.AccessMode
RPC_TIMEOUT = 90.0


def mount_cap(mode: int = Mode.SINGLE_NODE_WRITER, fs_type: str = "") -> pb.VolumeCapability:
    return pb.VolumeCapability(mount=pb.VolumeCapability.MountVolume(fs_type=fs_type),
                               access_mode=Mode(mode=mode))


def block_cap(mode: int = Mode.SINGLE_NODE_WRITER) -> pb.VolumeCapability:
    return pb.VolumeCapability(block=pb.VolumeCapability.BlockVolume(),
                               access_mode=Mode(mode=mode))


@dataclass
class CsiNode:
    node: NodeUnderTest
    daemon: Daemon
    socket: Path
    channel: grpc.Channel
    identity: csi_pb2_grpc.IdentityStub
    controller: csi_pb2_grpc.ControllerStub
    nodes: csi_pb2_grpc.NodeStub

    @property
    def csi_dir(self) -> Path:
        return self.node.state / "csi.d"

    def files(self) -> dict[str, dict]:
        return {p.stem: yaml.safe_load(p.read_text()) for p in self.csi_dir.glob("*.yaml")}

    def kubelet_paths(self, pv: str) -> tuple[Path, Path]:
        """Kubelet-shaped staging dir (kubelet makes it) and target (we make it)."""
        kubelet = self.node.srv / "kubelet"
        staging = kubelet / "plugins/kubernetes.io/csi/rbd/globalmount" / pv
        staging.mkdir(parents=True, exist_ok=True)
        target_dir = kubelet / "pods" / pv / "volumes"
        target_dir.mkdir(parents=True, exist_ok=True)
        return staging, target_dir / "mount"

    def create(self, name: str, size: int = 64 << 20, cap: pb.VolumeCapability | None = None,
               **params: str) -> pb.Volume:
        req = pb.CreateVolumeRequest(
            name=name, capacity_range=pb.CapacityRange(required_bytes=size),
            volume_capabilities=[cap or mount_cap()],
            parameters={"pool": self.node.cluster.pool, **params},
            secrets={"userKey": "not-a-real-secret-4711"})
        vol = self.controller.CreateVolume(req, timeout=RPC_TIMEOUT).volume
        self.node.images.add(vol.volume_id.rsplit(":", 1)[1])
        return vol

    def stop(self, sig: int = signal.SIGTERM) -> int:
        self.channel.close()
        return self.daemon.stop(sig)


def connect(node: NodeUnderTest, daemon: Daemon, sock: Path) -> CsiNode:
    # The log line, not the socket: a killed predecessor's socket may linger.
    wait_for(lambda: "serving on" in daemon.log.read_text() or daemon.proc.poll() is not None,
             "the CSI server")
    assert daemon.proc.poll() is None, daemon.log.read_text()
    channel = grpc.insecure_channel(f"unix://{sock}")
    return CsiNode(node, daemon, sock, channel, csi_pb2_grpc.IdentityStub(channel),
                   csi_pb2_grpc.ControllerStub(channel), csi_pb2_grpc.NodeStub(channel))


def csi_config(node: NodeUnderTest, extra: str = "") -> None:
    node.config.write_text(node.config.read_text() + "csi:\n  driverName: rbd.test.local\n"
                           + extra)


def start_csi_fixture(node: NodeUnderTest) -> Iterator[Callable[..., CsiNode]]:
    """The body of conftest's ``start_csi`` fixture."""
    started: list[CsiNode] = []
    sock = node.root / "csi" / "csi.sock"

    def _start(config: str = "", args: tuple[str, ...] = (), **kw: object) -> CsiNode:
        """``args``: more daemon arguments (``-v``: every command logged)."""
        if not started:
            csi_config(node, config)
        d = Daemon(node, args=(*args, "--csi-endpoint", f"unix://{sock}"),
                   **kw)  # type: ignore[arg-type]
        c = connect(node, d, sock)
        started.append(c)
        return c

    yield _start
    for c in started:
        c.channel.close()
        if c.daemon.notify.fileno() != -1:
            c.daemon.stop()
    # Give back whatever a failed test left: release the CSI files' volumes and
    # delete their images, so the node fixture's leak check sees the truth.
    csi_dir = node.state / "csi.d"
    if csi_dir.is_dir() and any(csi_dir.glob("*.yaml")):
        node.cli("release", str(csi_dir))
        with node.cluster.client() as cl, cl.open_ioctx(node.cluster.pool) as io:
            for f in csi_dir.glob("*.yaml"):
                doc = yaml.safe_load(f.read_text())
                if doc.get("kind") == "Snapshot":
                    continue  # the node fixture removes the images with their snapshots
                image = doc["spec"]["image"]["name"]
                with contextlib.suppress(rbd.ImageNotFound, rbd.ImageBusy):
                    rbd.RBD().remove(io, image)
