// Step traces (Note [Step traces] in ops/profile.h, io/trace.h): kernels and
// host phases recorded only while a trace is on, and the Chrome trace-event
// layout -- one pid per rank, named tracks, spans sorted with parents first.
// tests/apps/check_trace.py checks whole files from chorus train and bench.
#include "chorus/io/trace.h"

#include <gtest/gtest.h>

#include <chorus/chorus.h>

#include <algorithm>
#include <set>

#include "chorus/ops/elementwise.h"
#include "chorus/ops/factory.h"
#include "chorus/ops/profile.h"

namespace chorus::io {
namespace {

TEST(StepTrace, RecordsKernelsAndPhasesOnlyWhileOn) {
  (void)ops::take_trace();
  Tensor a = randn({8, 8}, {kFloat32, cpu_device(0)});
  (void)ops::binary(BinaryOp::Add, a, a);  // not traced
  ops::start_trace();
  ops::set_trace_step(4);
  {
    ops::TraceScope phase("forward");
    (void)ops::binary(BinaryOp::Mul, a, a);
  }
  ops::stop_trace();
  (void)ops::binary(BinaryOp::Add, a, a);  // not traced
  std::vector<ops::TraceSpan> spans = ops::take_trace();
  ops::set_trace_step(-1);
  ASSERT_GE(spans.size(), 2u);
  const ops::TraceSpan* forward = nullptr;
  int kernels = 0;
  for (const ops::TraceSpan& s : spans) {
    EXPECT_EQ(s.step, 4);
    EXPECT_LE(s.start_us, s.end_us);
    if (s.name == "forward") forward = &s;
    if (s.category == "kernel") {
      ++kernels;
      EXPECT_EQ(s.track, "cpu:0");
    }
  }
  ASSERT_NE(forward, nullptr);
  EXPECT_EQ(forward->track, "host");
  EXPECT_EQ(forward->category, "phase");
  EXPECT_GE(kernels, 1);
  for (const ops::TraceSpan& s : spans)
    if (s.category == "kernel") {
      EXPECT_GE(s.start_us, forward->start_us);
      EXPECT_LE(s.end_us, forward->end_us);
    }
  EXPECT_TRUE(ops::take_trace().empty());
}

TEST(StepTrace, ChromeEventsOnePidPerRankNamedTracks) {
  std::vector<ops::TraceSpan> spans = {
      {"relu", "kernel", "cpu:1", 150, 160, 2},
      {"step 2", "step", "host", 100, 300, 2},
      {"forward", "phase", "host", 100, 200, 2},
      {"all_reduce", "comm", "gloo", 210, 250, 2},
      {"all_gather", "comm", "gloo tp", 260, 270, 2},  // a mesh's tensor group (ProcessGroup::trace_track)
  };
  nlohmann::json ev = trace_events(spans, 3);
  std::map<int, std::string> tracks;
  std::vector<std::string> order;
  for (const auto& e : ev) {
    EXPECT_EQ(e["pid"], 3);
    if (e["ph"] == "M" && e["name"] == "process_name") EXPECT_EQ(e["args"]["name"], "rank 3");
    if (e["ph"] == "M" && e["name"] == "thread_name") tracks[e["tid"].get<int>()] = e["args"]["name"];
    if (e["ph"] == "X") order.push_back(e["name"]);
  }
  EXPECT_EQ(tracks[0], "host");
  EXPECT_EQ(tracks[1], "cpu:1 kernels");
  EXPECT_EQ(tracks[2], "gloo collectives");
  EXPECT_EQ(tracks[3], "gloo tp collectives");
  // By start time; at a tie the enclosing (longer) span first.
  EXPECT_EQ(order, (std::vector<std::string>{"step 2", "forward", "relu", "all_reduce", "all_gather"}));
  for (const auto& e : ev)
    if (e["ph"] == "X" && e["name"] == "forward") {
      EXPECT_DOUBLE_EQ(e["ts"].get<double>(), 100);
      EXPECT_DOUBLE_EQ(e["dur"].get<double>(), 100);
      EXPECT_EQ(e["args"]["step"], 2);
    }
}

// Note [Device tracks]: a GPU's own tracks keep their names and follow its
// launch track; the device spans come out in time order with the rest.
TEST(StepTrace, DeviceTracksNamedAsRecordedAfterTheLaunches) {
  std::vector<ops::TraceSpan> spans = {
      {"memcpy HtoD 1.0 MB", "gpu_copy", "cuda:0 copies", 120, 130, -1},
      {"ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "gpu_comm", "cuda:0 nccl stream",
       180, 260, -1},
      {"gemm", "kernel", "cuda:0", 101, 103, 1},
      {"step 1", "step", "host", 100, 300, 1},
      {"sgemm_128x64", "gpu_kernel", "cuda:0 compute stream", 140, 170, -1},
      {"gemm", "kernel", "cuda:1", 102, 104, 1},
      {"sgemm_128x64", "gpu_kernel", "cuda:1 compute stream (CUDA graph)", 150, 175, -1},
  };
  nlohmann::json ev = trace_events(spans, 0);
  std::vector<std::string> tracks;
  std::vector<double> starts;
  for (const auto& e : ev) {
    if (e["ph"] == "M" && e["name"] == "thread_name") tracks.push_back(e["args"]["name"]);
    if (e["ph"] == "X") {
      starts.push_back(e["ts"].get<double>());
      EXPECT_EQ(e.contains("args"), e["cat"] == "kernel" || e["cat"] == "step") << e.dump();
    }
  }
  EXPECT_EQ(tracks, (std::vector<std::string>{"host", "cuda:0 kernel launches", "cuda:0 compute stream", "cuda:0 copies",
                                              "cuda:0 nccl stream", "cuda:1 kernel launches",
                                              "cuda:1 compute stream (CUDA graph)"}));
  EXPECT_TRUE(std::is_sorted(starts.begin(), starts.end()));
}

}  // namespace
}  // namespace chorus::io
