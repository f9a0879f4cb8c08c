// chorus_ddp_probe: one rank of a DistributedDataParallel test job (started
// by tests/distributed/ddp.sh through chorus launch). Every rank also trains, alone,
// a reference copy of the model on the whole global batch -- the independent
// result DDP must reproduce -- and compares losses and final weights.
//
//   match MODEL      MODEL = mlp | cnn (no batch norm) | cnn-bn-sync (SyncBatchNorm):
//                    5 SGD steps (momentum, weight decay) equal the reference;
//                    each rank starts from different weights (the broadcast
//                    from rank 0 must fix them). PROBE_BUCKET_BYTES small:
//                    many buckets (and the rebuild from rank 0's order);
//                    PROBE_HOOK=bf16: bf16-compressed all-reduce (looser tolerance);
//                    PROBE_HOOK=rank-order: a hook written here against
//                    dist::CommHook (DDPOptions::hook), the average made
//                    from an all_gather in rank order.
//   no_sync          3 micro-steps under no_sync() and a 4th that reduces
//                    equal one step on the 4 micro-batches together.
//   unused           a head used only on some steps and some ranks, and one
//                    never used: equal the reference, whose unused
//                    parameters get no gradient (SGD leaves them alone).
//   mismatch         the last rank builds a wider hidden layer: every rank
//                    gets the error naming that rank and the parameter.
//   modelpar         a model-parallel module (cpu:0 and cpu:1) under DDP.
//   dp               DDP over a DataParallel on cpu:0 and cpu:1 in each process.
//   graphed MODEL    (GPUs: cuda:LOCAL_RANK, NCCL) 20 DDP steps captured as a
//                    CUDA graph and replayed (Note [DDP in a CUDA graph])
//                    equal 20 eager DDP steps of a twin (fp32, deterministic
//                    convolutions, TF32 off: <= 1e-6 relative), the learning
//                    rate changing every step; MODEL = cnn-bn | cnn-bn-sync
//                    (SyncBatchNorm, whose collectives are captured too).
// Prints "rank R: ok ..." and exits 0, or FAIL lines and exits 1.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include <chorus/chorus.h>
#include <chorus/ops/indexing.h>
#include <chorus/data_parallel/comm_hook.h>
#include <chorus/data_parallel/ddp.h>
#include <chorus/distributed/init.h>
#include <chorus/optim/sgd.h>
#include <chorus/parallel/data_parallel.h>
#include <chorus/parallel/graphed_step.h>
#include <chorus/data_parallel/sync_batch_norm.h>
#ifdef CHORUS_WITH_CUDA
#include <chorus/cuda/blas/blas.h>
#endif

using namespace chorus;
namespace F = chorus::nn::functional;

namespace {

int failures = 0;
void expect(bool ok, const std::string& what) {
  if (!ok) {
    ++failures;
    std::fprintf(stderr, "FAIL: %s\n", what.c_str());
  }
}

double rel_err(const Tensor& a, const Tensor& b) {
  Tensor x = a.to(cpu_device(0)).to(kFloat64), y = b.to(cpu_device(0)).to(kFloat64);
  const std::vector<double> u = x.to_vector<double>(), v = y.to_vector<double>();
  double num = 0, den = 0;
  for (size_t i = 0; i < u.size(); ++i) {
    num += (u[i] - v[i]) * (u[i] - v[i]);
    den += v[i] * v[i];
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
}

// A module whose forward takes a per-step flag: the head `aux` is added only
// when `use_aux`; `never` is never used.
class Branchy : public nn::Module {
 public:
  Branchy() : Module("Branchy") {
    fc1 = register_module("fc1", std::make_shared<nn::Linear>(64, 16));
    fc2 = register_module("fc2", std::make_shared<nn::Linear>(16, 4));
    aux = register_module("aux", std::make_shared<nn::Linear>(64, 4));
    never = register_module("never", std::make_shared<nn::Linear>(4, 4));
  }
  Tensor forward(const Tensor& x) override {
    Tensor h = x.flatten(1);
    Tensor out = fc2->forward(relu(fc1->forward(h)));
    return use_aux ? out + aux->forward(h) : out;
  }
  bool use_aux = false;
  std::shared_ptr<nn::Linear> fc1, fc2, aux, never;

 protected:
  std::shared_ptr<Module> make_empty() const override { return std::make_shared<Branchy>(); }
};

// Layers on cpu:0, then cpu:1, moving the activation itself (as PyTorch's
// model-parallel example does).
class TwoDevices : public nn::Module {
 public:
  TwoDevices() : Module("TwoDevices") {
    a = register_module("a", std::make_shared<nn::Linear>(64, 32));
    b = register_module("b", std::make_shared<nn::Linear>(32, 4));
    b->to(Device("cpu:1"));
  }
  Tensor forward(const Tensor& x) override {
    Tensor h = relu(a->forward(x.flatten(1).to(Device("cpu:0"))));
    return b->forward(h.to(Device("cpu:1"))).to(Device("cpu:0"));
  }
  std::shared_ptr<nn::Linear> a, b;

 protected:
  std::shared_ptr<Module> make_empty() const override { return std::make_shared<TwoDevices>(); }
};

nn::ModulePtr build(const std::string& kind, uint64_t seed) {
  manual_seed(seed);
  if (kind == "mlp")
    return std::make_shared<nn::Sequential>(std::initializer_list<nn::ModulePtr>{
        std::make_shared<nn::Flatten>(), std::make_shared<nn::Linear>(64, 32), std::make_shared<nn::ReLU>(),
        std::make_shared<nn::Linear>(32, 4)});
  if (kind == "cnn")
    return std::make_shared<nn::Sequential>(std::initializer_list<nn::ModulePtr>{
        std::make_shared<nn::Conv2d>(nn::Conv2dOptions{1, 6, 3, 1, 1}), std::make_shared<nn::ReLU>(),
        std::make_shared<nn::MaxPool2d>(nn::Pool2dOptions{2}), std::make_shared<nn::Flatten>(),
        std::make_shared<nn::Linear>(6 * 4 * 4, 4)});
  if (kind == "cnn-bn" || kind == "cnn-bn-sync")
    return std::make_shared<nn::Sequential>(std::initializer_list<nn::ModulePtr>{
        std::make_shared<nn::Conv2d>(nn::Conv2dOptions{1, 6, 3, 1, 1, 1, 1, false}),
        std::make_shared<nn::BatchNorm2d>(nn::BatchNorm2dOptions{6}), std::make_shared<nn::ReLU>(),
        std::make_shared<nn::MaxPool2d>(nn::Pool2dOptions{2}), std::make_shared<nn::Flatten>(),
        std::make_shared<nn::Linear>(6 * 4 * 4, 4)});
  if (kind == "branchy") return std::make_shared<Branchy>();
  if (kind == "twodev") return std::make_shared<TwoDevices>();
  if (kind == "wide") {  // the mismatch case: a wider hidden layer
    return std::make_shared<nn::Sequential>(std::initializer_list<nn::ModulePtr>{
        std::make_shared<nn::Flatten>(), std::make_shared<nn::Linear>(64, 48), std::make_shared<nn::ReLU>(),
        std::make_shared<nn::Linear>(48, 4)});
  }
  std::fprintf(stderr, "unknown model %s\n", kind.c_str());
  std::exit(2);
}

constexpr int64_t kGlobal = 12;  // divisible by 1, 2, 3 and 4 ranks
constexpr int kSteps = 5;

std::pair<Tensor, Tensor> global_batch(int step) {
  manual_seed(1000 + step);
  Tensor x = randn({kGlobal, 1, 8, 8});
  Tensor y = randint(0, 4, {kGlobal});
  return {x, y};
}

Tensor rows(const Tensor& t, int rank, int n) {
  const int64_t per = t.size(0) / n;
  return t.narrow(0, rank * per, per);
}

optim::SGD make_sgd(const nn::ModulePtr& m) {
  return optim::SGD(m->parameters(), {.lr = 0.1, .momentum = 0.9, .weight_decay = 1e-3});
}

double mean_over_ranks(dist::ProcessGroup& pg, double v) {
  Tensor t = from_vector(std::vector<double>{v}, {1}, {kFloat64});
  pg.all_reduce(t, dist::ReduceOp::Avg)->wait();
  return t.to_vector<double>()[0];
}

void compare_weights(const nn::ModulePtr& got, const nn::ModulePtr& want, double tol, const std::string& what) {
  double worst = 0;
  std::string where;
  auto g = got->named_parameters(), w = want->named_parameters();
  expect(g.size() == w.size(), what + ": parameter lists differ");
  for (size_t i = 0; i < g.size() && i < w.size(); ++i) {
    expect(g[i].first == w[i].first, what + ": names differ: " + g[i].first + " vs " + w[i].first);
    const double e = rel_err(g[i].second, w[i].second);
    if (e > worst) worst = e, where = g[i].first;
  }
  auto gb = got->named_buffers(), wb = want->named_buffers();
  for (size_t i = 0; i < gb.size() && i < wb.size(); ++i) {
    if (!is_floating(gb[i].second.dtype())) continue;
    const double e = rel_err(gb[i].second, wb[i].second);
    if (e > worst) worst = e, where = gb[i].first;
  }
  expect(worst <= tol, what + ": weights differ from the reference by " + std::to_string(worst) + " at " + where);
  std::printf("%s: max relative weight error %.3g (%s)\n", what.c_str(), worst, where.c_str());
}

// A communication hook of a user's own (data_parallel/comm_hook.h): every rank's
// bucket gathered (all_gather) and averaged in rank order, so that the
// result's bits do not depend on the group's reduction algorithm. Waits in
// reduce(): join() has nothing left to do.
class RankOrderAverage final : public dist::CommHook {
 public:
  explicit RankOrderAverage(dist::ProcessGroupPtr pg) : pg_(std::move(pg)) {}
  Tensor reduce(std::vector<Tensor>& srcs, const std::vector<Event>& ready) override {
    Tensor bucket = srcs[0];
    if (!ready.empty()) Stream::current(bucket.device()).wait(ready[0]);
    const int64_t numel = bucket.numel(), n = pg_->size();
    Tensor all = empty({n * numel}, TensorOptions(bucket.dtype(), bucket.device()));
    pg_->all_gather(bucket, all)->wait();
    Tensor sum = all.narrow(0, 0, numel).clone();
    for (int64_t r = 1; r < n; ++r) sum.add_(all.narrow(0, r * numel, numel), 1.0);
    sum.mul_(1.0 / static_cast<double>(n));
    bucket.copy_(sum);
    ++calls;
    return bucket;
  }
  void join(const Device&) override {}

  int64_t calls = 0;  // buckets reduced (one engine thread at a time: the reducer's lock)

 private:
  dist::ProcessGroupPtr pg_;
};

dist::DDPOptions options_from_env(const dist::ProcessGroupPtr& pg) {
  dist::DDPOptions o;
  if (const char* b = std::getenv("PROBE_BUCKET_BYTES")) {
    o.bucket_bytes = std::atoll(b);
    o.first_bucket_bytes = o.bucket_bytes / 2;
  }
  if (const char* h = std::getenv("PROBE_HOOK")) {
    if (std::string(h) == "rank-order") o.hook = std::make_shared<RankOrderAverage>(pg);
    else o.comm_hook = dist::parse_comm_hook(h);
  }
  return o;
}

// DDP on this rank's rows vs the reference on all rows, for kSteps steps.
void match(dist::ProcessGroupPtr pg, const std::string& kind) {
  const int r = pg->rank(), n = pg->size();
  const bool sync_bn = kind == "cnn-bn-sync";
  nn::ModulePtr ref = build(kind, 100);
  nn::ModulePtr mine = build(kind, 100 + r);  // rank 0's weights arrive by broadcast
  if (sync_bn) mine = nn::convert_sync_batchnorm(mine, pg);
  const dist::DDPOptions opts = options_from_env(pg);
  auto ddp = std::make_shared<dist::DistributedDataParallel>(mine, pg, opts);
  optim::SGD opt = make_sgd(mine), ref_opt = make_sgd(ref);
  // The noop hook communicates nothing: each rank then trains alone on its
  // own rows, and that is its reference.
  const bool noop = !opts.hook && opts.comm_hook == dist::CommHookKind::Noop;
  double worst_loss = 0;
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = global_batch(step);
    opt.zero_grad();
    Tensor loss = F::cross_entropy(ddp->forward(rows(x, r, n)), rows(y, r, n));
    loss.backward();
    opt.step();
    ref_opt.zero_grad();
    Tensor ref_loss = noop ? F::cross_entropy(ref->forward(rows(x, r, n)), rows(y, r, n)) : F::cross_entropy(ref->forward(x), y);
    ref_loss.backward();
    ref_opt.step();
    const double global = noop ? loss.item() : mean_over_ranks(*pg, loss.item());
    worst_loss = std::max(worst_loss, std::abs(global - ref_loss.item()) / std::abs(ref_loss.item()));
  }
  const double tol = !opts.hook && opts.comm_hook == dist::CommHookKind::Bf16Compress ? 2e-2 : 1e-5;
  expect(worst_loss <= tol, "loss differs from the reference by " + std::to_string(worst_loss));
  compare_weights(mine, ref, tol, "rank " + std::to_string(r) + " " + kind);
  if (auto* user = dynamic_cast<RankOrderAverage*>(opts.hook.get())) {
    expect(user->calls >= kSteps, "the user's hook reduced " + std::to_string(user->calls) + " buckets");
    std::printf("rank %d: the user's hook reduced %lld buckets\n", r, static_cast<long long>(user->calls));
  }
  std::printf("rank %d: %zu buckets, max relative loss error %.3g\n", r, ddp->buckets().buckets.size(), worst_loss);
}

void no_sync(dist::ProcessGroupPtr pg) {
  const int r = pg->rank(), n = pg->size();
  nn::ModulePtr ref = build("mlp", 100), mine = build("mlp", 100 + r);
  auto ddp = std::make_shared<dist::DistributedDataParallel>(mine, pg);
  optim::SGD opt = make_sgd(mine), ref_opt = make_sgd(ref);
  for (int step = 0; step < 2; ++step) {
    opt.zero_grad();
    ref_opt.zero_grad();
    std::vector<Tensor> xs, ys;
    for (int micro = 0; micro < 4; ++micro) {
      auto [x, y] = global_batch(10 * step + micro);
      xs.push_back(x);
      ys.push_back(y);
      auto run = [&] {
        Tensor loss = F::cross_entropy(ddp->forward(rows(x, r, n)), rows(y, r, n)) * 0.25;
        loss.backward();
      };
      if (micro < 3) {
        auto guard = ddp->no_sync();
        run();
      } else {
        run();
      }
    }
    opt.step();
    Tensor ref_loss = F::cross_entropy(ref->forward(cat(xs, 0)), cat(ys, 0));
    ref_loss.backward();
    ref_opt.step();
  }
  compare_weights(mine, ref, 1e-5, "rank " + std::to_string(r) + " no_sync x4");
}

void unused(dist::ProcessGroupPtr pg) {
  const int r = pg->rank(), n = pg->size();
  auto ref = std::static_pointer_cast<Branchy>(build("branchy", 100));
  auto mine = std::static_pointer_cast<Branchy>(build("branchy", 100 + r));
  auto ddp = std::make_shared<dist::DistributedDataParallel>(mine, pg);
  optim::SGD opt = make_sgd(mine), ref_opt = make_sgd(ref);
  // Step s uses the head on rank (s % (n + 1)): some steps on one rank, one
  // step (s % (n + 1) == n) on none.
  const int steps = n + 2;
  for (int step = 0; step < steps; ++step) {
    auto [x, y] = global_batch(step);
    const int user = step % (n + 1);
    opt.zero_grad();
    mine->use_aux = r == user;
    Tensor loss = F::cross_entropy(ddp->forward(rows(x, r, n)), rows(y, r, n));
    loss.backward();
    const std::vector<std::string> none = ddp->unused_parameters();
    const bool aux_unused = std::find(none.begin(), none.end(), "aux.weight") != none.end();
    expect(aux_unused == (user == n), "step " + std::to_string(step) + ": aux reported " +
                                          (aux_unused ? "unused" : "used") + " with user rank " + std::to_string(user));
    expect(std::find(none.begin(), none.end(), "never.weight") != none.end(), "never.weight not reported unused");
    expect(!mine->never->weight().grad().defined(), "never.weight got a gradient");
    expect(mine->aux->weight().grad().defined() == (user < n), "aux.weight's gradient presence is wrong at step " +
                                                                  std::to_string(step));
    opt.step();
    // The reference: the shards' mean losses, averaged, the head on shard `user` only.
    ref_opt.zero_grad();
    for (int s = 0; s < n; ++s) {
      ref->use_aux = s == user;
      Tensor l = F::cross_entropy(ref->forward(rows(x, s, n)), rows(y, s, n)) * (1.0 / n);
      l.backward();
    }
    ref_opt.step();
  }
  compare_weights(mine, ref, 1e-5, "rank " + std::to_string(r) + " unused");
}

void mismatch(dist::ProcessGroupPtr pg) {
  const int r = pg->rank(), n = pg->size();
  nn::ModulePtr m = build(r == n - 1 ? "wide" : "mlp", 100);
  try {
    dist::DistributedDataParallel ddp(m, pg);
    expect(n == 1, "no error for a model that differs on rank " + std::to_string(n - 1));
  } catch (const ValueError& e) {
    const std::string msg = e.what();
    std::printf("rank %d error: %s\n", r, msg.c_str());
    expect(msg.find("rank " + std::to_string(n - 1)) != std::string::npos && msg.find("'1.weight'") != std::string::npos,
           "the error does not name rank " + std::to_string(n - 1) + " and 1.weight: " + msg);
  }
}

void modelpar(dist::ProcessGroupPtr pg) {
  const int r = pg->rank(), n = pg->size();
  nn::ModulePtr ref = build("twodev", 100), mine = build("twodev", 100 + r);
  auto ddp = std::make_shared<dist::DistributedDataParallel>(mine, pg);
  optim::SGD opt = make_sgd(mine), ref_opt = make_sgd(ref);
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = global_batch(step);
    opt.zero_grad();
    F::cross_entropy(ddp->forward(rows(x, r, n)), rows(y, r, n)).backward();
    opt.step();
    ref_opt.zero_grad();
    F::cross_entropy(ref->forward(x), y).backward();
    ref_opt.step();
  }
  std::printf("rank %d: %zu buckets over cpu:0 and cpu:1\n", r, ddp->buckets().buckets.size());
  compare_weights(mine, ref, 1e-5, "rank " + std::to_string(r) + " model-parallel");
}

void dp(dist::ProcessGroupPtr pg) {
  const int r = pg->rank(), n = pg->size();
  nn::ModulePtr ref = build("cnn", 100), mine = build("cnn", 100 + r);
  auto inner = std::make_shared<parallel::DataParallel>(mine, std::vector<Device>{Device("cpu:0"), Device("cpu:1")});
  auto ddp = std::make_shared<dist::DistributedDataParallel>(inner, pg);
  optim::SGD opt = make_sgd(mine), ref_opt = make_sgd(ref);
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = global_batch(step);
    opt.zero_grad();
    F::cross_entropy(ddp->forward(rows(x, r, n)), rows(y, r, n)).backward();
    opt.step();
    ref_opt.zero_grad();
    F::cross_entropy(ref->forward(x), y).backward();
    ref_opt.step();
  }
  compare_weights(mine, ref, 1e-5, "rank " + std::to_string(r) + " DDP over DataParallel(cpu:0, cpu:1)");
}

// Note [DDP in a CUDA graph]: graphed DDP steps against eager ones, on GPUs.
void graphed(dist::ProcessGroupPtr pg, const std::string& kind) {
#ifdef CHORUS_WITH_CUDA
  const int r = pg->rank(), n = pg->size();
  const Device dev = pg->device();
  expect(dev.is_cuda(), "graphed: run with PROBE_DEVICE=cuda (an NCCL group)");
  cuda::set_allow_tf32(false);
  const bool prev_det = cuda::deterministic();
  cuda::set_deterministic(true);
  constexpr int kGraphSteps = 20;
  struct Run {
    nn::ModulePtr model;
    std::vector<double> losses;
    int64_t replays = 0;
  };
  auto train = [&](bool graphs) {
    Run run;
    run.model = build(kind, 100 + r);  // rank 0's weights arrive by broadcast
    if (kind == "cnn-bn-sync") run.model = nn::convert_sync_batchnorm(run.model, pg);
    run.model->to(dev);
    auto ddp = std::make_shared<dist::DistributedDataParallel>(run.model, pg, options_from_env(pg));
    optim::SGD opt = make_sgd(run.model);
    parallel::GraphedStepOptions go;
    go.enabled = graphs;
    go.on_fallback = [&](const std::string& line) { expect(false, "rank " + std::to_string(r) + ": " + line); };
    parallel::GraphedStep step(
        [&](const std::vector<Tensor>& in) {
          Tensor loss = F::cross_entropy(ddp->forward(in[0]), in[1]);
          opt.zero_grad();
          loss.backward();
          opt.step();
          return std::vector<Tensor>{loss};
        },
        go);
    for (int i = 0; i < kGraphSteps; ++i) {
      auto [x, y] = global_batch(i);
      opt.set_lr(0.1 / (1.0 + 0.05 * i));
      Tensor loss = step({rows(x, r, n).to(dev), rows(y, r, n).to(dev)})[0];
      run.losses.push_back(loss.item());
    }
    run.replays = step.replays();
    return run;
  };
  Run eager = train(false), graph = train(true);
  expect(eager.replays == 0, "graphed: the eager twin replayed a graph");
  expect(graph.replays == kGraphSteps - 2, "rank " + std::to_string(r) + ": " + std::to_string(graph.replays) +
                                               " replays, expected " + std::to_string(kGraphSteps - 2));
  double worst_loss = 0;
  for (int i = 0; i < kGraphSteps; ++i)
    worst_loss = std::max(worst_loss, std::abs(graph.losses[i] - eager.losses[i]) / std::max(std::abs(eager.losses[i]), 1e-12));
  expect(worst_loss <= 1e-6, "graphed: losses differ by " + std::to_string(worst_loss));
  std::printf("rank %d graphed %s: %lld replays, max relative loss difference %.3g\n", r, kind.c_str(),
              static_cast<long long>(graph.replays), worst_loss);
  compare_weights(graph.model, eager.model, 1e-6, "rank " + std::to_string(r) + " graphed DDP vs eager DDP");
  cuda::set_deterministic(prev_det);
#else
  (void)pg;
  (void)kind;
  expect(false, "graphed: this build has no CUDA");
#endif
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "match";
  const std::string model = argc > 2 ? argv[2] : "mlp";
  int rank = -1;
  try {
    dist::InitOptions o;
    if (const char* t = std::getenv("PROBE_TIMEOUT_MS")) o.timeout = std::chrono::milliseconds(std::atoi(t));
    if (const char* d = std::getenv("PROBE_DEVICE"); d && std::string(d) == "cuda") {
      const char* local = std::getenv("LOCAL_RANK");
      o.backend = "nccl";
      set_device(cuda_device(local ? std::atoi(local) : 0));
    }
    auto pg = dist::init_process_group(o);
    rank = pg->rank();
    if (mode == "match") match(pg, model);
    else if (mode == "no_sync") no_sync(pg);
    else if (mode == "unused") unused(pg);
    else if (mode == "mismatch") mismatch(pg);
    else if (mode == "modelpar") modelpar(pg);
    else if (mode == "dp") dp(pg);
    else if (mode == "graphed") graphed(pg, model);
    else {
      std::fprintf(stderr, "unknown mode %s\n", mode.c_str());
      return 2;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "FAIL: rank %d: %s\n", rank, e.what());
    return 1;
  }
  if (failures) return 1;
  std::printf("rank %d: ok %s %s\n", rank, mode.c_str(), mode == "match" || mode == "graphed" ? model.c_str() : "");
  return 0;
}
