// chorus_syncbn_probe: one rank of a SyncBatchNorm job (tests/distributed/sync_batch_norm.sh
// starts 1, 2 or 3 of them over Gloo with the rendezvous environment set by
// hand). Every rank draws the same global batch from a fixed seed and takes
// its own uneven slice (rank r: r + 2 samples, then r + 3, ...); every rank
// also computes the reference, nn::BatchNorm2d on the whole batch in one
// process, and compares:
//   layer   one SyncBatchNorm, two training steps: its output and input
//           gradient (this rank's slice), weight and bias gradients (summed
//           over the ranks, as DDP would) and running statistics;
//   train   a small CNN with two batch norms, converted by
//           convert_sync_batchnorm, trained for four SGD steps with gradients
//           summed over the ranks: every step's loss, and every weight and
//           running statistic at the end.
// With SYNCBN_DP=K each rank runs its slice through a DataParallel over
// cpu:0..K-1 (statistics summed over the replicas, then across the ranks).
// With SYNCBN_CONTROL=1 the batch norms get no process group (each rank's own
// statistics): the control, which must fail for more than one rank.
// Prints the largest relative errors; exits 1 if any is above 1e-5.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <chorus/chorus.h>
#include <chorus/distributed/init.h>
#include <chorus/data_parallel/sync_batch_norm.h>

using namespace chorus;

namespace {

constexpr double kTol = 1e-5;
int failures = 0;
double worst = 0;

double rel_err(const Tensor& a, const Tensor& b) {
  const auto va = a.to(cpu_device(0)).to(kFloat64).to_vector<double>();
  const auto vb = b.to(cpu_device(0)).to(kFloat64).to_vector<double>();
  if (va.size() != vb.size()) return INFINITY;
  double diff = 0, scale = 0;
  for (size_t i = 0; i < va.size(); ++i) {
    diff = std::max(diff, std::abs(va[i] - vb[i]));
    scale = std::max(scale, std::abs(vb[i]));
  }
  return diff / std::max(scale, 1e-12);
}

void check(const std::string& what, double err) {
  worst = std::max(worst, err);
  if (!(err <= kTol)) {
    ++failures;
    std::fprintf(stderr, "FAIL: %s: relative error %.3e\n", what.c_str(), err);
  }
}

struct World {
  dist::ProcessGroupPtr pg;
  dist::ProcessGroupPtr bn_pg;  // pg, or null for the control
  int rank, size, dp;  // dp: devices per rank (0: no DataParallel)
  // The slice of a global batch of step `step`: rank r gets r + 2 + step samples.
  int64_t size_of(int r, int step) const { return r + 2 + step; }
  int64_t start(int step) const {
    int64_t s = 0;
    for (int r = 0; r < rank; ++r) s += size_of(r, step);
    return s;
  }
  int64_t global(int step) const {
    int64_t s = 0;
    for (int r = 0; r < size; ++r) s += size_of(r, step);
    return s;
  }
  Tensor mine(const Tensor& t, int step) const { return t.narrow(0, start(step), size_of(rank, step)).contiguous(); }
  nn::ModulePtr wrap(nn::ModulePtr m) const {
    if (dp == 0) return m;
    std::vector<Device> devs;
    for (int i = 0; i < dp; ++i) devs.push_back(cpu_device(i));
    return std::make_shared<parallel::DataParallel>(m, devs);
  }
  void sum_grads(nn::Module& m) const {
    for (Tensor& p : m.parameters()) {
      Tensor g = p.grad();
      if (!g.defined()) continue;
      Tensor flat = g.contiguous();  // a Linear's weight gradient is a transposed view
      pg->all_reduce(flat)->wait();
      if (!flat.is_same(g)) {
        NoGradGuard ng;
        g.copy_(flat);
      }
    }
  }
};

Tensor random_input(const Shape& shape, uint64_t seed) {
  manual_seed(seed);
  return randn(shape).mul(1.5).add(0.7);
}

void layer(const World& w) {
  const int64_t c = 3;
  nn::BatchNorm2d ref(c);
  auto bn = std::make_shared<dist::SyncBatchNorm>(c, w.bn_pg);
  {
    manual_seed(5);
    NoGradGuard ng;
    Tensor wt = randn({c}).mul(0.5).add(1.0), bs = randn({c});
    for (nn::Module* m : std::initializer_list<nn::Module*>{&ref, bn.get()}) {
      m->own_parameters()[0].second.copy_(wt);
      m->own_parameters()[1].second.copy_(bs);
    }
  }
  nn::ModulePtr model = w.wrap(std::make_shared<nn::Sequential>(std::initializer_list<nn::ModulePtr>{bn}));
  for (int step = 0; step < 2; ++step) {
    const std::string tag = "layer step " + std::to_string(step) + ": ";
    const Shape shape{w.global(step), c, 4, 5};
    Tensor x = random_input(shape, 10 + step), r = random_input(shape, 20 + step);
    ref.zero_grad();
    bn->zero_grad();
    Tensor xr = x.clone().set_requires_grad(true);
    Tensor yr = ref.forward(xr);
    chorus::sum(chorus::mul(yr, r)).backward();
    Tensor xm = w.mine(x, step).set_requires_grad(true);
    Tensor ym = model->forward(xm);
    chorus::sum(chorus::mul(ym, w.mine(r, step))).backward();
    check(tag + "output", rel_err(ym, w.mine(yr.detach(), step)));
    check(tag + "input gradient", rel_err(xm.grad(), w.mine(xr.grad(), step)));
    w.sum_grads(*bn);
    check(tag + "weight gradient", rel_err(bn->own_parameters()[0].second.grad(), ref.own_parameters()[0].second.grad()));
    check(tag + "bias gradient", rel_err(bn->own_parameters()[1].second.grad(), ref.own_parameters()[1].second.grad()));
    const auto got = bn->named_buffers(), want = ref.named_buffers();
    for (size_t i = 0; i < want.size(); ++i) check(tag + want[i].first, rel_err(got[i].second, want[i].second));
  }
}

nn::ModulePtr make_bn_cnn() {
  return std::make_shared<nn::Sequential>(std::initializer_list<nn::ModulePtr>{
      std::make_shared<nn::Conv2d>(nn::Conv2dOptions{2, 4, 3, 1, 1}), std::make_shared<nn::BatchNorm2d>(4),
      std::make_shared<nn::ReLU>(), std::make_shared<nn::Conv2d>(nn::Conv2dOptions{4, 6, 3, 1, 1}),
      std::make_shared<nn::BatchNorm2d>(6), std::make_shared<nn::ReLU>(),
      std::make_shared<nn::MaxPool2d>(nn::Pool2dOptions{2}), std::make_shared<nn::Flatten>(),
      std::make_shared<nn::Linear>(6 * 3 * 3, 5)});
}

void train(const World& w) {
  manual_seed(1234);
  nn::ModulePtr ref = make_bn_cnn();
  manual_seed(1234);
  nn::ModulePtr mine = dist::convert_sync_batchnorm(make_bn_cnn(), w.bn_pg);
  nn::ModulePtr model = w.wrap(mine);
  optim::SGD ref_opt(ref->parameters(), optim::SGDOptions{.lr = 0.05, .momentum = 0.9});
  optim::SGD opt(mine->parameters(), optim::SGDOptions{.lr = 0.05, .momentum = 0.9});
  for (int step = 0; step < 4; ++step) {
    const int64_t b = w.global(step);
    Tensor x = random_input({b, 2, 6, 6}, 100 + step);
    manual_seed(200 + step);
    Tensor y = randint(0, 5, {b});
    ref_opt.zero_grad();
    Tensor ref_loss = nn::functional::cross_entropy(ref->forward(x), y);
    ref_loss.backward();
    ref_opt.step();
    // This rank's share of the global mean: its own mean weighted by its size.
    opt.zero_grad();
    const double share = static_cast<double>(w.size_of(w.rank, step)) / static_cast<double>(b);
    Tensor loss = nn::functional::cross_entropy(model->forward(w.mine(x, step)), w.mine(y, step)).mul(share);
    loss.backward();
    w.sum_grads(*mine);
    opt.step();
    Tensor total = loss.detach().reshape({1}).to(kFloat64);
    w.pg->all_reduce(total)->wait();
    check("train step " + std::to_string(step) + " loss", rel_err(total, ref_loss.detach().reshape({1})));
  }
  const auto got = mine->state_dict(), want = ref->state_dict();
  if (got.size() != want.size()) {
    ++failures;
    std::fprintf(stderr, "FAIL: state_dict sizes differ\n");
    return;
  }
  for (size_t i = 0; i < want.size(); ++i) {
    if (got[i].first != want[i].first) {
      ++failures;
      std::fprintf(stderr, "FAIL: name %s vs %s\n", got[i].first.c_str(), want[i].first.c_str());
    }
    check("train final " + want[i].first, rel_err(got[i].second, want[i].second));
  }
}

}  // namespace

int main() {
  int rank = -1;
  try {
    dist::InitOptions o;
    o.timeout = std::chrono::seconds(60);
    World w;
    w.pg = dist::init_process_group(o);
    rank = w.rank = w.pg->rank();
    w.size = w.pg->size();
    w.dp = std::getenv("SYNCBN_DP") ? std::atoi(std::getenv("SYNCBN_DP")) : 0;
    const bool control = std::getenv("SYNCBN_CONTROL") && std::string(std::getenv("SYNCBN_CONTROL")) == "1";
    w.bn_pg = control ? nullptr : w.pg;
    layer(w);
    const double layer_worst = worst;
    worst = 0;
    train(w);
    std::printf("rank %d of %d%s: %s (max relative error: layer %.2e, training %.2e)\n", w.rank, w.size,
                w.dp ? (", DataParallel over " + std::to_string(w.dp) + " CPU devices").c_str() : "",
                failures ? "FAILED" : "syncbn ok", layer_worst, worst);
    return failures ? 1 : 0;
  } catch (const std::exception& e) {
    std::printf("rank %d: error: %s\n", rank, e.what());
    return 4;
  }
}
