# shellcheck shell=bash
# The private test network of scripts/kernel-tests.sh and scripts/node-tests.sh,
# sourced by both after they define log(). The test cluster listens on $ADDR
# only, inside a network namespace that `unshare --net` made: lo and d0 with
# $ADDR/32, no route out. Never a real interface.

# In the namespace's first process: lo and d0 up, and the namespace's inode
# in $RUN/ns (how the caller's cleanup finds what is left in it).
testns_up() {
  local run=$1
  fail() { log "$*"; exit 125; }
  ip link set lo up || fail "cannot bring up lo"
  # No dummy driver on some kernels: a veth pair with both ends in here.
  if ! ip link add d0 type dummy 2>/dev/null; then
    ip link add d0 type veth peer name d0-peer && ip link set d0-peer up \
      || fail "cannot create d0 (dummy or veth)"
  fi
  ip addr add "$ADDR/32" dev d0 && ip link set d0 up || fail "cannot put $ADDR/32 on d0"
  [[ $(ip -4 route get "$ADDR") == local* ]] || fail "$ADDR is not local in the namespace"
  RBD_RECONCILER_TEST_NETNS=$(stat -L -c %i /proc/self/ns/net)
  export RBD_RECONCILER_TEST_NETNS
  echo "$RBD_RECONCILER_TEST_NETNS" >"$run/ns"
}

ns_pids() {  # every process in the namespace the inner half made
  local ns; ns=$(cat "$RUN/ns" 2>/dev/null) || return 0
  { stat -L -c '%i %n' /proc/[0-9]*/ns/net 2>/dev/null || true; } |
    awk -v ns="$ns" '$1 == ns { split($2, a, "/"); print a[3] }'
}

# The EXIT trap of the caller's side: the inner half ($CHILD) asked to stop
# (devcluster's own stop, then QEMU's), then whatever is left in the
# namespace, each wait bounded; $RUN removed unless $KEEP_RUN is set.
testns_cleanup() {
  local rc=$? pids end
  trap - EXIT INT TERM
  set +e
  [[ -n $CHILD ]] && kill -0 "$CHILD" 2>/dev/null && kill -TERM "$CHILD"
  end=$((SECONDS + 40))
  while [[ -n $CHILD ]] && kill -0 "$CHILD" 2>/dev/null && ((SECONDS < end)); do sleep 0.2; done
  pids=$(ns_pids)
  if [[ -n $pids ]]; then
    log "stopping what is left in the test namespace: $pids"
    # shellcheck disable=SC2086
    kill -TERM $pids 2>/dev/null; end=$((SECONDS + 20))
    while [[ -n $(ns_pids) ]] && ((SECONDS < end)); do sleep 0.2; done
    # shellcheck disable=SC2046
    kill -KILL $(ns_pids) 2>/dev/null
  fi
  if [[ -n ${KEEP_RUN:-} ]]; then
    log "kept $RUN ($KEEP_RUN)"
  else
    rm -rf -- "$RUN"
  fi
  exit "$rc"
}
