#include "chorus/parallel/placement.h"

#include <algorithm>
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

}  // namespace chorus::parallel
