"""The CSI socket: 0600 from the moment anyone can reach it, without the
process umask (shared by every thread) ever changing, in a directory only
root may change."""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from reconciler.csi.server import grpc_listen
from reconciler.drivers.privsock import PrivateSocket

NOBODY = 65534


@pytest.fixture
def server() -> Iterator[grpc.Server]:
    s = grpc.server(ThreadPoolExecutor(max_workers=2))
    yield s
    s.stop(0).wait()


@pytest.fixture
def no_umask(monkeypatch: pytest.MonkeyPatch) -> None:
    def umask(_mask: int) -> int:
        raise AssertionError("os.umask is process-wide: another thread's files would get it")
    monkeypatch.setattr(os, "umask", umask)


def serves(path: Path) -> bool:
    """A call reaches a gRPC server there (it has no such method: UNIMPLEMENTED)."""
    with grpc.insecure_channel(f"unix://{path}") as ch:
        try:
            ch.unary_unary("/x.Y/Z")(b"", timeout=10)
        except grpc.RpcError as exc:
            return exc.code() == grpc.StatusCode.UNIMPLEMENTED
    return False


def test_born_0600_in_place_and_serving(tmp_path: Path, server: grpc.Server,
                                        no_umask: None) -> None:
    path = tmp_path / "plugins" / "rbd.csi" / "csi.sock"  # its directory made too
    sock = PrivateSocket(path, "CSI")
    sock.bind(grpc_listen(server))
    st = path.lstat()
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == 0
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o755
    assert os.listdir(path.parent) == ["csi.sock"]  # the private directory is gone
    assert serves(path)
    sock.remove()
    assert not path.exists()


def test_a_stale_socket_is_replaced_anything_else_refused(tmp_path: Path,
                                                          server: grpc.Server) -> None:
    path = tmp_path / "csi.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))
    stale.close()  # a killed predecessor's
    sock = PrivateSocket(path, "CSI")
    sock.bind(grpc_listen(server))
    assert serves(path)
    # A successor's socket at the name is not ours to remove.
    sock_ino = path.lstat().st_ino
    os.unlink(path)
    other = socket.socket(socket.AF_UNIX)
    other.bind(str(path))
    other.close()
    assert path.lstat().st_ino != sock_ino
    sock.remove()
    assert stat.S_ISSOCK(path.lstat().st_mode)

    path2 = tmp_path / "file.sock"
    path2.write_text("not a socket")
    with pytest.raises(RuntimeError, match="exists and is not a socket"):
        PrivateSocket(path2, "CSI").bind(
            grpc_listen(grpc.server(ThreadPoolExecutor(max_workers=1))))
    assert path2.read_text() == "not a socket"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a directory of nobody's)")
@pytest.mark.parametrize(("mode", "owner"), [(0o755, NOBODY), (0o775, 0), (0o1777, 0)])
def test_refused_in_a_directory_others_may_change(tmp_path: Path, mode: int,
                                                  owner: int) -> None:
    d = tmp_path / "plugin"
    d.mkdir()
    d.chmod(mode)
    os.chown(d, owner, owner)
    with pytest.raises(RuntimeError, match="refusing to serve CSI"):
        PrivateSocket(d / "csi.sock", "CSI").bind(
            grpc_listen(grpc.server(ThreadPoolExecutor(max_workers=1))))
    assert os.listdir(d) == []
