#!/usr/bin/env bash
# Configures and builds cdcca into build/ (or $CDCCA_BUILD_DIR).
# Extra arguments go to cmake's configure step, e.g. -DCDCCA_SANITIZE=address.
# CDCCA_TARGETS="a b" builds only those targets (default: everything).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${CDCCA_BUILD_DIR:-$root/build}"
jobs="${CDCCA_JOBS:-$(nproc)}"

# ccache: PCH users are cacheable only with this sloppiness.
export CCACHE_SLOPPINESS="${CCACHE_SLOPPINESS:-pch_defines,time_macros,include_file_mtime,include_file_ctime}"
export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/ccache}"
export CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-5G}"
# Paths under the checkout hash as relative ones, so worktrees and clones share the cache.
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$root}"

# A full build tree takes about 2.6 GB (line-table debug info, CDCCA_DEBUG_INFO) and ccache
# up to CCACHE_MAXSIZE more: say so up front rather than fail at a link.
mkdir -p "$build"
free_mb=$(df -Pm "$build" | awk 'NR == 2 {print $4}')
if [ -n "$free_mb" ] && [ "$free_mb" -lt 4096 ]; then
  echo "build.sh: only ${free_mb} MB free under $build; a full build needs about 2.6 GB" \
    "plus the compiler cache (${CCACHE_MAXSIZE})" >&2
fi

generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@"
elif [ $# -gt 0 ]; then
  cmake "$build" "$@"
fi
targets=()
for t in ${CDCCA_TARGETS:-}; do targets+=(--target "$t"); done
cmake --build "$build" -j "$jobs" "${targets[@]}"
