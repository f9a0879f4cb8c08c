#!/usr/bin/env bash
# Same-call A/B of whole graphed steps (issue 14): builds the working tree as
# variant B, then each variant "name:path=copy,path=copy" of MP_VARIANTS (the
# listed files replaced by the copies, the tree restored after), and runs each
# build's graphed bench in turn, MP_REPEAT rounds (MP_MODELS, default
# wrn-28-10; MP_PRECISION, default bf16; channels-last). MP_FILTER runs those
# CUDA tests on B first. E.g. the old kernel against the new:
#   git show HEAD~1:src/chorus/cuda/kernels/optim.cu > .bench/optim_old.cu
#   MP_VARIANTS="A:src/chorus/cuda/kernels/optim.cu=.bench/optim_old.cu" OUT=$OUT bash scripts/variant_steps.sh
OUT=${OUT:-gpu-out}
bash scripts/gpu_check.sh build >/dev/null 2>&1 || { grep -E "error|FAILED" $OUT/build.log | head -20; exit 1; }
cp build-gpu/chorus /tmp/chorus-B
[ -n "${MP_FILTER:-}" ] && ./build-gpu/chorus_tests --gtest_filter="$MP_FILTER" 2>&1 | grep -E "^\[  (FAILED|PASSED) |Failure" | head
mkdir -p /tmp/orig
names="B"
for v in $MP_VARIANTS; do
  name=${v%%:*}; pairs=${v#*:}; names="$names $name"
  for pr in ${pairs//,/ }; do dst=${pr%%=*}; mkdir -p /tmp/orig/$(dirname $dst); cp $dst /tmp/orig/$dst; cp ${pr#*=} $dst; done
  ninja -C build-gpu chorus >/dev/null 2>&1 || echo "$name build failed"
  cp build-gpu/chorus /tmp/chorus-$name
  for pr in ${pairs//,/ }; do dst=${pr%%=*}; cp /tmp/orig/$dst $dst; done
done
echo "built $names"
for r in $(seq ${MP_REPEAT:-2}); do
  for m in ${MP_MODELS:-wrn-28-10}; do
    for v in $names; do
      timeout 300 /tmp/chorus-$v bench --model $m --precision ${MP_PRECISION:-bf16} --channels-last --devices cuda:0 --batch-size 128 --steps 40 --warmup 8 2>&1 | grep img/s | sed "s/^/$v run $r: /" | cut -c1-90
    done
  done
done
