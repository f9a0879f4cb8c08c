// A communication hook written by a user against the one interface
// (data_parallel/comm_hook.h): every replica's bucket travels as float16 and the sum
// is made from the float16 values, as PyTorch's fp16_compress_hook. It plugs
// into both front ends of the gradient reducer -- DataParallel's replicas in
// one process (DataParallelOptions::comm_hook) and the per-process hook form
// DDP runs on (HookReducer, DDPOptions::hook) -- and is checked against an
// independent reference: each chunk's float64 gradient on one device, rounded
// to float16 and summed on the host.
#include <gtest/gtest.h>

#include <chorus/chorus.h>
#include <chorus/data_parallel/comm_hook.h>
#include <chorus/data_parallel/grad_hooks.h>
#include <chorus/ops/copy.h>
#include <chorus/ops/elementwise.h>
#include <chorus/optim/sgd.h>
#include <chorus/parallel/data_parallel.h>

#include <atomic>
#include <memory>
#include <vector>

#include "testing/compare.h"
#include "testing/devices.h"
#include "testing/expect_error.h"

namespace chorus::dist {
namespace user_hook_test {  // names of its own in the unity build
namespace {

namespace F = nn::functional;
using test::rel_err;

// The user's hook: srcs[r] (replica r's flat buffer of one bucket and dtype)
// goes over the wire as float16; the sum of the float16 values, in the
// bucket's dtype, lands in every replica's buffer (an all-reduce, so
// DataParallel's replicas can step their own weights with it). Issued on the
// current streams, so join() has nothing left to wait for.
class Fp16Compress final : public CommHook {
 public:
  Tensor reduce(std::vector<Tensor>& srcs, const std::vector<Event>& ready) override {
    calls.fetch_add(1);
    const Device home = srcs[0].device();
    Tensor sum;
    for (size_t r = 0; r < srcs.size(); ++r) {
      Stream::current(srcs[r].device()).wait(ready[r]);  // the replica's backward wrote it
      const Tensor wire = ops::to_dtype(srcs[r], kFloat16);
      const Tensor back = ops::to_dtype(ops::to_device(wire, home), srcs[r].dtype());
      if (!sum.defined()) sum = ops::clone(back);
      else ops::binary_(BinaryOp::Add, sum, back, 1.0);
    }
    for (Tensor& s : srcs) ops::copy_(s, sum);
    return srcs[0];
  }
  void join(const Device&) override {}
  bool all_reduces() const override { return true; }

  std::atomic<int> calls{0};
};

std::shared_ptr<nn::Sequential> mlp(uint64_t seed) {
  manual_seed(seed);
  auto net = std::make_shared<nn::Sequential>();
  net->push_back(std::make_shared<nn::Linear>(6, 8));
  net->push_back(std::make_shared<nn::ReLU>());
  net->push_back(std::make_shared<nn::Linear>(8, 3));
  net->to(kFloat64);
  return net;
}

Tensor f16_round(const Tensor& t) { return t.to(kFloat16).to(kFloat64); }

// The reference of one step's gradients: each half of the batch's float64
// gradient (of its share of the batch's mean loss) on one device, rounded to
// float16, summed.
std::vector<Tensor> reference_grads(const Tensor& x, const Tensor& y) {
  std::vector<Tensor> sum;
  for (int64_t start : {int64_t{0}, int64_t{6}}) {
    auto net = mlp(7);
    Tensor loss = F::cross_entropy(net->forward(x.narrow(0, start, 6)), y.narrow(0, start, 6)) * 0.5;
    loss.backward();
    const auto ps = net->parameters();
    for (size_t i = 0; i < ps.size(); ++i) {
      Tensor g = f16_round(ps[i].grad());
      if (sum.size() <= i) sum.push_back(g);
      else sum[i] = sum[i] + g;
    }
  }
  return sum;
}

TEST(UserHook, Fp16CompressionInDataParallelMatchesTheRoundedChunkGradients) {
  manual_seed(3);
  const Tensor x = randn({12, 6}, {kFloat64, cpu_device(0)}), y = randint(0, 3, {12});
  const std::vector<Tensor> want = reference_grads(x, y);

  auto hook = std::make_shared<Fp16Compress>();
  auto net = mlp(7);
  // Small buckets: several buckets, each through the hook.
  auto dp = std::make_shared<parallel::DataParallel>(
      net, test::cpus(2), parallel::DataParallelOptions{.bucket_bytes = 64, .comm_hook = hook});
  optim::SGD opt(dp->parameters(), optim::SGDOptions{.lr = 0.1});
  parallel::ReplicatedUpdates u = dp->replicate_updates(opt.params());
  opt.add_replicas(u.copies, u.after_step);
  opt.zero_grad();
  F::cross_entropy(dp->forward(x), y).backward();
  EXPECT_GE(hook->calls.load(), 2);
  const auto ps = net->parameters();
  ASSERT_EQ(ps.size(), want.size());
  for (size_t i = 0; i < ps.size(); ++i) {
    // The chunks' losses are scaled by 1/12 here and by 0.5/6 there: equal up
    // to a float64 rounding, which float16's can round apart (one unit).
    EXPECT_LE(rel_err(ps[i].grad(), want[i]), 1e-3) << "parameter " << i;
  }
  // The compression is visible: the weights' sums are not the float64 ones.
  auto plain = mlp(7);
  F::cross_entropy(plain->forward(x), y).backward();
  EXPECT_GT(rel_err(ps[0].grad(), plain->parameters()[0].grad()), 1e-6);
  // Each replica steps with its own copy of the same sum: still its master.
  opt.step();
  const auto reps = dp->replica(1)->parameters();
  for (size_t i = 0; i < ps.size(); ++i) EXPECT_EQ(rel_err(reps[i].to(cpu_device(0)), ps[i]), 0.0) << i;
}

TEST(UserHook, Fp16CompressionOnTheHookReducer) {
  // DDP's form: one replica, each bucket through the hook alone (a hook over
  // a process group would all-reduce the float16 wire instead).
  manual_seed(3);
  const Tensor x = randn({12, 6}, {kFloat64, cpu_device(0)}), y = randint(0, 3, {12});
  auto ref = mlp(7);
  F::cross_entropy(ref->forward(x), y).backward();
  auto net = mlp(7);
  auto hook = std::make_shared<Fp16Compress>();
  HookReducer reducer(net->parameters(), hook, {.bucket_bytes = 64});
  reducer.prepare_for_backward();
  F::cross_entropy(net->forward(x), y).backward();
  ASSERT_TRUE(reducer.finished());
  EXPECT_EQ(hook->calls.load(), static_cast<int>(reducer.buckets().size()));
  const auto ps = net->parameters(), rs = ref->parameters();
  for (size_t i = 0; i < ps.size(); ++i) EXPECT_EQ(rel_err(ps[i].grad(), f16_round(rs[i].grad())), 0.0) << i;
}

TEST(UserHook, ReplicatedUpdatesNeedAnAllReducingHook) {
  struct FirstOnly final : CommHook {
    Tensor reduce(std::vector<Tensor>& srcs, const std::vector<Event>&) override { return srcs[0]; }
    void join(const Device&) override {}
  };
  auto net = mlp(7);
  auto dp = std::make_shared<parallel::DataParallel>(
      net, test::cpus(2), parallel::DataParallelOptions{.comm_hook = std::make_shared<FirstOnly>()});
  EXPECT_TRUE(test::throws_naming([&] { (void)dp->replicate_updates(net->parameters()); }, {"all_reduces"}));
}

}  // namespace
}  // namespace user_hook_test
}  // namespace chorus::dist
