#include "chorus/parallel/placement.h"

#include <algorithm>
#include <cmath>
#include <chrono>
#include <limits>
#include <numeric>
#include <string>

#include "chorus/autograd/grad_mode.h"
#include "chorus/core/backend.h"
#include "chorus/core/error.h"

namespace chorus::parallel {

std::string balance_str(const std::vector<int64_t>& balance) {
  std::string s;
  for (size_t i = 0; i < balance.size(); ++i) s += (i ? "," : "") + std::to_string(balance[i]);
  return s;
}

void place(nn::Sequential& seq, const std::vector<int64_t>& balance, const std::vector<Device>& devices) {
  const int64_t layers = static_cast<int64_t>(seq.size());
  CHORUS_CHECK(!balance.empty(), "placement: the balance is empty");
  CHORUS_CHECK(balance.size() == devices.size(), "placement: a balance of ", balance.size(), " parts (", balance_str(balance),
               ") for ", devices.size(), " devices; give one part per device");
  CHORUS_CHECK(static_cast<int64_t>(balance.size()) <= layers, "placement: ", balance.size(), " parts but the model has only ",
               layers, " layers");
  for (size_t i = 0; i < balance.size(); ++i)
    CHORUS_CHECK(balance[i] > 0, "placement: part ", i, " of the balance (", balance_str(balance), ") has ", balance[i],
                 " layers; every part needs at least one");
  const int64_t total = std::accumulate(balance.begin(), balance.end(), int64_t{0});
  CHORUS_CHECK(total == layers, "placement: the balance ", balance_str(balance), " adds up to ", total, " layers but the model has ",
               layers);
  for (const Device& d : devices) check_device(d);
  int64_t next = 0;
  for (size_t part = 0; part < balance.size(); ++part)
    for (int64_t i = 0; i < balance[part]; ++i) seq[static_cast<size_t>(next++)]->to(devices[part]);
}

std::vector<int64_t> balance_by_cost(const std::vector<double>& costs, int64_t partitions) {
  const int64_t n = static_cast<int64_t>(costs.size());
  CHORUS_CHECK(partitions >= 1, "balance: partitions must be >= 1, got ", partitions);
  CHORUS_CHECK(n >= partitions, "balance: ", partitions, " parts but only ", n, " layers");
  std::vector<double> prefix(static_cast<size_t>(n) + 1, 0.0);
  for (int64_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + costs[i];
  const double inf = std::numeric_limits<double>::infinity();
  // best[p][i]: the least possible slowest part splitting the first i layers into p parts.
  std::vector<std::vector<double>> best(static_cast<size_t>(partitions) + 1, std::vector<double>(n + 1, inf));
  std::vector<std::vector<int64_t>> cut(static_cast<size_t>(partitions) + 1, std::vector<int64_t>(n + 1, 0));
  best[0][0] = 0;
  for (int64_t p = 1; p <= partitions; ++p)
    for (int64_t i = p; i <= n; ++i)
      for (int64_t j = p - 1; j < i; ++j) {
        const double v = std::max(best[p - 1][j], prefix[i] - prefix[j]);
        if (v < best[p][i]) best[p][i] = v, cut[p][i] = j;
      }
  std::vector<int64_t> balance(static_cast<size_t>(partitions));
  for (int64_t p = partitions, i = n; p >= 1; --p) {
    const int64_t j = cut[p][i];
    balance[static_cast<size_t>(p - 1)] = i - j;
    i = j;
  }
  return balance;
}

std::vector<int64_t> balance_by_time(nn::Sequential& seq, const Tensor& sample, int64_t partitions, int repeats) {
  CHORUS_CHECK(repeats >= 1, "balance_by_time: repeats must be >= 1, got ", repeats);
  // The timing runs are training steps to batch norm: keep its running
  // statistics as they were.
  std::vector<std::pair<Tensor, Tensor>> saved;
  {
    NoGradGuard ng;
    for (auto& [name, b] : seq.named_buffers()) saved.emplace_back(b, b.clone());
  }
  std::vector<double> costs;
  Tensor x = sample;
  for (size_t l = 0; l < seq.size(); ++l) {
    const nn::ModulePtr layer = seq[l];
    double secs = 0;
    Tensor out;
    for (int r = 0; r <= repeats; ++r) {  // run 0 warms up (allocations, autotuning)
      Tensor in = x.detach();
      in.set_requires_grad(true);
      const Device dev = layer->device();
      synchronize(dev);
      const auto t0 = std::chrono::steady_clock::now();
      out = layer->forward(in);
      if (out.requires_grad()) out.sum().backward();
      synchronize(out.device());
      if (r > 0) secs += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    layer->zero_grad();
    costs.push_back(secs / repeats);
    x = out.detach();
  }
  {
    NoGradGuard ng;
    for (auto& [b, copy] : saved) b.copy_(copy);
  }
  return balance_by_cost(costs, partitions);
}

std::vector<int64_t> balance_by_memory(nn::Sequential& seq, const Tensor& sample, int64_t partitions,
                                       double param_scale) {
  CHORUS_CHECK(param_scale >= 0, "balance_by_memory: param_scale must be >= 0, got ", param_scale);
  std::vector<std::pair<Tensor, Tensor>> saved;
  {
    NoGradGuard ng;
    for (auto& [name, b] : seq.named_buffers()) saved.emplace_back(b, b.clone());
  }
  std::vector<double> costs;
  Tensor x = sample;
  std::vector<Tensor> keep;  // each layer's output (and graph) stays alive, as in training
  for (size_t l = 0; l < seq.size(); ++l) {
    const nn::ModulePtr layer = seq[l];
    const Device dev = layer->parameters().empty() ? x.device() : layer->device();
    Tensor in = x.detach();
    in.set_requires_grad(true);
    synchronize(dev);
    const size_t before = backend(dev).bytes_in_use(dev);
    backend(dev).reset_peak_bytes(dev);
    Tensor out = layer->forward(in);
    synchronize(dev);
    const size_t peak = backend(dev).peak_bytes(dev);
    double params = 0;
    for (const Tensor& p : layer->parameters()) params += static_cast<double>(p.nbytes());
    costs.push_back(static_cast<double>(peak > before ? peak - before : 0) + param_scale * params);
    keep.push_back(out);
    x = out.detach();
  }
  keep.clear();
  {
    NoGradGuard ng;
    for (auto& [b, copy] : saved) b.copy_(copy);
  }
  return balance_by_cost(costs, partitions);
}

namespace {

// The work of each rank's stages (stage s on rank s % ranks).
std::vector<double> rank_loads(const std::vector<double>& costs, const std::vector<int64_t>& balance, int64_t ranks) {
  std::vector<double> load(static_cast<size_t>(ranks), 0.0);
  size_t l = 0;
  for (size_t s = 0; s < balance.size(); ++s)
    for (int64_t i = 0; i < balance[s]; ++i) load[s % static_cast<size_t>(ranks)] += costs[l++];
  return load;
}

double slowest(const std::vector<double>& loads) { return *std::max_element(loads.begin(), loads.end()); }

}  // namespace

std::vector<int64_t> balance_ranks(const std::vector<double>& costs, int64_t ranks, int64_t virtual_stages) {
  CHORUS_CHECK(ranks >= 1 && virtual_stages >= 1, "balance_ranks: ", ranks, " ranks x ", virtual_stages,
               " stages each");
  const int64_t stages = ranks * virtual_stages, n = static_cast<int64_t>(costs.size());
  CHORUS_CHECK(stages <= n, "balance_ranks: ", stages, " stages but only ", n, " layers");
  std::vector<int64_t> balance;
  std::vector<double> prefix(static_cast<size_t>(n) + 1, 0.0);
  for (int64_t i = 0; i < n; ++i) prefix[static_cast<size_t>(i) + 1] = prefix[static_cast<size_t>(i)] + costs[static_cast<size_t>(i)];
  if (virtual_stages == 1) {
    // The least slowest stage (exact), then among the splits under it the
    // most even one: the least sum of the stages' squared costs (exact, by
    // dynamic programming over the same cuts), a tie going to the split whose
    // later stages are lighter (Note [Pipeline stages by cost]).
    const double cap = slowest(rank_loads(costs, balance_by_cost(costs, stages), ranks)) * (1 + 1e-12);
    const double inf = std::numeric_limits<double>::infinity();
    const size_t N = static_cast<size_t>(n) + 1;
    std::vector<std::vector<double>> best(static_cast<size_t>(stages) + 1, std::vector<double>(N, inf));
    std::vector<std::vector<int64_t>> cut(static_cast<size_t>(stages) + 1, std::vector<int64_t>(N, 0));
    best[0][0] = 0;
    for (int64_t p = 1; p <= stages; ++p)
      for (int64_t i = p; i <= n; ++i)
        for (int64_t j = p - 1; j < i; ++j) {
          const double part = prefix[static_cast<size_t>(i)] - prefix[static_cast<size_t>(j)];
          const double prev = best[static_cast<size_t>(p - 1)][static_cast<size_t>(j)];
          if (part > cap || prev == inf) continue;
          const double v = prev + part * part;
          double& b = best[static_cast<size_t>(p)][static_cast<size_t>(i)];
          // A later cut on a tie (within rounding): this last part the lighter.
          if (v <= b * (1 + 1e-12) || b == inf) b = v, cut[static_cast<size_t>(p)][static_cast<size_t>(i)] = j;
        }
    balance.assign(static_cast<size_t>(stages), 0);
    for (int64_t p = stages, i = n; p >= 1; --p) {
      const int64_t j = cut[static_cast<size_t>(p)][static_cast<size_t>(i)];
      balance[static_cast<size_t>(p - 1)] = i - j;
      i = j;
    }
    return balance;
  }
  // Several stages a rank (interleaved): what counts is each rank's stages
  // together, which the least slowest single stage does not even out (its
  // cap rounded up on every stage adds up on a rank). Instead each cut goes
  // to the layer boundary nearest its share of the total work, k / stages
  // (each stage at least one layer; on a tie the later boundary); the even
  // split by count is kept where that is no better.
  int64_t prev = 0;
  for (int64_t k = 1; k < stages; ++k) {
    const double target = prefix.back() * static_cast<double>(k) / static_cast<double>(stages);
    int64_t cut = prev + 1;
    for (int64_t i = prev + 1; i <= n - (stages - k); ++i)
      if (std::abs(prefix[static_cast<size_t>(i)] - target) <= std::abs(prefix[static_cast<size_t>(cut)] - target)) cut = i;
    balance.push_back(cut - prev);
    prev = cut;
  }
  balance.push_back(n - prev);
  std::vector<int64_t> even(static_cast<size_t>(stages), n / stages);
  for (int64_t i = 0; i < n % stages; ++i) ++even[static_cast<size_t>(i)];
  return slowest(rank_loads(costs, balance, ranks)) < slowest(rank_loads(costs, even, ranks)) ? balance : even;
}

}  // namespace chorus::parallel
