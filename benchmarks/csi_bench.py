"""Shared by P4 and P5: a disposable cluster, the daemon serving CSI on a unix
socket, a gRPC client, and a cleanup that leaves nothing behind (the same
sweep as P1 when a run failed half-way)."""

from __future__ import annotations

import contextlib
import math
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import find_cli, sweep

from reconciler.csi import csi_pb2 as pb
from reconciler.csi import csi_pb2_grpc
from reconciler.drivers.reaper import become_subreaper, reap_zombies
from reconciler.testing.devcluster import start_cluster

MiB = 1 << 20
CALL_TIMEOUT = 120.0

CONFIG_YAML = """\
desiredDir: {root}/desired
stateDir: {root}/state
controlSocket: {root}/state/control.sock
nodeName: csi-bench
ceph:
  conf: {conf}
  user: {user}
  keyring: {keyring}
allowedRoots: [{root}/kubelet]
mapper: fuse
resyncSeconds: 3600
parallel: {parallel}
csi:
  timeoutSeconds: 300
"""


def mount_cap() -> pb.VolumeCapability:
    mode = pb.VolumeCapability.AccessMode
    return pb.VolumeCapability(mount=pb.VolumeCapability.MountVolume(fs_type="ext4"),
                               access_mode=mode(mode=mode.SINGLE_NODE_WRITER))


def percentile(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(p / 100 * len(s)) - 1))]


def figures(xs: list[float]) -> str:
    return (f"median {percentile(xs, 50) * 1000:.1f} ms, p99 {percentile(xs, 99) * 1000:.1f} ms,"
            f" max {max(xs) * 1000:.1f} ms (n={len(xs)})")


@dataclass
class Bench:
    root: Path
    pool: str
    proc: subprocess.Popen[bytes]
    channel: grpc.Channel
    controller: csi_pb2_grpc.ControllerStub
    node: csi_pb2_grpc.NodeStub
    volumes: list[pb.Volume]

    def create(self, name: str, size: int = 64 * MiB) -> pb.Volume:
        vol = self.controller.CreateVolume(pb.CreateVolumeRequest(
            name=name, capacity_range=pb.CapacityRange(required_bytes=size),
            volume_capabilities=[mount_cap()], parameters={"pool": self.pool}),
            timeout=CALL_TIMEOUT).volume
        self.volumes.append(vol)
        return vol

    def log(self) -> str:
        return (self.root / "daemon.log").read_text(errors="replace")


@contextlib.contextmanager
def csi_daemon(parallel: int = 4) -> Iterator[Bench]:
    become_subreaper()
    root = Path(tempfile.mkdtemp(prefix="rbd-reconciler-csi-bench-"))
    for d in ("desired", "state", "kubelet"):
        (root / d).mkdir(mode=0o755)
    cluster = start_cluster()
    proc = None
    bench = None
    try:
        config = root / "config.yaml"
        config.write_text(CONFIG_YAML.format(root=root, conf=cluster.conf, user=cluster.user,
                                             keyring=cluster.keyring, parallel=parallel))
        sock = root / "csi.sock"
        logf = open(root / "daemon.log", "ab")  # noqa: SIM115 - lives as long as the daemon
        proc = subprocess.Popen(
            ["setpriv", "--pdeathsig", "KILL", str(find_cli()), "--config", str(config), "run",
             "--log-format", "plain", "--csi-endpoint", f"unix://{sock}"],
            stdin=subprocess.DEVNULL, stdout=logf, stderr=logf)
        channel = grpc.insecure_channel(f"unix://{sock}")
        grpc.channel_ready_future(channel).result(timeout=60)
        identity = csi_pb2_grpc.IdentityStub(channel)
        end = time.monotonic() + 60
        while not identity.Probe(pb.ProbeRequest(), timeout=30).ready.value:
            if time.monotonic() > end:
                raise RuntimeError("the daemon never became ready")
            time.sleep(0.05)
        bench = Bench(root, cluster.pool, proc, channel, csi_pb2_grpc.ControllerStub(channel),
                      csi_pb2_grpc.NodeStub(channel), [])
        yield bench
    finally:
        problems = []
        if bench is not None:
            for vol in bench.volumes:  # the CSI way first: engine-made teardown
                try:
                    bench.controller.DeleteVolume(pb.DeleteVolumeRequest(
                        volume_id=vol.volume_id), timeout=CALL_TIMEOUT)
                except grpc.RpcError as exc:
                    problems.append(f"DeleteVolume {vol.volume_id}: {exc.details()}")
            bench.channel.close()
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        problems += sweep(root)
        reap_zombies()
        cluster.stop()
        if problems:
            print("csi-bench: cleanup problems:\n  " + "\n  ".join(problems), file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)
