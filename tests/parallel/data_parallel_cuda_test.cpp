// parallel::DataParallel on two GPUs (NCCL broadcast of the parameters and
// reduce of the gradients, Note [DataParallel flat buffers]) against one GPU:
// same seed, same global batch, same optimizer. float32 with TF32 off, so the
// only differences are summation orders (the replicas' partial gradients, NCCL's
// reduction, cuDNN's algorithms): 1e-4.
#ifdef CHORUS_WITH_CUDA

#include <gtest/gtest.h>

#include <chorus/autograd/autocast.h>
#include <chorus/chorus.h>
#include <chorus/models/models.h>
#include <chorus/optim/sgd.h>
#include <chorus/parallel/data_parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "chorus/cuda/blas/blas.h"
#include "chorus/cuda/runtime/context.h"
#ifdef CHORUS_WITH_CUDNN
#include "chorus/cuda/conv/conv_plan.h"
#endif

#include "testing/compare.h"

namespace chorus::parallel {
namespace {

namespace F = nn::functional;
using nn::ModulePtr;
using nn::Value;

constexpr double kTol = 1e-4;
constexpr uint64_t kSeed = 4321;

using test::rel_err;

// TF32 off for the test's duration (it is on by default for convolutions).
class NoTf32 {
 public:
  NoTf32() : conv_(cuda::allow_tf32_conv()), matmul_(cuda::allow_tf32_matmul()) { cuda::set_allow_tf32(false); }
  ~NoTf32() {
    cuda::set_allow_tf32_conv(conv_);
    cuda::set_allow_tf32_matmul(matmul_);
  }

 private:
  bool conv_, matmul_;
};

std::shared_ptr<nn::Sequential> small_cnn() {
  // No batch norm: per-replica statistics differ from the global batch's by design.
  auto s = std::make_shared<nn::Sequential>();
  s->push_back(std::make_shared<nn::Conv2d>(nn::Conv2dOptions{3, 8, 3, 1, 1}));
  s->push_back(std::make_shared<nn::ReLU>());
  s->push_back(std::make_shared<nn::Conv2d>(nn::Conv2dOptions{8, 8, 3, 1, 1}));
  s->push_back(std::make_shared<nn::ReLU>());
  s->push_back(std::make_shared<nn::MaxPool2d>(nn::Pool2dOptions{2}));
  s->push_back(std::make_shared<nn::Flatten>());
  s->push_back(std::make_shared<nn::Linear>(8 * 8 * 8, 10));
  return s;
}

struct TrainRun {
  std::vector<double> losses;
  nn::NamedTensors state;
};

// gpus == 0: the plain module on cuda:0; else DataParallel over cuda:0..gpus-1.
// replicated: the replicas step their own weights (Note [Replicated updates]).
TrainRun train(int gpus, int steps, int64_t bucket_bytes = DataParallelOptions{}.bucket_bytes,
               bool replicated = false, dist::GradSumMethod grad_sum = dist::GradSumMethod::Auto) {
  const Device g0 = cuda_device(0);
  manual_seed(kSeed);
  ModulePtr net = small_cnn();
  net->to(g0);
  std::vector<Device> devs;
  for (int i = 0; i < gpus; ++i) devs.push_back(cuda_device(i));
  ModulePtr model =
      gpus > 0 ? ModulePtr(std::make_shared<DataParallel>(
                     net, devs, DataParallelOptions{.bucket_bytes = bucket_bytes, .grad_sum = grad_sum}))
               : net;
  optim::SGD opt(model->parameters(), optim::SGDOptions{.lr = 0.05, .momentum = 0.9});
  if (replicated) {
    ReplicatedUpdates u = std::static_pointer_cast<DataParallel>(model)->replicate_updates(opt.params());
    opt.add_replicas(u.copies, u.after_step);
  }
  manual_seed(77);
  Tensor x = randn({16, 3, 16, 16}).to(g0), y = randint(0, 10, {16}).to(g0);
  TrainRun run;
  for (int i = 0; i < steps; ++i) {
    opt.zero_grad();
    Tensor loss = F::cross_entropy(model->forward(x), y);
    loss.backward();
    opt.step();
    run.losses.push_back(loss.item());
  }
  for (const auto& [n, t] : model->state_dict()) run.state.emplace_back(n, t.to(cpu_device(0)).clone());
  return run;
}

void expect_same_run(const TrainRun& got, const TrainRun& ref) {
  ASSERT_EQ(got.losses.size(), ref.losses.size());
  for (size_t i = 0; i < ref.losses.size(); ++i) {
    ASSERT_TRUE(std::isfinite(ref.losses[i]));
    EXPECT_LE(std::abs(got.losses[i] - ref.losses[i]) / std::abs(ref.losses[i]), kTol)
        << "step " << i << ": " << got.losses[i] << " vs " << ref.losses[i];
  }
  EXPECT_LT(ref.losses.back(), ref.losses.front());
  ASSERT_EQ(got.state.size(), ref.state.size());
  for (size_t i = 0; i < ref.state.size(); ++i) {
    EXPECT_EQ(got.state[i].first, ref.state[i].first);
    EXPECT_LE(rel_err(got.state[i].second, ref.state[i].second), kTol) << ref.state[i].first;
  }
}

TEST(DataParallelCuda, TwoGpusTrainLikeOne_MultiCUDA) {
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs two CUDA devices";
  NoTf32 no_tf32;
  expect_same_run(train(2, 3), train(0, 3));
}

// Note [Replicated updates]: all-reduced buckets (of any size) and the
// optimizer stepping every replica train like one GPU.
TEST(DataParallelCuda, ReplicatedUpdatesTrainLikeOneGpu_MultiCUDA) {
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs two CUDA devices";
  NoTf32 no_tf32;
  const TrainRun ref = train(0, 3);
  for (int64_t bytes : {int64_t{1}, int64_t{4096}, int64_t{0}}) {
    SCOPED_TRACE("bucket_bytes " + std::to_string(bytes));
    expect_same_run(train(2, 3, bytes, /*replicated=*/true), ref);
  }
}

// The same with the all-reduce done by the copy engines (Note [Copy-engine
// all-reduce] in cuda/kernels/peer_all_reduce.h).
TEST(DataParallelCuda, CopyEngineAllReduceTrainsLikeOneGpu_MultiCUDA) {
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs two CUDA devices";
  NoTf32 no_tf32;
  const TrainRun ref = train(0, 3);
  for (int64_t bytes : {int64_t{1}, int64_t{4096}, int64_t{0}}) {
    SCOPED_TRACE("bucket_bytes " + std::to_string(bytes));
    expect_same_run(train(2, 3, bytes, /*replicated=*/true, dist::GradSumMethod::CopyEngine), ref);
  }
}

// Note [NCCL graph mixing] in cuda/runtime/nccl.h: once a DataParallel over two GPUs
// has summed gradients, NCCL's graph mixing is off for the process (unless the
// user had set it: the test runs under whatever the environment says).
TEST(DataParallelCuda, InProcessNcclTurnsGraphMixingOff_MultiCUDA) {
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs two CUDA devices";
  const char* before = std::getenv("NCCL_GRAPH_MIXING_SUPPORT");
  const std::string user = before ? before : "";
  (void)train(2, 1);
  const char* after = std::getenv("NCCL_GRAPH_MIXING_SUPPORT");
  ASSERT_NE(after, nullptr);
  EXPECT_EQ(std::string(after), before ? user : std::string("0"));
}

// Note [Gradient buckets] in data_parallel/reducer.h: one NCCL reduction per parameter
// (overlapping the rest of the backward) sums the same gradients as one
// reduction at the end, on every GPU of the machine.
TEST(DataParallelCuda, GradientBucketsTrainLikeOneGpu_MultiCUDA) {
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs two CUDA devices";
  NoTf32 no_tf32;
  const TrainRun ref = train(0, 3);
  for (int gpus : {2, std::min(cuda_device_count(), 4)}) {
    for (int64_t bytes : {int64_t{1}, int64_t{4096}, int64_t{0}}) {
      SCOPED_TRACE(std::to_string(gpus) + " GPUs, bucket_bytes " + std::to_string(bytes));
      expect_same_run(train(gpus, 3, bytes), ref);
    }
  }
}

// Batch norm's buffers travel with the parameters (int64 counters included):
// in eval mode every replica normalises with the master's running statistics.
TEST(DataParallelCuda, BatchNormBuffersReachTheReplicas_MultiCUDA) {
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs two CUDA devices";
  NoTf32 no_tf32;
  const Device g0 = cuda_device(0);
  manual_seed(kSeed);
  auto net = std::make_shared<models::SmallCNN>(models::ModelSpec{{3, 16, 16}, 10});
  net->to(g0);
  DataParallel dp(net, {g0, cuda_device(1)});
  optim::SGD opt(dp.parameters(), optim::SGDOptions{.lr = 0.05});
  manual_seed(5);
  Tensor x = (randn({8, 3, 16, 16}) * 2.0 + 0.5).to(g0), y = randint(0, 10, {8}).to(g0);
  for (int i = 0; i < 2; ++i) {
    opt.zero_grad();
    F::cross_entropy(dp.forward(x), y).backward();
    opt.step();
  }
  dp.eval();
  NoGradGuard no_grad;
  Tensor got = dp.forward(x), ref = net->forward(x);
  EXPECT_LE(rel_err(got, ref), kTol);
  auto master = net->named_buffers(), rep = dp.replica(1)->named_buffers();
  ASSERT_EQ(master.size(), rep.size());
  for (size_t i = 0; i < master.size(); ++i) {
    EXPECT_EQ(rep[i].second.device(), cuda_device(1)) << master[i].first;
    EXPECT_EQ(rel_err(rep[i].second, master[i].second), 0.0) << master[i].first;
  }
}

// The bug this guards against: autocast is thread-local, and the replicas'
// threads used to run in float32 under a bf16 step.
TEST(DataParallelCuda, ReplicasRunUnderAutocast_MultiCUDA) {
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs two CUDA devices";
  const Device g0 = cuda_device(0);
  manual_seed(kSeed);
  ModulePtr net = small_cnn();
  net->to(g0);
  DataParallel dp(net, {g0, cuda_device(1)}, {.gather_output = false});
  Tensor x = randn({4, 3, 16, 16}).to(g0);
  Value outs;
  {
    AutocastGuard cast(kBFloat16);
    outs = dp.forward_value(Value(x));
  }
  ASSERT_EQ(outs.list().size(), 2u);
  for (size_t r = 0; r < 2; ++r) EXPECT_EQ(outs[r].tensor().dtype(), kBFloat16) << "replica " << r;
  // The gradients still reach the float32 masters.
  Tensor loss = outs[0].tensor().to(kFloat32).pow(2).sum() + outs[1].tensor().to(g0).to(kFloat32).pow(2).sum();
  loss.backward();
  for (const Tensor& p : dp.parameters()) {
    ASSERT_TRUE(p.grad().defined());
    EXPECT_EQ(p.grad().dtype(), kFloat32);
  }
}

// Note [Autocast weight copies]: each replica's weights keep 16-bit copies
// from step to step (the recorded aliases stand for their parameters), and a
// kept copy is always the weights' current value -- after a broadcast (which
// bumps the replica views' versions) as after the optimizer's replicated
// update (which writes the copies). With replicated updates the weights of
// every replica are kept.
TEST(DataParallelCuda, AutocastCopiesOfTheReplicasFollowTheirWeights_MultiCUDA) {
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs two CUDA devices";
  const Device g0 = cuda_device(0);
  for (bool replicated : {false, true}) {
    SCOPED_TRACE(replicated ? "replicated updates" : "broadcasts");
    manual_seed(kSeed);
    auto net = small_cnn();
    net->to(g0);
    auto dp = std::make_shared<DataParallel>(net, std::vector<Device>{g0, cuda_device(1)});
    optim::SGD opt(dp->parameters(), optim::SGDOptions{.lr = 0.1, .momentum = 0.9});
    if (replicated) {
      ReplicatedUpdates u = dp->replicate_updates(opt.params());
      opt.add_replicas(u.copies, u.after_step);
    }
    manual_seed(78);
    Tensor x = randn({16, 3, 16, 16}).to(g0), y = randint(0, 10, {16}).to(g0);
    for (int i = 0; i < 4; ++i) {
      AutocastGuard cast(kBFloat16);
      opt.zero_grad();
      F::cross_entropy(dp->forward(x), y).backward();
      opt.step();
    }
    {
      AutocastGuard cast(kBFloat16);
      (void)dp->forward(x);  // broadcasts (without replicated updates), then casts what is stale
    }
    {
      // A replica's slots hold this forward's recorded aliases until the next
      // forward puts its own weights back (without recording, under no_grad).
      NoGradGuard no_grad;
      (void)dp->forward(x);
    }
    size_t kept = 0, weights = 0;
    for (size_t r = 0; r < 2; ++r) {
      for (const Tensor& p : dp->replica(r)->parameters()) {
        if (p.dim() < 2) continue;  // biases are not cast as weights
        ++weights;
        Tensor c = autocast_copy_for_update(p);
        if (!c.defined()) continue;
        ++kept;
        EXPECT_EQ(rel_err(c.to(kFloat32), p.to(kBFloat16).to(kFloat32)), 0.0) << "replica " << r;
      }
    }
    if (replicated) EXPECT_EQ(kept, weights);
  }
}

#ifdef CHORUS_WITH_CUDNN
// Note [One plan choice per kind of GPU]: with shared choices the replica on
// cuda:1 runs the convolution plans cuda:0 searched (rebuilt on its own
// handle), so both run the same kernels. Geometries no other test uses (5 and
// 7 channels, 13x13), so every one is new here: each searched once, and
// reused once.
TEST(DataParallelCuda, ReplicasRunThePlansTheFirstGpuChose_MultiCUDA) {
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs 2 CUDA devices";
  const cudaDeviceProp &a = cuda::device_properties(0), &b = cuda::device_properties(1);
  if (std::string(a.name) != b.name || a.multiProcessorCount != b.multiProcessorCount)
    GTEST_SKIP() << "cuda:0 and cuda:1 are GPUs of different kinds";
  if (!cuda::conv_graph_enabled()) GTEST_SKIP() << "CHORUS_CUDNN_LEGACY: the legacy path has no shared choices";
  manual_seed(kSeed);
  auto s = std::make_shared<nn::Sequential>();
  s->push_back(std::make_shared<nn::Conv2d>(nn::Conv2dOptions{5, 7, 3, 1, 1}));
  s->push_back(std::make_shared<nn::ReLU>());
  s->push_back(std::make_shared<nn::Conv2d>(nn::Conv2dOptions{7, 7, 3, 1, 1}));
  s->push_back(std::make_shared<nn::Flatten>());
  s->push_back(std::make_shared<nn::Linear>(7 * 13 * 13, 3));
  s->to(cuda_device(0));
  auto dp = std::make_shared<DataParallel>(s, std::vector<Device>{cuda_device(0), cuda_device(1)});
  struct Restore {
    bool prev = cuda::shared_plan_choices();
    ~Restore() { cuda::set_shared_plan_choices(prev); }
  } restore;
  cuda::set_shared_plan_choices(true);
  const cuda::ConvSearchCounts before = cuda::conv_search_counts();
  Tensor x = randn({6, 5, 13, 13}).to(cuda_device(0));
  Tensor y = randint(0, 3, {6}, {kInt64}).to(cuda_device(0));
  F::cross_entropy(dp->forward(x), y).backward();
  synchronize(cuda_device(0));
  const cuda::ConvSearchCounts after = cuda::conv_search_counts();
  const int64_t searched = after.searched - before.searched, reused = after.reused - before.reused;
  // Forward of both convolutions, their weight gradients, the second one's
  // input gradient: five geometries, searched on one GPU, reused on the other.
  EXPECT_EQ(searched, 5);
  EXPECT_EQ(reused, 5);
}
#endif

}  // namespace
}  // namespace chorus::parallel

#endif  // CHORUS_WITH_CUDA
