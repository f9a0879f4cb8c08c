OUT=$OUT TESTS_FILTER='GraphedStep*:DataParallel*:CudaGraphMemsets*' bash scripts/gpu_check.sh build tests 2>&1 | grep -E 'build ok|error|PASSED|FAILED|Failure' | head
C=./build-gpu/chorus
for m in wrn-16-4 wrn-28-10; do
  timeout 120 $C bench --model $m --strategy dp --devices cuda:0,cuda:1 --device-counts 1,2 --precision bf16 --channels-last --batch-size 128 --steps 60 --warmup 8 2>&1 | grep img/s | sed "s/^/dp: /"
done
