# shellcheck shell=bash
# scripts/gpu_check.sh stages: Kernels and graph launches measured alone.
# Sourced by the dispatcher, which sets OUT, BUILD, C (the chorus binary) and rows (the summary's JSON rows);
# each stage_NAME function is one stage, described by the "# NAME: ..." line above it (--list shows it).

# bnbench: the batch-norm + ReLU kernels alone, per layer shape
stage_bnbench() {
  # Issue 14: the channels-last batch norm + ReLU kernels alone, per layer
  # shape (microseconds and GB/s against the GPU's copy bandwidth), then the
  # same kernels' test and one graphed WRN-28-10 bf16 run.
  ./$BUILD/bench_batch_norm_gpu | tee "$OUT/bnbench.txt"
  ./$BUILD/bench_batch_norm_gpu --fp32 | tee -a "$OUT/bnbench.txt"
  timeout 300 ./$BUILD/chorus_tests --gtest_filter='CudaBatchNorm*:SyncBatchNorm.Alone*' 2>&1 | grep -E "^\[  (FAILED|PASSED) |Failure"
}

# direct: the stem's direct and the first block's tensor-core convolutions, checked and timed; cuDNN's GEN_STATS probe
stage_direct() {
  # Issue 14: the few-channel convolution kernels (Note [Direct convolutions of
  # a few input channels], cuda/conv/conv_direct.h, for the stem; Note [Tensor-core
  # convolutions of few channels], cuda/conv/conv_mma.h, for the first block's
  # forward):
  # their tests, the choices against cuDNN, cuDNN's GEN_STATS fusion probe
  # (bench/conv_genstats_gpu.cpp), then whole graphed WRN-28-10 steps with
  # both (default), without the tensor-core one (CHORUS_CONV_MMA=0) and
  # without either, alternated DIRECT_REPEAT times.
  timeout 300 ./$BUILD/chorus_tests --gtest_filter='ConvDirect.*:ConvGemm.*:ConvMma.*' 2>&1 | grep -E "^\[  (FAILED|PASSED) |Failure|Expected|Which is|forward|gradient" | head -40
  CHORUS_CONV_SEARCH_LOG=1 timeout 200 $C bench --model wrn-28-10 --precision bf16 --channels-last --devices cuda:0 \
    --batch-size 128 --steps 10 --warmup 3 2>&1 | grep -E "conv (direct|gemm|mma):"
  [ "${GENSTATS:-1}" = 1 ] && timeout 200 ./$BUILD/bench_conv_genstats_gpu | tee "$OUT/genstats.txt"
  for r in $(seq ${DIRECT_REPEAT:-3}); do
    for v in "1 1" "1 0" "0 0"; do
      set -- $v
      CHORUS_CONV_DIRECT=$1 CHORUS_CONV_MMA=$2 timeout 300 $C bench --model wrn-28-10 --precision bf16 --channels-last --devices cuda:0 \
        --batch-size 128 --steps 40 --warmup 8 --json | python3 -c "import json,sys; r=json.loads(sys.stdin.read()); print(f'direct=$1 mma=$2 wrn-28-10 {r[\"img_per_s\"]:.1f} img/s')"
    done
  done
}

# convadd: the residual add in the convolution's epilogue, per layer shape and in whole steps
stage_convadd() {
  # Issue 14: the residual add in the convolution's epilogue (Note [Residual
  # add in the epilogue], cuda/conv/conv.cpp): per layer shape against conv + add,
  # then whole graphed steps with it (default) and without
  # (CHORUS_CONV_ADD_EPILOGUE=0), alternated CONVADD_REPEAT times.
  timeout 200 ./$BUILD/bench_conv_add_gpu | tee "$OUT/convadd.txt"
  for r in $(seq ${CONVADD_REPEAT:-2}); do
    for e in 1 0; do
      for m in ${CONVADD_MODELS:-wrn-28-10 wrn-16-4}; do
        CHORUS_CONV_ADD_EPILOGUE=$e timeout 300 $C bench --model $m --precision bf16 --channels-last --devices cuda:0 \
          --batch-size 128 --steps 40 --warmup 8 --json | python3 -c "import json,sys; r=json.loads(sys.stdin.read()); print(f'convadd epilogue=$e $m {r[\"img_per_s\"]:.0f} img/s')"
      done
    done
  done
}

# graphlaunch: what a CUDA graph replay costs beyond its kernels (bench/graph_launch)
stage_graphlaunch() {
  # What a CUDA graph's replay costs beyond its kernels (bench/graph_launch):
  # one device, through a caller's stream, one graph over two devices, a graph
  # per device; per device, the gap between replays and the time inside one.
  timeout 300 ./$BUILD/bench_graph_launch ${GRAPHLAUNCH_ARGS:-400 20 200} | tee "$OUT/graph_launch.txt"
}
