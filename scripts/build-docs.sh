#!/usr/bin/env bash
# Build the documentation site (docs/, mkdocs.yml) with MkDocs, strictly: a
# broken link, a missing anchor, a page left out of the nav or a link to a
# file the repository does not have fails the build.
#
#   scripts/build-docs.sh            # regenerate docs/reference/, build into site/
#   scripts/build-docs.sh --check    # CI: fail if docs/reference/ is stale; write nothing there
#   scripts/build-docs.sh -d DIR     # build into DIR instead of site/ (gitignored)
#
# The reference pages (docs/reference/*.md) come from schemas/*.schema.json
# and the command-line parser (scripts/gen-docs.py) and are checked in, so
# the Markdown reads on a git forge too. Needs the venv's `docs` extra
# (mkdocs, mkdocs-material), which scripts/setup.sh installs.
set -euo pipefail
cd "$(dirname "$0")/.."

check=0
out=site
while (($#)); do
  case $1 in
    --check) check=1 ;;
    -d) out=${2:?-d needs a directory}; shift ;;
    *) echo "usage: scripts/build-docs.sh [--check] [-d DIR]" >&2; exit 64 ;;
  esac
  shift
done

if [[ ! -x .venv/bin/mkdocs ]]; then
  echo "build-docs: .venv/bin/mkdocs is missing: run scripts/setup.sh" >&2
  exit 1
fi
if ((check)); then
  .venv/bin/python scripts/gen-docs.py --check
else
  .venv/bin/python scripts/gen-docs.py
fi
# Material's banner about its end of life is not a build warning.
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict -d "$out"
echo "build-docs: built into $out/"
