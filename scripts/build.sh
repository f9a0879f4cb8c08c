#!/usr/bin/env bash
# Configures and builds Chorus in ./build (CUDA, cuDNN and NCCL are used when
# the toolkit is found, e.g. under /usr/local/cuda; otherwise a CPU-only build).
# Arguments are passed to cmake's configure step (scripts/test.sh's sanitizer
# build passes its flags this way).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
GEN=()
if command -v ninja >/dev/null 2>&1; then GEN=(-G Ninja); fi
if [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi
# ccache, where installed, makes rebuilds of unchanged files (other worktrees,
# CI on a machine that built before) nearly free.
LAUNCH=()
if command -v ccache >/dev/null 2>&1; then
  LAUNCH=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
cmake -S . -B "$BUILD_DIR" "${GEN[@]}" "${LAUNCH[@]}" -DCMAKE_BUILD_TYPE=Release ${CHORUS_CMAKE_ARGS:-} "$@"
cmake --build "$BUILD_DIR" -j "$(nproc)"
