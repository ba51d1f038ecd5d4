#!/usr/bin/env bash
# Installs the Debian 12 packages cdcca needs, when any is missing.
# Usage: scripts/setup.sh            (as root, or with sudo available)
# Sourced by scripts/test.sh and scripts/demo.sh; safe to run again (does nothing then).
set -euo pipefail

CDCCA_PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config git
  libtorch-dev libopenblas0-pthread
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libzstd-dev zlib1g-dev libabsl-dev libopencv-dev libssl-dev openssl
  libgtest-dev libgmock-dev libbenchmark-dev nlohmann-json3-dev
  libpcre2-dev libicu-dev
  postgresql libpq-dev nginx
  clang libclang-rt-14-dev
  dataset-fashion-mnist python3
)

missing=()
for p in "${CDCCA_PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#CDCCA_PACKAGES[@]} packages present"
  exit 0
fi

echo "setup: installing ${#missing[@]} missing packages: ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "setup: need root or sudo to install packages" >&2; exit 1; }
  SUDO=sudo
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
echo "setup: done"
