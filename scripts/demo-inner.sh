#!/usr/bin/env bash
# Runs inside `python -m reconciler.testing.devcluster run` (Ceph env vars are set).
# Every wait has a deadline, waits on a state that holds (a phase, a size, a
# mount; never a transient value) and says what it waited for when it gives
# up. On success, failure or interrupt, what the demo started is undone.
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=examples/config/local-cluster.yaml
DEMO=/run/rbd-reconciler-demo          # must match $CONFIG
DESIRED=$DEMO/volumes.d
STATUS=$DEMO/state/status
SRV=/srv/rbd-demo
R=(.venv/bin/rbd-reconciler --config "$CONFIG")
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
die() { echo "demo: $*" >&2; exit 1; }

mkdir -p "$DESIRED"
chmod 0755 "$DESIRED"
cp examples/*.yaml "$DESIRED"/

# --- clean-up: runs on every exit ------------------------------------------
DAEMON_PID=""
stop_daemon() {  # SIGTERM, then SIGKILL after 40 s (the daemon's own stop deadline is 30 s)
  [[ -n $DAEMON_PID ]] || return 0
  if kill -0 "$DAEMON_PID" 2>/dev/null; then
    kill -TERM "$DAEMON_PID" 2>/dev/null || true
    local deadline=$((SECONDS + 40))
    while kill -0 "$DAEMON_PID" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.2; done
    if kill -0 "$DAEMON_PID" 2>/dev/null; then
      echo "demo: the daemon did not stop within 40 s of SIGTERM; killing it" >&2
      kill -KILL "$DAEMON_PID" 2>/dev/null || true
    fi
  fi
  wait "$DAEMON_PID" 2>/dev/null || true
  DAEMON_PID=""
}
FLEET_PIDS=()
stop_fleet() {  # every fleet daemon at once: SIGTERM, then SIGKILL after 40 s
  ((${#FLEET_PIDS[@]})) || return 0
  kill -TERM "${FLEET_PIDS[@]}" 2>/dev/null || true
  local deadline=$((SECONDS + 40)) p alive
  while :; do
    alive=0
    for p in "${FLEET_PIDS[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    ((alive && SECONDS < deadline)) || break
    sleep 0.2
  done
  for p in "${FLEET_PIDS[@]}"; do
    if kill -0 "$p" 2>/dev/null; then
      echo "demo: fleet daemon $p did not stop within 40 s of SIGTERM; killing it" >&2
      kill -KILL "$p" 2>/dev/null || true
    fi
    wait "$p" 2>/dev/null || true
  done
  FLEET_PIDS=()
}
mounts_under() {  # mount points under $1, deepest first (the paths here need no unescaping)
  awk -v p="$1/" 'index($5, p) == 1 {print $5}' /proc/self/mountinfo | sort -r
}
force_clean() {  # only what is provably the demo's: mounts under $SRV and $DEMO, loops on $DEMO
  local m lo
  for m in $(mounts_under "$SRV") $(mounts_under "$DEMO/state/staging"); do
    timeout -k 5 30 umount -l "$m" || true
  done
  for lo in $(losetup -n -l -O NAME,BACK-FILE | awk -v p="$DEMO/" 'index($2, p) == 1 {print $1}'); do
    timeout -k 5 30 losetup -d "$lo" || true
  done
  for m in $(mounts_under "$DEMO"); do timeout -k 5 30 umount -l "$m" || true; done
}
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  stop_daemon
  stop_fleet
  if ((rc != 0)); then
    echo "demo: failed (exit $rc); releasing what it set up" >&2
    local c
    for c in "$DEMO"/fleet/*/daemon.log; do  # the fleet's daemons log to files
      [[ -e $c ]] && { echo "demo: the last lines of $c:" >&2; tail -n 15 "$c" >&2; }
    done
    timeout -k 5 120 "${R[@]}" release >/dev/null 2>&1 || true
    for c in "$DEMO"/git/config.yaml "$DEMO"/fleet/*/config.yaml; do
      [[ -e $c ]] && { timeout -k 5 120 .venv/bin/rbd-reconciler --config "$c" release >/dev/null 2>&1 || true; }
    done
    force_clean
  fi
  rm -rf "$SRV" 2>/dev/null || true
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# --- waits -------------------------------------------------------------------
# wait_until SECONDS WHAT CMD...: poll CMD every 0.1 s until it succeeds.
wait_until() {
  local limit=$1 what=$2; shift 2
  local deadline=$((SECONDS + limit))
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < deadline)) || die "gave up after ${limit} s waiting for $what"
    if [[ -n $DAEMON_PID ]] && ! kill -0 "$DAEMON_PID" 2>/dev/null; then
      die "the daemon exited while waiting for $what"
    fi
    for p in "${FLEET_PIDS[@]}"; do
      kill -0 "$p" 2>/dev/null || die "a fleet daemon (pid $p) exited while waiting for $what"
    done
    sleep 0.1
  done
}
status_has() { grep -q "$2" "$STATUS/$1.json"; }
phase_is() { status_has "$1" "\"phase\": \"$2\""; }
wait_phase() { wait_until 60 "$1 to be $2 (daemon status $STATUS/$1.json)" phase_is "$1" "$2"; echo "  $1: $2"; }
mounted() { findmnt -n "$1"; }

say "the local cluster answers"
timeout 20 ceph health
timeout 20 rbd ls -l "$RBD_RECONCILER_POOL"

say "validate $DESIRED"
"${R[@]}" validate

say "plan (exit 2: changes pending)"
rc=0; "${R[@]}" plan || rc=$?
[[ $rc -eq 2 ]] || die "plan exited $rc, expected 2"

say "apply"
"${R[@]}" apply

say "plan again (exit 0: nothing to do)"
"${R[@]}" plan

say "status"
"${R[@]}" status

say "the volumes are real filesystems"
echo "hello from rbd" > $SRV/pgdata/hello.txt
cat $SRV/pgdata-backup-view/hello.txt
if touch $SRV/pgdata-backup-view/nope 2>/dev/null; then
  die "read-only publish was writable"
fi
echo "read-only view refuses writes, as it should"
df -h $SRV/pgdata $SRV/metrics | sed 's/^/  /'

# --- the daemon: files in, mounts out ---------------------------------------
say "run the daemon (logs below, journal style)"
"${R[@]}" run --log-format plain &
DAEMON_PID=$!
wait_phase pgdata Published

say "edit: grow metrics (xfs) from 512Mi to 768Mi"
sed -i 's/size: 512Mi/size: 768Mi/' "$DESIRED/metrics-xfs.yaml"
wait_until 60 "metrics to report 768Mi (805306368 bytes) in its status" \
  status_has metrics '"size": 805306368'
fs_grown() { (( $(df --output=size -B1M $SRV/metrics | tail -1) > 700 )); }
wait_until 30 "the xfs on $SRV/metrics to grow past 700 MiB" fs_grown
df -h $SRV/metrics | sed 's/^/  /'

say "drift: unmount the read-only view by hand; the daemon puts it back"
umount $SRV/pgdata-backup-view
wait_until 60 "$SRV/pgdata-backup-view to be mounted again" mounted $SRV/pgdata-backup-view
cat $SRV/pgdata-backup-view/hello.txt

say "add a file: a new volume appears"
sed -e 's/name: scratch/name: scratch2/' -e 's#scratch.dev#scratch2.dev#' \
    "$DESIRED/scratch-block.yaml" > "$DESIRED/.scratch2.tmp"
mv "$DESIRED/.scratch2.tmp" "$DESIRED/scratch2.yaml"
wait_phase scratch2 Published

say "remove a file: its volume is released (the image is kept)"
rm "$DESIRED/scratch2.yaml"
wait_phase scratch2 Released

say "break a file: its volume is frozen, its mounts untouched"
cp "$DESIRED/pgdata.yaml" $DEMO/pgdata.good
sed -i 's/size: 256Mi/size: 256 megabytes/' "$DESIRED/pgdata.yaml"
wait_phase pgdata Frozen
cat $SRV/pgdata/hello.txt
cp $DEMO/pgdata.good "$DESIRED/.pgdata.tmp"
mv "$DESIRED/.pgdata.tmp" "$DESIRED/pgdata.yaml"
wait_phase pgdata Published

say "snapshot and clone: golden, written, then snapshotted and cloned"
# The first document of the example alone (the golden volume), then the whole file.
sed -n '1,/^---$/p' examples/snapshots/golden.yaml | sed '$d' > "$DESIRED/.golden.tmp"
mv "$DESIRED/.golden.tmp" "$DESIRED/golden.yaml"
wait_phase golden Published
echo "written before the snapshot" > $SRV/golden/v1.txt
sync -f $SRV/golden/v1.txt
cp examples/snapshots/golden.yaml "$DESIRED/.golden.tmp"
mv "$DESIRED/.golden.tmp" "$DESIRED/golden.yaml"
wait_phase test-env Published
wait_phase golden-copy Created
echo "  the clone holds: $(cat $SRV/test-env/v1.txt)"
df -h $SRV/test-env | sed 's/^/  /'

say "status, as the daemon sees it"
"${R[@]}" status
"${R[@]}" explain pgdata

say "stop the daemon (SIGTERM): mounts stay"
stop_daemon
mounted $SRV/pgdata >/dev/null || die "$SRV/pgdata is no longer mounted after the daemon stopped"
findmnt -n -o TARGET $SRV/pgdata

say "release: unpublish, unstage, unmap (images are kept)"
"${R[@]}" release
left=$(mounts_under "$SRV"; mounts_under "$DEMO")
[[ -z $left ]] || die "still mounted after release: $left"
echo "nothing of the demo is mounted or mapped any more"

# --- the GitOps source: a signed commit applied, an unsigned one refused ------
GIT=$DEMO/git
GCONFIG=$GIT/config.yaml
G=(.venv/bin/rbd-reconciler --config "$GCONFIG")
STATUS=$DEMO/state-git/status
say "a git repository signed with an ssh key; the node follows it"
mkdir -p "$GIT" && chmod 0700 "$GIT"
ssh-keygen -q -t ed25519 -N '' -C demo-signer -f "$GIT/signer"
echo "demo@example.invalid namespaces=\"git\" $(cat "$GIT/signer.pub")" > "$GIT/allowed_signers"
git init -q --bare "$GIT/fleet.git"
cat > "$GCONFIG" <<CONF
stateDir: $DEMO/state-git
controlSocket: $DEMO/state-git/control.sock
nodeName: demo-node
ceph: {conf: $DEMO/ceph.conf, user: admin, keyring: $DEMO/ceph.client.admin.keyring}
allowedRoots: [$SRV]
source:
  url: file://$GIT/fleet.git
  ref: {branch: main}
  path: nodes/{nodeName}
  intervalSeconds: 2
  verify: {mode: head, format: ssh, allowedSignersFile: $GIT/allowed_signers}
CONF
export GIT_CONFIG_NOSYSTEM=1 GIT_CONFIG_GLOBAL=/dev/null
GW=(git -C "$GIT/work" -c user.name=Demo -c user.email=demo@example.invalid
    -c gpg.format=ssh -c user.signingkey="$GIT/signer")
git init -q -b main "$GIT/work"
mkdir -p "$GIT/work/nodes/demo-node"
sed -e 's/name: pgdata/name: gitops/' -e 's#/srv/rbd-demo/pgdata-backup-view#/srv/rbd-demo/gitops-view#' \
    -e 's#/srv/rbd-demo/pgdata#/srv/rbd-demo/gitops#' examples/pgdata.yaml > "$GIT/work/nodes/demo-node/gitops.yaml"
"${GW[@]}" add -A && "${GW[@]}" commit -q -S -m "gitops: a volume from git"
"${GW[@]}" push -q "$GIT/fleet.git" main
"${GW[@]}" -c gpg.ssh.allowedSignersFile="$GIT/allowed_signers" log --show-signature -1 \
    --format='%h %s' 2>&1 | sed 's/^/  /'
"${G[@]}" run --log-format plain &
DAEMON_PID=$!
wait_phase gitops Published
"${G[@]}" source status | sed 's/^/  /'
echo "  gitops converged from $(grep -o '"sourceRevision": "[^"]*"' "$STATUS/gitops.json")"

say "an unsigned commit (grow gitops to 384Mi) is refused; the signed revision stays applied"
sed -i 's/size: 256Mi/size: 384Mi/' "$GIT/work/nodes/demo-node/gitops.yaml"
"${GW[@]}" commit -q -a -m "grow gitops (not signed)"
"${GW[@]}" push -q "$GIT/fleet.git" main
rc=0; "${G[@]}" source sync || rc=$?
[[ $rc -eq 1 ]] || die "source sync of an unsigned commit exited $rc, expected 1 (refused)"
"${G[@]}" source status | sed 's/^/  /' || true
status_has gitops '"size": 268435456' || die "gitops changed size although its commit was refused"
echo "  gitops is still 256Mi: nothing of the unsigned commit was applied"

say "stop the daemon; release what the source applied"
stop_daemon
"${G[@]}" release
left=$(mounts_under "$SRV"; mounts_under "$DEMO")
[[ -z $left ]] || die "still mounted after release: $left"
echo "nothing of the demo is mounted or mapped any more"

# --- a fleet: three nodes, one halted commit -----------------------------------
# Three daemons follow the same repository (each its own stateDir, control
# socket and nodeName) and report to each other through RADOS (source.fleet).
# fleet.yaml, signed like the rest: demo-a is the canary; the rest apply a
# commit once it has reported it applied and Healthy for 2 s.
FLEET=$DEMO/fleet
FLEET_NODES=(demo-a demo-b demo-c)
fleet_cli() { local n=$1; shift; .venv/bin/rbd-reconciler --config "$FLEET/$n/config.yaml" "$@"; }
fleet_phase_is() { grep -q "\"phase\": \"$2\"" "$FLEET/$1/state/status/fleet-$1.json"; }
wait_fleet_phase() {
  wait_until 60 "volume fleet-$1 on $1 to be $2 ($FLEET/$1/state/status/fleet-$1.json)" \
    fleet_phase_is "$1" "$2"
  echo "  $1: fleet-$1 $2"
}
# rollout_is NODE STATE COMMIT: its source status says STATE, COMMIT applied
# (source status exits 1 while a revision is held back: its JSON is what counts).
rollout_is() {
  { fleet_cli "$1" source status -o json || true; } | .venv/bin/python -c '
import json, sys
d = json.load(sys.stdin)
sys.exit(not (d["rollout"]["state"] == sys.argv[1] and (d["applied"] or {}).get("commit") == sys.argv[2]))
' "$2" "$3"
}
volume() {  # an image-only volume (quick to converge): NAME SIZE
  printf 'apiVersion: rbd-reconciler/v1\nkind: Volume\nmetadata: {name: %s}\nspec:\n  image: {pool: %s, size: %s}\n' \
    "$1" "$RBD_RECONCILER_POOL" "$2"
}

say "a fleet: three nodes, one halted commit (waves: canary demo-a, then the rest)"
for n in "${FLEET_NODES[@]}"; do
  mkdir -p "$FLEET/$n"
  cat > "$FLEET/$n/config.yaml" <<CONF
stateDir: $FLEET/$n/state
controlSocket: $FLEET/$n/state/control.sock
nodeName: $n
ceph: {conf: $DEMO/ceph.conf, user: admin, keyring: $DEMO/ceph.client.admin.keyring}
allowedRoots: [$SRV]
source:
  url: file://$GIT/fleet.git
  ref: {branch: main}
  path: nodes/{nodeName}
  intervalSeconds: 1
  verify: {mode: head, format: ssh, allowedSignersFile: $GIT/allowed_signers}
  fleet: {pool: $RBD_RECONCILER_POOL}
CONF
  mkdir -p "$GIT/work/nodes/$n"
  volume "fleet-$n" 2Mi > "$GIT/work/nodes/$n/data.yaml"
done
cat > "$GIT/work/fleet.yaml" <<'YAML'
apiVersion: rbd-reconciler/v1
kind: Rollout
metadata: {name: demo}
spec:
  waves:
    - {name: canary, nodes: [demo-a]}
    - {name: rest, nodes: ["*"]}
  gate: {healthySeconds: 2, staleSeconds: 30}
YAML
sed 's/^/  /' "$GIT/work/fleet.yaml"
"${GW[@]}" add -A && "${GW[@]}" commit -q -S -m "fleet: three nodes in two waves"
"${GW[@]}" push -q "$GIT/fleet.git" main
GOOD=$("${GW[@]}" rev-parse HEAD)
for n in "${FLEET_NODES[@]}"; do  # not through fleet_cli: $! must be the daemon's own pid
  .venv/bin/rbd-reconciler --config "$FLEET/$n/config.yaml" run --log-format plain \
    > "$FLEET/$n/daemon.log" 2>&1 &
  FLEET_PIDS+=($!)
done
echo "  three daemons (logs in $FLEET/*/daemon.log); the signed commit ${GOOD:0:12} rolls out"
for n in "${FLEET_NODES[@]}"; do wait_fleet_phase "$n" Created; done
fleet_cli demo-c fleet status | sed 's/^/  /'

say "a signed commit that shrinks the canary's image (2Mi to 1Mi: never shrink) halts the rollout"
volume fleet-demo-a 1Mi > "$GIT/work/nodes/demo-a/data.yaml"
"${GW[@]}" commit -q -a -S -m "shrink fleet-demo-a (refused on the canary)"
"${GW[@]}" push -q "$GIT/fleet.git" main
BAD=$("${GW[@]}" rev-parse HEAD)
wait_fleet_phase demo-a Failed
for n in demo-b demo-c; do
  wait_until 30 "$n to hold ${BAD:0:12} back as Halted, ${GOOD:0:12} still applied" \
    rollout_is "$n" Halted "$GOOD"
  echo "  $n: keeps ${GOOD:0:12}; ${BAD:0:12} halted"
done
out=$(fleet_cli demo-b fleet status)
echo "$out" | sed 's/^/  /'
grep -q "revision ${BAD:0:12}: Halted: halted: it failed on demo-a, volume fleet-demo-a" <<<"$out" \
  || die "fleet status does not name the halt (demo-a, fleet-demo-a)"

say "stop the fleet's daemons; release what they applied"
stop_fleet
for n in "${FLEET_NODES[@]}"; do fleet_cli "$n" release >/dev/null; done
echo "the fleet's daemons are stopped (their images stay, with the disposable cluster)"
