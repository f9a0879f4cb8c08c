#!/usr/bin/env bash
# Builds the Debian package build-deb/chorus_<version>_<arch>.deb: a shared
# (libchorus.so), CPU-only Chorus for /usr, packed by `cpack -G DEB`
# (cmake/Packaging.cmake). CPU-only because a .deb must work on a machine
# without the CUDA toolkit, which is no Debian package here; CHORUS_DEB_CUDA=1
# builds with CUDA instead, for machines that have the toolkit (and cuDNN, NCCL).
#   sudo apt-get install ./build-deb/chorus_*.deb
set -euo pipefail
cd "$(dirname "$0")/.."
export BUILD_DIR=${BUILD_DIR:-build-deb}
cuda=OFF
if [ "${CHORUS_DEB_CUDA:-0}" = 1 ]; then cuda=ON; fi
CHORUS_CMAKE_ARGS="-DBUILD_SHARED_LIBS=ON -DCHORUS_WITH_CUDA=$cuda -DCHORUS_BUILD_TESTS=OFF -DCHORUS_BUILD_BENCH=OFF \
  -DCMAKE_INSTALL_PREFIX=/usr ${CHORUS_CMAKE_ARGS:-}" scripts/build.sh
cd "$BUILD_DIR"
rm -f chorus_*.deb
cpack -G DEB
deb=$(ls chorus_*.deb)
echo "$BUILD_DIR/$deb"
dpkg-deb -f "$deb" Package Version Architecture Depends Recommends
