#!/usr/bin/env bash
# Installs what Chorus needs from Debian's packages, builds it, and trains the
# default job (the small CNN on Fashion-MNIST; on the CPU where there is no GPU).
# Usage: scripts/setup.sh [extra `chorus train` options]
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
echo "== installing build dependencies (apt-get)"
$SUDO apt-get update -q
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
  build-essential cmake ninja-build libopenblas-dev zlib1g-dev libcli11-dev nlohmann-json3-dev \
  libfmt-dev libgtest-dev libgmock-dev libbenchmark-dev dataset-fashion-mnist bible-kjv python3-torch librsvg2-bin \
    libgloo-dev openmpi-bin libopenmpi-dev iproute2 python3 pkg-config

scripts/build.sh
echo "== training the default model (chorus train)"
./build/chorus train "$@"
