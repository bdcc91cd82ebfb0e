"""reconciler/csi/csi_pb2*.py are what scripts/gen-csi-proto.sh makes from
csi.proto with Debian 12's generators (protoc 3.21.12, the gRPC plugin
1.51.1): code that imports on Debian's python3-protobuf/python3-grpcio and on
pip's newer ones. A newer generator would write a runtime version check
that refuses Debian 12's."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
CSI = REPO / "reconciler" / "csi"
GENERATED = ("csi_pb2.py", "csi_pb2_grpc.py")


def test_the_checked_in_code_is_what_the_generator_makes(tmp_path: Path) -> None:
    subprocess.run([REPO / "scripts" / "gen-csi-proto.sh", tmp_path], check=True, timeout=60)
    for name in GENERATED:
        assert (tmp_path / name).read_bytes() == (CSI / name).read_bytes(), (
            f"{name} is stale or was made by another generator: run scripts/gen-csi-proto.sh")


def test_no_runtime_version_check() -> None:
    for name in GENERATED:
        text = (CSI / name).read_text()
        for marker in ("runtime_version", "GRPC_GENERATED_VERSION", "_registered_method"):
            assert marker not in text, f"{name}: {marker}: generated for a newer runtime only"
