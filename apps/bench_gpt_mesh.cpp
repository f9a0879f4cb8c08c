// `chorus bench --model gpt2|...|dN --mesh dp=A,tp=B`: a tensor-parallel
// GPT's training throughput on random token ids, every rank of the mesh
// running the step `chorus train --mesh` runs (forward, vocabulary-parallel
// loss, backward, DDP over the dp groups, global-norm clipping, AdamW), timed
// after a warm-up. Rank 0 prints one row: tokens/s of the whole job, per GPU,
// MFU (llm.c's FLOP count over all the GPUs' peak) and its peak memory.
#include <chrono>
#include <cstdio>

#include <nlohmann/json.hpp>

#include "bench.h"
#include "chorus/autograd/autocast.h"
#include "chorus/core/backend.h"
#include "chorus/core/error.h"
#include "chorus/core/rng.h"
#include "chorus/dist/ddp.h"
#include "chorus/ops/factory.h"
#include "chorus/optim/adamw.h"
#include "chorus/tensor_parallel/clip_grad.h"
#include "gpt_mesh.h"
#include "train_gpt.h"

namespace chorus::app {

int run_bench_gpt_mesh(const BenchConfig& c) {
  CHORUS_CHECK(c.strategy == "single", "chorus bench --mesh sets the layout itself: --strategy ", c.strategy,
               " cannot go with it");
  CHORUS_CHECK(c.precision == "fp32" || c.precision == "bf16", "unknown precision '", c.precision, "'");
  CHORUS_CHECK(c.recompute == "never", "chorus bench --mesh: --recompute is not offered with --mesh yet");
  CHORUS_CHECK(c.batch_size > 0 && c.steps > 0 && c.warmup >= 0, "--batch-size and --steps must be positive");
  const int64_t seq = c.seq_len > 0 ? c.seq_len : 1024;
  models::GPTConfig cfg = models::GPTConfig::named(c.model, 50257, std::max<int64_t>(seq, 1024));
  cfg.attention = ops::parse_attention_kernel(c.attention);
  MeshSettings ms;
  ms.spec = *c.mesh;
  ms.sequence_parallel = c.sequence_parallel;
  ms.devices = c.devices;
  ms.quiet = c.json;
  MeshGpt m = start_mesh_gpt(ms, cfg, seq);
  const Device dev = m.device;
  CHORUS_CHECK(c.precision == "fp32" || dev.is_cuda(), "--precision bf16 needs a CUDA device (got ", dev.str(), ")");
  std::shared_ptr<dist::DistributedDataParallel> ddp;
  nn::ModulePtr net = m.model;
  if (m.dp() > 1) net = ddp = std::make_shared<dist::DistributedDataParallel>(m.model, m.mesh->group("dp"));
  const auto sharded = tp::sharded_parameters(*m.model);
  optim::AdamWOptions ao{6e-4, 0.9, 0.95, 1e-8, 0.1};
  std::vector<Tensor> params;
  for (const auto& p : sharded) {
    params.push_back(p.tensor);
    const bool embedding = p.name.find(".wte.") != std::string::npos || p.name.find(".wpe.") != std::string::npos;
    ao.param_weight_decay.push_back(p.tensor.dim() >= 2 && !embedding ? 0.1 : 0.0);
  }
  optim::AdamW opt(params, ao);
  // Each data rank its own ids, the same on its tensor ranks.
  manual_seed(1000 + static_cast<uint64_t>(m.dp_rank()));
  Tensor ids = randint(0, cfg.vocab, {c.batch_size, seq}, {kInt64, dev});
  Tensor tg = randint(0, cfg.vocab, {c.batch_size, seq}, {kInt64, dev});
  const std::optional<DType> cast = c.precision == "bf16" ? std::optional<DType>(kBFloat16) : std::nullopt;
  Tensor loss;
  auto step = [&] {
    {
      AutocastGuard g(cast);
      loss = m.model->loss_of_logits(net->forward(ids), tg);
    }
    loss.backward();
    tp::clip_grad_norm_(sharded, 1.0, m.ctx.group);
    opt.step();
    opt.zero_grad();
  };
  for (int64_t i = 0; i < c.warmup; ++i) step();
  synchronize(dev);
  m.rc.group->barrier()->wait();
  backend(dev).reset_peak_bytes(dev);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < c.steps; ++i) step();
  synchronize(dev);
  m.rc.group->barrier()->wait();
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const int world = m.rc.group->size();
  const double tok_s = static_cast<double>(c.batch_size * seq * c.steps * m.dp()) / dt;
  const double peak_flops = dev.is_cuda() ? bf16_peak_flops(backend(dev).device_name(dev)) : 0.0;
  const double mfu = peak_flops > 0 ? tok_s * cfg.flops_per_token(seq) / (peak_flops * world) : 0.0;
  const size_t peak = backend(dev).peak_bytes(dev);
  const double final_loss = loss.item();
  if (!m.rc.leader()) return 0;
  nlohmann::ordered_json row = {{"model", c.model},
                                {"strategy", "mesh"},
                                {"mesh", dist::mesh_spec_str(m.mesh->axes())},
                                {"sequence_parallel", c.sequence_parallel},
                                {"devices", std::to_string(world) + " ranks"},
                                {"device_name", backend(dev).device_name(dev)},
                                {"precision", c.precision},
                                {"batch_per_device", c.batch_size},
                                {"seq_len", seq},
                                {"params", cfg.num_parameters()},
                                {"tok_per_s", tok_s},
                                {"tok_per_s_per_device", tok_s / world},
                                {"step_ms", 1000.0 * dt / static_cast<double>(c.steps)},
                                {"mfu", peak_flops > 0 ? nlohmann::ordered_json(mfu) : nlohmann::ordered_json(nullptr)},
                                {"peak_mem_bytes", peak},
                                {"loss", final_loss},
                                {"cuda_graph", false}};
  if (c.json) {
    std::printf("%s\n", row.dump().c_str());
  } else {
    std::printf("%-10s mesh %-14s %-5s batch %lld x %lld  %10.0f tok/s (%8.0f per device)  %8.2f ms/step",
                c.model.c_str(), dist::mesh_spec_str(m.mesh->axes()).c_str(), c.precision.c_str(),
                (long long)c.batch_size, (long long)seq, tok_s, tok_s / world, 1000.0 * dt / static_cast<double>(c.steps));
    if (peak_flops > 0) std::printf("  MFU %5.1f%%", 100 * mfu);
    std::printf("  peak %8.1f MiB (rank 0)\n", static_cast<double>(peak) / (1 << 20));
  }
  return 0;
}

}  // namespace chorus::app
