"""The generated CSI code on the wire: real gRPC calls over a unix socket,
through the servicer classes, the metrics interceptor and the socket the
daemon binds. No Ceph, no engine: both are small fakes.

The checked-in csi_pb2*.py must serve the pip runtime (the venv) and
Debian 12's (python3-grpcio 1.51, python3-protobuf 3.21): this file runs
under both (tests/test_debian_package.py runs it with /usr/bin/python3 and
Debian's packages only)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from reconciler import __version__
from reconciler.csi import csi_pb2 as pb
from reconciler.csi import csi_pb2_grpc
from reconciler.csi.identity import IdentityServicer
from reconciler.csi.server import MetricsInterceptor, PrivateSocket, grpc_listen, implemented


class Metrics:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def csi_served(self, methods: Iterable[str]) -> None:
        pass

    def csi_call(self, method: str, code: str, seconds: float) -> None:
        self.calls.append((method, code))


class Ceph:
    problem_is: Any = None

    def problem(self) -> str | None:
        if isinstance(self.problem_is, Exception):
            raise self.problem_is
        return self.problem_is


class Engine:
    def __init__(self) -> None:
        self.config = SimpleNamespace(csi=SimpleNamespace(driver_name="rbd.example.com"))
        self.metrics = Metrics()
        self.ready = True


@pytest.fixture
def wire(tmp_path: Path) -> Iterator[tuple[grpc.Channel, Engine, Ceph]]:
    engine, ceph = Engine(), Ceph()
    server = grpc.server(ThreadPoolExecutor(max_workers=2),
                         interceptors=[MetricsInterceptor(engine.metrics)])
    csi_pb2_grpc.add_IdentityServicer_to_server(IdentityServicer(engine, ceph), server)  # type: ignore[arg-type]
    # The generated base alone: every call UNIMPLEMENTED.
    csi_pb2_grpc.add_NodeServicer_to_server(csi_pb2_grpc.NodeServicer(), server)
    sock = PrivateSocket(tmp_path / "csi" / "csi.sock", "CSI")
    sock.bind(grpc_listen(server))
    try:
        with grpc.insecure_channel(f"unix://{sock.path}") as channel:
            yield channel, engine, ceph
    finally:
        server.stop(0).wait()
        sock.remove()


def test_identity_answers_over_the_socket(wire: tuple[grpc.Channel, Engine, Ceph]) -> None:
    channel, engine, ceph = wire
    identity = csi_pb2_grpc.IdentityStub(channel)
    info = identity.GetPluginInfo(pb.GetPluginInfoRequest(), timeout=10)
    assert (info.name, info.vendor_version) == ("rbd.example.com", __version__)
    caps = identity.GetPluginCapabilities(pb.GetPluginCapabilitiesRequest(), timeout=10)
    assert {c.service.type for c in caps.capabilities if c.HasField("service")} == {
        pb.PluginCapability.Service.CONTROLLER_SERVICE,
        pb.PluginCapability.Service.GROUP_CONTROLLER_SERVICE}
    # google.protobuf.BoolValue, a well-known type from the runtime, set and unset.
    assert identity.Probe(pb.ProbeRequest(), timeout=10).ready.value is True
    ceph.problem_is = "Ceph unreachable"
    probe = identity.Probe(pb.ProbeRequest(), timeout=10)
    assert probe.HasField("ready") and probe.ready.value is False
    assert engine.metrics.calls == [("GetPluginInfo", "OK"), ("GetPluginCapabilities", "OK"),
                                    ("Probe", "OK"), ("Probe", "OK")]


def test_errors_keep_their_code_and_message(wire: tuple[grpc.Channel, Engine, Ceph]) -> None:
    channel, engine, ceph = wire
    ceph.problem_is = RuntimeError("boom")
    with pytest.raises(grpc.RpcError) as err:
        csi_pb2_grpc.IdentityStub(channel).Probe(pb.ProbeRequest(), timeout=10)
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert "Probe: internal error: RuntimeError: boom" in (err.value.details() or "")
    with pytest.raises(grpc.RpcError) as err:
        csi_pb2_grpc.NodeStub(channel).NodeGetInfo(pb.NodeGetInfoRequest(), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert engine.metrics.calls == [("Probe", "INTERNAL"), ("NodeGetInfo", "UNIMPLEMENTED")]


def test_secret_fields_are_marked_and_round_trip() -> None:
    """csi_secret, the extension the secrets fields carry, is readable from
    the descriptor; a request survives serialization unchanged."""
    field = pb.CreateVolumeRequest.DESCRIPTOR.fields_by_name["secrets"]
    assert field.GetOptions().Extensions[pb.csi_secret] is True
    request = pb.CreateVolumeRequest(name="pvc-1", secrets={"k": "v"},
                                     capacity_range=pb.CapacityRange(required_bytes=1 << 30))
    again = pb.CreateVolumeRequest.FromString(request.SerializeToString())
    assert again == request and dict(again.secrets) == {"k": "v"}


def test_implemented_sees_the_generated_base() -> None:
    assert implemented(IdentityServicer(Engine(), Ceph())) == [  # type: ignore[arg-type]
        "GetPluginCapabilities", "GetPluginInfo", "Probe"]
