// parallel::Pipeline (issue 13, item 2) on logical CPU devices: every
// schedule, stage count and micro-batch count gives the loss and gradients of
// the plain model on the whole batch; deferred batch norm gives full-batch
// running statistics; recomputation changes nothing; 1F1B holds fewer
// activations than GPipe; bad input is one clear error. The schedules alone
// (parallel/pipeline_schedule.h) are checked by simulation.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>

#include "chorus/chorus.h"
#include "chorus/core/graph_capture.h"
#include "chorus/parallel/pipeline.h"
#include "testing/devices.h"
#include "testing/expect_error.h"

namespace chorus::parallel {
namespace {

// ---- schedules ------------------------------------------------------------

TEST(PipelineSchedule, EveryTaskOnceAndNoDeadlockForAnyShape) {
  for (Schedule sch : {Schedule::GPipe, Schedule::OneFOneB, Schedule::Interleaved})
    for (int D = 1; D <= 4; ++D)
      for (int v = 1; v <= 3; ++v)
        for (int M : {1, 2, 3, 4, 5, 8}) {
          if (sch == Schedule::OneFOneB && v > 1) continue;
          const int S = D * v;
          auto lists = make_schedule(sch, D, S, M);
          ASSERT_EQ(lists.size(), static_cast<size_t>(D));
          std::map<std::tuple<int, int, int>, int> seen;
          for (int d = 0; d < D; ++d)
            for (const PipeTask& t : lists[static_cast<size_t>(d)]) {
              EXPECT_EQ(t.stage % D, d) << task_str(t) << " on device " << d;
              ++seen[{t.kind, t.stage, t.micro}];
            }
          EXPECT_EQ(seen.size(), static_cast<size_t>(2 * S * M)) << schedule_name(sch) << " D" << D << " v" << v;
          for (auto& [k, n] : seen) EXPECT_EQ(n, 1);
          SimulatedRun r = simulate(lists, S, M);
          EXPECT_FALSE(r.deadlock) << schedule_name(sch) << " D" << D << " v" << v << " M" << M;
        }
}

TEST(PipelineSchedule, BubblesAndActivationsAsTheoryHas) {
  for (int D : {2, 4})
    for (int M : {1, 4, 8}) {
      SimulatedRun g = simulate(make_schedule(Schedule::GPipe, D, D, M), D, M);
      SimulatedRun f = simulate(make_schedule(Schedule::OneFOneB, D, D, M), D, M);
      const double bound = static_cast<double>(D - 1) / (M + D - 1);  // GPipe's bubble
      EXPECT_NEAR(g.bubble, bound, 1e-9) << "D" << D << " M" << M;
      EXPECT_NEAR(f.bubble, bound, 1e-9) << "1F1B has GPipe's bubble, D" << D << " M" << M;
      for (int d = 0; d < D; ++d) {
        EXPECT_EQ(g.max_in_flight[static_cast<size_t>(d)], M);
        EXPECT_EQ(f.max_in_flight[static_cast<size_t>(d)], std::min(M, D - d));
      }
      // Two virtual stages per device: a smaller bubble than 1F1B's.
      if (M % D == 0 && M > 1) {
        SimulatedRun in = simulate(make_schedule(Schedule::Interleaved, D, 2 * D, M), 2 * D, M);
        EXPECT_LT(in.bubble, f.bubble) << "D" << D << " M" << M;
      }
    }
}

// Note [Pipeline links]: over processes NCCL matches a link's messages by
// their order alone, so every schedule must send each link's messages in the
// order the receiver takes them -- the interleaved ring (the last device's
// activations back to device 0) included, and micro-batch counts that are
// not a multiple of the devices (a longer warm-up).
TEST(PipelineSchedule, EveryLinkSendsInTheOrderItsReceiverNeeds) {
  for (Schedule sch : {Schedule::GPipe, Schedule::OneFOneB, Schedule::Interleaved})
    for (int D = 1; D <= 4; ++D)
      for (int v = 1; v <= 3; ++v)
        for (int M = 1; M <= 9; ++M) {
          if (sch == Schedule::OneFOneB && v > 1) continue;
          EXPECT_EQ(link_order_mismatch(make_schedule(sch, D, D * v, M), D * v), "")
              << schedule_name(sch) << " D" << D << " v" << v << " M" << M;
          auto fwd = forward_lists(D, D * v, M);
          EXPECT_EQ(link_order_mismatch(fwd, D * v), "") << "forwards only, D" << D << " v" << v << " M" << M;
          EXPECT_FALSE(simulate(fwd, D * v, M).deadlock);
        }
  // Two sends on the activations' link 0 -> 1 swapped: device 1 needs micro-batch 0 first.
  auto lists = make_schedule(Schedule::Interleaved, 2, 4, 4);
  std::swap(lists[0][0], lists[0][1]);
  EXPECT_NE(link_order_mismatch(lists, 4).find("activations from device 0 to 1"), std::string::npos);
  // Rank 1's backwards of stages 1 and 3 swapped: the gradients to device 0 leave in another order.
  lists = make_schedule(Schedule::Interleaved, 2, 4, 2);
  auto& l1 = lists[1];
  const auto b3 = std::find(l1.begin(), l1.end(), PipeTask{PipeTask::Backward, 3, 1});
  const auto b1 = std::find(l1.begin(), l1.end(), PipeTask{PipeTask::Backward, 1, 0});
  ASSERT_TRUE(b3 != l1.end() && b1 != l1.end());
  std::iter_swap(b3, b1);
  EXPECT_NE(link_order_mismatch(lists, 4).find("gradients from device 1 to 0"), std::string::npos);
}

TEST(PipelineSchedule, BadShapesAreClearErrors) {
  EXPECT_TRUE(test::throws_naming([] { parse_schedule("zigzag"); }, {"zigzag", "gpipe, 1f1b, interleaved"}));
  EXPECT_TRUE(test::throws_naming([] { make_schedule(Schedule::OneFOneB, 2, 4, 4); }, {"1f1b", "interleaved"}));
  EXPECT_TRUE(test::throws_naming([] { make_schedule(Schedule::GPipe, 2, 3, 4); }, {"3 stages", "2 devices"}));
  EXPECT_TRUE(test::throws_naming([] { make_schedule(Schedule::GPipe, 2, 2, 0); }, {"micro-batches"}));
}

// ---- equality with the plain model ----------------------------------------

std::shared_ptr<nn::Sequential> mlp(int64_t seed) {
  manual_seed(static_cast<uint64_t>(seed));
  return std::make_shared<nn::Sequential>(std::initializer_list<nn::ModulePtr>{
      std::make_shared<nn::Linear>(12, 16), std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(16, 16),
      std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(16, 16), std::make_shared<nn::ReLU>(),
      std::make_shared<nn::Linear>(16, 12), std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(12, 5)});
}

using test::cpus;

double max_rel(const Tensor& a, const Tensor& b) {
  const auto x = a.to(cpu_device()).to(kFloat64).to_vector<double>();
  const auto y = b.to(cpu_device()).to(kFloat64).to_vector<double>();
  double scale = 1e-12, diff = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    scale = std::max(scale, std::abs(y[i]));
    diff = std::max(diff, std::abs(x[i] - y[i]));
  }
  return diff / scale;
}

Tensor ce(const Tensor& out, const Tensor& t) { return nn::functional::cross_entropy(out, t); }

// Reference: the plain model's loss on the whole batch, and its gradients.
struct Reference {
  double loss;
  NamedTensors grads;
};
Reference plain(const std::shared_ptr<nn::Sequential>& model, const Tensor& x, const Tensor& y) {
  model->zero_grad();
  Tensor loss = ce(model->forward(x), y);
  loss.backward();
  Reference r{loss.item<double>(), {}};
  for (auto& [n, p] : model->named_parameters()) r.grads.emplace_back(n, p.grad().clone());
  return r;
}

void expect_matches(const Reference& ref, const Pipeline& pipe, double loss, const std::string& what,
                    double tol = 1e-5) {
  EXPECT_LE(std::abs(loss - ref.loss) / std::abs(ref.loss), tol) << what << ": loss " << loss << " vs " << ref.loss;
  const NamedTensors got = pipe.named_parameters();
  ASSERT_EQ(got.size(), ref.grads.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].first, ref.grads[i].first) << what << ": state_dict names depend on the pipeline";
    ASSERT_TRUE(got[i].second.grad().defined()) << what << ": " << got[i].first << " has no gradient";
    EXPECT_LE(max_rel(got[i].second.grad(), ref.grads[i].second), tol) << what << ": gradient of " << got[i].first;
  }
}

TEST(Pipeline, EverySchedulesStagesAndMicroBatchesMatchThePlainModel) {
  manual_seed(7);
  const Tensor x = randn({10, 12});  // 10 samples: uneven micro-batches for M = 4 and 8
  const Tensor y = randint(0, 5, {10});
  const Reference ref = plain(mlp(3), x, y);
  for (Schedule sch : {Schedule::GPipe, Schedule::OneFOneB, Schedule::Interleaved})
    for (int S : {2, 3, 4})
      for (int M : {1, 2, 4, 8}) {
        // Interleaved: two virtual stages per device where S is even, else S on one device.
        const int D = sch == Schedule::Interleaved ? (S % 2 == 0 ? S / 2 : 1) : S;
        PipelineOptions o;
        o.micro_batches = M;
        o.schedule = sch;
        o.virtual_stages = S / D;
        Pipeline pipe(mlp(3), {}, cpus(D), o);
        ASSERT_EQ(pipe.num_stages(), S);
        pipe.zero_grad();
        auto r = pipe.train_step(x, y, ce);
        const std::string what = schedule_name(sch) + " S" + std::to_string(S) + " M" + std::to_string(M);
        expect_matches(ref, pipe, r.loss.item<double>(), what);
        EXPECT_EQ(r.output.device(), pipe.stage_device(S - 1)) << what;
        EXPECT_EQ(r.output.size(0), 10) << what;
      }
}

// keep_output = false: the same loss and gradients, no joined output.
TEST(Pipeline, WithoutKeptOutputTheStepIsTheSame) {
  manual_seed(9);
  const Tensor x = randn({10, 12});
  const Tensor y = randint(0, 5, {10});
  const Reference ref = plain(mlp(3), x, y);
  for (Schedule sch : {Schedule::GPipe, Schedule::OneFOneB, Schedule::Interleaved}) {
    PipelineOptions o;
    o.micro_batches = 4;
    o.schedule = sch;
    o.keep_output = false;
    Pipeline pipe(mlp(3), {}, cpus(2), o);
    pipe.zero_grad();
    auto r = pipe.train_step(x, y, ce);
    expect_matches(ref, pipe, r.loss.item<double>(), schedule_name(sch));
    EXPECT_FALSE(r.output.defined()) << schedule_name(sch);
  }
}

// evaluate(): the forwards only, for validation -- the plain model's loss on
// the whole batch (uneven micro-batches too, and more micro-batches than
// samples), no gradient anywhere, no graph kept.
TEST(Pipeline, EvaluateGivesThePlainLossWithoutGradients) {
  manual_seed(8);
  const Tensor x = randn({10, 12});
  const Tensor y = randint(0, 5, {10});
  const Reference ref = plain(mlp(3), x, y);
  for (Schedule sch : {Schedule::GPipe, Schedule::OneFOneB, Schedule::Interleaved})
    for (int M : {1, 4, 16}) {
      PipelineOptions o;
      o.micro_batches = M;
      o.schedule = sch;
      Pipeline pipe(mlp(3), {}, cpus(2), o);
      const std::string what = schedule_name(sch) + " M" + std::to_string(M);
      const Tensor loss = pipe.evaluate(x, y, ce);
      ASSERT_TRUE(loss.defined()) << what;
      EXPECT_FALSE(loss.requires_grad()) << what;
      EXPECT_LE(std::abs(loss.item<double>() - ref.loss) / std::abs(ref.loss), 1e-5) << what;
      for (const Tensor& p : pipe.parameters()) EXPECT_FALSE(p.grad().defined()) << what << ": a gradient appeared";
    }
  Pipeline pipe(mlp(3), {}, cpus(2), {.micro_batches = 2});
  EXPECT_TRUE(test::throws_naming([&] { (void)pipe.evaluate(x, y.narrow(0, 0, 4), ce); }, {"for a batch of 10"}));
}

TEST(Pipeline, LayersRunOnTheirStagesDevices) {
  Pipeline pipe(mlp(3), {3, 2, 4}, cpus(3), {.micro_batches = 2});
  EXPECT_EQ(pipe.balance(), (std::vector<int64_t>{3, 2, 4}));
  const NamedTensors ps = pipe.named_parameters();
  EXPECT_EQ(ps[0].first, "0.weight");
  EXPECT_EQ(ps[0].second.device(), cpu_device(0));   // layer 0: stage 0
  EXPECT_EQ(ps[2].second.device(), cpu_device(0));   // layer 2: stage 0
  EXPECT_EQ(ps[4].second.device(), cpu_device(1));   // layer 4: stage 1
  EXPECT_EQ(ps[6].second.device(), cpu_device(2));   // layer 6: stage 2
}

TEST(Pipeline, StagesGivenAsSequentialsAreOneModel) {
  manual_seed(8);
  const Tensor x = randn({6, 12});
  const Tensor y = randint(0, 5, {6});
  const Reference ref = plain(mlp(4), x, y);
  auto whole = mlp(4);
  auto first = std::make_shared<nn::Sequential>(), second = std::make_shared<nn::Sequential>();
  for (size_t l = 0; l < whole->size(); ++l) (l < 3 ? first : second)->push_back((*whole)[l]);
  Pipeline pipe({first, second}, cpus(2), {.micro_batches = 3});
  EXPECT_EQ(pipe.balance(), (std::vector<int64_t>{3, 6}));
  pipe.zero_grad();
  auto r = pipe.train_step(x, y, ce);
  expect_matches(ref, pipe, r.loss.item<double>(), "stages as Sequentials");  // names 0.weight ... 8.weight
  EXPECT_TRUE(test::throws_naming([&] { Pipeline({first, std::make_shared<nn::Sequential>()}, cpus(2)); },
                                  {"stage 1 is empty"}));
}

TEST(Pipeline, ForwardIsDifferentiableThroughEveryStage) {
  manual_seed(9);
  const Tensor x = randn({6, 12});
  const Tensor y = randint(0, 5, {6});
  const Reference ref = plain(mlp(4), x, y);
  Pipeline pipe(mlp(4), {}, cpus(3), {.micro_batches = 3, .schedule = Schedule::GPipe});
  pipe.zero_grad();
  Tensor loss = ce(pipe.forward(x), y);
  EXPECT_EQ(loss.device(), cpu_device(2));
  loss.backward();
  expect_matches(ref, pipe, loss.item<double>(), "forward() + backward()");
}

TEST(Pipeline, TrainingStepsMatchThePlainModelUnderSGD) {
  manual_seed(11);
  const Tensor x = randn({8, 12});
  const Tensor y = randint(0, 5, {8});
  auto a = mlp(5);
  Pipeline pipe(mlp(5), {}, cpus(2), {.micro_batches = 4, .schedule = Schedule::OneFOneB});
  optim::SGD oa(a->parameters(), {.lr = 0.1, .momentum = 0.9});
  optim::SGD ob(pipe.parameters(), {.lr = 0.1, .momentum = 0.9});
  for (int step = 0; step < 5; ++step) {
    oa.zero_grad();
    ce(a->forward(x), y).backward();
    oa.step();
    ob.zero_grad();
    pipe.train_step(x, y, ce);
    ob.step();
  }
  const NamedTensors pa = a->named_parameters(), pb = pipe.named_parameters();
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_LE(max_rel(pb[i].second, pa[i].second), 1e-5) << pa[i].first;
}

// ---- batch norm, recomputation ------------------------------------------

std::shared_ptr<nn::Sequential> cnn(int64_t seed) {
  manual_seed(static_cast<uint64_t>(seed));
  return std::make_shared<nn::Sequential>(std::initializer_list<nn::ModulePtr>{
      std::make_shared<nn::Conv2d>(nn::Conv2dOptions{2, 4, 3, 1, 1}), std::make_shared<nn::BatchNorm2d>(4),
      std::make_shared<nn::ReLU>(), std::make_shared<nn::Conv2d>(nn::Conv2dOptions{4, 4, 3, 1, 1}),
      std::make_shared<nn::BatchNorm2d>(4), std::make_shared<nn::ReLU>(), std::make_shared<nn::Flatten>(),
      std::make_shared<nn::Linear>(4 * 5 * 5, 3)});
}

TEST(Pipeline, DeferredBatchNormKeepsFullBatchStatistics) {
  manual_seed(13);
  const Tensor x = randn({12, 2, 5, 5});
  const Tensor y = randint(0, 3, {12});
  const int M = 4;
  // The plain model on each micro-batch (what the layers compute), weighted as the pipeline weights them...
  auto ref = cnn(6);
  ref->zero_grad();
  double loss = 0;
  for (int m = 0; m < M; ++m) {
    Tensor l = ce(ref->forward(x.narrow(0, 3 * m, 3)), y.narrow(0, 3 * m, 3)).mul(0.25);
    l.backward();
    loss += l.item<double>();
  }
  Reference per_micro{loss, {}};
  for (auto& [n, p] : ref->named_parameters()) per_micro.grads.emplace_back(n, p.grad().clone());
  // ...and the running statistics a batch-norm layer gets from the whole
  // batch of what it sees, by the formula: (1 - 0.1) * initial + 0.1 * the
  // statistic, the variance unbiased. Its inputs are the micro-batches as the
  // layers before it compute them (a fresh copy, so nothing is counted twice).
  auto probe = cnn(6);
  std::map<size_t, std::vector<Tensor>> seen;  // layer index -> inputs per micro-batch
  for (int m = 0; m < M; ++m) {
    Tensor h = x.narrow(0, 3 * m, 3);
    for (size_t l = 0; l < probe->size(); ++l) {
      if (l == 1 || l == 4) seen[l].push_back(h.detach());
      h = (*probe)[l]->forward(h);
    }
  }
  NamedTensors want;
  for (size_t l : {size_t{1}, size_t{4}}) {
    const Tensor all = chorus::cat(seen[l], 0);  // [12, 4, 5, 5]
    const double n = static_cast<double>(all.numel() / all.size(1));
    const Tensor mean = all.mean({0, 2, 3});
    const Tensor var = all.sub(mean.view({1, 4, 1, 1})).pow(2).sum({0, 2, 3}).mul(1.0 / (n - 1));
    want.emplace_back(std::to_string(l) + ".running_mean", mean.mul(0.1));
    want.emplace_back(std::to_string(l) + ".running_var", var.mul(0.1).add(0.9));
  }
  for (Schedule sch : {Schedule::GPipe, Schedule::OneFOneB}) {
    PipelineOptions o;
    o.micro_batches = M;
    o.schedule = sch;
    o.deferred_batch_norm = true;
    Pipeline pipe(cnn(6), {3, 5}, cpus(2), o);
    pipe.zero_grad();
    auto r = pipe.train_step(x, y, ce);
    expect_matches(per_micro, pipe, r.loss.item<double>(), "deferred BN " + schedule_name(sch));
    std::map<std::string, Tensor> got;
    for (auto& [n, b] : pipe.named_buffers()) got[n] = b;
    for (const auto& [name, value] : want)
      EXPECT_LE(max_rel(got.at(name), value), 1e-5) << "full-batch statistics: " << name << " " << schedule_name(sch);
    EXPECT_EQ(got.at("1.num_batches_tracked").item<int64_t>(), 1) << "one batch, counted once";
  }
  // Without deferring, the running statistics move once per micro-batch: not the whole batch's.
  Pipeline plain_bn(cnn(6), {3, 5}, cpus(2), {.micro_batches = M});
  plain_bn.train_step(x, y, ce);
  EXPECT_GT(max_rel(plain_bn.named_buffers()[0].second, want[0].second), 1e-3);
  EXPECT_EQ(plain_bn.named_buffers()[2].second.item<int64_t>(), M);
}

// Issue 47, item 2: in float64 the deferred statistics are float64 all the
// way (no round trip through float32, which left them ~1e-7 off): the
// first batch norm sees conv(x) for the whole batch, micro-batch by
// micro-batch, so its running statistics are the full batch's to rounding.
TEST(Pipeline, DeferredBatchNormKeepsFloat64StatisticsInFloat64) {
  manual_seed(14);
  const Tensor x = randn({12, 2, 5, 5}).to(kFloat64);
  const Tensor y = randint(0, 3, {12});
  auto plain_model = cnn(7);
  plain_model->to(kFloat64);
  NamedTensors want;
  {
    NoGradGuard ng;
    const Tensor h = (*plain_model)[0]->forward(x);  // what the first batch norm sees, [12, 4, 5, 5]
    const double n = static_cast<double>(h.numel() / h.size(1));
    const Tensor mean = h.mean({0, 2, 3});
    const Tensor var = h.sub(mean.view({1, 4, 1, 1})).pow(2).sum({0, 2, 3}).mul(1.0 / (n - 1));
    want.emplace_back("1.running_mean", mean.mul(0.1));
    want.emplace_back("1.running_var", var.mul(0.1).add(0.9));
  }
  for (Schedule sch : {Schedule::GPipe, Schedule::OneFOneB}) {
    auto model = cnn(7);
    model->to(kFloat64);
    PipelineOptions o;
    o.micro_batches = 4;
    o.schedule = sch;
    o.deferred_batch_norm = true;
    Pipeline pipe(model, {3, 5}, cpus(2), o);
    pipe.train_step(x, y, ce);
    std::map<std::string, Tensor> got;
    for (auto& [n, b] : pipe.named_buffers()) got[n] = b;
    for (const auto& [name, value] : want) {
      EXPECT_EQ(got.at(name).dtype(), kFloat64) << name;
      EXPECT_LE(max_rel(got.at(name), value), 1e-12) << name << " " << schedule_name(sch);
    }
  }
}

TEST(Pipeline, RecomputationGivesTheSameGradientsAndStatistics) {
  manual_seed(17);
  const Tensor x = randn({8, 2, 5, 5});
  const Tensor y = randint(0, 3, {8});
  auto run = [&](Checkpoint c, Schedule sch) {
    auto model = cnn(8);
    model->push_back(std::make_shared<nn::Dropout>(0.3));  // recomputed with the same mask
    PipelineOptions o;
    o.micro_batches = 4;
    o.schedule = sch;
    o.checkpoint = c;
    auto pipe = std::make_shared<Pipeline>(model, std::vector<int64_t>{4, 5}, cpus(2), o);
    manual_seed(99);
    pipe->train_step(x, y, ce);
    return pipe;
  };
  for (Schedule sch : {Schedule::GPipe, Schedule::OneFOneB}) {
    auto never = run(Checkpoint::Never, sch);
    for (Checkpoint c : {Checkpoint::ExceptLast, Checkpoint::Always}) {
      auto ck = run(c, sch);
      const NamedTensors a = never->named_parameters(), b = ck->named_parameters();
      for (size_t i = 0; i < a.size(); ++i)
        EXPECT_LE(max_rel(b[i].second.grad(), a[i].second.grad()), 1e-6)
            << checkpoint_name(c) << " " << schedule_name(sch) << ": " << a[i].first;
      const NamedTensors ba = never->named_buffers(), bb = ck->named_buffers();
      for (size_t i = 0; i < ba.size(); ++i)
        EXPECT_LE(max_rel(bb[i].second, ba[i].second), 1e-6) << checkpoint_name(c) << ": " << ba[i].first;
    }
  }
}

// ---- memory, measurement ----------------------------------------------------

TEST(Pipeline, OneFOneBHoldsFewerActivationsThanGPipe) {
  manual_seed(19);
  const Tensor x = randn({64, 12});
  const Tensor y = randint(0, 5, {64});
  auto wide = [] {
    manual_seed(2);
    return std::make_shared<nn::Sequential>(std::initializer_list<nn::ModulePtr>{
        std::make_shared<nn::Linear>(12, 512), std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(512, 512),
        std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(512, 512), std::make_shared<nn::ReLU>(),
        std::make_shared<nn::Linear>(512, 5)});
  };
  std::map<Schedule, std::vector<size_t>> peak;
  for (Schedule sch : {Schedule::GPipe, Schedule::OneFOneB}) {
    Pipeline pipe(wide(), {4, 3}, cpus(2), {.micro_batches = 8, .schedule = sch});
    pipe.train_step(x, y, ce);  // warm-up: gradients allocated
    for (int d = 0; d < 2; ++d) backend(cpu_device(d)).reset_peak_bytes(cpu_device(d));
    std::vector<size_t> base;
    for (int d = 0; d < 2; ++d) base.push_back(backend(cpu_device(d)).bytes_in_use(cpu_device(d)));
    pipe.train_step(x, y, ce);
    for (int d = 0; d < 2; ++d)
      peak[sch].push_back(backend(cpu_device(d)).peak_bytes(cpu_device(d)) - base[static_cast<size_t>(d)]);
  }
  std::printf("peak activation bytes over the step, M=8: gpipe cpu:0 %zu cpu:1 %zu | 1f1b cpu:0 %zu cpu:1 %zu\n",
              peak[Schedule::GPipe][0], peak[Schedule::GPipe][1], peak[Schedule::OneFOneB][0],
              peak[Schedule::OneFOneB][1]);
  EXPECT_LT(peak[Schedule::OneFOneB][0], peak[Schedule::GPipe][0]);
  EXPECT_LE(peak[Schedule::OneFOneB][1], peak[Schedule::GPipe][1]);
}

TEST(Pipeline, MeasuredStepReportsBusyTimeAndBubble) {
  manual_seed(23);
  Pipeline pipe(mlp(1), {}, cpus(2), {.micro_batches = 4, .measure = true});
  pipe.train_step(randn({16, 12}), randint(0, 5, {16}), ce);
  const PipelineStats& st = pipe.last_stats();
  ASSERT_EQ(st.busy_ms.size(), 2u);
  EXPECT_GT(st.busy_ms[0], 0);
  EXPECT_GT(st.busy_ms[1], 0);
  EXPECT_GE(st.bubble, 0);
  EXPECT_LT(st.bubble, 1);
  EXPECT_GT(st.step_ms, 0);
}

// Note [Pipelines and CUDA graphs]: inside a capture a pipelined step draws
// nothing from the process's random stream on the host; the reservation it
// makes is an on_each_replay action, so each replay advances the stream by
// exactly what an eager step does (else the program's next batches differ).
TEST(Pipeline, InACaptureTheRandomStreamAdvancesOncePerReplay) {
  manual_seed(29);
  Pipeline pipe(mlp(1), {}, cpus(2), {.micro_batches = 4});
  const Tensor x = randn({16, 12}), y = randint(0, 5, {16});
  const RngState before = default_generator().state();
  pipe.train_step(x, y, ce);
  const uint64_t per_step = default_generator().state().offset - before.offset;
  EXPECT_GT(per_step, 0u);
  pipe.train_step(x, y, ce);
  EXPECT_EQ(default_generator().state().offset - before.offset, 2 * per_step);
  const RngState at_capture = default_generator().state();
  std::vector<std::function<void()>> actions;
  {
    CaptureScope scope;
    pipe.train_step(x, y, ce);
    actions = scope.take_actions();
  }
  EXPECT_EQ(default_generator().state().offset, at_capture.offset) << "the capture drew from the random stream";
  ASSERT_FALSE(actions.empty());
  for (int replay = 1; replay <= 3; ++replay) {
    for (auto& a : actions) a();
    EXPECT_EQ(default_generator().state().offset - at_capture.offset, replay * per_step) << "replay " << replay;
  }
}

// ---- bad input ------------------------------------------------------------------

TEST(Pipeline, BadInputIsOneClearError) {
  EXPECT_TRUE(test::throws_naming([] { Pipeline(mlp(1), {3, 3}, cpus(2)); }, {"3,3", "adds up to 6", "9"}));
  EXPECT_TRUE(test::throws_naming([] { Pipeline(mlp(1), {}, cpus(8), {.virtual_stages = 2}); },
                                  {"16 stages", "only 9 layers"}));
  EXPECT_TRUE(
      test::throws_naming([] { Pipeline(mlp(1), {1, 1, 1, 1, 1, 1, 1, 1, 1, 1}, cpus(2)); }, {"10 stages", "9 layers"}));
  EXPECT_TRUE(test::throws_naming([] { Pipeline(mlp(1), {4, 5}, {cpu_device(0), Device("cpu:99")}); }, {"cpu:99"}));
  EXPECT_TRUE(test::throws_naming([] { Pipeline(mlp(1), {4, 5}, {cpu_device(0), cpu_device(0)}); },
                                  {"cpu:0", "listed twice"}));
  EXPECT_TRUE(test::throws_naming([] { Pipeline(mlp(1), {2, 2, 2, 3}, cpus(2), {.schedule = Schedule::OneFOneB}); },
                                  {"1f1b", "interleaved"}));
  EXPECT_TRUE(test::throws_naming(
      [] {
        Pipeline p(mlp(1), {}, cpus(2), {.micro_batches = 8});
        p.train_step(randn({4, 12}), randint(0, 5, {4}), ce);
      },
      {"8 micro-batches", "batch of 4"}));
  // A failure inside a stage names the stage, its device and the micro-batch.
  EXPECT_TRUE(test::throws_naming<Error>(
      [] {
        Pipeline p(mlp(1), {}, cpus(2), {.micro_batches = 2});
        p.train_step(randn({4, 7}), randint(0, 5, {4}), ce);  // 7 features for a Linear(12, ...)
      },
      {"pipeline stage 0", "cpu:0", "micro-batch 0 forward"}));
}

}  // namespace
}  // namespace chorus::parallel
