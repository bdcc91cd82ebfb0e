#!/usr/bin/env bash
# Run the whole test suite on a fresh Debian 12 machine (as root): installs
# what it needs, then pytest. The tests start their own disposable Ceph
# cluster (1 mon + 1 memstore OSD on 127.0.0.1) and clean up after themselves.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
