"""The Kubernetes examples (examples/kubernetes/) would deploy (no cluster here).

Every document parses; every core, apps, RBAC and storage object validates
against the Kubernetes JSON schemas that kubernetes-validate bundles (strict:
an unknown field fails). The snapshot and group snapshot kinds are CRDs no
bundled schema covers: their fields that matter are checked by hand below.
Then what the schemas cannot see: one driver name everywhere, the node
plugin's host mounts, Bidirectional propagation only where privileged, every
sidecar on the plugin's socket, leader election, and that the desired
directories the initContainers prepare pass the daemon's trust check.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from test_spec_invalid import GOOD  # a valid desired-volume document

from reconciler.spec.config import Config, default_config, load_config
from reconciler.spec.loader import load
from reconciler.spec.security import directory_problems

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "kubernetes"
# 1.33: the release the pinned sidecars (csi-provisioner v5.2, csi-resizer
# v1.13, csi-snapshotter v8.2) are made for; 1.36: the newest bundled one that
# still serves VolumeAttributesClass storage.k8s.io/v1beta1.
K8S_VERSIONS = ("1.33", "1.36")
# CRDs (external-snapshotter): no bundled schema; checked by hand.
CRD_API = {
    "VolumeSnapshotClass": "snapshot.storage.k8s.io/v1",
    "VolumeSnapshot": "snapshot.storage.k8s.io/v1",
    "VolumeGroupSnapshotClass": "groupsnapshot.storage.k8s.io/v1beta1",
    "VolumeGroupSnapshot": "groupsnapshot.storage.k8s.io/v1beta1",
}
Doc = dict[str, Any]


def documents() -> list[tuple[str, Doc]]:
    out = []
    for f in sorted(EXAMPLES.glob("*.yaml")):
        for d in yaml.safe_load_all(f.read_text()):
            out.append((f"{f.name}: {d.get('kind')}/{d.get('metadata', {}).get('name')}", d))
    return out


def by_kind_name() -> dict[tuple[str, str], Doc]:
    return {(d["kind"], d["metadata"]["name"]): d for _, d in documents()}


def pod_specs() -> Iterator[tuple[str, Doc]]:
    for where, d in documents():
        if d["kind"] == "Pod":
            yield where, d["spec"]
        elif d["kind"] in ("DaemonSet", "Deployment"):
            yield where, d["spec"]["template"]["spec"]


def containers(d: Doc) -> dict[str, Doc]:
    return {c["name"]: c for c in d["spec"]["template"]["spec"]["containers"]}


def init_containers(d: Doc) -> dict[str, Doc]:
    return {c["name"]: c for c in d["spec"]["template"]["spec"].get("initContainers", [])}


def volumes(d: Doc) -> dict[str, Doc]:
    return {v["name"]: v for v in d["spec"]["template"]["spec"]["volumes"]}


def mounts(c: Doc) -> dict[str, Doc]:
    return {m["mountPath"]: m for m in c.get("volumeMounts", [])}


def arg(c: Doc, flag: str) -> str | None:
    """The value of ``--flag=value`` or ``--flag value`` in a container's args."""
    args = c.get("args", [])
    for i, a in enumerate(args):
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
        if a == flag and i + 1 < len(args):
            return args[i + 1]
    return None


def on_volume(c: Doc, path: str) -> tuple[str, str]:
    """Which volume ``path`` (in container ``c``) is on, and where inside it."""
    best = max((m for m in c.get("volumeMounts", [])
                if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")),
               key=lambda m: len(m["mountPath"]), default=None)
    assert best is not None, f"{c['name']}: {path} is on no volume"
    return best["name"], os.path.relpath(path, best["mountPath"])


def config_data() -> dict[str, str]:
    return by_kind_name()[("ConfigMap", "rbd-reconciler-config")]["data"]


def load_example_config(tmp_path: Path, key: str) -> Config:
    """The config ConfigMap's ``key``, through the daemon's own loader."""
    data = yaml.safe_load(config_data()[key])
    path = tmp_path / key
    path.write_text(yaml.safe_dump(data))
    return load_config(path)


def rbac_grants(rules: list[Doc]) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule in rules for g in rule["apiGroups"]
            for r in rule["resources"] for v in rule["verbs"]}


def run_init(init: Doc, env: dict[str, str]) -> None:
    """Run an initContainer's shell script here, its paths moved by ``env``."""
    assert init["command"] == ["sh", "-c"]
    [script] = init["args"]
    assert {e["name"] for e in init["env"]} == set(env), "every path comes from env"
    subprocess.run(["sh", "-c", script], env={**os.environ, **env}, check=True, timeout=30)


# --- parse and schemas -----------------------------------------------------------------------

def test_every_document_parses_and_is_named_once() -> None:
    seen: set[tuple[str, str, str]] = set()
    docs = documents()
    assert len(docs) >= 20
    for where, d in docs:
        assert isinstance(d, dict) and d.get("apiVersion") and d.get("kind"), where
        key = (d["kind"], d["metadata"].get("namespace", ""), d["metadata"]["name"])
        assert key not in seen, f"{where}: defined twice"
        seen.add(key)


SCHEMA_DOCS = [(w, d) for w, d in documents() if d["kind"] not in CRD_API]


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize(("where", "doc"), SCHEMA_DOCS, ids=[w for w, _ in SCHEMA_DOCS])
def test_validates_against_the_kubernetes_schema(where: str, doc: Doc, version: str) -> None:
    # Strict: additionalProperties false, so a misspelled field fails too. A
    # kind without a schema raises SchemaNotFoundError: a failure, not a skip.
    kubernetes_validate.validate(doc, version, strict=True)


def test_the_validator_catches_a_wrong_manifest() -> None:
    ds = by_kind_name()[("DaemonSet", "rbd-reconciler-node")]
    kubernetes_validate.validate(ds, K8S_VERSIONS[0], strict=True)
    bad = json.loads(json.dumps(ds))
    plugin = bad["spec"]["template"]["spec"]["containers"][0]
    plugin["volumeMount"] = plugin.pop("volumeMounts")  # a typo
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[0], strict=True)
    bad = json.loads(json.dumps(ds))
    bad["spec"]["template"]["spec"]["containers"][0]["volumeMounts"][1][
        "mountPropagation"] = 1  # not a string
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[0], strict=True)


def test_crds_by_hand() -> None:
    m = by_kind_name()
    driver = m[("StorageClass", "rbd-reconciler")]["provisioner"]
    crds = [(w, d) for w, d in documents() if d["kind"] in CRD_API]
    assert {d["kind"] for _, d in crds} == set(CRD_API)
    for where, d in crds:
        assert d["apiVersion"] == CRD_API[d["kind"]], where
        if d["kind"].endswith("Class"):
            assert set(d) <= {"apiVersion", "kind", "metadata", "driver", "deletionPolicy",
                              "parameters"}, where
            assert d["driver"] == driver, where
            assert d["deletionPolicy"] in ("Delete", "Retain"), where
    snap = m[("VolumeSnapshot", "data-fs-before-upgrade")]
    assert set(snap) == {"apiVersion", "kind", "metadata", "spec"}
    assert ("VolumeSnapshotClass", snap["spec"]["volumeSnapshotClassName"]) in m
    assert snap["spec"]["source"] == {"persistentVolumeClaimName": "data-fs"}
    assert ("PersistentVolumeClaim", "data-fs") in m
    group = m[("VolumeGroupSnapshot", "db-before-upgrade")]
    assert set(group) == {"apiVersion", "kind", "metadata", "spec"}
    assert ("VolumeGroupSnapshotClass", group["spec"]["volumeGroupSnapshotClassName"]) in m
    labels = group["spec"]["source"]["selector"]["matchLabels"]
    selected = {name for (kind, name), d in m.items() if kind == "PersistentVolumeClaim"
                and labels.items() <= d["metadata"].get("labels", {}).items()}
    assert selected == {"db-data", "db-wal"}


# --- one driver ------------------------------------------------------------------------------

def test_one_driver_name_everywhere(tmp_path: Path) -> None:
    m = by_kind_name()
    node, controller = (load_example_config(tmp_path, k) for k in ("node.yaml",
                                                                   "controller.yaml"))
    assert "/var/lib/kubelet" in node.allowed_roots
    names = {node.csi.driver_name, controller.csi.driver_name}
    names |= {name for kind, name in m if kind == "CSIDriver"}
    names |= {d["provisioner"] for (kind, _), d in m.items() if kind == "StorageClass"}
    names |= {d["driver"] for (kind, _), d in m.items()
              if kind in ("VolumeSnapshotClass", "VolumeGroupSnapshotClass")}
    names |= {d["driverName"] for (kind, _), d in m.items() if kind == "VolumeAttributesClass"}
    ds = m[("DaemonSet", "rbd-reconciler-node")]
    socket_dir = volumes(ds)["socket-dir"]["hostPath"]["path"]
    names.add(Path(socket_dir).name)  # /var/lib/kubelet/plugins/<driver>
    assert len(names) == 1, names
    [driver] = names
    assert m[("CSIDriver", driver)]["spec"]["attachRequired"] is False
    sc = m[("StorageClass", "rbd-reconciler")]
    assert sc["parameters"]["pool"] and sc["allowVolumeExpansion"] is True
    vac = m[("VolumeAttributesClass", "rbd-reconciler-silver")]
    assert vac["parameters"] and all(k.startswith("qos") for k in vac["parameters"])
    from reconciler.csi import mutable  # the driver's own parser takes every one

    assert set(mutable.parse(vac["parameters"])) == {"readIops", "writeIops", "writeBps"}
    assert m[("PersistentVolumeClaim", "data-silver")]["spec"][
        "volumeAttributesClassName"] == "rbd-reconciler-silver"


def test_controller_keeps_its_state_in_ceph(tmp_path: Path) -> None:
    m = by_kind_name()
    controller_cfg = yaml.safe_load(config_data()["controller.yaml"])
    pool = controller_cfg["csi"]["statePool"]
    assert isinstance(pool, str) and pool
    assert "statePool" not in yaml.safe_load(config_data()["node.yaml"]).get("csi", {})
    controller = load_example_config(tmp_path, "controller.yaml")
    node = load_example_config(tmp_path, "node.yaml")
    assert controller.csi.state_pool == pool and node.csi.state_pool is None
    dep = m[("Deployment", "rbd-reconciler-controller")]
    plugin = containers(dep)["rbd-reconciler"]
    state, _ = on_volume(plugin, str(controller.csi_dir))
    assert "emptyDir" in volumes(dep)[state]  # any replica rebuilds it from Ceph
    ds = m[("DaemonSet", "rbd-reconciler-node")]
    state, _ = on_volume(containers(ds)["rbd-reconciler"], str(node.state_dir))
    assert volumes(ds)[state]["hostPath"]["path"] == str(node.state_dir)  # mounts outlive pods


# --- node plugin -----------------------------------------------------------------------------

def test_node_plugin_host_mounts() -> None:
    ds = by_kind_name()[("DaemonSet", "rbd-reconciler-node")]
    spec = ds["spec"]["template"]["spec"]
    assert spec["hostNetwork"] is True  # krbd's kernel client and udev's events: the host's
    plugin = containers(ds)["rbd-reconciler"]
    assert plugin["securityContext"]["privileged"] is True
    vols, mnt = volumes(ds), mounts(plugin)
    for path in ("/dev", "/sys", "/lib/modules", "/run/udev"):
        assert vols[mnt[path]["name"]]["hostPath"]["path"] == path, path
    assert mnt["/lib/modules"].get("readOnly") is True
    assert not mnt["/dev"].get("readOnly") and not mnt["/sys"].get("readOnly")
    assert {"/etc/ceph/ceph.conf", "/etc/ceph-keyring"} <= set(mnt)
    # kubelet's staging/publish mounts and rbd-fuse mounts must reach the host.
    assert mnt["/var/lib/kubelet"]["mountPropagation"] == "Bidirectional"
    assert vols[mnt["/var/lib/kubelet"]["name"]]["hostPath"]["path"] == "/var/lib/kubelet"
    assert mnt["/var/lib/rbd-reconciler"]["mountPropagation"] == "Bidirectional"


def test_bidirectional_only_in_privileged_containers() -> None:
    found = 0
    for where, spec in pod_specs():
        for c in spec["containers"] + spec.get("initContainers", []):
            for mnt in c.get("volumeMounts", []):
                if mnt.get("mountPropagation") == "Bidirectional":
                    found += 1
                    assert c.get("securityContext", {}).get("privileged") is True, \
                        f"{where} {c['name']} {mnt['mountPath']}"
    assert found == 2


def test_no_configmap_or_secret_is_a_desired_dir(tmp_path: Path) -> None:
    """Kubelet makes a ConfigMap volume's mount point 0777: the daemon would refuse it."""
    m = by_kind_name()
    for dep_name, key in ((("DaemonSet", "rbd-reconciler-node"), "node.yaml"),
                          (("Deployment", "rbd-reconciler-controller"), "controller.yaml")):
        d = m[dep_name]
        config = load_example_config(tmp_path, key)
        name, rel = on_volume(containers(d)["rbd-reconciler"], str(config.desired_dir))
        assert rel == "." and set(volumes(d)[name]) == {"name", "emptyDir"}, dep_name
        # ... made trusted by an initContainer before the daemon starts.
        assert any(name in {mnt["name"] for mnt in init.get("volumeMounts", [])}
                   for init in init_containers(d).values()), dep_name


def test_every_sidecar_uses_the_plugins_socket() -> None:
    m = by_kind_name()
    for key in (("DaemonSet", "rbd-reconciler-node"), ("Deployment",
                                                       "rbd-reconciler-controller")):
        d = m[key]
        cs = containers(d)
        plugin = cs.pop("rbd-reconciler")
        endpoint = arg(plugin, "--csi-endpoint")
        assert endpoint is not None and endpoint.startswith("unix://")
        socket = on_volume(plugin, endpoint.removeprefix("unix://"))
        assert cs, key
        for name, c in cs.items():
            address = arg(c, "--csi-address")
            assert address is not None, f"{key} {name}"
            assert on_volume(c, address) == socket, f"{key} {name}"
        if key[0] == "DaemonSet":  # kubelet dials the same file from the host
            host = volumes(d)[socket[0]]["hostPath"]["path"]
            assert arg(cs["node-driver-registrar"], "--kubelet-registration-path") == \
                f"{host}/{socket[1]}"
            assert "/registration" in mounts(cs["node-driver-registrar"])


@pytest.mark.parametrize("workload", [("DaemonSet", "rbd-reconciler-node"),
                                      ("Deployment", "rbd-reconciler-controller")])
def test_liveness_probe_sidecar_and_port(workload: tuple[str, str]) -> None:
    cs = containers(by_kind_name()[workload])
    plugin = cs["rbd-reconciler"]
    [probe] = [c for c in cs.values() if "/livenessprobe:" in c["image"]]
    port = int(arg(probe, "--health-port") or 9808)
    get = plugin["livenessProbe"]["httpGet"]
    assert get["path"] == "/healthz"
    named = {p["name"]: p["containerPort"] for p in plugin.get("ports", [])}
    assert named.get(get["port"], get["port"]) == port


# --- controller ------------------------------------------------------------------------------

def test_controller_replicas_leader_election_and_feature_gates() -> None:
    m = by_kind_name()
    dep = m[("Deployment", "rbd-reconciler-controller")]
    assert dep["spec"]["replicas"] == 2
    cs = containers(dep)
    sidecars = {"csi-provisioner", "csi-resizer", "csi-snapshotter"}
    assert {n for n, c in cs.items() if f"/{n}:" in c["image"]} == sidecars
    for name in sidecars:
        assert "--leader-election" in cs[name]["args"], name
    # The others call no API: the plugin, and livenessprobe (no such flag).
    assert set(cs) - sidecars == {"rbd-reconciler", "liveness-probe"}
    gates = {n: arg(cs[n], "--feature-gates") or "" for n in sidecars}
    assert "VolumeAttributesClass=true" in gates["csi-resizer"].split(",")
    assert "VolumeAttributesClass=true" in gates["csi-provisioner"].split(",")
    assert "CSIVolumeGroupSnapshot=true" in gates["csi-snapshotter"].split(",")


def test_controller_rbac() -> None:
    m = by_kind_name()
    dep = m[("Deployment", "rbd-reconciler-controller")]
    sa, ns = dep["spec"]["template"]["spec"]["serviceAccountName"], dep["metadata"]["namespace"]
    subject = {"kind": "ServiceAccount", "name": sa, "namespace": ns}

    def granted(kind: str, binding: str) -> set[tuple[str, str, str]]:
        b = m.get((binding, kind))
        assert b is not None and subject in b["subjects"], (binding, kind)
        return rbac_grants(m[(b["roleRef"]["kind"], b["roleRef"]["name"])]["rules"])

    cluster = granted("rbd-reconciler-controller", "ClusterRoleBinding")
    lease = granted("rbd-reconciler-leader-election", "RoleBinding")
    assert m[("Role", "rbd-reconciler-leader-election")]["metadata"]["namespace"] == ns
    assert {("coordination.k8s.io", "leases", v) for v in ("get", "create", "update")} <= lease
    gs = "groupsnapshot.storage.k8s.io"
    needed = {
        ("", "persistentvolumes", "create"), ("", "persistentvolumes", "delete"),
        ("", "persistentvolumes", "patch"), ("", "persistentvolumeclaims/status", "patch"),
        ("storage.k8s.io", "volumeattributesclasses", "watch"),
        ("snapshot.storage.k8s.io", "volumesnapshotcontents", "create"),
        ("snapshot.storage.k8s.io", "volumesnapshotcontents/status", "update"),
        (gs, "volumegroupsnapshotclasses", "watch"),
        (gs, "volumegroupsnapshotcontents", "patch"),
        (gs, "volumegroupsnapshotcontents/status", "update"),
    }
    assert needed <= cluster, needed - cluster


def test_claims_and_pods() -> None:
    m = by_kind_name()
    fs, block = (m[("PersistentVolumeClaim", n)] for n in ("data-fs", "data-block"))
    assert fs["spec"]["storageClassName"] == block["spec"]["storageClassName"] == \
        "rbd-reconciler"
    assert fs["spec"]["volumeMode"] == "Filesystem" and block["spec"]["volumeMode"] == "Block"
    fs_pod = m[("Pod", "uses-data-fs")]["spec"]
    assert fs_pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "data-fs"
    assert fs_pod["containers"][0]["volumeMounts"]
    block_pod = m[("Pod", "uses-data-block")]["spec"]
    assert block_pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "data-block"
    assert block_pod["containers"][0]["volumeDevices"]
    restored = m[("PersistentVolumeClaim", "data-fs-restored")]["spec"]["dataSource"]
    assert restored == {"apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot",
                        "name": "data-fs-before-upgrade"}
    copy = m[("PersistentVolumeClaim", "data-fs-copy")]["spec"]["dataSource"]
    assert copy["kind"] == "PersistentVolumeClaim" and copy["name"] == "data-fs"


# --- the desired directory's trust check -----------------------------------------------------

def configmap_volume(root: Path) -> Path:
    """What kubelet makes of a ConfigMap volume: a 0777 mount point (its emptyDir
    wrapper), a timestamped data directory, ``..data`` and each key symlinked."""
    root.mkdir()
    data = root / "..2026_01_01_00_00_00.000000001"
    data.mkdir(mode=0o755)
    (data / "v.yaml").write_text(GOOD)
    (data / "v.yaml").chmod(0o644)
    (root / "..data").symlink_to(data.name)
    (root / "v.yaml").symlink_to("..data/v.yaml")
    root.chmod(0o777)
    return root


def emptydir(path: Path) -> Path:
    path.mkdir()
    path.chmod(0o777)  # as kubelet makes it
    return path


@pytest.fixture
def as_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("the initContainers chown to root")


def test_a_configmap_volume_is_refused_as_desired_dir(tmp_path: Path) -> None:
    cm = configmap_volume(tmp_path / "cm")
    refused = load([cm], default_config())
    assert refused.refused and refused.volumes == ()
    assert any(f"directory {cm} is writable by group or others" in d.message
               for d in refused.diagnostics), [str(d) for d in refused.diagnostics]
    # The symlinks are not the reason: they stay inside the directory.
    cm.chmod(0o755)
    assert load([cm], default_config()).ok


def test_the_node_init_container_makes_a_trusted_copy(tmp_path: Path, as_root: None) -> None:
    ds = by_kind_name()[("DaemonSet", "rbd-reconciler-node")]
    cm = configmap_volume(tmp_path / "cm")
    (cm / "..data" / "notes.txt").write_text("not a spec")
    (cm / "notes.txt").symlink_to("..data/notes.txt")
    dst = emptydir(tmp_path / "desired")
    run_init(init_containers(ds)["copy-desired"], {"SRC": str(cm), "DST": str(dst)})
    assert sorted(p.name for p in dst.iterdir()) == ["v.yaml"]
    copied = dst / "v.yaml"
    assert not copied.is_symlink() and copied.read_text() == GOOD
    assert (copied.stat().st_mode & 0o7777, dst.stat().st_mode & 0o7777) == (0o644, 0o755)
    result = load([dst], default_config())
    assert result.ok and [v.name for v in result.volumes] == ["vol"]


def test_the_controller_init_container_makes_trusted_dirs(tmp_path: Path,
                                                          as_root: None) -> None:
    dep = by_kind_name()[("Deployment", "rbd-reconciler-controller")]
    state, desired = emptydir(tmp_path / "state"), emptydir(tmp_path / "desired")
    csi_dir = state / "csi.d"
    csi_dir.mkdir(mode=0o700)  # what the daemon makes (reconciler/csi/files.py)
    assert directory_problems(csi_dir) and directory_problems(desired)
    run_init(init_containers(dep)["prepare-dirs"], {"STATE": str(state),
                                                    "DESIRED": str(desired)})
    assert directory_problems(csi_dir) == [] and directory_problems(desired) == []
    assert load([desired], default_config()).ok
