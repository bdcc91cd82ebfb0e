#!/usr/bin/env bash
# Regenerate reconciler/csi/csi_pb2.py and csi_pb2_grpc.py from
# reconciler/csi/proto/csi.proto with the pinned grpcio-tools (pyproject.toml:
# its bundled protoc matches the pinned protobuf runtime).
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
"$py" -m grpc_tools.protoc -I reconciler/csi/proto \
  --python_out=reconciler/csi --grpc_python_out=reconciler/csi \
  reconciler/csi/proto/csi.proto
# grpc_tools writes "import csi_pb2"; the modules live in a package.
sed -i 's/^import csi_pb2 as csi__pb2/from . import csi_pb2 as csi__pb2/' \
  reconciler/csi/csi_pb2_grpc.py
