#include "chorus/data_parallel/sync_batch_norm.h"

#include <exception>
#include <unordered_map>

#include "chorus/autograd/functions.h"
#include "chorus/autograd/grad_mode.h"
#include "chorus/autograd/node.h"
#include "chorus/core/error.h"
#include "chorus/ops/comm.h"
#include "chorus/ops/copy.h"
#include "chorus/ops/elementwise.h"
#include "chorus/ops/factory.h"
#include "chorus/ops/indexing.h"
#include "chorus/ops/nn.h"
#include "chorus/ops/reduce.h"
#include "chorus/ops/views.h"

namespace chorus::dist {

// ---- the groups ----------------------------------------------------------------

ProcessStatsGroup::ProcessStatsGroup(ProcessGroupPtr process_group) : pg_(std::move(process_group)) {
  CHORUS_CHECK(pg_ != nullptr, "ProcessStatsGroup: the process group is null");
}

Tensor ProcessStatsGroup::sum(const Tensor& local, int /*member*/) {
  Tensor total = ops::clone(local);
  pg_->all_reduce(total)->wait();
  ProcessGroupPtr pg = pg_;
  return autograd::record("SyncBatchNormAllReduceBackward", total, {local}, [pg](const TensorList& g) {
    Tensor t = ops::clone(ops::contiguous(g[0]));
    pg->all_reduce(t)->wait();
    return TensorList{t};
  });
}

struct ReplicaStatsGroup::Round {
  std::vector<Tensor> locals, totals;  // [member]
  int arrived = 0;
  bool done = false;
  std::exception_ptr error;
};

ReplicaStatsGroup::ReplicaStatsGroup(int members, StatsGroupPtr across, std::chrono::milliseconds timeout)
    : members_(members), across_(std::move(across)), timeout_(timeout) {
  CHORUS_CHECK(members >= 1, "ReplicaStatsGroup: needs at least one member, got ", members);
}

void ReplicaStatsGroup::begin(int active) {
  CHORUS_CHECK(active >= 1 && active <= members_, "ReplicaStatsGroup: ", active, " active members of ", members_);
  std::lock_guard<std::mutex> lk(mu_);
  active_ = active;
  round_ = nullptr;
  aborted_.clear();
}

void ReplicaStatsGroup::end() {
  std::lock_guard<std::mutex> lk(mu_);
  active_ = 1;
  round_ = nullptr;
  aborted_.clear();
}

void ReplicaStatsGroup::abort(const std::string& why) {
  std::lock_guard<std::mutex> lk(mu_);
  if (aborted_.empty()) aborted_ = why.empty() ? "aborted" : why;
  cv_.notify_all();
}

Tensor ReplicaStatsGroup::sum(const Tensor& local, int member) {
  std::unique_lock<std::mutex> lk(mu_);
  CHORUS_CHECK(member >= 0 && member < active_, "SyncBatchNorm: replica ", member, " summed its statistics but ",
               active_, " of ", members_, " replicas take part in this forward");
  if (active_ == 1) {
    lk.unlock();
    return across_ ? across_->sum(local, 0) : local;
  }
  if (!aborted_.empty()) CHORUS_THROW(Error, "SyncBatchNorm: ", aborted_);
  if (!round_) {
    round_ = std::make_shared<Round>();
    round_->locals.resize(static_cast<size_t>(active_));
  }
  std::shared_ptr<Round> round = round_;
  CHORUS_ASSERT(!round->locals[static_cast<size_t>(member)].defined());
  round->locals[static_cast<size_t>(member)] = local;
  if (++round->arrived < active_) {
    const bool woken = cv_.wait_for(lk, timeout_, [&] { return round->done || !aborted_.empty(); });
    if (!round->done) {
      if (!aborted_.empty()) CHORUS_THROW(Error, "SyncBatchNorm: ", aborted_);
      CHORUS_ASSERT(!woken);
      const int arrived = round->arrived;
      aborted_ = "a replica waited past the timeout for the others";
      cv_.notify_all();
      CHORUS_THROW(DistError, "SyncBatchNorm: replica ", member, " waited ",
                   std::chrono::duration<double>(timeout_).count(), " s for the other replicas' statistics; ",
                   arrived, " of ", active_, " arrived (every replica must run the same SyncBatchNorm layers)");
    }
    if (round->error) std::rethrow_exception(round->error);
    return round->totals[static_cast<size_t>(member)];
  }
  // The last to arrive sums, outside the lock; the next sum starts a new round.
  round_ = nullptr;
  lk.unlock();
  try {
    round->totals = combine(round->locals);
  } catch (...) {
    round->error = std::current_exception();
  }
  lk.lock();
  round->done = true;
  cv_.notify_all();
  if (round->error) std::rethrow_exception(round->error);
  return round->totals[static_cast<size_t>(member)];
}

namespace {
Tensor sum_over_devices(const std::vector<Tensor>& parts, const StatsGroupPtr& across) {
  Tensor total = empty(parts[0].sizes(), TensorOptions(parts[0].dtype(), parts[0].device()));
  ops::reduce_sum(parts, total);  // in member order on CPU devices: the same sum every time
  return across ? across->sum(total, 0) : total;  // `total` needs no grad: a plain all_reduce
}
}  // namespace

TensorList ReplicaStatsGroup::combine(const std::vector<Tensor>& locals) {
  const size_t n = locals.size();
  Tensor total = sum_over_devices(locals, across_);
  TensorList totals{total};
  std::vector<Tensor> others;
  for (size_t r = 1; r < n; ++r) {
    totals.push_back(empty(total.sizes(), TensorOptions(total.dtype(), locals[r].device())));
    others.push_back(totals.back());
  }
  ops::broadcast_coalesced(total, others);
  std::vector<Device> devices;
  for (const Tensor& t : locals) devices.push_back(t.device());
  const Shape shape = total.sizes();
  const DType dtype = total.dtype();
  StatsGroupPtr across = across_;
  // One node for every member (on the first member's device): the engine hands
  // it each member's gradient, and it returns their sum to each.
  return autograd::record("SyncBatchNormReplicaSumBackward", totals, locals,
                          [devices, shape, dtype, across](const TensorList& g) {
                            std::vector<Tensor> parts;
                            for (size_t r = 0; r < devices.size(); ++r)
                              parts.push_back(r < g.size() && g[r].defined()
                                                  ? ops::contiguous(g[r])
                                                  : zeros(shape, TensorOptions(dtype, devices[r])));
                            Tensor total = sum_over_devices(parts, across);
                            return TensorList(devices.size(), total);
                          });
}

// ---- the op ----------------------------------------------------------------------

namespace {

// What the two backward nodes of one call share. The output's node runs first
// (the input's waits for the group's sum, which waits for it) and leaves the
// local backward sums here.
struct Saved {
  Tensor x, weight;          // detached
  DType param_dtype;         // of weight and bias
  Tensor mean, invstd, n;    // [C], [C], [1] in the statistics dtype
  DType stat_dtype;
  Shape dims, bshape;        // reduced dims; [1, C, 1, 1] (or [1, C])
  int64_t c;
  Tensor dy, xc;             // statistics dtype; xc = x - mean
  Tensor sum_dy, sum_dy_xhat;
};

Tensor channel_sum(const Tensor& t, const Saved& s) { return ops::reduce(chorus::ReduceOp::Sum, t, s.dims, false); }
Tensor per_channel(const Tensor& v, const Saved& s) { return ops::reshape(v, s.bshape); }
Tensor part(const Tensor& packed, int64_t start, int64_t len) { return ops::slice(packed, 0, start, start + len, 1); }

// The output's backward: the local sum(dy) and sum(dy * xhat), packed as the
// forward's sums were (the count slot 0) for the group to sum.
TensorList output_backward(Saved& s, const TensorList& g) {
  s.dy = ops::to_dtype(g[0], s.stat_dtype);
  s.xc = ops::binary(BinaryOp::Sub, ops::to_dtype(s.x, s.stat_dtype), per_channel(s.mean, s));
  s.sum_dy = channel_sum(s.dy, s);
  s.sum_dy_xhat = ops::binary(BinaryOp::Mul, channel_sum(ops::binary(BinaryOp::Mul, s.dy, s.xc), s), s.invstd);
  Tensor zero = zeros({1}, TensorOptions(s.stat_dtype, s.sum_dy.device()));
  return {ops::cat({s.sum_dy, s.sum_dy_xhat, zero}, 0)};
}

// The local sums' backward, given the group's totals SDY, SDYX:
// dx = weight * invstd * (dy - SDY/n - xhat * SDYX/n); dweight, dbias local.
TensorList input_backward(Saved& s, const Tensor& totals, bool need_x, bool has_w, bool has_b) {
  if (!s.dy.defined()) {  // this member's output got no gradient; its input still moved the statistics
    s.dy = zeros(s.x.sizes(), TensorOptions(s.stat_dtype, s.x.device()));
    s.xc = ops::binary(BinaryOp::Sub, ops::to_dtype(s.x, s.stat_dtype), per_channel(s.mean, s));
    s.sum_dy = zeros({s.c}, TensorOptions(s.stat_dtype, s.x.device()));
    s.sum_dy_xhat = s.sum_dy;
  }
  TensorList out;
  if (need_x) {
    const Tensor t = ops::to_device(totals, s.x.device());
    Tensor mean_dy = ops::binary(BinaryOp::Div, part(t, 0, s.c), s.n);
    // xhat * SDYX/n = xc * (invstd * SDYX/n)
    Tensor proj = ops::binary(BinaryOp::Mul, ops::binary(BinaryOp::Div, part(t, s.c, s.c), s.n), s.invstd);
    Tensor k = s.weight.defined() ? ops::binary(BinaryOp::Mul, s.invstd, s.weight) : s.invstd;
    Tensor d = ops::binary(BinaryOp::Sub, s.dy, per_channel(mean_dy, s));
    d = ops::binary(BinaryOp::Sub, d, ops::binary(BinaryOp::Mul, s.xc, per_channel(proj, s)));
    d = ops::binary(BinaryOp::Mul, d, per_channel(k, s));
    out.push_back(ops::to_dtype(d, s.x.dtype()));
  } else {
    out.push_back(Tensor());
  }
  if (has_w) out.push_back(ops::to_dtype(s.sum_dy_xhat, s.param_dtype));
  if (has_b) out.push_back(ops::to_dtype(s.sum_dy, s.param_dtype));
  s.dy = s.xc = Tensor();  // the activation-sized ones
  return out;
}

}  // namespace

Tensor sync_batch_norm(const Tensor& x, const Tensor& running_mean, const Tensor& running_var, const Tensor& weight,
                       const Tensor& bias, double momentum, double eps, StatsGroup* group, int member) {
  CHORUS_CHECK(x.defined() && (x.dim() == 2 || x.dim() == 4),
               "sync_batch_norm: expected input [N, C] or [N, C, H, W], got ", x.defined() ? x.describe() : "undefined");
  CHORUS_CHECK(is_floating(x.dtype()), "sync_batch_norm: expected a floating input, got ", x.describe());
  auto s = std::make_shared<Saved>();
  s->c = x.size(1);
  const int64_t c = s->c;
  for (const Tensor* t : {&running_mean, &running_var, &weight, &bias})
    if (t->defined())
      CHORUS_CHECK(t->dim() == 1 && t->size(0) == c, "sync_batch_norm: ", t->describe(), " must be [", c,
                   "] for input ", shape_str(x.sizes()));
  CHORUS_CHECK(running_mean.defined() == running_var.defined(),
               "sync_batch_norm: running_mean and running_var must be both defined or both undefined");
  const Device dev = x.device();
  // Statistics in float64 on the CPU; GPUs (NCCL, Chorus's CUDA kernels) take float32.
  s->stat_dtype = dev.is_cpu() ? kFloat64 : kFloat32;
  s->dims = x.dim() == 4 ? Shape{0, 2, 3} : Shape{0};
  s->bshape = x.dim() == 4 ? Shape{1, c, 1, 1} : Shape{1, c};
  s->x = x.detach();
  s->weight = weight.defined() ? weight.detach() : Tensor();
  s->param_dtype = weight.defined() ? weight.dtype() : bias.defined() ? bias.dtype() : x.dtype();
  const TensorOptions so(s->stat_dtype, dev);

  // 1. Local sums, packed; recorded so that the input's backward hangs on them.
  Tensor xs = ops::to_dtype(x, s->stat_dtype);
  const double count = c > 0 ? static_cast<double>(x.numel() / c) : 0.0;
  Tensor local = ops::cat({channel_sum(xs, *s), channel_sum(ops::unary(UnaryOp::Square, xs), *s), full({1}, count, so)}, 0);
  xs = Tensor();
  TensorList inputs{x};
  if (weight.defined()) inputs.push_back(weight);
  if (bias.defined()) inputs.push_back(bias);
  const bool need_x = x.requires_grad(), has_w = weight.defined(), has_b = bias.defined();
  local = autograd::record("SyncBatchNormBackward", local, inputs, [s, need_x, has_w, has_b](const TensorList& g) {
    return input_backward(*s, g[0], need_x, has_w, has_b);
  });

  // 2. Summed over the group: one collective.
  Tensor total = group ? group->sum(local, member) : local;
  CHORUS_CHECK(total.sizes() == local.sizes() && total.device() == dev, "sync_batch_norm: the statistics group returned ",
               total.describe(), " for ", local.describe());

  // 3. Global statistics. The count is checked where reading it costs no GPU wait.
  s->n = part(total, 2 * c, 1);
  if (dev.is_cpu()) {
    const double n = ops::item(s->n);
    CHORUS_CHECK(n > 1, "SyncBatchNorm: training needs more than one value per channel over all members, got ", n,
                 " (input ", shape_str(x.sizes()), " here)");
  }
  s->mean = ops::binary(BinaryOp::Div, part(total, 0, c), s->n);
  Tensor var = ops::binary(BinaryOp::Sub, ops::binary(BinaryOp::Div, part(total, c, c), s->n),
                           ops::unary(UnaryOp::Square, s->mean));
  var = ops::binary(BinaryOp::Max, var, zeros({1}, so));  // rounding can leave a tiny negative
  s->invstd = ops::unary(UnaryOp::Rsqrt, ops::unary(UnaryOp::AddScalar, var, eps));
  Tensor y = std::get<0>(ops::batch_norm(x, weight, bias, s->mean, var, /*training=*/false, 0.0, eps));

  // 4. Running statistics, with the unbiased variance of the global count.
  if (running_mean.defined()) {
    Tensor nm1 = ops::unary(UnaryOp::AddScalar, s->n, -1.0);
    Tensor unbiased = ops::binary(BinaryOp::Div, ops::binary(BinaryOp::Mul, var, s->n), nm1);
    auto update = [momentum](const Tensor& running, const Tensor& batch) {
      Tensor r = ops::unary(UnaryOp::MulScalar, ops::to_dtype(running, batch.dtype()), 1.0 - momentum);
      ops::copy_(running, ops::binary(BinaryOp::Add, r, batch, momentum));
    };
    update(running_mean, s->mean);
    update(running_var, unbiased);
  }

  // 5. The output's node: the local backward sums, to the group's sum.
  return autograd::record("SyncBatchNormOutputBackward", y, {total},
                          [s](const TensorList& g) { return output_backward(*s, g); });
}

// ---- the module ----------------------------------------------------------------

SyncBatchNorm::SyncBatchNorm(SyncBatchNormOptions o)
    : nn::BatchNorm2d(nn::BatchNorm2dOptions{o.features, o.eps, o.momentum, o.affine}, "SyncBatchNorm"), opts_(o) {
  if (opts_.process_group) group_ = std::make_shared<ProcessStatsGroup>(opts_.process_group);
}

void SyncBatchNorm::set_stats_group(StatsGroupPtr group, int member) {
  group_ = std::move(group);
  member_ = member;
}

Tensor SyncBatchNorm::run(const Tensor& x, bool relu) {
  if (!is_training()) return nn::BatchNorm2d::run(x, relu);  // running statistics: nothing to share
  CHORUS_CHECK(x.dim() == 4 || x.dim() == 2, "SyncBatchNorm: expected [N, C, H, W], got ", x.describe());
  CHORUS_CHECK(x.size(1) == opts_.features, "SyncBatchNorm: input has ", x.size(1), " channels, expected ",
               opts_.features);
  auto& bufs = own_buffers();
  Tensor w = opts_.affine ? own_parameters()[0].second : Tensor();
  Tensor b = opts_.affine ? own_parameters()[1].second : Tensor();
  const bool count = !recomputing();  // a recomputed forward's batch is counted already
  Tensor y = sync_batch_norm(x, bufs[0].second, bufs[1].second, w, b, count ? opts_.momentum : 0.0, opts_.eps,
                             group_.get(), member_);
  if (count) ops::unary_(UnaryOp::AddScalar, bufs[2].second, 1.0);  // num_batches_tracked, on the device
  return relu ? chorus::relu(y) : y;
}

std::string SyncBatchNorm::extra_repr() const {
  std::string where = opts_.process_group ? ", process_group=" + std::to_string(opts_.process_group->size()) + " ranks"
                                          : "";
  return nn::BatchNorm2d::extra_repr() + where;
}

// ---- conversion ------------------------------------------------------------------

namespace {
nn::ModulePtr convert(const nn::ModulePtr& m, const ProcessGroupPtr& pg,
                      std::unordered_map<const nn::Module*, nn::ModulePtr>* done) {
  if (auto it = done->find(m.get()); it != done->end()) return it->second;
  nn::ModulePtr out = m;
  auto bn = std::dynamic_pointer_cast<nn::BatchNorm2d>(m);
  if (bn && !std::dynamic_pointer_cast<SyncBatchNorm>(m)) {
    const nn::BatchNorm2dOptions o = bn->options_for_clone();
    auto sync = std::make_shared<SyncBatchNorm>(SyncBatchNormOptions{o.features, o.eps, o.momentum, o.affine, pg});
    // The very tensors, under the very names.
    sync->own_parameters() = bn->own_parameters();
    sync->own_buffers() = bn->own_buffers();
    sync->train(bn->is_training());
    out = sync;
  } else {
    for (auto& [name, child] : m->own_children()) child = convert(child, pg, done);
  }
  done->emplace(m.get(), out);
  return out;
}
}  // namespace

nn::ModulePtr convert_sync_batchnorm(nn::ModulePtr module, ProcessGroupPtr process_group) {
  CHORUS_CHECK(module != nullptr, "convert_sync_batchnorm: the module is null");
  std::unordered_map<const nn::Module*, nn::ModulePtr> done;
  return convert(module, process_group, &done);
}

}  // namespace chorus::dist
