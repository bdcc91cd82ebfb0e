#!/usr/bin/env bash
# Regenerate reconciler/csi/csi_pb2.py and csi_pb2_grpc.py from
# reconciler/csi/proto/csi.proto with Debian 12's generators: protoc 3.21.12
# (protobuf-compiler; the well-known .proto files come from libprotobuf-dev)
# and the gRPC Python plugin 1.51.1 (protobuf-compiler-grpc), which
# scripts/setup.sh installs.
#
# Why these: the checked-in code must import on Debian 12's runtime
# (python3-protobuf 3.21, python3-grpcio 1.51: the Debian package's
# dependencies) and on pip's (protobuf 7.x, grpcio 1.85: the wheel's). Code
# from protoc 3.21 and the 1.51 plugin does, without a warning
# (tests/unit/csi/test_csi_wire.py passes under both); code from
# grpcio-tools 1.85 checks at import that the runtime is at least protobuf
# 7.35 / grpcio 1.85 and refuses Debian's. Protobuf's own policy promises
# old generated code nothing across a major version: pyproject.toml's
# ranges stop at the major versions measured.
#
#   scripts/gen-csi-proto.sh [OUTDIR]    (default: reconciler/csi)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-reconciler/csi}
want_protoc="libprotoc 3.21.12"
have=$(protoc --version)
if [[ $have != "$want_protoc" ]]; then
  echo "gen-csi-proto: protoc says '$have', want '$want_protoc' (Debian 12's protobuf-compiler)" >&2
  exit 1
fi
protoc -I reconciler/csi/proto -I /usr/include \
  --python_out="$out" --grpc_out="$out" --plugin=protoc-gen-grpc=/usr/bin/grpc_python_plugin \
  reconciler/csi/proto/csi.proto
# The plugin writes "import csi_pb2"; the modules live in a package.
sed -i 's/^import csi_pb2 as csi__pb2$/from . import csi_pb2 as csi__pb2/' "$out/csi_pb2_grpc.py"
