#!/usr/bin/env bash
# The kernel tests: the tests marked `kernel` (krbd, rbd-nbd, dm-crypt) run
# inside a QEMU VM that boots a stock Debian 12 kernel, against a disposable
# Ceph cluster on the host. This machine's kernel has none of those modules.
#
#   scripts/kernel-tests.sh [--timeout S] [PYTEST ARGS...]
#   scripts/kernel-tests.sh [--timeout S] --bench [--trials N] [--breakdown NAME]
#                           [--daemon] [--before CHECKOUT]  (benchmarks/p14; .p14-breakdown/NAME)
#
# PYTEST ARGS go to pytest in the guest, after `-m kernel tests/kernel`: a
# subset is `-k partition` (or `-k "lifecycle and krbd"`), output `-s`.
# RBD_KT_LONG_PARTITION_S (default 300) is the long partition of
# tests/kernel/test_partition.py; 0 leaves it out.
#
# 1. Outside any namespace: install what it needs (QEMU, the kernel package,
#    virtme-ng in its own venv, the project's venv), idempotently, under a
#    lock. Cache: ~/.cache/rbd-reconciler/kernel-tests (not under /run or
#    /var/*: the guest mounts tmpfs there and would not see it).
# 2. A private network namespace (unshare --net) with lo and one veth pair,
#    d0 carrying 10.99.0.1/32 and no route out. The test cluster listens on
#    that address only (devcluster refuses it anywhere else); QEMU runs in
#    the same namespace, so the guest reaches it through user networking and
#    reaches nothing else.
# 3. A VM boot (TCG: KVM is not usable here) runs pytest -m kernel with the
#    repository's venv over the host's read-only root; its output comes back
#    through files in a shared directory. When the first boot left a reboot
#    test's state (tests/kernel/test_reboot.py), a second boot runs the
#    tests marked reboot: the same cluster, a kernel that mapped nothing.
#    The exit status is the first failing boot's.
# Everything it started is stopped by pid, the namespace's processes swept,
# temp dirs removed: on success, failure, the deadline (exit 124) and SIGTERM.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
SELF="$REPO/scripts/kernel-tests.sh"
CACHE=${RBD_RECONCILER_KT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rbd-reconciler/kernel-tests}
ADDR=10.99.0.1
VNG_SPEC=virtme-ng==1.42
APT_PKGS=(qemu-system-x86 busybox-static cpio kmod iproute2 rbd-nbd cryptsetup-bin
          xfsprogs e2fsprogs python3-venv util-linux)

log() { echo "kernel-tests: $*" >&2; }
# shellcheck source=scripts/lib/testns.sh
. "$REPO/scripts/lib/testns.sh"

# ---------------------------------------------------------------- in the VM (guest side is generated)
# ---------------------------------------------------------------- in the namespace: run one VM
if [[ ${1:-} == --vm ]]; then
  shift
  RUN=$1 KIMG=$2 VM_TIMEOUT=$3 BOOT=$4 MARKERS=$5; shift 5
  GUEST_PATH="$PATH:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
  {
    echo '#!/bin/bash'
    printf 'exec </dev/null >>%q 2>>%q\n' "$RUN/stdout" "$RUN/stderr"
    printf 'export PATH=%q RUN_IN_VM=1 HOME=/root LANG=C.UTF-8 PYTHONDONTWRITEBYTECODE=1\n' \
      "$GUEST_PATH"
    printf 'export KERNEL_TESTS_BOOT=%q RBD_RECONCILER_KT_STATE=%q KERNEL_TESTS_AGENT=%q\n' \
      "$BOOT" "$RUN/state" "$RUN/agent"
    # The repository is read-only in the guest: what a benchmark writes for
    # the host goes here, and is copied to .p14-breakdown/ after the boot.
    printf 'export KERNEL_TESTS_OUT=%q\n' "$RUN/out"
    # The partition tests' long cut (tests/kernel/test_partition.py); 0: none.
    printf 'export RBD_KT_LONG_PARTITION_S=%q\n' "${RBD_KT_LONG_PARTITION_S:-300}"
    # No udevd in the guest: libdevmapper makes /dev/mapper nodes itself.
    echo 'export DM_DISABLE_UDEV=1'
    for v in CEPH_CONF RBD_RECONCILER_CEPH_CONF RBD_RECONCILER_CEPH_KEYRING \
             RBD_RECONCILER_CEPH_USER RBD_RECONCILER_POOL; do
      printf 'export %q\n' "$v=${!v}"
    done
    # The conf's run dir is on 9p in the guest: no unix sockets there.
    printf 'export CEPH_ARGS=%q\n' "${CEPH_ARGS:-} --run-dir=/run/ceph"
    cat <<'EOF'
mkdir -p /run/ceph
modprobe virtio_net 2>/dev/null
for _ in $(seq 100); do [[ -e /sys/class/net/eth0 ]] && break; sleep 0.1; done
ip link set lo up; ip link set eth0 up && ip addr add 10.0.2.15/24 dev eth0 \
  && ip route add default via 10.0.2.2 || echo "kernel-tests: guest network setup failed" >&2
for m in rbd nbd dm-crypt; do modprobe "$m" || echo "kernel-tests: modprobe $m failed" >&2; done
EOF
    printf 'cd %q || exit 125\n' "$REPO"
    # No arguments is no arguments: printf ' %q' with none prints one '' (an
    # empty path, which made pytest collect the whole repository).
    printf 'set --'; (($#)) && printf ' %q' "$@"; printf '\n'
    if [[ $MARKERS == @bench ]]; then
      echo '.venv/bin/python benchmarks/p14_kernel_paths.py "$@"; rc=$?'
    else
      # Only tests/kernel is collected: importing the whole suite over 9p
      # under TCG cost minutes per boot, for tests the marker then deselects.
      # A test still running after 15 minutes prints every thread's stack
      # (and runs on): a hang then says where it is before the deadline's kill.
      printf '.venv/bin/python -m pytest -p no:cacheprovider --durations=0 -o faulthandler_timeout=900 -m %q tests/kernel "$@"; rc=$?\n' \
        "$MARKERS"
    fi
    echo '((rc)) && { echo "--- kernel-tests: guest dmesg (tail) after exit $rc"; dmesg | tail -n 60; } >&2'
    printf 'sync; echo "$rc" >%q; sync\n' "$RUN/rc"
  } >"$RUN/guest.sh"
  : >"$RUN/stdout"; : >"$RUN/stderr"; : >"$RUN/console.log"; rm -f "$RUN/rc"
  VMPID='' TAILS=()
  stop_vm() {
    if [[ -n $VMPID ]] && kill -0 "$VMPID" 2>/dev/null; then
      kill -TERM -- "-$VMPID" 2>/dev/null || kill -TERM "$VMPID" 2>/dev/null || true
      timeout 15 tail --pid="$VMPID" -f /dev/null 2>/dev/null || kill -KILL -- "-$VMPID" 2>/dev/null || true
    fi
    local t; for t in "${TAILS[@]}"; do kill "$t" 2>/dev/null || true; done
  }
  trap stop_vm EXIT
  trap 'exit 143' TERM
  trap 'exit 130' INT
  # timeout(1) makes its own process group: vng -> virtme-run -> qemu end with it.
  PATH="$CACHE/venv/bin:$PATH" timeout -k 10 "$VM_TIMEOUT" \
    vng --run "$KIMG" --disable-kvm --force-9p --memory 3G --cpus 2 --verbose \
        --rwdir "$RUN" --network user --no-dhcp --exec "bash $RUN/guest.sh" \
        </dev/null >"$RUN/console.log" 2>&1 &
  VMPID=$!
  tail -n +1 -f --pid="$VMPID" "$RUN/stdout" & TAILS+=($!)
  tail -n +1 -f --pid="$VMPID" "$RUN/stderr" >&2 & TAILS+=($!)
  set +e; wait "$VMPID"; VMRC=$?; set -e
  VMPID=''
  for t in "${TAILS[@]}"; do wait "$t" 2>/dev/null || true; done
  TAILS=()
  if [[ -s $RUN/rc ]]; then exit "$(<"$RUN/rc")"; fi
  if ((VMRC == 124 || VMRC == 137)); then
    log "the VM did not finish within ${VM_TIMEOUT}s (killed); its console's last lines:"
  else
    log "the VM ended (status $VMRC) without the tests' exit status; its console's last lines:"
  fi
  tail -n 30 "$RUN/console.log" >&2
  exit 125
fi

# ---------------------------------------------------------------- in the namespace: the boots
if [[ ${1:-} == --boots ]]; then
  shift
  RUN=$1 KIMG=$2 VM_TIMEOUT=$3; shift 3
  mkdir -p "$RUN/state" "$RUN/agent"; chmod 700 "$RUN/state" "$RUN/agent"
  end=$((SECONDS + VM_TIMEOUT))
  # What the partition tests need done on Ceph while the VM is cut off from it
  # (another node's takeover, a blocklist entry): tests/kernel/hostagent.py.
  .venv/bin/python tests/kernel/hostagent.py "$RUN/agent" "$RUN" &
  AGENT=$!
  trap 'touch "$RUN/agent/stop"; kill "$AGENT" 2>/dev/null; wait "$AGENT" 2>/dev/null' EXIT
  if [[ ${1:-} == --bench ]]; then
    shift
    log "one boot: benchmarks/p14_kernel_paths.py $*"
    mkdir -p "$RUN/out"
    set +e
    bash "$SELF" --vm "$RUN" "$KIMG" "$VM_TIMEOUT" 1 @bench "$@"; rc=$?
    if [[ -n $(ls -A "$RUN/out") ]]; then
      mkdir -p "$REPO/.p14-breakdown" && cp -a "$RUN/out/." "$REPO/.p14-breakdown/" \
        && log "what the benchmark wrote: $REPO/.p14-breakdown/"
    fi
    exit "$rc"
  fi
  set +e
  log "boot 1: pytest -m kernel $*"
  bash "$SELF" --vm "$RUN" "$KIMG" "$VM_TIMEOUT" 1 kernel "$@"; rc=$?
  if [[ -e $RUN/state/checksums.json ]]; then
    left=$((end - SECONDS))
    if ((left < 120)); then
      log "no time left for the second boot (${left}s)"; ((rc)) || rc=124
    else
      log "boot 2 (after an unclean power-off): pytest -m 'kernel and reboot'"
      bash "$SELF" --vm "$RUN" "$KIMG" "$left" 2 "kernel and reboot" "$@"; rc2=$?
      ((rc)) || rc=$rc2
    fi
  fi
  exit "$rc"
fi

# ---------------------------------------------------------------- the namespace's first process
if [[ ${1:-} == --inner ]]; then
  shift
  RUN=$1 KIMG=$2 VM_TIMEOUT=$3; shift 3
  testns_up "$RUN"
  cd "$REPO"
  # devcluster stops the cluster (by pid) when the VM run returns, or on TERM.
  exec .venv/bin/python -m reconciler.testing.devcluster run --addr "$ADDR" \
    --dir "$RUN/cluster" -- bash "$SELF" --boots "$RUN" "$KIMG" "$VM_TIMEOUT" "$@"
fi

# ---------------------------------------------------------------- the caller's side
TIMEOUT=900
while (($#)); do
  case $1 in
    --timeout) TIMEOUT=$2; shift 2 ;;
    -h|--help) sed -n '2,31p' "$SELF" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) break ;;
  esac
done
[[ $TIMEOUT =~ ^[0-9]+$ ]] || { log "--timeout takes whole seconds"; exit 2; }
[[ $(id -u) == 0 ]] || { log "must run as root (network namespace, QEMU, mounts)"; exit 125; }
[[ $(uname -m) == x86_64 ]] || { log "only x86_64 hosts are supported"; exit 125; }

setup() {
  mkdir -p "$CACHE"
  case $(realpath "$CACHE")/ in /var/cache/*|/var/tmp/*|/var/log/*|/run/*)
    log "cache $CACHE would be hidden by a tmpfs in the guest; set RBD_RECONCILER_KT_CACHE"
    exit 125 ;;
  esac
  exec 9>"$CACHE/.lock"
  flock -w 900 9 || { log "could not lock $CACHE/.lock within 900 s"; exit 125; }
  local missing=() p
  for p in "${APT_PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  if ((${#missing[@]})); then
    log "installing ${missing[*]}"
    timeout 900 apt-get update -qq >&2 || { log "apt-get update failed"; exit 125; }
    DEBIAN_FRONTEND=noninteractive timeout 900 apt-get install -y -qq --no-install-recommends \
      "${missing[@]}" >&2 || { log "apt-get install ${missing[*]} failed"; exit 125; }
  fi
  local kpkg
  kpkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
  if [[ -z $kpkg ]]; then
    timeout 900 apt-get update -qq >&2 || true
    kpkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
  fi
  [[ -n $kpkg ]] || { log "cannot find the kernel package (apt-cache depends linux-image-amd64)"; exit 125; }
  KDIR=$CACHE/kernels/$kpkg
  if [[ ! -e $KDIR/.complete ]]; then
    log "fetching $kpkg"
    local tmp kver; tmp=$(mktemp -d "$CACHE/.kernel.XXXXXX"); chmod 755 "$tmp"
    ( cd "$tmp" && timeout 900 apt-get download -q -o APT::Sandbox::User=root "$kpkg" >&2 ) \
      || { rm -rf "$tmp"; log "apt-get download $kpkg failed"; exit 125; }
    dpkg -x "$tmp"/*.deb "$tmp/root" && rm -f "$tmp"/*.deb
    kver=$(basename "$(ls -d "$tmp"/root/lib/modules/*/ | head -1)")
    depmod -b "$tmp/root" "$kver"
    rm -rf "$KDIR"; mkdir -p "$CACHE/kernels"; mv "$tmp/root" "$KDIR"; rm -rf "$tmp"
    touch "$KDIR/.complete"
  fi
  KIMG=$(ls "$KDIR"/boot/vmlinuz-* | head -1)
  if [[ ! -e $CACHE/venv/.complete-$VNG_SPEC ]]; then
    log "installing $VNG_SPEC into $CACHE/venv"
    rm -rf "$CACHE/venv"
    /usr/bin/python3 -m venv "$CACHE/venv"
    timeout 900 "$CACHE/venv/bin/pip" install -q "$VNG_SPEC" >&2 \
      || { rm -rf "$CACHE/venv"; log "pip install $VNG_SPEC failed"; exit 125; }
    touch "$CACHE/venv/.complete-$VNG_SPEC"
  fi
  flock -u 9; exec 9>&-
}
setup
"$REPO/scripts/setup.sh" >&2

RUN=$(mktemp -d /tmp/rbd-reconciler-kt.XXXXXX)
chmod 755 "$RUN"
CHILD=''
trap testns_cleanup EXIT
trap 'exit 143' TERM
trap 'exit 130' INT

log "VM boots run pytest -m kernel (deadline ${TIMEOUT}s; TCG emulation: minutes)"
START=$SECONDS
set +e
# The VM's own deadline leaves 60 s for the cluster to stop and the sweep.
timeout -k 30 "$TIMEOUT" unshare --net -- bash "$SELF" --inner "$RUN" "$KIMG" \
  "$((TIMEOUT > 120 ? TIMEOUT - 60 : TIMEOUT))" "$@" &
CHILD=$!
wait "$CHILD"; RC=$?
set -e
CHILD=''
((RC == 124)) && log "the kernel tests did not finish within ${TIMEOUT}s"
log "done in $((SECONDS - START))s: exit $RC"
exit "$RC"
