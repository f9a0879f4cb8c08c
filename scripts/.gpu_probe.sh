OUT=$OUT bash scripts/gpu_check.sh build 2>&1 | grep -E 'build ok|error' | head
C=./build-gpu/chorus
for v in "X=1" "NCCL_PROTO=Simple" "NCCL_PROTO=LL128" "NCCL_PROTO=LL" "NCCL_MIN_CTAS=4,NCCL_MAX_CTAS=4" "NCCL_MIN_CTAS=32,NCCL_MAX_CTAS=32"; do
  env ${v//,/ } timeout 120 $C bench --model wrn-16-4 --strategy dp --devices cuda:0,cuda:1 --device-counts 2 --precision bf16 --channels-last --batch-size 128 --steps 60 --warmup 8 2>&1 | grep img/s | sed "s/^/dp $v: /"
done
OUT=$OUT DDPPROF_CASES="dp:wrn-16-4" DDPPROF_COUNTS="2" bash scripts/gpu_check.sh ddpprof 2>&1 | grep 'per step'
