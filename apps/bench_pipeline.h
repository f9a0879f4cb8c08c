// `chorus bench --strategy pipeline`: a model split over --devices, one row
// per schedule -- naive model parallelism (one micro-batch: one device works
// at a time), GPipe, 1F1B, interleaved -- with throughput, the speed-up over
// naive, the bubble fraction measured per device (time in tasks / step time,
// from events on GPUs) beside the schedule's ideal one, and peak memory per
// device. --batch-size is the pipeline's whole batch.
#pragma once

#include "bench.h"

namespace chorus::app {

int run_bench_pipeline(const BenchConfig& c);

}  // namespace chorus::app
