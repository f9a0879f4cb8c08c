// DataParallel's replicated updates with each gradient summed where the
// backward wrote it (Note [Gradients summed where they are] in
// data_parallel/reducer.h), on logical CPU devices: the same training as with the
// gradients packed into flat buckets first (losses, weights, batch-norm
// buffers) over 2 and 3 devices and batches that leave replicas out; two
// parameters whose gradients are one buffer (the backward of a + b hands the
// same tensor to both) trained like one device, where summing in place
// without copying would count the shared buffer twice.

#include <gtest/gtest.h>

#include <chorus/chorus.h>
#include <chorus/data_parallel/reducer.h>
#include <chorus/optim/sgd.h>
#include <chorus/parallel/data_parallel.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "testing/compare.h"
#include "testing/devices.h"
#include "testing/nets.h"

namespace chorus::parallel {
namespace gradient_sums_test {  // names of its own in the unity build
namespace {

namespace F = nn::functional;
using test::AddedScales;
using test::UsedOnOneDevice;
using test::rel_err;

// train()'s in_place_min_bytes for every gradient packed
// (DataParallelOptions::grads_in_place = false).
constexpr int64_t kPacked = -1;

struct TrainRun {
  std::vector<double> losses;
  nn::NamedTensors state;
  double replica_diff = 0;  // the largest relative difference of a replica's parameter from its master
};

// `devices` empty: the plain module on cpu:0 (the reference); otherwise
// DataParallel with replicated updates over them (the data on the first).
TrainRun train(const std::shared_ptr<nn::Module>& net, const std::vector<Device>& devices, const Shape& input,
               const std::vector<int64_t>& batches, int64_t in_place_min_bytes = 0,
               int64_t bucket_bytes = int64_t{25} << 20) {
  std::shared_ptr<nn::Module> model = net;
  std::shared_ptr<DataParallel> dp;
  const Device first = devices.empty() ? cpu_device(0) : devices[0];
  net->to(first);
  if (!devices.empty())
    model = dp = std::make_shared<DataParallel>(net, devices,
                                                DataParallelOptions{.bucket_bytes = bucket_bytes,
                                                                    .grads_in_place = in_place_min_bytes != kPacked,
                                                                    .in_place_min_bytes = std::max<int64_t>(0, in_place_min_bytes)});
  optim::SGD opt(model->parameters(),
                 optim::SGDOptions{.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-3, .nesterov = true});
  if (dp) {
    ReplicatedUpdates u = dp->replicate_updates(opt.params());
    opt.add_replicas(u.copies, u.after_step);
  }
  manual_seed(5);
  Shape xs{12};
  xs.insert(xs.end(), input.begin(), input.end());
  Tensor x = randn(xs).to(first), y = randint(0, 5, {12}).to(first);
  TrainRun run;
  for (int64_t b : batches) {
    opt.zero_grad();
    Tensor loss = F::cross_entropy(model->forward(x.narrow(0, 0, b)), y.narrow(0, 0, b));
    loss.backward();
    opt.step();
    run.losses.push_back(loss.item());
    if (!dp) continue;
    const auto masters = dp->module()->parameters();
    for (size_t r = 1; r < devices.size(); ++r) {
      const auto reps = dp->replica(r)->parameters();
      for (size_t i = 0; i < masters.size(); ++i)
        run.replica_diff = std::max(run.replica_diff, rel_err(reps[i].to(first), masters[i]));
    }
  }
  for (const auto& [n, t] : net->state_dict()) run.state.emplace_back(n, t.clone());
  return run;
}

void expect_same(const TrainRun& got, const TrainRun& ref, double tol) {
  test::expect_same_training(got.losses, got.state, ref.losses, ref.state, tol);
}

// conv_bn_net's gradients: the convolution's weight 432 bytes, the linear
// layer's 1920, the others 20-24: a threshold of 0 sums every one where it
// is, 400 those two (the rest packed), 1 MiB (the default) none.
TEST(GradientSums, InPlaceTrainsLikePackedBuckets) {
  // Batches of 1 and 2 leave replicas out of a step.
  const std::vector<int64_t> batches{12, 12, 1, 12, 2, 12, 7};
  TrainRun packed2, packed3;
  packed2 = train(test::conv_bn_net(31), test::cpus(2), {2, 8, 8}, batches, kPacked);
  packed3 = train(test::conv_bn_net(31), test::cpus(3), {2, 8, 8}, batches, kPacked);
  for (int devices : {2, 3}) {
    for (int64_t min_bytes : {int64_t{0}, int64_t{400}, int64_t{1} << 20}) {
      SCOPED_TRACE(std::to_string(devices) + " devices, in place from " + std::to_string(min_bytes) + " bytes");
      const TrainRun in_place = train(test::conv_bn_net(31), test::cpus(devices), {2, 8, 8}, batches, min_bytes);
      // The same additions in the same order, only not all through a flat buffer.
      expect_same(in_place, devices == 2 ? packed2 : packed3, 1e-6);
      EXPECT_LT(in_place.losses.back(), in_place.losses.front());
    }
  }
}

TEST(GradientSums, ParametersSharingOneGradientBufferTrainLikeOneDevice) {
  const std::vector<int64_t> batches{12, 12, 12, 5, 12};
  manual_seed(17);
  auto ref_net = std::make_shared<AddedScales>();
  const TrainRun ref = train(ref_net, {}, {2, 3, 3}, batches);
  // a and b (72 bytes each) summed where they are, then packed.
  for (int64_t min_bytes : {int64_t{0}, int64_t{100}}) {
    SCOPED_TRACE("in place from " + std::to_string(min_bytes) + " bytes");
    manual_seed(17);
    auto dp_net = std::make_shared<AddedScales>();
    expect_same(train(dp_net, test::cpus(2), {2, 3, 3}, batches, min_bytes), ref, 1e-5);
  }
  EXPECT_LT(ref.losses.back(), ref.losses.front());
}

// Zeros for a parameter a replica did not use, in place and packed, in a
// bucket it sent others of and in a bucket of its own (one bucket per
// parameter): the same training as packed, the replicas equal to the masters.
void check_partly_used(const std::vector<Device>& devices) {
  const std::vector<int64_t> batches{12, 12, 9, 12};
  for (int64_t bucket_bytes : {int64_t{25} << 20, int64_t{1}}) {
    TrainRun packed;
    manual_seed(23);
    packed = train(std::make_shared<UsedOnOneDevice>(), devices, {2, 3, 3}, batches, kPacked, bucket_bytes);
    for (int64_t min_bytes : {int64_t{0}, int64_t{100}}) {
      SCOPED_TRACE("bucket_bytes " + std::to_string(bucket_bytes) + ", in place from " + std::to_string(min_bytes));
      manual_seed(23);
      const TrainRun got =
          train(std::make_shared<UsedOnOneDevice>(), devices, {2, 3, 3}, batches, min_bytes, bucket_bytes);
      expect_same(got, packed, 1e-6);
      EXPECT_EQ(got.replica_diff, 0.0);
    }
  }
}

TEST(GradientSums, AParameterOneReplicaDidNotUseGetsItsZeros) { check_partly_used(test::cpus(3)); }

// The common case takes no copy: a convolution's weight gradient (and batch
// norm's), and a linear layer's with a bias (ops::linear_bias writes dW as
// [out, in] itself), are summed where the backward wrote them; the shared
// buffer of a + b is copied.
TEST(GradientSums, FreshGradientsAreNotCopied) {
  auto conv = std::make_shared<nn::Sequential>();
  conv->push_back(std::make_shared<nn::Conv2d>(nn::Conv2dOptions{2, 5, 3, 1, 0, 1, 1, false}));
  conv->push_back(std::make_shared<nn::BatchNorm2d>(5));
  conv->push_back(std::make_shared<nn::Flatten>());
  uint64_t before = dist::in_place_gradient_copies();
  (void)train(conv, test::cpus(2), {2, 3, 3}, {12, 12});
  EXPECT_EQ(dist::in_place_gradient_copies(), before);
  before = dist::in_place_gradient_copies();
  (void)train(std::make_shared<AddedScales>(), test::cpus(2), {2, 3, 3}, {12, 12});
  // Per replica and step: one of a and b.
  EXPECT_GE(dist::in_place_gradient_copies(), before + 2 * 2);
}

TEST(GradientSums, BadThresholdIsAValueError) {
  EXPECT_THROW(DataParallel(test::conv_bn_net(1), test::cpus(2), DataParallelOptions{.in_place_min_bytes = -1}),
               ValueError);
}

#ifdef CHORUS_WITH_CUDA
// On two GPUs: NCCL's grouped all-reduce of the gradients where they are
// against its one all-reduce per flat bucket (two ranks: each element's sum
// is rounded once either way), and the shared-buffer parameters.
TEST(GradientSums, InPlaceTrainsLikePackedBucketsOnTwoGpus_MultiCUDA) {
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs two CUDA devices";
  const std::vector<Device> gpus{cuda_device(0), cuda_device(1)};
  const std::vector<int64_t> batches{12, 12, 1, 12, 7};
  TrainRun packed;
  packed = train(test::conv_bn_net(31), gpus, {2, 8, 8}, batches, kPacked);
  for (int64_t min_bytes : {int64_t{0}, int64_t{400}}) {
    SCOPED_TRACE("in place from " + std::to_string(min_bytes) + " bytes");
    expect_same(train(test::conv_bn_net(31), gpus, {2, 8, 8}, batches, min_bytes), packed, 1e-6);
  }
  manual_seed(17);
  auto ref_net = std::make_shared<AddedScales>();
  manual_seed(17);
  auto dp_net = std::make_shared<AddedScales>();
  expect_same(train(dp_net, gpus, {2, 3, 3}, {12, 12, 5}), train(ref_net, {}, {2, 3, 3}, {12, 12, 5}), 1e-4);
  // Zeros made for what a replica did not use are summed after they are
  // written (on GPUs the sum would otherwise read the buffer first).
  check_partly_used(gpus);
}
#endif

}  // namespace
}  // namespace gradient_sums_test
}  // namespace chorus::parallel
