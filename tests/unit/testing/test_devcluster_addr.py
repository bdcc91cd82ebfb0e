"""The test cluster listens on loopback, or on another address only inside
the private network namespace scripts/kernel-tests.sh makes: never on what
could be a real interface. Checked before anything is started."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from reconciler.testing import devcluster
from reconciler.testing.devcluster import DevClusterError, in_test_netns, start_cluster


def _own_netns() -> str:
    return str(os.stat("/proc/self/ns/net").st_ino)


def test_a_non_loopback_address_is_refused_outside_the_test_namespace(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RBD_RECONCILER_TEST_NETNS", raising=False)
    root = tmp_path / "cluster"
    with pytest.raises(DevClusterError, match=r"refusing to listen on 10\.99\.0\.1"):
        start_cluster(root=root, addr="10.99.0.1")
    assert not root.exists()  # refused before anything was made


def test_another_namespace_s_inode_is_not_ours(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RBD_RECONCILER_TEST_NETNS", str(int(_own_netns()) + 1))
    assert not in_test_netns()
    with pytest.raises(DevClusterError, match="private network namespace"):
        start_cluster(root=tmp_path / "cluster", addr="192.0.2.7")


def test_the_namespace_is_recognised_by_its_inode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RBD_RECONCILER_TEST_NETNS", _own_netns())
    assert in_test_netns()
    monkeypatch.setenv("RBD_RECONCILER_TEST_NETNS", "")
    assert not in_test_netns()


def test_loopback_is_not_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Past the address check, a missing tool is the next refusal: no daemon starts.
    monkeypatch.delenv("RBD_RECONCILER_TEST_NETNS", raising=False)
    monkeypatch.setattr(devcluster.shutil, "which", lambda _tool: None)
    with pytest.raises(DevClusterError, match="missing Ceph tools"):
        start_cluster(root=tmp_path / "cluster", addr="127.0.0.1")
