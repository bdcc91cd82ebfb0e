"""Controller replicas with test-only faults, for tests that model what real
machines do to a CSI controller: a replica is a daemon serving CSI on its own
socket and state dir, sharing the cluster, the nodeName and ``csi.statePool``
with the others, started with tests/csi/faultsite first on its PYTHONPATH (its
own wall clock offset, and pause points that SIGSTOP the process at a chosen
step). Nothing here hooks the product."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import rados
from conftest import NodeUnderTest
from csi_fixture import CsiNode, connect, mount_cap
from test_daemon import Daemon, wait_for

from reconciler.csi import csi_pb2 as pb
from reconciler.csi.records import OBJECT, PREFIX

ROOT = Path(__file__).resolve().parents[2]
FAULTSITE = Path(__file__).resolve().parent / "faultsite"
POINTS = ("records.get", "records.write", "records.remove", "volumes.converge", "volumes.gate")
PAUSE_WITHIN_S = 60.0  # how long a replica may take to reach its pause point
MiB = 1 << 20


def process_state(pid: int) -> str:
    """The state letter of ``/proc/PID/stat`` ('T': stopped); '' when gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return text[text.rindex(")") + 2]


@dataclass
class Replica:
    label: str
    csi: CsiNode
    pause_dir: Path
    clock_offset_s: float

    @property
    def daemon(self) -> Daemon:
        return self.csi.daemon

    @property
    def pid(self) -> int:
        return self.daemon.proc.pid

    def log(self) -> str:
        return self.daemon.log.read_text(errors="replace")

    def pause_at(self, point: str, name: str) -> None:
        """The next call reaching ``point`` for ``name`` stops this process."""
        assert point in POINTS, point
        (self.pause_dir / point).write_text(name)

    def paused(self) -> bool:
        return process_state(self.pid) in ("T", "t")

    def wait_paused(self, point: str, timeout: float = PAUSE_WITHIN_S) -> None:
        """Wait until the replica stopped itself at ``point`` (the faultsite
        removes the point's file as it stops the process)."""
        def stopped() -> bool:
            assert self.daemon.proc.poll() is None, f"{self.label} died:\n{self.log()[-4000:]}"
            return self.paused() and not (self.pause_dir / point).exists()
        wait_for(stopped, f"replica {self.label} to stop at {point}", timeout)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)
        wait_for(lambda: not self.paused(), f"replica {self.label} to run again", 30)

    def kill(self) -> None:
        """SIGKILL (a stopped process dies too): the machine is gone."""
        self.csi.channel.close()
        self.daemon.stop(signal.SIGKILL)

    def stop(self) -> None:
        """At the end of a test: running again, then stopped as usual."""
        if self.daemon.notify.fileno() == -1:
            return  # already stopped or killed
        with contextlib.suppress(ProcessLookupError):
            if self.daemon.proc.poll() is None:
                os.kill(self.pid, signal.SIGCONT)
        self.csi.stop()


def start_replica(base: NodeUnderTest, root: Path, label: str, timeout_s: float | None = None,
                  clock_offset_s: float = 0.0) -> Replica:
    """A controller daemon on ``base``'s cluster with its own state under
    ``root/label``; ``timeout_s``: csi.timeoutSeconds (its records' stale time
    is 2 * that + 60 s)."""
    home = root / label
    dirs = [home / d for d in ("desired", "state", "srv")]
    for d in dirs:
        d.mkdir(parents=True)
    pause_dir = home / "pause"
    pause_dir.mkdir()
    text = base.config.read_text()
    for old, new in zip((base.desired, base.state, base.srv), dirs, strict=True):
        text = text.replace(str(old), str(new))
    text += ("csi:\n  driverName: rbd.test.local\n"
             f"  statePool: {base.cluster.pool}\n")
    if timeout_s is not None:
        text += f"  timeoutSeconds: {timeout_s:g}\n"
    config = home / "config.yaml"
    config.write_text(text)
    node = NodeUnderTest(home, base.cluster, config, *dirs, base.tag)
    env = {"PYTHONPATH": f"{FAULTSITE}{os.pathsep}{ROOT}",
           "RBD_TEST_PAUSE_DIR": str(pause_dir),
           "RBD_TEST_CLOCK_OFFSET_S": str(clock_offset_s)}
    sock = home / "csi" / "csi.sock"
    daemon = Daemon(node, extra_env=env, args=("--csi-endpoint", f"unix://{sock}"))
    return Replica(label, connect(node, daemon, sock), pause_dir, clock_offset_s)


# -- requests as a CO sends them ------------------------------------------------------
def create_req(node: NodeUnderTest, request: str, size: int = 16 * MiB,
               **mutable: str) -> pb.CreateVolumeRequest:
    return pb.CreateVolumeRequest(
        name=request, capacity_range=pb.CapacityRange(required_bytes=size),
        volume_capabilities=[mount_cap()], parameters={"pool": node.cluster.pool},
        mutable_parameters=mutable)


def expand_req(vid: str, size: int) -> pb.ControllerExpandVolumeRequest:
    return pb.ControllerExpandVolumeRequest(
        volume_id=vid, capacity_range=pb.CapacityRange(required_bytes=size))


def modify_req(vid: str, **params: str) -> pb.ControllerModifyVolumeRequest:
    return pb.ControllerModifyVolumeRequest(volume_id=vid, mutable_parameters=params)


def rpc_code(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    """The call's status code and message (OK, "" when it succeeded)."""
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code(), exc.details()  # type: ignore[return-value]
    return grpc.StatusCode.OK, ""


def retry_until(call: Callable[[], object], within_s: float,
                retry: tuple[grpc.StatusCode, ...] = (grpc.StatusCode.ABORTED,)) -> object:
    """A CO's retries: the call again while it answers one of ``retry``, up
    to ``within_s``; the last error is raised past it."""
    end = time.monotonic() + within_s
    while True:
        try:
            return call()
        except grpc.RpcError as exc:
            if exc.code() not in retry or time.monotonic() > end:
                raise
        time.sleep(0.5)  # the CO's backoff between retries, not a synchronisation


# -- records --------------------------------------------------------------------------
def record(node: NodeUnderTest, name: str) -> dict | None:
    """The decoded JSON of ``name``'s controller record (None: none, or the
    marker a finished delete leaves, which the controller reads as absent)."""
    with node.cluster.client() as cl, cl.open_ioctx(node.cluster.pool) as io, \
            rados.ReadOpCtx() as op:
        it, _ = io.get_omap_vals_by_keys(op, (PREFIX + name,))
        try:
            io.operate_read_op(op, OBJECT)
        except rados.ObjectNotFound:
            return None
        found = dict(it)
    raw = found.get(PREFIX + name)
    doc = None if raw is None else json.loads(raw)
    return None if doc is None or doc.get("state") == "deleted" else doc  # type: ignore[no-any-return]


def settled(node: NodeUnderTest, name: str) -> bool:
    """The record is created and no replica holds a lease on it."""
    rec = record(node, name)
    return rec is not None and rec["state"] == "created" and "op" not in rec
