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

DAEMON_PID=""
cleanup() {
  if [[ -n $DAEMON_PID ]] && kill -0 "$DAEMON_PID" 2>/dev/null; then
    kill -TERM "$DAEMON_PID"; wait "$DAEMON_PID" || true
  fi
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

# --- the daemon: files in, mounts out ---------------------------------------
STATUS=/run/rbd-reconciler-demo/state/status
phase() { sed -n 's/.*"phase": "\([A-Za-z]*\)".*/\1/p' "$STATUS/$1.json" 2>/dev/null; }
wait_phase() {  # NAME PHASE: poll the daemon's status file, 60 s deadline
  local deadline=$((SECONDS + 60))
  until [[ "$(phase "$1")" == "$2" ]]; do
    ((SECONDS < deadline)) || { echo "demo: $1 never became $2" >&2; exit 1; }
    sleep 0.1
  done
  echo "  $1: $2"
}

say "run the daemon (logs below, journal style)"
"${R[@]}" run --log-format plain &
DAEMON_PID=$!
wait_phase pgdata Published

say "edit: grow metrics (xfs) from 512Mi to 768Mi"
sed -i 's/size: 512Mi/size: 768Mi/' "$DESIRED/metrics-xfs.yaml"
until grep -q '"lastResult": "changed"' "$STATUS/metrics.json" 2>/dev/null; do sleep 0.1; done
df -h /srv/rbd-demo/metrics | sed 's/^/  /'

say "add a file: a new volume appears"
sed -e 's/name: scratch/name: scratch2/' -e 's#scratch.dev#scratch2.dev#' \
    "$DESIRED/scratch-block.yaml" > "$DESIRED/.scratch2.tmp"
mv "$DESIRED/.scratch2.tmp" "$DESIRED/scratch2.yaml"
wait_phase scratch2 Published

say "remove a file: its volume is released (the image is kept)"
rm "$DESIRED/scratch2.yaml"
wait_phase scratch2 Released

say "break a file: its volume is frozen, its mounts untouched"
cp "$DESIRED/pgdata.yaml" /run/rbd-reconciler-demo/pgdata.good
sed -i 's/size: 256Mi/size: 256 megabytes/' "$DESIRED/pgdata.yaml"
wait_phase pgdata Frozen
cat /srv/rbd-demo/pgdata/hello.txt
cp /run/rbd-reconciler-demo/pgdata.good "$DESIRED/pgdata.yaml"
wait_phase pgdata Published

say "status, as the daemon sees it"
"${R[@]}" status
"${R[@]}" explain pgdata

say "stop the daemon (SIGTERM): mounts stay"
kill -TERM "$DAEMON_PID"; wait "$DAEMON_PID"; DAEMON_PID=""
findmnt -n -o TARGET /srv/rbd-demo/pgdata
