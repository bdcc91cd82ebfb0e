"""CSI with encryption: StorageClass parameters encrypted/encryptionKey become
the volume's key source; NodeStage puts spec.encryption beside the map and
NodeUnstage takes it away again; a clone of an encrypted volume must say so.
On a kernel without dm-crypt the open fails cleanly (the kernel tests open it)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import yaml
from conftest import NodeUnderTest
from csi_fixture import CsiNode, mount_cap

from reconciler.csi import csi_pb2 as pb
from reconciler.drivers import ceph
from reconciler.facts import meta

MiB = 1 << 20
T = 90


@pytest.fixture
def keyed(node: NodeUnderTest, start_csi: Callable[..., CsiNode]) -> CsiNode:
    keys = node.root / "keys"
    keys.mkdir(mode=0o700)
    (keys / "node.key").write_bytes(os.urandom(64))
    (keys / "node.key").chmod(0o600)
    with node.config.open("a") as f:
        f.write(f"encryption:\n  keyRoot: {keys}\n  pbkdf: pbkdf2\n  iterations: 1000\n")
    return start_csi()


def doc_of(c: CsiNode, vol: pb.Volume) -> dict:
    [f] = [p for p in (c.node.state / "csi.d").glob("*.yaml")
           if vol.volume_context["image"] in p.read_text()]
    return yaml.safe_load(f.read_text())


def test_parameters_are_checked(keyed: CsiNode) -> None:
    for params, word in (({"encrypted": "yes"}, "\"true\" or \"false\""),
                         ({"encryptionKey": "file:/k"}, "needs encrypted"),
                         ({"encrypted": "true", "encryptionKey": "vault:/k"}, "wrappedBy:/PATH"),
                         ({"encrypted": "true", "encryptionKey": "file:/root/k"},
                          "must lie under")):
        with pytest.raises(grpc.RpcError) as err:
            keyed.create("pvc-bad", **params)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert word in (err.value.details() or "")


def test_encrypted_volume_stages_with_its_key_source(keyed: CsiNode) -> None:
    c = keyed
    key = f"wrappedBy:{c.node.root / 'keys' / 'node.key'}"
    vol = c.create("pvc-enc", size=64 * MiB, encrypted="true", encryptionKey=key)
    labels = doc_of(c, vol)["metadata"]["labels"]
    assert key in labels.values()
    # The same request again is the same volume; another key source is not.
    assert c.create("pvc-enc", size=64 * MiB, encrypted="true", encryptionKey=key) == vol
    with pytest.raises(grpc.RpcError) as err:
        c.create("pvc-enc", size=64 * MiB)
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "encryption" in (err.value.details() or "")
    staging, _ = c.kubelet_paths("pv-enc")
    stage = pb.NodeStageVolumeRequest(volume_id=vol.volume_id, staging_target_path=str(staging),
                                      volume_capability=mount_cap(),
                                      volume_context=vol.volume_context)
    try:
        c.nodes.NodeStageVolume(stage, timeout=T)
        staged = True
    except grpc.RpcError as exc:
        assert not Path("/sys/module/dm_crypt").exists(), exc.details()
        assert "device-mapper" in (exc.details() or "") or "dm_mod" in (exc.details() or "")
        staged = False
    spec = doc_of(c, vol)["spec"]
    if staged:
        assert spec["encryption"] == {"type": "luks2", "key": {
            "wrappedBy": str(c.node.root / "keys" / "node.key")}}
    else:  # a failed stage leaves the file as it was
        assert "encryption" not in spec and "stage" not in spec, spec
    pool, image = vol.volume_context["pool"], vol.volume_context["image"]
    with c.node.cluster.client() as cl:
        assert ceph.get_meta(cl, pool, image)[meta.CRYPT_FORMATTED] == "luks2"
    # A clone must carry encryption too (it opens with its source's key).
    with pytest.raises(grpc.RpcError) as err:
        c.controller.CreateVolume(pb.CreateVolumeRequest(
            name="pvc-clone", volume_capabilities=[mount_cap()],
            parameters={"pool": pool},
            volume_content_source=pb.VolumeContentSource(
                volume=pb.VolumeContentSource.VolumeSource(volume_id=vol.volume_id))),
            timeout=T)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "encrypted" in (err.value.details() or "")
    c.nodes.NodeUnstageVolume(pb.NodeUnstageVolumeRequest(
        volume_id=vol.volume_id, staging_target_path=str(staging)), timeout=T)
    spec = doc_of(c, vol)["spec"]
    assert "encryption" not in spec and "map" not in spec and "stage" not in spec
    if staged:  # where the kernel has dm-crypt, the container was open and is closed now
        assert not Path("/dev/mapper/rbdr-" + doc_of(c, vol)["metadata"]["name"]).exists()
