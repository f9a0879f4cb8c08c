#include "train_step.h"

#include <chrono>

#include "chorus/autograd/autocast.h"
#include "chorus/autograd/grad_mode.h"
#include "chorus/data_parallel/in_process_hooks.h"
#include "chorus/nn/functional.h"
#include "chorus/ops/profile.h"
#include "chorus/ops/comm.h"
#include "commands.h"

namespace chorus::app {

void check_dp_all_reduce(const std::optional<std::string>& method, const std::string& strategy, bool dp_broadcast) {
  // A bad --dp-all-reduce or environment switch fails here, not mid-step.
  if (strategy == "dp") (void)dp_options(0, std::nullopt, method);
  if (!method) return;
  (void)dist::parse_grad_sum_method(*method, "--dp-all-reduce");
  CHORUS_CHECK(strategy == "dp", "--dp-all-reduce goes with --strategy dp");
  CHORUS_CHECK(!dp_broadcast, "--dp-all-reduce goes with replicated updates, not --dp-broadcast (which sums the "
                              "gradients on the first device and broadcasts the weights)");
}

std::string dp_all_reduce_name(const CommCounts& before, const Device& device, const parallel::DataParallelOptions& o) {
  if (ops::exchange_calls() > before.exchanges) return "in-update";
  if (!device.is_cuda()) return "adds";
  if (ops::copy_engine_all_reduce_calls() > before.copy_engine) return "copy-engine";
  return o.grad_sum == dist::GradSumMethod::CopyEngine ? "nccl (copy engines unavailable)" : "nccl";
}

CommCounts comm_counts() { return {ops::copy_engine_all_reduce_calls(), ops::exchange_calls()}; }

std::string dp_grads_name(const CommCounts& before, const Device& device, const parallel::DataParallelOptions& o) {
  // The copy engines sum flat buffers: packed whatever the setting.
  if (device.is_cuda() && ops::copy_engine_all_reduce_calls() > before.copy_engine) return "packed";
  if (o.grad_sum == dist::GradSumMethod::CopyEngine) return "packed";
  return o.grads_in_place ? "in-place" : "packed";
}

nn::ModulePtr wrap_for_strategy(const nn::ModulePtr& model, const std::string& strategy,
                                const std::vector<Device>& devices, double bucket_mb,
                                std::optional<double> last_bucket_mb, optim::Optimizer* opt,
                                const std::optional<std::string>& dp_all_reduce) {
  if (strategy != "dp") return model;
  auto dp = std::make_shared<parallel::DataParallel>(model, devices,
                                                     dp_options(bucket_mb, last_bucket_mb, dp_all_reduce));
  if (opt && devices.size() > 1) {
    parallel::ReplicatedUpdates u = dp->replicate_updates(opt->params());
    opt->add_replicas(u.copies, u.after_step);
  }
  return dp;
}

bool cuda_graphs_apply(const std::string& strategy, const std::vector<Device>& devices) {
  for (const Device& d : devices)
    if (!d.is_cuda()) return false;
  // DataParallel: one graph over its devices (the replicas' threads issue to
  // the capture's streams of every device); DDP with one GPU per process
  // captures its collectives too (Note [DDP in a CUDA graph]).
  // A pipeline: one graph over its stages' devices (Note [Pipelines and CUDA
  // graphs]). Zero's gathers and reduce-scatters too (Note [Sharded steps in
  // a CUDA graph] in data_parallel/sharded.h; auto-found units' first step is eager).
  if (strategy == "dp" || strategy == "pipeline") return true;
  return (strategy == "single" || strategy == "ddp" || strategy == "zero") && devices.size() == 1;
}

bool TrainStep::enable_cuda_graphs(parallel::GraphedStepOptions options) {
  TrainStep eager = *this;  // the step as it is now, without the graph
  eager.graph = nullptr;
  graph = std::make_shared<parallel::GraphedStep>(
      [eager](const std::vector<Tensor>& in) {
        Result r = eager.run_eager(in[0], in[1], nullptr);
        return std::vector<Tensor>{r.logits, r.loss};
      },
      std::move(options));
  return true;
}

TrainStep::Result TrainStep::run(const Tensor& x, const Tensor& y, Phases* phases) const {
  if (!graph) return run_eager(x, y, phases);
  std::vector<Tensor> out = (*graph)({x, y});
  return Result{out[0], out[1]};
}

TrainStep::Result TrainStep::run_eager(const Tensor& x, const Tensor& y, Phases* phases) const {
  using Clock = std::chrono::steady_clock;
  auto t = Clock::now();
  // Each phase's host time, into `phases` when asked for, and as a span of
  // the step's trace when one is recorded (Note [Step traces]).
  auto lap = [&](const char* phase, double* into) {
    if (!phases && !ops::tracing()) return;
    auto now = Clock::now();
    if (into) *into += std::chrono::duration<double, std::milli>(now - t).count();
    ops::trace_host_span(phase, "phase", t, now);
    t = now;
  };
  Result r;
  if (pipeline) {
    opt->zero_grad();
    {
      AutocastGuard guard(autocast);
      const double smoothing = label_smoothing;
      auto res = pipeline->train_step(x, y, [smoothing](const Tensor& out, const Tensor& t) {
        return nn::functional::cross_entropy(out, t, smoothing);
      });
      r.logits = res.output;
      r.loss = res.loss;
    }
    lap("forward+backward", phases ? &phases->backward_ms : nullptr);  // they interleave: one phase
    opt->step();
    lap("optimizer", phases ? &phases->optim_ms : nullptr);
    return r;
  }
  // Note [Per-replica losses] in parallel/data_parallel.h: each replica's loss
  // on its own device, and one backward from all of them.
  auto* dp = dp_gather_output ? nullptr : dynamic_cast<parallel::DataParallel*>(net.get());
  if (dp && dp->devices().size() > 1) {
    parallel::ReplicaLosses losses;
    {
      AutocastGuard guard(autocast);
      const double smoothing = label_smoothing;
      losses = dp->forward_loss(x, y, [smoothing](const nn::Value& out, const nn::Value& t) {
        return nn::functional::cross_entropy(out.tensor(), t.tensor(), smoothing);
      });
    }
    // Gathered beside the backward, joined after the step (Note [Losses
    // gathered beside the backward] in parallel/data_parallel.cpp).
    const parallel::ReplicaLosses::Gathered gathered = losses.gather_beside();
    r.loss = gathered.loss;
    r.logits = gathered.output.tensor();
    lap("forward", phases ? &phases->forward_ms : nullptr);
    opt->zero_grad();
    losses.backward();
    lap("backward", phases ? &phases->backward_ms : nullptr);
    opt->step();
    gathered.join();
    lap("optimizer", phases ? &phases->optim_ms : nullptr);
    return r;
  }
  // The last step's gradients go before the forward, not after it: under
  // zero they hold the float32 gradient shards, which would otherwise live
  // through the forward's activations (Note [Sharded gradient shards] in
  // data_parallel/sharded.h).
  opt->zero_grad();
  {
    AutocastGuard guard(autocast);
    r.logits = net->forward(x);
    r.loss = nn::functional::cross_entropy(r.logits, y, label_smoothing);
  }
  lap("forward", phases ? &phases->forward_ms : nullptr);
  r.loss.backward();
  lap("backward", phases ? &phases->backward_ms : nullptr);
  opt->step();
  lap("optimizer", phases ? &phases->optim_ms : nullptr);
  return r;
}

}  // namespace chorus::app
