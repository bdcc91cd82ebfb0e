"""The Kubernetes examples parse and carry what a cluster needs (no cluster here)."""

from __future__ import annotations

from pathlib import Path

import yaml

from reconciler.spec.config import load_config

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "kubernetes"


def docs() -> dict[tuple[str, str], dict]:
    out = {}
    for f in sorted(EXAMPLES.glob("*.yaml")):
        for d in yaml.safe_load_all(f.read_text()):
            assert d["apiVersion"] and d["kind"] and d["metadata"]["name"], f
            out[(d["kind"], d["metadata"]["name"])] = d
    return out


def containers(d: dict) -> dict[str, dict]:
    return {c["name"]: c for c in d["spec"]["template"]["spec"]["containers"]}


def test_manifests_name_one_driver(tmp_path: Path) -> None:
    m = docs()
    cfg = m[("ConfigMap", "rbd-reconciler-config")]["data"]
    names = set()
    for key in ("node.yaml", "controller.yaml"):
        path = tmp_path / key
        path.write_text(cfg[key])
        config = load_config(path)
        assert "/var/lib/kubelet" in config.allowed_roots
        names.add(config.csi.driver_name)
    [driver] = names
    csidriver = m[("CSIDriver", driver)]
    assert csidriver["apiVersion"] == "storage.k8s.io/v1"
    assert csidriver["spec"]["attachRequired"] is False
    sc = m[("StorageClass", "rbd-reconciler")]
    assert sc["provisioner"] == driver and sc["parameters"]["pool"]
    assert sc["allowVolumeExpansion"] is True

    ds = m[("DaemonSet", "rbd-reconciler-node")]
    c = containers(ds)
    plugin, registrar = c["rbd-reconciler"], c["node-driver-registrar"]
    assert plugin["securityContext"]["privileged"] is True
    assert "--csi-endpoint" in plugin["args"]
    mounts = {v["mountPath"]: v for v in plugin["volumeMounts"]}
    assert mounts["/var/lib/kubelet"]["mountPropagation"] == "Bidirectional"
    assert {"/dev", "/sys", "/etc/ceph/ceph.conf", "/etc/ceph-keyring"} <= set(mounts)
    assert f"--kubelet-registration-path=/var/lib/kubelet/plugins/{driver}/csi.sock" in \
        registrar["args"]
    host_paths = {v["hostPath"]["path"] for v in ds["spec"]["template"]["spec"]["volumes"]
                  if "hostPath" in v}
    assert f"/var/lib/kubelet/plugins/{driver}" in host_paths
    assert "/var/lib/kubelet/plugins_registry" in host_paths

    dep = containers(m[("Deployment", "rbd-reconciler-controller")])
    assert {"rbd-reconciler", "csi-provisioner", "csi-resizer"} <= set(dep)
    assert m[("ClusterRoleBinding", "rbd-reconciler-controller")]


def test_claims_and_pods() -> None:
    m = docs()
    fs, block = m[("PersistentVolumeClaim", "data-fs")], m[("PersistentVolumeClaim",
                                                             "data-block")]
    assert fs["spec"]["storageClassName"] == block["spec"]["storageClassName"] == \
        "rbd-reconciler"
    assert fs["spec"]["volumeMode"] == "Filesystem" and block["spec"]["volumeMode"] == "Block"
    fs_pod = m[("Pod", "uses-data-fs")]["spec"]
    assert fs_pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "data-fs"
    assert fs_pod["containers"][0]["volumeMounts"]
    block_pod = m[("Pod", "uses-data-block")]["spec"]
    assert block_pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "data-block"
    assert block_pod["containers"][0]["volumeDevices"]


def test_snapshot_class_and_restore() -> None:
    m = docs()
    driver = m[("StorageClass", "rbd-reconciler")]["provisioner"]
    vsc = m[("VolumeSnapshotClass", "rbd-reconciler-snapshots")]
    assert vsc["driver"] == driver and vsc["deletionPolicy"] == "Delete"
    snap = m[("VolumeSnapshot", "data-fs-before-upgrade")]["spec"]
    assert snap["volumeSnapshotClassName"] == "rbd-reconciler-snapshots"
    assert snap["source"]["persistentVolumeClaimName"] == "data-fs"
    restored = m[("PersistentVolumeClaim", "data-fs-restored")]["spec"]["dataSource"]
    assert restored == {"apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot",
                        "name": "data-fs-before-upgrade"}
    copy = m[("PersistentVolumeClaim", "data-fs-copy")]["spec"]["dataSource"]
    assert copy["kind"] == "PersistentVolumeClaim" and copy["name"] == "data-fs"
    assert "csi-snapshotter" in containers(m[("Deployment", "rbd-reconciler-controller")])
