#!/usr/bin/env bash
# The demo on a fresh Debian 12 machine (as root): installs what it needs,
# starts a disposable local Ceph (1 mon + 1 memstore OSD on 127.0.0.1), and
# converges the examples: validate -> plan -> apply -> plan (nothing left) ->
# status -> release; then the daemon at work, the GitOps source, and a fleet
# of three daemons with a halted rollout (README). Everything is undone at
# the end, even on Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
DEMO=/run/rbd-reconciler-demo   # must match examples/config/local-cluster.yaml
if [[ -e $DEMO ]] && [[ -n "$(ls -A "$DEMO")" ]]; then
  echo "demo: $DEMO is not empty (an earlier demo still running, or interrupted?)" >&2
  echo "demo: see scripts/demo-inner.sh for what it holds; remove it when nothing is mounted there" >&2
  exit 1
fi
exec .venv/bin/python -m reconciler.testing.devcluster run --dir "$DEMO" -- scripts/demo-inner.sh
