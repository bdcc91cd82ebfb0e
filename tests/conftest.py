"""Shared pytest fixtures."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from reconciler.devcluster import DevCluster, start_cluster

# --- real Ceph cluster (reconciler.devcluster) ---------------------------------
# One disposable 1-mon + 1-memstore-OSD cluster per test session. Startup takes
# about a second, but its data lives in OSD RAM (3 GiB cap), so tests share it:
# use unique image names and remove what you create. Mark such tests
# `@pytest.mark.ceph`.


@pytest.fixture(scope="session")
def ceph_cluster() -> Iterator[DevCluster]:
    if shutil.which("ceph-mon") is None or shutil.which("ceph-osd") is None:
        # Not a skip: a suite that silently drops its Ceph tests is not green.
        pytest.fail("ceph-mon/ceph-osd not installed (scripts/setup.sh installs them)")
    cluster = start_cluster()
    try:
        yield cluster
    finally:
        cluster.stop()
