#!/usr/bin/env bash
# The layer check (scripts/check_layers.py) passes on the tree as it is, and
# fails — naming the file, line and layers — on a copy of the tree with one
# include planted that points up DESIGN.md's layer table (core -> nn), spelled
# chorus/nn/... and then ../nn/...
set -uo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
check="$here/scripts/check_layers.py"
python3 "$check" "$here/src/chorus" || { echo "FAIL: the tree has upward includes"; exit 1; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
cp -r "$here/src/chorus" "$tmp/chorus"
echo '#include "chorus/nn/module.h"  // planted' >> "$tmp/chorus/core/device.cpp"
out=$(python3 "$check" "$tmp/chorus"); rc=$?
echo "$out"
if [ $rc -eq 0 ] || ! grep -q "core/device.cpp:.*layer 'core' includes chorus/nn/" <<<"$out"; then
  echo "FAIL: the planted upward include was not reported"; exit 1
fi
echo "ok: planted include reported, exit $rc"
# The same include written relative to the folder is caught too.
cp "$here/src/chorus/core/device.cpp" "$tmp/chorus/core/device.cpp"
echo '#include "../nn/module.h"  // planted' >> "$tmp/chorus/core/device.cpp"
out=$(python3 "$check" "$tmp/chorus"); rc=$?
echo "$out"
if [ $rc -eq 0 ] || ! grep -q "core/device.cpp:.*relative include out of 'core/'" <<<"$out"; then
  echo "FAIL: the planted relative include was not reported"; exit 1
fi
echo "ok: planted relative include reported, exit $rc"
