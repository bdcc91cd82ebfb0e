"""The adapter keeps one librados connection across requests (issue 17, cold
paths: a connect per CreateVolume cost more than the call)."""

from __future__ import annotations

import threading

import pytest
import rados
import rbd
from conftest import NodeUnderTest

from reconciler.csi.cephinfo import CSI_NAME_META, CephInfo
from reconciler.spec.config import CephConfig

pytestmark = pytest.mark.ceph


def test_one_connection_across_requests_replaced_after_a_failure(node: NodeUnderTest) -> None:
    c = node.cluster
    image = node.name("keep")
    node.images.add(image)
    with c.client() as cl, cl.open_ioctx(c.pool) as io:
        rbd.RBD().create(io, image, 4 << 20)
    info = CephInfo(CephConfig(str(c.conf), c.user, str(c.keyring)))
    try:
        assert info.image_size(c.pool, image) == 4 << 20
        assert info.image_size(c.pool, "no-such-image") is None  # "not found" keeps it
        info.record_name(c.pool, image, "pvc-1")
        errors: list[BaseException] = []

        def request(i: int) -> None:
            try:
                assert info.image_size(c.pool, image) == 4 << 20
                assert info.watchers(c.pool, image) == []
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=request, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert info.connects == 1
        with c.client() as cl, cl.open_ioctx(c.pool) as io, rbd.Image(io, image) as img:
            assert dict(img.metadata_list())[CSI_NAME_META] == "pvc-1"

        # A call that fails on the connection retires it: the next one connects afresh.
        with pytest.raises(rados.TimedOut), info._client():
            raise rados.TimedOut("a call that did not answer")
        assert info.image_size(c.pool, image) == 4 << 20
        assert info.connects == 2
    finally:
        info.close()
