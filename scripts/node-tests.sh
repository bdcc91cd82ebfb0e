#!/usr/bin/env bash
# The node tests ("a node in a box", issue 28): a Debian 12 node booted in
# QEMU with systemd as PID 1 and udev, the package installed as the README
# says, and the product checked there through its units.
#
#   scripts/node-tests.sh [--timeout S] [--deb PKG.deb] [--newer-deb PKG.deb]
#   scripts/node-tests.sh --image-only      (build or find the cached image)
#
# --deb is the package under test, --newer-deb the one the upgrade check
# installs over it; by default both are built by scripts/build-deb.sh (the
# newer one with --version-suffix upgrade1). RBD_RECONCILER_NODE_KEEP=1
# keeps the run directory (the node's disk overlay, consoles, logs).
#
# 1. Outside any namespace, under a lock: install what it needs (QEMU,
#    qemu-img, mmdebstrap), fetch the stock kernel package (the one
#    linux-image-amd64 depends on, as the kernel tests), and build the node's
#    image unless the cache has it: a root filesystem from mmdebstrap (the
#    apt registry: systemd, udev, ceph-common, rbd-nbd, rbd-fuse, cryptsetup,
#    e2fsprogs, xfsprogs, python3 and every package the .deb depends on, so
#    apt in the node needs no network) with the kernel's modules for krbd,
#    nbd, dm-crypt, 9p and virtio, as an ext4 disk image, plus a busybox
#    initramfs that mounts it. Cache: ~/.cache/rbd-reconciler/node-tests,
#    one image per key (the package list, mmdebstrap's and the kernel's
#    versions, tests/node/image/*); each run boots a qcow2 overlay of it, so
#    the cached image is never written.
# 2. A private network namespace (as scripts/kernel-tests.sh): lo and d0
#    with 10.99.0.1/32, no route out; the test cluster listens there only,
#    and QEMU's user networking from inside it is all the node reaches.
# 3. tests/node/host.py boots the node (TCG) and tests/node/guest.py, run at
#    every boot by a unit of the image from a read-only share of this
#    checkout, does the checks and reboots or powers off the node; results,
#    logs and times come back through a read-write share.
# Everything it started is stopped by pid, the namespace's processes swept,
# temp dirs removed: on success, failure, the deadline (exit 124) and SIGTERM.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
SELF="$REPO/scripts/node-tests.sh"
CACHE=${RBD_RECONCILER_NODE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rbd-reconciler/node-tests}
ADDR=10.99.0.1
HOST_PKGS=(qemu-system-x86 qemu-utils mmdebstrap busybox-static cpio kmod iproute2
           e2fsprogs util-linux python3-venv)
SUITES=("deb http://deb.debian.org/debian bookworm main"
        "deb http://deb.debian.org/debian bookworm-updates main"
        "deb http://deb.debian.org/debian-security bookworm-security main")
# The node: what a Debian 12 edge box running us has, and what the package
# depends on (so `apt install ./rbd-reconciler_*.deb` needs no network).
IMAGE_PKGS=(systemd systemd-sysv udev dbus kmod iproute2 procps
            ceph-common rbd-nbd rbd-fuse fuse3 cryptsetup-bin e2fsprogs xfsprogs
            python3 python3-yaml python3-jsonschema python3-watchdog python3-rados python3-rbd
            python3-grpcio python3-protobuf python3-cryptography python3-prometheus-client
            python3-systemd)
# The stock kernel's modules the node may load (with what they depend on).
MODULES=(virtio_pci virtio_blk virtio_net virtio_console virtio_rng 9pnet_virtio 9p
         ext4 xfs fuse loop rbd nbd dm_mod dm_crypt xts ecb cbc aesni_intel crc32c_intel
         crc32c_generic algif_skcipher algif_hash autofs4 configfs binfmt_misc)
# What the initramfs loads to mount the root disk.
INITRD_MODULES=(virtio_pci virtio_blk crc32c_intel crc32c_generic ext4)

log() { echo "node-tests: $*" >&2; }
# shellcheck source=scripts/lib/testns.sh
. "$REPO/scripts/lib/testns.sh"

# ---------------------------------------------------------------- the namespace's first process
if [[ ${1:-} == --inner ]]; then
  shift
  RUN=$1; shift
  testns_up "$RUN"
  cd "$REPO"
  # devcluster stops the cluster (by pid) when the boots return, or on TERM.
  exec .venv/bin/python -m reconciler.testing.devcluster run --addr "$ADDR" \
    --dir "$RUN/cluster" -- .venv/bin/python tests/node/host.py "$@"
fi

# ---------------------------------------------------------------- the caller's side
TIMEOUT=900 DEB='' NEWER_DEB='' IMAGE_ONLY=0
while (($#)); do
  case $1 in
    --timeout) TIMEOUT=$2; shift 2 ;;
    --deb) DEB=$(realpath -- "$2"); shift 2 ;;
    --newer-deb) NEWER_DEB=$(realpath -- "$2"); shift 2 ;;
    --image-only) IMAGE_ONLY=1; shift ;;
    -h|--help) sed -n '2,34p' "$SELF" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) log "unknown argument $1 (--help)"; exit 2 ;;
  esac
done
[[ $TIMEOUT =~ ^[0-9]+$ ]] || { log "--timeout takes whole seconds"; exit 2; }
[[ $(id -u) == 0 ]] || { log "must run as root (mmdebstrap, network namespace, QEMU)"; exit 125; }
[[ $(uname -m) == x86_64 ]] || { log "only x86_64 hosts are supported"; exit 125; }
START=$SECONDS

kernel_package() {
  apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ {print $2; exit}'
}

setup() {
  mkdir -p "$CACHE"
  exec 9>"$CACHE/.lock"
  flock -w 900 9 || { log "could not lock $CACHE/.lock within 900 s"; exit 125; }
  local missing=() p
  for p in "${HOST_PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  if ((${#missing[@]})); then
    log "installing ${missing[*]}"
    timeout 900 apt-get update -qq >&2 || { log "apt-get update failed"; exit 125; }
    DEBIAN_FRONTEND=noninteractive timeout 900 apt-get install -y -qq --no-install-recommends \
      "${missing[@]}" >&2 || { log "apt-get install ${missing[*]} failed"; exit 125; }
  fi
  KPKG=$(kernel_package)
  if [[ -z $KPKG ]]; then
    timeout 900 apt-get update -qq >&2 || true
    KPKG=$(kernel_package)
  fi
  [[ -n $KPKG ]] || { log "cannot find the kernel package (apt-cache depends linux-image-amd64)"; exit 125; }
  KDIR=$CACHE/kernels/$KPKG
  if [[ ! -e $KDIR/.complete ]]; then
    log "fetching $KPKG"
    local tmp; tmp=$(mktemp -d "$CACHE/.kernel.XXXXXX"); chmod 755 "$tmp"
    ( cd "$tmp" && timeout 900 apt-get download -q -o APT::Sandbox::User=root "$KPKG" >&2 ) \
      || { rm -rf "$tmp"; log "apt-get download $KPKG failed"; exit 125; }
    dpkg-deb -f "$tmp"/*.deb Version >"$tmp/version"
    dpkg -x "$tmp"/*.deb "$tmp/root" && rm -f "$tmp"/*.deb
    mv "$tmp/version" "$tmp/root/.version"
    depmod -b "$tmp/root" "$(basename "$(ls -d "$tmp"/root/lib/modules/*/ | head -1)")"
    rm -rf "$KDIR"; mkdir -p "$CACHE/kernels"; mv "$tmp/root" "$KDIR"; rm -rf "$tmp"
    touch "$KDIR/.complete"
  fi
  KVER=$(basename "$(ls -d "$KDIR"/lib/modules/*/ | head -1)")
  image
  flock -u 9; exec 9>&-
}

# The closure of MODULES... in the kernel package: paths under lib/modules/KVER.
module_files() {
  local m
  for m in "$@"; do
    modprobe -d "$KDIR" -S "$KVER" --show-depends "$m" \
      || { log "module $m is not in $KPKG"; return 1; }
  done | awk -v p="$KDIR/lib/modules/$KVER/" '$1 == "insmod" {sub(p, "", $2); if (!seen[$2]++) print $2}'
}

image() {
  local key
  key=$( { printf '%s\n' "${IMAGE_PKGS[@]}" "${MODULES[@]}" "${INITRD_MODULES[@]}" "${SUITES[@]}"
           mmdebstrap --version; echo "$KPKG $(cat "$KDIR/.version" 2>/dev/null)"
           dpkg-query -W -f='${Version}\n' busybox-static
           (cd "$REPO/tests/node/image" && sha256sum -- *); } | sha256sum | cut -c1-16)
  IMG=$CACHE/images/$key
  if [[ -e $IMG/.complete ]]; then
    log "image $IMG (cached)"
    return
  fi
  log "building the node's image $IMG (mmdebstrap; a few minutes)"
  local t0=$SECONDS tmp
  mkdir -p "$CACHE/images"
  tmp=$(mktemp -d "$CACHE/images/.build.XXXXXX")
  # shellcheck disable=SC2064
  trap "rm -rf '$tmp'" EXIT
  module_files "${MODULES[@]}" >"$tmp/modules" || exit 125
  NODEBOX_KDIR=$KDIR NODEBOX_KVER=$KVER NODEBOX_MODULES=$tmp/modules \
    timeout 1200 mmdebstrap --variant=apt --mode=root --format=directory \
      --include="$(IFS=,; echo "${IMAGE_PKGS[*]}")" \
      --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
      --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
      --dpkgopt='path-exclude=/usr/share/info/*' \
      --customize-hook="$REPO/tests/node/image/customize.sh" \
      bookworm "$tmp/root" "${SUITES[@]}" >"$tmp/mmdebstrap.log" 2>&1 \
    || { tail -n 40 "$tmp/mmdebstrap.log" >&2; log "mmdebstrap failed (log above)"; exit 125; }
  chroot "$tmp/root" dpkg-query -W -f='${Package} ${Version}\n' >"$tmp/packages"
  # The initramfs: busybox, the modules that mount the root disk, the init.
  mkdir -p "$tmp/initramfs/bin" "$tmp/initramfs/modules"
  cp /bin/busybox "$tmp/initramfs/bin/busybox"
  install -m 0755 "$REPO/tests/node/image/init" "$tmp/initramfs/init"
  local f
  module_files "${INITRD_MODULES[@]}" | while read -r f; do
    cp "$KDIR/lib/modules/$KVER/$f" "$tmp/initramfs/modules/"; basename "$f"
  done >"$tmp/initramfs/modules/order"
  (cd "$tmp/initramfs" && find . | cpio -o -H newc --quiet | gzip -1) >"$tmp/initrd.img"
  cp "$KDIR/boot/vmlinuz-$KVER" "$tmp/vmlinuz"
  truncate -s 3G "$tmp/base.raw"
  mkfs.ext4 -q -F -L nodebox -d "$tmp/root" "$tmp/base.raw" \
    || { log "mkfs.ext4 -d failed"; exit 125; }
  rm -rf "$tmp/root" "$tmp/initramfs"
  echo "$KVER" >"$tmp/kver"
  mv -T "$tmp" "$IMG"
  trap - EXIT
  touch "$IMG/.complete"
  # Only the newest image is kept: a key change is a rebuild, not a pile.
  for f in "$CACHE"/images/*/; do
    [[ ${f%/} == "$IMG" ]] || rm -rf -- "$f"
  done
  log "image built in $((SECONDS - t0)) s: $(du -sh --apparent-size "$IMG/base.raw" | cut -f1) disk" \
      "($(du -sh "$IMG/base.raw" | cut -f1) used), $(wc -l <"$IMG/packages") packages"
}

setup
((IMAGE_ONLY)) && { echo "$IMG"; exit 0; }
"$REPO/scripts/setup.sh" >&2

RUN=$(mktemp -d /tmp/rbd-reconciler-node.XXXXXX)
chmod 755 "$RUN"
CHILD='' KEEP_RUN=${RBD_RECONCILER_NODE_KEEP:+RBD_RECONCILER_NODE_KEEP}
trap testns_cleanup EXIT
trap 'exit 143' TERM
trap 'exit 130' INT

# The packages under test: given, or built by scripts/build-deb.sh (stdout:
# the .deb's path), the newer one with --version-suffix (VERSION+upgrade1).
build_deb() {
  [[ -x $REPO/scripts/build-deb.sh ]] \
    || { log "no --deb and no scripts/build-deb.sh to build one"; exit 2; }
  local out
  out=$(timeout 900 "$REPO/scripts/build-deb.sh" --outdir "$RUN/built" "$@") \
    || { log "scripts/build-deb.sh $* failed"; exit 1; }
  [[ -f $out ]] || { log "scripts/build-deb.sh $* printed no package ($out)"; exit 1; }
  echo "$out"
}
if [[ -z $DEB ]]; then
  log "building the package (scripts/build-deb.sh)"
  DEB=$(build_deb)
fi
if [[ -z $NEWER_DEB ]]; then
  log "building a newer package for the upgrade (scripts/build-deb.sh --version-suffix upgrade1)"
  NEWER_DEB=$(build_deb --version-suffix upgrade1)
fi
[[ -f $DEB && -f $NEWER_DEB ]] || { log "no such package: $DEB $NEWER_DEB"; exit 2; }

LEFT=$((TIMEOUT - (SECONDS - START)))
((LEFT > 120)) || { log "no time left to boot the node (${LEFT}s of ${TIMEOUT}s)"; exit 124; }
ARGS=(--run "$RUN" --image "$IMG" --repo "$REPO" --deb "$DEB" --newer-deb "$NEWER_DEB"
      --deadline "$(( $(date +%s) + LEFT - 45 ))")
log "booting the node (deadline ${TIMEOUT}s; TCG emulation: minutes)"
set +e
# The boots' own deadline leaves 45 s for the cluster to stop and the sweep.
timeout -k 30 "$LEFT" unshare --net -- \
  bash "$SELF" --inner "$RUN" "${ARGS[@]}" &
CHILD=$!
wait "$CHILD"; RC=$?
set -e
CHILD=''
((RC == 124)) && log "the node tests did not finish within ${TIMEOUT}s"
log "done in $((SECONDS - START))s: exit $RC"
exit "$RC"
