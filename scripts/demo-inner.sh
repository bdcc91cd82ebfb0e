#!/usr/bin/env bash
# Runs inside `python -m reconciler.devcluster run` (Ceph env vars are set).
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=examples/config/local-cluster.yaml
DESIRED=/run/rbd-reconciler-demo/volumes.d
R=(.venv/bin/rbd-reconciler --config "$CONFIG")
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

mkdir -p "$DESIRED"
chmod 0755 "$DESIRED"
cp examples/*.yaml "$DESIRED"/

cleanup() {
  say "release: unpublish, unstage, unmap (images are kept)"
  "${R[@]}" release || true
  rmdir /srv/rbd-demo 2>/dev/null || true
}
trap cleanup EXIT

say "the local cluster answers"
timeout 20 ceph health
timeout 20 rbd ls -l "$RBD_RECONCILER_POOL" || true

say "validate $DESIRED"
"${R[@]}" validate

say "plan (exit 2: changes pending)"
rc=0; "${R[@]}" plan || rc=$?
[[ $rc -eq 2 ]] || { echo "demo: plan exited $rc, expected 2" >&2; exit 1; }

say "apply"
"${R[@]}" apply

say "plan again (exit 0: nothing to do)"
"${R[@]}" plan

say "status"
"${R[@]}" status

say "the volumes are real filesystems"
echo "hello from rbd" > /srv/rbd-demo/pgdata/hello.txt
cat /srv/rbd-demo/pgdata-backup-view/hello.txt
if touch /srv/rbd-demo/pgdata-backup-view/nope 2>/dev/null; then
  echo "demo: read-only publish was writable" >&2; exit 1
fi
echo "read-only view refuses writes, as it should"
df -h /srv/rbd-demo/pgdata /srv/rbd-demo/metrics | sed 's/^/  /'
