"""Review: the nbd resize in KernelMapper.refresh is sent only for a device
that is still the one we mapped. The kernel compares the cookie it is given
with the device's own; a cookie read back from the device itself proves
nothing (any device would match), so it must be the one our record holds."""

from __future__ import annotations

from pathlib import Path

import pytest

from reconciler.drivers import kernelmapper, nbdnetlink
from reconciler.drivers.kernelmapper import KernelMapper
from reconciler.drivers.run import CommandError, Runner
from reconciler.spec.config import CephConfig
from reconciler.state.registry import NbdMappings

CEPH = CephConfig(conf="/etc/ceph/ceph.conf", user="admin", keyring="/k")
OURS = "db9ff88e-e64e-4c27-b5b7-265e68debddb"


def _setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, on_device: str,
           recorded: str | None) -> tuple[KernelMapper, list[tuple[str, int, str]]]:
    sysroot = tmp_path / "sys"
    block = sysroot / "block" / "nbd5"
    block.mkdir(parents=True)
    (block / "pid").write_text("176\n")
    (block / "backend").write_text(on_device + "\n")
    records = NbdMappings(tmp_path)
    if recorded is not None:
        records.record("/dev/nbd5", {"pool": "rbd", "image": "web", "cookie": recorded})
    sent: list[tuple[str, int, str]] = []
    monkeypatch.setattr(kernelmapper, "block_device_size", lambda _d: 1 << 30)
    monkeypatch.setattr(nbdnetlink, "resize", lambda d, s, c: sent.append((d, s, c)))
    m = KernelMapper("nbd", CEPH, Runner(), udev=lambda: True, records=records,
                     sys_root=sysroot)
    return m, sent


@pytest.mark.parametrize("recorded", [OURS, None])
def test_a_device_mapped_again_by_someone_else_is_not_resized(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recorded: str | None) -> None:
    """/dev/nbd5 now serves another image (its cookie is not the one we
    recorded, or we have no record of it): growing it to our image's size
    would make it larger than its own image (rbd-nbd drops writes past the
    end). No request is sent; the refresh waits and fails as before."""
    m, sent = _setup(tmp_path, monkeypatch, "someone-elses-cookie", recorded)
    with pytest.raises(CommandError):
        m.refresh("/dev/nbd5", 2 << 30, wait=0.05)
    assert sent == []


def test_our_device_is_resized_with_our_cookie(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    m, sent = _setup(tmp_path, monkeypatch, OURS, OURS)
    with pytest.raises(CommandError):  # the fake device never grows
        m.refresh("/dev/nbd5", 2 << 30, wait=0.05)
    assert sent == [("/dev/nbd5", 2 << 30, OURS)]
