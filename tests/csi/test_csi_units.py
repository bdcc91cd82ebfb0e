"""The adapter's pure parts: ids, sizes, parameters, capabilities, config, and
the operator-wins merge of the two directories. No cluster needed."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from reconciler.csi import capability, ids
from reconciler.csi import csi_pb2 as pb
from reconciler.csi.controller import MAX_REPLY_SIZE, _parameters, _size, max_size
from reconciler.csi.errors import CsiError
from reconciler.spec.config import ConfigError, load_config
from reconciler.spec.desired import forgettable, load_desired

MiB = 1 << 20
Mode = pb.VolumeCapability.AccessMode


def test_ids_round_trip_and_limits() -> None:
    image = ids.image_for_request("pvc-" + "Xy" * 62)
    assert image == ids.image_for_request("pvc-" + "Xy" * 62)  # stable
    assert image != ids.image_for_request("pvc-" + "xY" * 62)  # case matters
    vid = ids.volume_id("rbd", image)
    assert len(vid.encode()) <= 128 and ids.parse_volume_id(vid) == ("rbd", image)
    assert ids.volume_name("rbd", image) == image
    other = ids.volume_name("rbd", "Static_Image.1")
    assert other.startswith("csi-x") and len(other) <= 63
    for bad in ("", "fake-vol-id", "rbdr1:rbd", "rbdr1:rb d:img", "rbdr2:rbd:img",
                "rbdr1:rbd:img:extra"):
        assert ids.parse_volume_id(bad) is None
    with pytest.raises(ValueError):
        ids.volume_id("p" * 100, image)


@pytest.mark.parametrize(("required", "limit", "size"), [
    (0, 0, 1 << 30), (1, 0, MiB), (64 * MiB, 64 * MiB, 64 * MiB), (5 * MiB + 1, 0, 6 * MiB),
    (0, 10 * MiB + 5, 10 * MiB)])
def test_sizes_round_up_to_mib(required: int, limit: int, size: int) -> None:
    assert _size(pb.CapacityRange(required_bytes=required, limit_bytes=limit)) == size


@pytest.mark.parametrize(("required", "limit", "code"), [
    (0, 1000, grpc.StatusCode.OUT_OF_RANGE), (MiB + 1, MiB + 2, grpc.StatusCode.OUT_OF_RANGE),
    (-1, 0, grpc.StatusCode.INVALID_ARGUMENT), (2 * MiB, MiB, grpc.StatusCode.INVALID_ARGUMENT)])
def test_impossible_sizes(required: int, limit: int, code: grpc.StatusCode) -> None:
    with pytest.raises(CsiError) as exc:
        _size(pb.CapacityRange(required_bytes=required, limit_bytes=limit))
    assert exc.value.code == code


def test_sizes_fit_rbd_the_mapper_and_the_reply() -> None:
    """Checked before rounding: 2^63-1 would round up to 2^63, past an int64."""
    om = 256_000_000 * 4 * MiB
    assert max_size(None) == max_size(["layering", "exclusive-lock", "object-map"]) == om
    assert max_size(["layering"]) == MAX_REPLY_SIZE == (1 << 63) - MiB
    rng = pb.CapacityRange
    assert _size(rng(required_bytes=MAX_REPLY_SIZE), MAX_REPLY_SIZE) == MAX_REPLY_SIZE
    assert _size(rng(required_bytes=om), om) == om
    for required, most in (((1 << 63) - 1, MAX_REPLY_SIZE), (MAX_REPLY_SIZE + 1, MAX_REPLY_SIZE),
                           (om + 1, om), ((1 << 63) - 1, om)):
        with pytest.raises(CsiError) as exc:
            _size(rng(required_bytes=required), most)
        assert exc.value.code == grpc.StatusCode.OUT_OF_RANGE, required
    with pytest.raises(CsiError) as exc:  # the default bound is the reply's
        _size(rng(required_bytes=(1 << 63) - 1))
    assert exc.value.code == grpc.StatusCode.OUT_OF_RANGE


def test_parameters() -> None:
    assert _parameters({"pool": "rbd", "csi.storage.k8s.io/pvc/name": "x"}) == {"pool": "rbd"}
    for bad in ({}, {"pool": "rbd", "colour": "red"}, {"pool": "rbd", "fsType": "btrfs"}):
        with pytest.raises(CsiError) as exc:
            _parameters(bad)
        assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_capabilities() -> None:
    mount = pb.VolumeCapability(
        mount=pb.VolumeCapability.MountVolume(fs_type="xfs", mount_flags=["noatime,nodev"]),
        access_mode=Mode(mode=Mode.MULTI_NODE_READER_ONLY))
    acc = capability.parse(mount)
    assert acc == capability.Access(False, "xfs", ("noatime", "nodev"), True)
    block = pb.VolumeCapability(block=pb.VolumeCapability.BlockVolume(),
                                access_mode=Mode(mode=Mode.SINGLE_NODE_WRITER))
    assert capability.parse(block).block
    for bad in (pb.VolumeCapability(access_mode=Mode(mode=Mode.SINGLE_NODE_WRITER)),
                pb.VolumeCapability(block=pb.VolumeCapability.BlockVolume()),
                pb.VolumeCapability(block=pb.VolumeCapability.BlockVolume(),
                                    access_mode=Mode(mode=Mode.MULTI_NODE_SINGLE_WRITER))):
        with pytest.raises(CsiError):
            capability.parse(bad)


def test_config_csi_keys(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"desiredDir: {tmp_path}/d\nstateDir: {tmp_path}/s\n")
    c = load_config(cfg)
    assert c.csi.endpoint is None and c.csi_dir == tmp_path / "s" / "csi.d"
    assert c.csi.driver_name == "rbd.reconciler.local" and c.csi.timeout_seconds == 120
    cfg.write_text(f"desiredDir: {tmp_path}/d\ncsi:\n  dir: {tmp_path}/d/csi\n")
    with pytest.raises(ConfigError, match="must not be desiredDir"):
        load_config(cfg)
    for bad in ("csi:\n  endpoint: tcp://1.2.3.4:5\n", "csi:\n  driverName: -bad-\n",
                "csi:\n  timeoutSeconds: 0\n", "csi:\n  colour: red\n"):
        cfg.write_text(bad)
        with pytest.raises(ConfigError):
            load_config(cfg)


def _volume(path: Path, name: str, image: str, extra: str = "") -> None:
    path.write_text(f"apiVersion: rbd-reconciler/v1\nkind: Volume\nmetadata:\n  name: {name}\n"
                    f"spec:\n  image: {{pool: rbd, name: {image}, size: 16Mi}}\n{extra}")


def test_operator_files_win(tmp_path: Path) -> None:
    desired, state = tmp_path / "d", tmp_path / "s"
    desired.mkdir()
    (state / "csi.d").mkdir(parents=True)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"desiredDir: {desired}\nstateDir: {state}\n")
    config = load_config(cfg)
    _volume(desired / "a.yaml", "shared-name", "img-a")
    _volume(desired / "b.yaml", "op-b", "img-shared")
    _volume(state / "csi.d" / "x.yaml", "shared-name", "img-x")  # name clash
    _volume(state / "csi.d" / "y.yaml", "csi-y", "img-shared")  # image clash
    _volume(state / "csi.d" / "z.yaml", "csi-z", "img-z")  # fine
    res = load_desired(config)
    by_name = {v.name: v for v in res.volumes}
    assert set(by_name) == {"shared-name", "op-b", "csi-z"}
    assert by_name["shared-name"].image.name == "img-a"  # the operator's
    assert res.frozen_names == {"csi-y"}  # its image is the operator's: hands off
    bad = {str(d.file) for d in res.diagnostics}
    assert bad == {str(state / "csi.d" / "x.yaml"), str(state / "csi.d" / "y.yaml")}

    record = {"file": str(state / "csi.d" / "z.yaml"), "volume": {"state": "absent"}}
    assert forgettable(record, config)
    record["volume"] = {"state": "present", "map": {"mapper": "fuse"}}
    assert not forgettable(record, config)
    assert not forgettable({"file": str(desired / "a.yaml"), "volume": {"state": "absent"}},
                           config)


def test_a_broken_volume_file_is_reported_not_overwritten(tmp_path: Path) -> None:
    from reconciler.csi.files import VolumeFiles, new_document

    files = VolumeFiles(tmp_path)
    assert files.read("csi-a") is None
    files.commit("csi-a", files.write_temp("csi-a", new_document("csi-a", {}, {"pool": "rbd"})))
    assert files.read("csi-a")["spec"]["image"] == {"pool": "rbd"}  # type: ignore[index]
    assert files.names() == ["csi-a"]
    for broken in ("spec: [unclosed\n", "just a string\n"):
        files.path("csi-a").write_text(broken)
        with pytest.raises(CsiError) as exc:
            files.read("csi-a")
        assert exc.value.code == grpc.StatusCode.FAILED_PRECONDITION
    files.remove("csi-a")
    assert files.names() == []


POD = "1b4c7d2e-58a4-4f0b-9a55-3f2c1e0d9abc"


@pytest.mark.parametrize("driver", ["systemd", "cgroupfs"])
def test_the_pod_cgroup_of_a_kubelet_path(tmp_path: Path, driver: str) -> None:
    from reconciler.csi import podcgroup

    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpu io memory\n")
    if driver == "systemd":
        pod = (root / "kubepods.slice" / "kubepods-burstable.slice"
               / f"kubepods-burstable-pod{POD.replace('-', '_')}.slice")
    else:
        pod = root / "kubepods" / "burstable" / f"pod{POD}"
    (pod / "cri-containerd-abc.scope").mkdir(parents=True)
    (root / "system.slice" / f"pod{POD}").mkdir(parents=True)  # not under kubepods: not it
    fs = f"/var/lib/kubelet/pods/{POD}/volumes/kubernetes.io~csi/pvc-1/mount"
    block = f"/var/lib/kubelet/plugins/kubernetes.io/csi/volumeDevices/publish/pvc-1/{POD}"
    for target in (fs, block):
        assert podcgroup.find(target, (str(root),)) == str(pod)
    other = fs.replace(POD[:8], "00000000")
    assert podcgroup.find(other, (str(root),)) is None  # that pod has no cgroup here
    assert podcgroup.find("/srv/app", (str(root),)) is None  # not kubelet's
    assert podcgroup.find(fs, (str(tmp_path / "none"),)) is None  # no cgroup v2


def test_request_values_are_quoted_briefly_and_messages_bounded() -> None:
    from reconciler.csi.errors import MAX_MESSAGE_BYTES, QUOTE_CHARS, bounded, quoted

    vid = ids.volume_id("rbd", ids.image_for_request("pvc-x"))
    assert quoted(vid) == repr(vid)  # every id we hand out, whole
    long = quoted("x" * 20_000)
    assert long == repr("x" * QUOTE_CHARS) + "…"
    assert quoted("a\nb\u202e") == repr("a\nb\u202e")  # escaped, never raw
    assert bounded("short") == "short"
    cut = bounded("é" * 10_000)  # 20,000 bytes; percent-encoded by gRPC: 60,000
    assert len(cut.encode()) <= MAX_MESSAGE_BYTES and cut.endswith("(message cut)")
