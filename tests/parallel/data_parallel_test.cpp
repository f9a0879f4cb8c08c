// parallel::DataParallel on logical CPU devices, against the plain module on
// one device: same seed, same global batch, same optimizer, so every per-step
// loss and every final weight must agree up to float32 rounding (the replicas
// sum partial gradients where the reference sums one big reduction).
//
// Also: uneven and tiny batches, nested (table) inputs and outputs, DP nested
// inside a Sequential, shared parameters, an exception on one replica, bad
// arguments, per-replica outputs, and replicas following the optimizer without
// any syncParameters call (Note [DataParallel replicas]); and the flat
// gradient path (Note [DataParallel flat buffers]): unused, partly used and
// frozen parameters, accumulation over two backward passes, a loss over some
// replicas only, forwards under NoGradGuard, and the caller's autocast.
#include <gtest/gtest.h>

#include <chorus/autograd/autocast.h>
#include <chorus/autograd/node.h>
#include <chorus/chorus.h>
#include <chorus/models/models.h>
#include <chorus/optim/sgd.h>
#include <chorus/parallel/data_parallel.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "testing/devices.h"
#include "testing/compare.h"

namespace chorus::parallel {
namespace {

namespace F = nn::functional;
using nn::ModulePtr;
using nn::Value;

constexpr double kTol = 1e-5;
constexpr uint64_t kSeed = 1234;

using test::cpus;

using test::rel_err;

std::vector<std::string> names(const nn::NamedTensors& ts) {
  std::vector<std::string> out;
  for (const auto& [n, t] : ts) out.push_back(n);
  return out;
}

std::shared_ptr<nn::Sequential> seq(std::initializer_list<ModulePtr> mods) {
  auto s = std::make_shared<nn::Sequential>();
  for (const ModulePtr& m : mods) s->push_back(m);
  return s;
}

// ---- the models ---------------------------------------------------------------

const models::ModelSpec kMlpSpec{{2, 3, 3}, 5};
ModulePtr make_mlp() { return std::make_shared<models::MLP>(models::MLPOptions{kMlpSpec, {16, 8}}); }

// A small CNN without batch norm (batch norm makes per-replica statistics differ
// from the global batch's, by design).
const models::ModelSpec kCnnSpec{{2, 8, 8}, 5};
ModulePtr make_cnn() {
  return seq({std::make_shared<nn::Conv2d>(nn::Conv2dOptions{2, 4, 3, 1, 1}), std::make_shared<nn::ReLU>(),
              std::make_shared<nn::MaxPool2d>(nn::Pool2dOptions{2}), std::make_shared<nn::Flatten>(),
              std::make_shared<nn::Linear>(4 * 4 * 4, 5)});
}

// One Linear applied twice (a tied weight): its gradient has two terms per replica.
class TiedTwice : public nn::Module {
 public:
  explicit TiedTwice(nn::NoOptions = {}) : Module("TiedTwice") {
    lin_ = register_module("lin", std::make_shared<nn::Linear>(18, 18));
    head_ = register_module("head", std::make_shared<nn::Linear>(18, 5));
  }
  Tensor forward(const Tensor& x) override {
    Tensor h = x.flatten(1);
    return head_->forward(lin_->forward(lin_->forward(h).relu()).tanh());
  }
  nn::NoOptions options_for_clone() const { return {}; }
  CHORUS_MODULE_CLONEABLE(TiedTwice)
 private:
  std::shared_ptr<nn::Linear> lin_, head_;
};

// ---- training: the reference and the DP run share this loop ---------------------

struct Batch {
  Tensor x, y;
};

// Batch i is the first sizes[i] samples of one fixed pool, so that a model
// trained on equal-sized batches is fitting one data set (its loss must fall).
std::vector<Batch> make_batches(const models::ModelSpec& spec, const std::vector<int64_t>& sizes) {
  manual_seed(99);
  const int64_t pool = *std::max_element(sizes.begin(), sizes.end());
  Shape xs{pool};
  xs.insert(xs.end(), spec.input.begin(), spec.input.end());
  Tensor x = randn(xs), y = randint(0, spec.classes, {pool});
  std::vector<Batch> out;
  for (int64_t b : sizes) out.push_back({x.narrow(0, 0, b).contiguous(), y.narrow(0, 0, b).contiguous()});
  return out;
}

struct TrainRun {
  std::vector<double> losses;
  nn::NamedTensors state;  // copies, after the last step
};

// Builds the model from kSeed (so every run starts from the same weights) and
// takes one SGD-with-momentum step per batch on the optimizer over
// model->parameters() — the wrapper's, for DP.
TrainRun train(const std::function<ModulePtr()>& build, const std::vector<Batch>& data) {
  manual_seed(kSeed);
  ModulePtr model = build();
  optim::SGD opt(model->parameters(), optim::SGDOptions{.lr = 0.05, .momentum = 0.9});
  TrainRun run;
  for (const Batch& b : data) {
    opt.zero_grad();
    Tensor loss = F::cross_entropy(model->forward(b.x), b.y);
    loss.backward();
    opt.step();
    run.losses.push_back(loss.item());
  }
  for (const auto& [n, t] : model->state_dict()) run.state.emplace_back(n, t.to(cpu_device(0)).clone());
  return run;
}

ModulePtr data_parallel(ModulePtr m, int n, DataParallelOptions o = {}) {
  return std::make_shared<DataParallel>(std::move(m), cpus(n), o);
}

void expect_same_run(const TrainRun& got, const TrainRun& ref, const std::string& what) {
  SCOPED_TRACE(what);
  ASSERT_EQ(got.losses.size(), ref.losses.size());
  for (size_t i = 0; i < ref.losses.size(); ++i)
    EXPECT_LE(std::abs(got.losses[i] - ref.losses[i]) / std::abs(ref.losses[i]), kTol)
        << "step " << i << ": " << got.losses[i] << " vs " << ref.losses[i];
  ASSERT_EQ(names(got.state), names(ref.state));
  for (size_t i = 0; i < ref.state.size(); ++i)
    EXPECT_LE(rel_err(got.state[i].second, ref.state[i].second), kTol) << ref.state[i].first;
}

// Trains the plain model and DP over each device count on the same batches.
void expect_dp_matches_plain(const std::function<ModulePtr()>& make, const models::ModelSpec& spec,
                             const std::vector<int64_t>& batch_sizes, const std::vector<int>& device_counts,
                             DataParallelOptions options = {}) {
  auto data = make_batches(spec, batch_sizes);
  TrainRun ref = train(make, data);
  for (double l : ref.losses) ASSERT_TRUE(std::isfinite(l));
  if (std::adjacent_find(batch_sizes.begin(), batch_sizes.end(), std::not_equal_to<>()) == batch_sizes.end())
    EXPECT_LT(ref.losses.back(), ref.losses.front());  // it is actually learning
  for (int n : device_counts) {
    TrainRun got = train([&] { return data_parallel(make(), n, options); }, data);
    expect_same_run(got, ref, std::to_string(n) + " device(s)");
  }
}

// ---- equivalence with the plain module ---------------------------------------------

TEST(DataParallel, MLPTrainsLikeThePlainModule) {
  expect_dp_matches_plain(make_mlp, kMlpSpec, {12, 12, 12, 12, 12}, {1, 2, 3});
}

TEST(DataParallel, CNNTrainsLikeThePlainModule) {
  expect_dp_matches_plain(make_cnn, kCnnSpec, {6, 6, 6, 6, 6}, {1, 2, 3});
}

// Note [Gradient buckets] in data_parallel/reducer.h: one bucket per parameter, a few
// parameters per bucket, and one bucket for everything give the same training.
TEST(DataParallel, GradientBucketsOfAnySizeTrainLikeThePlainModule) {
  for (int64_t bytes : {int64_t{1}, int64_t{700}, int64_t{0}}) {
    SCOPED_TRACE("bucket_bytes " + std::to_string(bytes));
    expect_dp_matches_plain(make_cnn, kCnnSpec, {6, 6, 6, 6}, {3}, {.bucket_bytes = bytes});
    expect_dp_matches_plain(make_mlp, kMlpSpec, {7, 7, 7}, {2, 3}, {.bucket_bytes = bytes});
  }
}

// The graph holds one reduce node per bucket (so each bucket's sum can start
// as soon as its gradients exist), fed by one node per replica and bucket.
TEST(DataParallel, GradientBucketsAreSeparateGraphNodes) {
  auto count_nodes = [](const Tensor& root, const std::string& name) {
    std::vector<autograd::Node*> stack{root.grad_fn().get()};
    std::set<autograd::Node*> seen(stack.begin(), stack.end());
    int n = 0;
    while (!stack.empty()) {
      autograd::Node* node = stack.back();
      stack.pop_back();
      if (node->name() == name) ++n;
      for (const autograd::Edge& e : node->next)
        if (e.fn && seen.insert(e.fn.get()).second) stack.push_back(e.fn.get());
    }
    return n;
  };
  auto data = make_batches(kMlpSpec, {6});
  for (int64_t bytes : {int64_t{0}, int64_t{1}}) {
    manual_seed(kSeed);
    ModulePtr net = make_mlp();
    const int params = static_cast<int>(net->parameters().size());
    ASSERT_GT(params, 2);
    auto dp = data_parallel(net, 3, {.bucket_bytes = bytes});
    Tensor loss = F::cross_entropy(dp->forward(data[0].x), data[0].y);
    const int buckets = bytes == 0 ? 1 : params;
    EXPECT_EQ(count_nodes(loss, "ReducerBucketBackward"), buckets) << "bucket_bytes " << bytes;
    EXPECT_EQ(count_nodes(loss, "ReducerReplicaBackward"), 3 * buckets) << "bucket_bytes " << bytes;
    loss.backward();
    for (const Tensor& p : net->parameters()) EXPECT_TRUE(p.grad().defined());
  }
}

// The summed gradients stay in their bucket: every master's .grad is a view of
// one buffer (no copy per parameter), and later in-place updates of one
// parameter's gradient leave the others alone.
TEST(DataParallel, SummedGradientsAreKeptAsViewsOfTheirBucket) {
  manual_seed(kSeed);
  ModulePtr net = make_mlp();
  auto dp = data_parallel(net, 3);
  auto data = make_batches(kMlpSpec, {6});
  F::cross_entropy(dp->forward(data[0].x), data[0].y).backward();
  std::vector<Tensor> grads;
  for (const Tensor& p : net->parameters()) grads.push_back(p.grad());
  ASSERT_GT(grads.size(), 2u);
  for (const Tensor& g : grads) {
    ASSERT_TRUE(g.defined());
    EXPECT_EQ(g.storage().get(), grads[0].storage().get());
  }
  std::vector<std::vector<float>> before;
  for (const Tensor& g : grads) before.push_back(g.contiguous().to_vector<float>());
  grads[0].mul_(2.0);
  for (size_t i = 1; i < grads.size(); ++i) EXPECT_EQ(grads[i].contiguous().to_vector<float>(), before[i]);
  EXPECT_LE(rel_err(grads[0], from_vector(before[0], grads[0].sizes()) * 2.0), 1e-7);
}

TEST(DataParallel, StateDictNamesAreThePlainModules) {
  manual_seed(kSeed);
  ModulePtr plain = make_cnn();
  manual_seed(kSeed);
  auto dp = data_parallel(make_cnn(), 3);
  EXPECT_EQ(names(dp->state_dict()), names(plain->state_dict()));
  EXPECT_EQ(names(dp->named_parameters()), names(plain->named_parameters()));
  // The optimizer sees the master parameters only, not one copy per replica.
  EXPECT_EQ(dp->parameters().size(), plain->parameters().size());
  for (const Tensor& p : dp->parameters()) EXPECT_EQ(p.device(), cpu_device(0));
  // And a checkpoint moves between the two.
  dp->load_state_dict(plain->state_dict());
}

// 7 over 3 devices is split 3, 2, 2; a batch of 1 over 4 devices uses one replica.
TEST(DataParallel, UnevenAndTinyBatchesMatch) {
  expect_dp_matches_plain(make_mlp, kMlpSpec, {7, 7, 7, 7, 7}, {3});
  expect_dp_matches_plain(make_mlp, kMlpSpec, {1, 1, 1, 1, 1}, {4});
  // Batch sizes changing from step to step (a short last batch).
  expect_dp_matches_plain(make_mlp, kMlpSpec, {8, 1, 8, 2, 5}, {4});
}

TEST(DataParallel, ChunksAreAsEqualAsPossible) {
  manual_seed(kSeed);
  DataParallel dp(make_mlp(), cpus(3), {.gather_output = false});
  Value outs = dp.forward_value(Value(randn({7, 2, 3, 3})));
  ASSERT_EQ(outs.list().size(), 3u);
  EXPECT_EQ(outs[0].tensor().size(0), 3);
  EXPECT_EQ(outs[1].tensor().size(0), 2);
  EXPECT_EQ(outs[2].tensor().size(0), 2);
}

// A forward on a small batch (fewer replicas) must not make the idle replicas
// miss the optimizer's update for the next full batch.
TEST(DataParallel, IdleReplicasCatchUpAfterASmallBatch) {
  auto data = make_batches(kMlpSpec, {8});
  manual_seed(7);
  Tensor probe_small = randn({1, 2, 3, 3}), probe = randn({8, 2, 3, 3});
  auto run = [&](bool dp) {
    manual_seed(kSeed);
    ModulePtr m = make_mlp();
    ModulePtr model = dp ? data_parallel(m, 4) : m;
    optim::SGD opt(model->parameters(), optim::SGDOptions{.lr = 0.5});
    F::cross_entropy(model->forward(data[0].x), data[0].y).backward();
    opt.step();
    NoGradGuard ng;
    model->forward(probe_small);  // uses only the replica on cpu:0
    return model->forward(probe);  // uses all four
  };
  EXPECT_LE(rel_err(run(true), run(false)), kTol);
}

TEST(DataParallel, LoadStateDictReachesTheReplicas) {
  manual_seed(kSeed);
  ModulePtr other = make_mlp();  // different weights from the one below
  manual_seed(kSeed + 1);
  auto dp = data_parallel(make_mlp(), 3);
  Tensor x = randn({6, 2, 3, 3});
  dp->forward(x);  // replicas synced with the old weights
  dp->load_state_dict(other->state_dict());
  EXPECT_LE(rel_err(dp->forward(x), other->forward(x)), kTol);
}

// ---- batch norm: buffers and train/eval ----------------------------------------------

// In eval mode every replica must normalise with the master's running
// statistics, so DP's output equals the plain module's exactly; and the mode
// follows the wrapped module however it was set.
TEST(DataParallelBatchNorm, EvalUsesTheMastersRunningStatistics) {
  manual_seed(kSeed);
  auto net = std::make_shared<models::SmallCNN>(models::ModelSpec{{1, 8, 8}, 3});
  auto dp = std::make_shared<DataParallel>(net, cpus(3));
  auto replica_modes = [&](bool training) {
    for (const auto& m : dp->replica(2)->modules())
      EXPECT_EQ(m->is_training(), training) << m->type_name() << " on the replica on cpu:2";
  };
  Tensor x = randn({6, 1, 8, 8}) * 3.0 + 1.0;
  dp->forward(x);  // train mode: moves the running statistics away from 0 / 1
  dp->eval();
  {
    NoGradGuard ng;
    Tensor got = dp->forward(x), ref = net->forward(x);
    EXPECT_LE(rel_err(got, ref), kTol);
  }
  replica_modes(false);
  net->train();  // on the wrapped module, not the wrapper
  dp->forward(x);
  replica_modes(true);
}

// ---- nested (table) inputs and outputs ---------------------------------------------

// {"a": [B, 4], "b": [[B, 4], [B, 4]]} -> [fa(a) + fb(b0), tanh(fb(b1)) * a[:, :3]]
class TableNet : public nn::Module {
 public:
  explicit TableNet(nn::NoOptions = {}) : Module("TableNet") {
    fa_ = register_module("fa", std::make_shared<nn::Linear>(4, 3));
    fb_ = register_module("fb", std::make_shared<nn::Linear>(4, 3));
  }
  Value forward_value(const Value& x) override {
    const Tensor& a = x["a"].tensor();
    const Tensor& b0 = x["b"][0].tensor();
    const Tensor& b1 = x["b"][1].tensor();
    Tensor first = fa_->forward(a) + fb_->forward(b0);
    Tensor second = fb_->forward(b1).tanh() * a.narrow(1, 0, 3);
    return Value{first, second};
  }
  nn::NoOptions options_for_clone() const { return {}; }
  CHORUS_MODULE_CLONEABLE(TableNet)
 private:
  std::shared_ptr<nn::Linear> fa_, fb_;
};

TEST(DataParallel, NestedInputsAndOutputs) {
  manual_seed(kSeed);
  auto net = std::make_shared<TableNet>();
  DataParallel dp(net, cpus(3));
  const int64_t batch = 5;
  auto inputs = [&] {
    manual_seed(5);
    Tensor a = randn({batch, 4}).requires_grad_();
    Tensor b0 = randn({batch, 4}), b1 = randn({batch, 4});
    return std::vector<Tensor>{a, b0, b1};
  };
  auto table = [](const std::vector<Tensor>& t) { return Value(Value::Map{{"a", t[0]}, {"b", Value{t[1], t[2]}}}); };
  manual_seed(6);
  Tensor w0 = randn({batch, 3}), w1 = randn({batch, 3});
  auto loss_of = [&](const Value& out) { return (out[0].tensor() * w0).sum() + (out[1].tensor() * w1).sum(); };

  // Direct.
  auto in_ref = inputs();
  Value ref = net->forward_value(table(in_ref));
  loss_of(ref).backward();
  nn::NamedTensors ref_grads;
  for (const auto& [n, p] : net->named_parameters()) ref_grads.emplace_back(n, p.grad().clone());
  Tensor ref_input_grad = in_ref[0].grad().clone();
  net->zero_grad();

  // Through DataParallel: same structure back, same values, same gradients.
  auto in_dp = inputs();
  Value got = dp.forward_value(table(in_dp));
  ASSERT_TRUE(got.is_list());
  ASSERT_EQ(got.list().size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(got[i].tensor().device(), cpu_device(0));
    EXPECT_LE(rel_err(got[i].tensor(), ref[i].tensor()), kTol) << "output " << i;
  }
  loss_of(got).backward();
  for (const auto& [n, g] : ref_grads) {
    Tensor p;
    for (const auto& [m, q] : net->named_parameters())
      if (m == n) p = q;
    ASSERT_TRUE(p.grad().defined()) << n;
    EXPECT_LE(rel_err(p.grad(), g), kTol) << n;
  }
  // The scatter is differentiable too: the input's gradient comes back.
  ASSERT_TRUE(in_dp[0].grad().defined());
  EXPECT_LE(rel_err(in_dp[0].grad(), ref_input_grad), kTol);
}

// ---- DP as one layer of a larger network -------------------------------------------

TEST(DataParallel, NestedInsideASequential) {
  auto build = [](bool dp) -> ModulePtr {
    ModulePtr middle = seq({std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(16, 16)});
    if (dp) middle = data_parallel(middle, 3);
    return seq({std::make_shared<nn::Flatten>(), std::make_shared<nn::Linear>(18, 16), middle,
                std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(16, 5)});
  };
  auto data = make_batches(kMlpSpec, {9, 9, 8, 9});
  TrainRun ref = train([&] { return build(false); }, data);
  TrainRun got = train([&] { return build(true); }, data);
  expect_same_run(got, ref, "Sequential{..., DataParallel(Sequential{ReLU, Linear}), ...}");
}

// ---- shared parameters --------------------------------------------------------------

TEST(DataParallel, SharedParametersGetEveryContribution) {
  auto data = make_batches(kMlpSpec, {9, 9, 9, 9});
  auto tied = [] { return std::make_shared<TiedTwice>(); };
  TrainRun ref = train(tied, data);
  TrainRun got = train([&] { return data_parallel(tied(), 3); }, data);
  expect_same_run(got, ref, "one Linear applied twice");

  // The same child registered twice in a Sequential: one parameter, two uses.
  auto shared_seq = [] {
    auto lin = std::make_shared<nn::Linear>(18, 18);
    return seq({std::make_shared<nn::Flatten>(), lin, std::make_shared<nn::ReLU>(), lin,
                std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(18, 5)});
  };
  TrainRun ref2 = train(shared_seq, data);
  TrainRun got2 = train([&] { return data_parallel(shared_seq(), 3); }, data);
  EXPECT_EQ(names(ref2.state), (std::vector<std::string>{"1.weight", "1.bias", "5.weight", "5.bias"}));
  expect_same_run(got2, ref2, "one Linear registered twice in a Sequential");
}

// ---- failures -----------------------------------------------------------------------

// Throws from its replica on cpu:2 only; the message itself does not name it.
class FailsOnCpu2 : public nn::Module {
 public:
  explicit FailsOnCpu2(nn::NoOptions = {}) : Module("FailsOnCpu2") {
    lin_ = register_module("lin", std::make_shared<nn::Linear>(4, 2));
  }
  Tensor forward(const Tensor& x) override {
    if (x.device() == Device("cpu:2")) CHORUS_THROW(ValueError, "the replica exploded");
    return lin_->forward(x);
  }
  nn::NoOptions options_for_clone() const { return {}; }
  CHORUS_MODULE_CLONEABLE(FailsOnCpu2)
 private:
  std::shared_ptr<nn::Linear> lin_;
};

TEST(DataParallel, ExceptionOnOneReplicaReachesTheCaller) {
  DataParallel dp(std::make_shared<FailsOnCpu2>(), cpus(3));
  try {
    dp.forward(randn({6, 4}));
    FAIL() << "expected chorus::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cpu:2"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("the replica exploded"), std::string::npos) << e.what();
  }
  // The worker threads survive: a batch that never reaches cpu:2 still works.
  EXPECT_EQ(dp.forward(randn({2, 4})).sizes(), (Shape{2, 2}));
}

template <typename Fn>
void expect_value_error(Fn&& fn, const std::vector<std::string>& needles) {
  try {
    fn();
    ADD_FAILURE() << "expected ValueError mentioning " << needles[0];
  } catch (const ValueError& e) {
    for (const auto& n : needles) EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what();
  }
}

TEST(DataParallel, BadArgumentsAreValueErrors) {
  expect_value_error([] { (void)DataParallel(make_mlp(), {}); }, {"device list is empty"});
  expect_value_error([] { (void)DataParallel(make_mlp(), {Device("cpu:0"), Device("cpu:1"), Device("cpu:0")}); },
                     {"cpu:0", "twice"});
  expect_value_error(
      [] {
        ModulePtr m = make_mlp();
        m->to(Device("cpu:1"));
        (void)DataParallel(m, cpus(2));
      },
      {"cpu:1", "first device", "cpu:0"});
  expect_value_error([] { (void)DataParallel(nullptr, cpus(2)); }, {"null"});
  expect_value_error([] { (void)DataParallel(make_mlp(), cpus(2), {.bucket_bytes = -1}); },
                     {"bucket_bytes", ">= 0", "-1"});
  expect_value_error(
      [] {
        DataParallel dp(make_mlp(), cpus(2), {.dim = 3});
        dp.forward(randn({4, 18}));
      },
      {"DataParallel", "dim 3", "out of range"});
  expect_value_error(
      [] {
        DataParallel dp(make_mlp(), cpus(2));
        dp.forward(randn({0, 18}));
      },
      {"empty"});
}

// ---- per-replica outputs --------------------------------------------------------------

TEST(DataParallel, UngatheredOutputsStayOnTheirDevices) {
  manual_seed(kSeed);
  ModulePtr m = make_mlp();
  DataParallel dp(m, cpus(3), {.gather_output = false});
  Tensor x = randn({9, 2, 3, 3});
  Value outs = dp.forward_value(Value(x));
  ASSERT_TRUE(outs.is_list());
  ASSERT_EQ(outs.list().size(), 3u);
  Tensor ref = m->forward(x);
  for (int r = 0; r < 3; ++r) {
    const Tensor& o = outs[r].tensor();
    EXPECT_EQ(o.device(), cpu_device(r));
    EXPECT_LE(rel_err(o.to(cpu_device(0)), ref.narrow(0, 3 * r, 3)), kTol) << "replica " << r;
  }
  // A per-replica loss, summed across devices, trains the one master model.
  Tensor loss = outs[0].tensor().pow(2).sum() + outs[1].tensor().pow(2).sum() + outs[2].tensor().pow(2).sum();
  loss.backward();
  for (const Tensor& p : dp.parameters()) EXPECT_TRUE(p.grad().defined());
  // The single-tensor forward needs a gathered output.
  EXPECT_THROW(dp.forward(x), ValueError);
}

// ---- replicas follow the optimizer ----------------------------------------------------

TEST(DataParallel, ReplicasPickUpNewParametersWithoutAnyCall) {
  manual_seed(kSeed);
  auto dp = std::make_shared<DataParallel>(make_mlp(), cpus(3));
  optim::SGD opt(dp->parameters(), optim::SGDOptions{.lr = 0.5, .momentum = 0.9});
  auto data = make_batches(kMlpSpec, {6, 6});
  auto replica_params = [&] { return dp->replica(1)->named_parameters(); };
  for (const Batch& b : data) {
    opt.zero_grad();
    F::cross_entropy(dp->forward(b.x), b.y).backward();
    opt.step();
    // Right after the step the replica still holds the old weights...
    auto master = dp->named_parameters();
    auto before = replica_params();
    ASSERT_EQ(names(before), names(master));
    EXPECT_GT(rel_err(before[0].second, master[0].second), 1e-4);
    // ... and the next forward brings it up to date.
    dp->forward(b.x);
    auto after = replica_params();
    for (size_t i = 0; i < master.size(); ++i) {
      EXPECT_EQ(after[i].second.device(), cpu_device(1)) << master[i].first;
      EXPECT_EQ(rel_err(after[i].second.to(cpu_device(0)), master[i].second), 0.0) << master[i].first;
    }
  }
}

// ---- gradients: the flat path (Note [DataParallel flat buffers]) ------------------

// The gradients the named parameters of `params_of` hold, cloned.
nn::NamedTensors grads_of(const ModulePtr& m) {
  nn::NamedTensors out;
  for (const auto& [n, p] : m->named_parameters()) out.emplace_back(n, p.grad().defined() ? p.grad().clone() : Tensor());
  return out;
}

void expect_same_grads(const nn::NamedTensors& got, const nn::NamedTensors& ref, double tol = kTol) {
  ASSERT_EQ(names(got), names(ref));
  for (size_t i = 0; i < ref.size(); ++i) {
    ASSERT_EQ(got[i].second.defined(), ref[i].second.defined()) << ref[i].first;
    if (ref[i].second.defined()) EXPECT_LE(rel_err(got[i].second, ref[i].second), tol) << ref[i].first;
  }
}

// lin is used by every forward; unused never; extra only by the replica on cpu:1.
class PartlyUsed : public nn::Module {
 public:
  explicit PartlyUsed(nn::NoOptions = {}) : Module("PartlyUsed") {
    lin = register_module("lin", std::make_shared<nn::Linear>(18, 5));
    unused = register_module("unused", std::make_shared<nn::Linear>(18, 5));
    extra = register_module("extra", std::make_shared<nn::Linear>(18, 5));
  }
  Tensor forward(const Tensor& x) override {
    Tensor h = x.flatten(1);
    Tensor y = lin->forward(h);
    if (x.device() == Device("cpu:1")) y = y + extra->forward(h);
    return y;
  }
  nn::NoOptions options_for_clone() const { return {}; }
  CHORUS_MODULE_CLONEABLE(PartlyUsed)
  std::shared_ptr<nn::Linear> lin, unused, extra;
};

TEST(DataParallel, UnusedParametersGetNoGradientAndPartlyUsedOnesTheirReplicasSum) {
  for (int64_t bytes : {int64_t{25} << 20, int64_t{1}}) {  // one bucket; one per parameter
    SCOPED_TRACE("bucket_bytes " + std::to_string(bytes));
    manual_seed(kSeed);
    auto net = std::make_shared<PartlyUsed>();
    DataParallel dp(net, cpus(3), {.bucket_bytes = bytes});
    manual_seed(3);
    Tensor x = randn({6, 2, 3, 3}), w = randn({6, 5});
    (dp.forward(x) * w).sum().backward();
    auto got = grads_of(net);
    net->zero_grad();

    // The same function without DP: rows 2..3 are the chunk of the replica on cpu:1.
    Tensor h = x.flatten(1);
    ((net->lin->forward(h) * w).sum() + (net->extra->forward(h.narrow(0, 2, 2)) * w.narrow(0, 2, 2)).sum()).backward();
    auto ref = grads_of(net);
    for (const auto& [n, g] : got)
      if (n.rfind("unused.", 0) == 0) EXPECT_FALSE(g.defined()) << n << " was never used";
    expect_same_grads(got, ref);
  }
}

TEST(DataParallel, TwoBackwardPassesWithoutZeroGradAccumulate) {
  manual_seed(kSeed);
  ModulePtr net = make_cnn();
  auto dp = data_parallel(net, 3);
  auto data = make_batches(kCnnSpec, {7});
  F::cross_entropy(dp->forward(data[0].x), data[0].y).backward();
  auto once = grads_of(net);
  F::cross_entropy(dp->forward(data[0].x), data[0].y).backward();
  auto twice = grads_of(net);
  ASSERT_EQ(names(twice), names(once));
  for (size_t i = 0; i < once.size(); ++i) {
    ASSERT_TRUE(once[i].second.defined()) << once[i].first;
    EXPECT_LE(rel_err(twice[i].second, once[i].second * 2.0), kTol) << once[i].first;
  }
}

TEST(DataParallel, NoGradForwardRecordsNothing) {
  manual_seed(kSeed);
  ModulePtr net = make_mlp();
  DataParallel dp(net, cpus(3));
  const TensorList masters = dp.parameters();
  Tensor x = randn({6, 2, 3, 3});
  auto expect_masters = [&](const char* when) {
    SCOPED_TRACE(when);
    TensorList now = dp.parameters();
    ASSERT_EQ(now.size(), masters.size());
    for (size_t i = 0; i < now.size(); ++i) {
      EXPECT_TRUE(now[i].is_same(masters[i])) << "parameter " << i;
      EXPECT_TRUE(now[i].is_leaf()) << "parameter " << i;
    }
  };
  {
    NoGradGuard no_grad;
    Tensor y = dp.forward(x);
    EXPECT_FALSE(y.requires_grad());
    for (size_t r = 0; r < 3; ++r)
      for (const Tensor& p : dp.replica(r)->parameters()) EXPECT_EQ(p.grad_fn(), nullptr) << "replica " << r;
    expect_masters("after a forward under NoGradGuard");
  }
  // With grad, replica 0 runs on recorded aliases of the masters during the
  // forward only: the wrapped module holds its masters again afterwards.
  Tensor y = dp.forward(x);
  EXPECT_TRUE(y.requires_grad());
  expect_masters("after a forward with grad");
  for (size_t r = 1; r < 3; ++r)
    for (const Tensor& p : dp.replica(r)->parameters()) EXPECT_NE(p.grad_fn(), nullptr) << "replica " << r;
  y.sum().backward();
  for (const Tensor& p : masters) EXPECT_TRUE(p.grad().defined());
}

TEST(DataParallel, SharedParameterGradientsEqualTheSingleDevices) {
  auto x_w = [] {
    manual_seed(11);
    Tensor x = randn({7, 2, 3, 3}), w = randn({7, 5});
    return std::pair{x, w};
  };
  auto [x, w] = x_w();
  manual_seed(kSeed);
  ModulePtr ref_net = std::make_shared<TiedTwice>();
  (ref_net->forward(x) * w).sum().backward();
  manual_seed(kSeed);
  ModulePtr net = std::make_shared<TiedTwice>();
  DataParallel dp(net, cpus(3));
  (dp.forward(x) * w).sum().backward();
  expect_same_grads(grads_of(net), grads_of(ref_net));
}

// A per-replica loss that leaves one replica out: the backward never reaches
// that replica's node, and must neither wait for it nor lose the others.
TEST(DataParallel, PerReplicaLossOverSomeReplicasOnly) {
  manual_seed(kSeed);
  ModulePtr net = make_mlp();
  DataParallel dp(net, cpus(3), {.gather_output = false});
  Tensor x = randn({9, 2, 3, 3});
  Value outs = dp.forward_value(Value(x));
  (outs[0].tensor().pow(2).sum() + outs[2].tensor().to(cpu_device(0)).pow(2).sum()).backward();
  auto got = grads_of(net);
  net->zero_grad();
  (net->forward(x.narrow(0, 0, 3)).pow(2).sum() + net->forward(x.narrow(0, 6, 3)).pow(2).sum()).backward();
  expect_same_grads(got, grads_of(net));
}

// A forward on frozen parameters (requires_grad off) with a grad-requiring
// input: only the input gets a gradient.
TEST(DataParallel, FrozenParametersGetNoGradient) {
  manual_seed(kSeed);
  ModulePtr net = make_mlp();
  for (Tensor& p : net->parameters()) p.set_requires_grad(false);
  DataParallel dp(net, cpus(3));
  Tensor x = randn({6, 2, 3, 3}).requires_grad_();
  dp.forward(x).sum().backward();
  for (const Tensor& p : net->parameters()) EXPECT_FALSE(p.grad().defined());
  ASSERT_TRUE(x.grad().defined());
  Tensor xr = x.detach().requires_grad_();
  net->forward(xr).sum().backward();
  EXPECT_LE(rel_err(x.grad(), xr.grad()), kTol);
}

// ---- autocast ---------------------------------------------------------------------

// Records the autocast state each replica's forward runs under.
class AutocastProbe : public nn::Module {
 public:
  explicit AutocastProbe(nn::NoOptions = {}) : Module("AutocastProbe") {
    lin_ = register_module("lin", std::make_shared<nn::Linear>(4, 2));
  }
  Tensor forward(const Tensor& x) override {
    seen()[static_cast<size_t>(x.device().index)] = current_autocast();
    return lin_->forward(x);
  }
  static std::vector<std::optional<DType>>& seen() {
    static std::vector<std::optional<DType>> s(8);
    return s;
  }
  nn::NoOptions options_for_clone() const { return {}; }
  CHORUS_MODULE_CLONEABLE(AutocastProbe)
 private:
  std::shared_ptr<nn::Linear> lin_;
};

TEST(DataParallel, ReplicasRunUnderTheCallersAutocast) {
  DataParallel dp(std::make_shared<AutocastProbe>(), cpus(3));
  auto& seen = AutocastProbe::seen();
  {
    AutocastGuard cast(kBFloat16);
    dp.forward(randn({6, 4}));
  }
  for (int r = 0; r < 3; ++r) EXPECT_EQ(seen[static_cast<size_t>(r)], std::optional<DType>(kBFloat16)) << "cpu:" << r;
  dp.forward(randn({6, 4}));
  for (int r = 0; r < 3; ++r) EXPECT_FALSE(seen[static_cast<size_t>(r)].has_value()) << "cpu:" << r;
}

}  // namespace
}  // namespace chorus::parallel
