#!/usr/bin/env bash
# Install everything a fresh Debian 12 machine needs (as root), idempotently:
# Ceph (mon, osd, client tools, Python bindings), the fuse-loop mapper,
# filesystem tools, and a venv that sees Debian's rados/rbd bindings.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(ceph-mon ceph-osd ceph-common python3-rados python3-rbd python3-systemd rbd-fuse rbd-nbd
              cryptsetup-bin python3-cryptography
              xfsprogs e2fsprogs kmod util-linux fuse3 python3-venv python3-pip)
# man and groff: tests render the generated man page (tests/unit/cli/test_manpage.py).
APT_PACKAGES+=(man-db groff-base)
# The GitOps source: git, ssh and gpg run by the daemon (reconciler/source/);
# libwrap0: the one library the extracted sshd (below) needs that is not
# otherwise here (a library only: installing it starts nothing).
APT_PACKAGES+=(git openssh-client gnupg libwrap0)
# The CSI code's generators (scripts/gen-csi-proto.sh, checked by
# tests/unit/csi/test_csi_generated.py): Debian 12's protoc and gRPC plugin,
# and the well-known .proto files (libprotobuf-dev).
APT_PACKAGES+=(protobuf-compiler protobuf-compiler-grpc libprotobuf-dev)
# tests/test_debian_package.py runs the unit tests under /usr/bin/python3
# with the Debian package's own dependencies (and Debian's pytest): the
# versions Debian 12 ships. The venv does not use them (pyproject.toml's test
# floors); scripts/build-deb.sh installs the build dependencies and lintian.
APT_PACKAGES+=(python3-yaml python3-jsonschema python3-grpcio python3-protobuf
               python3-prometheus-client python3-pytest python3-hypothesis)

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# A real sshd for the git-over-ssh tests (tests/gitserver.py), extracted and
# never installed: installing openssh-server would enable and start a system
# sshd on port 22. Keyed by version, so an upgrade is a new directory; the
# tests run sshd/current/usr/sbin/sshd.
SSHD_CACHE=/var/cache/rbd-reconciler-tests/sshd
sshd_version=$(apt-cache policy openssh-server | awk '/Candidate:/ {print $2}')
if [[ -z $sshd_version || $sshd_version == "(none)" ]]; then
  apt-get update -qq
  sshd_version=$(apt-cache policy openssh-server | awk '/Candidate:/ {print $2}')
fi
sshd_dir=$SSHD_CACHE/${sshd_version//[^A-Za-z0-9.+~-]/_}
if [[ ! -x $sshd_dir/usr/sbin/sshd ]]; then
  echo "setup: extracting openssh-server $sshd_version into $sshd_dir" >&2
  mkdir -p "$SSHD_CACHE"
  work=$(mktemp -d "$SSHD_CACHE/.extract-XXXXXX")
  # apt drops to _apt to download: let it write there (else it warns and runs as root).
  chown _apt "$work" 2>/dev/null || true
  (cd "$work" && apt-get download -qq "openssh-server=$sshd_version")
  dpkg-deb -x "$work"/openssh-server_*.deb "$work/root"
  rm -rf "$sshd_dir"
  mv -T "$work/root" "$sshd_dir"  # whole or absent: a half extraction is never current
  rm -rf "$work"
fi
if missing_libs=$(ldd "$sshd_dir/usr/sbin/sshd" | grep 'not found'); then
  echo "setup: $sshd_dir/usr/sbin/sshd: missing libraries: $missing_libs" >&2
  exit 1
fi
ln -sfn "$(basename "$sshd_dir")" "$SSHD_CACHE/.current.new"
mv -T "$SSHD_CACHE/.current.new" "$SSHD_CACHE/current"

# Debian's rados/rbd modules are built for /usr/bin/python3 (3.11); a venv made
# from it with --system-site-packages is the one environment that imports them.
if [[ ! -x .venv/bin/python ]] || ! .venv/bin/python -c 'import rados, rbd' 2>/dev/null; then
  rm -rf .venv
  /usr/bin/python3 -m venv --system-site-packages .venv
fi
stamp=.venv/.installed-compat-$(sha256sum pyproject.toml | cut -c1-16)
if [[ ! -e $stamp ]]; then
  # docs: mkdocs and mkdocs-material for scripts/build-docs.sh (the site).
  # compat: a plain path in a .pth. The default editable finder costs every
  # interpreter start ~11 ms of imports (pathlib, importlib.util).
  .venv/bin/pip install -q --disable-pip-version-check \
      --config-settings editable_mode=compat -e '.[test,docs]'
  touch "$stamp"
fi
# An editable install compiles nothing: byte-compile the package as a wheel
# install would, so a cold command does not compile ~35 modules (~50 ms) on
# every start where bytecode is not written back (PYTHONDONTWRITEBYTECODE).
.venv/bin/python -m compileall -q reconciler >/dev/null
