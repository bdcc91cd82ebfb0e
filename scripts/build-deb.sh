#!/usr/bin/env bash
# Build the Debian package from this checkout with Debian's own tools
# (debhelper 13 and dh-python's pybuild, driven by debian/), check it with
# lintian, and put the .deb into dist/. Run as root on Debian 12: the build
# dependencies (debian/control's Build-Depends, through `apt-get build-dep`)
# and lintian are installed from apt when missing, and only then.
#
#   scripts/build-deb.sh [--version-suffix SUFFIX] [--outdir DIR] [--keep]
#
# The contract other scripts and tests rely on:
#   - stdout is one line, the absolute path of the package:
#     DIR/rbd-reconciler_VERSION_all.deb (DIR: dist/ of the checkout unless
#     --outdir). Everything else (build log, lintian) goes to stderr.
#   - VERSION is pyproject.toml's version, which the top entry of
#     debian/changelog must carry too (checked before building).
#   - --version-suffix SUFFIX builds VERSION+SUFFIX instead: a package dpkg
#     sorts newer than VERSION, for an upgrade test. Only the build's copy
#     changes: a debian/changelog entry for it, and pyproject.toml and
#     reconciler/__init__.py say it too, so `rbd-reconciler --version` (and
#     the build_info metric) of the installed package tell the builds apart.
#     SUFFIX: lower-case letters, digits and dots, first a letter or digit
#     (valid for both dpkg and PEP 440: 0.1.0+upgrade1).
#   - exit 0 only if the package built and lintian reported no error and no
#     warning (overrides live in debian/*.lintian-overrides, each explained).
#   - nothing in the checkout is written but DIR's .deb: the build runs in a
#     copy of the tracked and untracked-but-not-ignored files under a
#     temporary directory, removed on exit (--keep: left, and named, to
#     look at the build tree, the .changes and the source package).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)

suffix="" outdir="$repo/dist" keep=""
while (($#)); do
  case $1 in
    --version-suffix) suffix=${2:?--version-suffix needs a value}; shift 2 ;;
    --outdir) outdir=${2:?--outdir needs a directory}; shift 2 ;;
    --keep) keep=1; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 0 ;;
    *) echo "build-deb: unknown argument: $1" >&2; exit 2 ;;
  esac
done
if [[ -n $suffix && ! $suffix =~ ^[a-z0-9][a-z0-9.]*$ ]]; then
  echo "build-deb: --version-suffix: lower-case letters, digits and dots only: $suffix" >&2
  exit 2
fi

# Debian's tools with Debian's interpreter: pybuild runs `python3.11` from
# PATH, which must be /usr/bin's (not a pyenv or venv one), with no
# PYTHONPATH or venv leaking in.
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
unset PYTHONPATH PYTHONHOME VIRTUAL_ENV PYTHONDONTWRITEBYTECODE

log() { echo "build-deb: $*" >&2; }
apt_install() {  # apt_install ARGS...: apt-get install/build-dep, updating the lists once if needed
  export DEBIAN_FRONTEND=noninteractive
  apt-get -y -qq --no-install-recommends "$@" >&2 ||
    { apt-get update -qq >&2 && apt-get -y -qq --no-install-recommends "$@" >&2; }
}

work=$(mktemp -d /tmp/rbd-reconciler-deb.XXXXXX)
if [[ -n $keep ]]; then
  trap 'log "kept the build in $work"' EXIT
else
  trap 'rm -rf "$work"' EXIT
fi
src=$work/rbd-reconciler
mkdir "$src"

# The copy: what git tracks or would track (no .venv, __pycache__,
# egg-info or dist/); a tree without git (an unpacked sdist) minus the same.
if git -C "$repo" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  (cd "$repo" && git ls-files -z --cached --others --exclude-standard |
     while IFS= read -r -d '' f; do [[ -e $f || -L $f ]] && printf '%s\0' "$f"; done |
     tar --null --no-recursion -T - -cf -) | tar -xf - -C "$src"
else
  tar -C "$repo" --exclude=.git --exclude=.venv --exclude=__pycache__ --exclude='*.egg-info' \
      --exclude=./dist --exclude=./build -cf - . | tar -xf - -C "$src"
fi

version=$(sed -n 's/^version = "\(.*\)"$/\1/p' "$src/pyproject.toml")
changelog_version=$(dpkg-parsechangelog -l "$src/debian/changelog" -S Version)
if [[ -z $version || $version != "$changelog_version" ]]; then
  log "pyproject.toml says version ${version:-?}, debian/changelog $changelog_version: add a" \
      "debian/changelog entry for $version"
  exit 1
fi
if [[ -n $suffix ]]; then
  new=$version+$suffix
  sed -i "s/^version = \"$version\"\$/version = \"$new\"/" "$src/pyproject.toml"
  sed -i "s/^__version__ = \"$version\"\$/__version__ = \"$new\"/" "$src/reconciler/__init__.py"
  grep -q "^__version__ = \"$new\"\$" "$src/reconciler/__init__.py"
  maintainer=$(dpkg-parsechangelog -l "$src/debian/changelog" -S Maintainer)
  # Dated now, and after the entry below it whatever that says (lintian).
  when=$(dpkg-parsechangelog -l "$src/debian/changelog" -S Timestamp)
  when=$(( when + 1 > $(date +%s) ? when + 1 : $(date +%s) ))
  { printf 'rbd-reconciler (%s) unstable; urgency=medium\n\n' "$new"
    printf '  * Built by scripts/build-deb.sh --version-suffix %s from %s.\n\n' "$suffix" "$version"
    printf ' -- %s  %s\n\n' "$maintainer" "$(date -R -u -d "@$when")"
    cat "$src/debian/changelog"; } > "$work/changelog"
  mv "$work/changelog" "$src/debian/changelog"
  version=$new
fi

# Build dependencies and lintian, from apt, only when missing.
if ! (cd "$src" && dpkg-checkbuilddeps) 2>/dev/null; then
  log "installing the build dependencies (apt-get build-dep)"
  apt_install build-dep "$src"
fi
if ! dpkg-query -W -f='${Status}' lintian 2>/dev/null | grep -q "install ok installed"; then
  log "installing lintian"
  apt_install install lintian
fi

log "building rbd-reconciler $version in $src"
# Source and binary: lintian then checks debian/ (control, rules, copyright)
# as well as the .deb. Native format: the copy is the whole source.
(cd "$src" && dpkg-buildpackage --build=full -us -uc >&2)
deb=$work/rbd-reconciler_${version}_all.deb
changes=$work/rbd-reconciler_${version}_amd64.changes
[[ -e $changes ]] || changes=$(ls "$work"/rbd-reconciler_"${version}"_*.changes)
[[ -f $deb ]] || { log "dpkg-buildpackage made no $deb"; exit 1; }

log "lintian $(basename "$changes")"
if ! lintian --fail-on error,warning "$changes" >&2; then
  log "lintian reported errors or warnings (above)"
  exit 1
fi

mkdir -p "$outdir"
outdir=$(cd "$outdir" && pwd)
cp "$deb" "$outdir/.$(basename "$deb").tmp"
mv -f "$outdir/.$(basename "$deb").tmp" "$outdir/$(basename "$deb")"
log "built $outdir/$(basename "$deb")"
echo "$outdir/$(basename "$deb")"
