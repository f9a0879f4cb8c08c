OUT=$OUT bash scripts/gpu_check.sh build 2>&1 | grep -E 'build ok|error' | head
C=./build-gpu/chorus
for v in 0 1 2; do
  timeout 120 $C bench --model wrn-16-4 --strategy dp --devices cuda:0,cuda:1 --device-counts 1,2 --precision bf16 --channels-last --batch-size 128 --steps 40 --warmup 8 --last-bucket-mb $v 2>&1 | grep img/s | sed "s/^/dp last $v: /"
done
OUT=$OUT TUNE_ONE_GPUS="0" TUNE_VARIANTS="last1:: last0::--last-bucket-mb=0 last4::--last-bucket-mb=4 again:: keep:CHORUS_GRAPH_MEMSETS=keep:" bash scripts/gpu_check.sh ddptune 2>&1 | grep '^tune'
OUT=$OUT DDPPROF_CASES="ddp:wrn-28-10" DDPPROF_COUNTS="2" bash scripts/gpu_check.sh ddpprof 2>&1 | grep 'per step'
