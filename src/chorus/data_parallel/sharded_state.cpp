// ShardedDataParallel's state outside the step (sharded.h): the parameters
// gathered for evaluation, whole (the masters) for export, loaded shard by
// shard from a checkpoint, and the memory the engine holds (held_bytes).
#include <algorithm>
#include <mutex>
#include <unordered_set>

#include "chorus/core/storage.h"
#include "chorus/data_parallel/sharded_engine.h"

namespace chorus::dist {

void ShardedDataParallel::gather_parameters() {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lk(s.mu);
  NoGradGuard no_grad;
  for (size_t b = 0; b < s.buckets.size(); ++b) {
    s.wait_gather(b);
    s.buckets[b].held = true;
  }
}

NamedTensors ShardedDataParallel::full_parameters() {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lk(s.mu);
  NoGradGuard no_grad;
  std::vector<Tensor> whole(s.params.size());
  for (size_t b = 0; b < s.plan.size(); ++b) {
    const GradBuckets::Bucket& pb = s.plan.buckets[b];
    for (size_t g = 0; g < s.buckets[b].flats.size(); ++g) {
      const Impl::Flat& f = s.buckets[b].flats[g];
      // The masters, not the gathered weights: param_dtype's would round.
      Tensor flat = empty({f.padded}, TensorOptions(f.master_dtype, pb.device));
      Tensor src = ops::clone(f.master);
      if (s.world > 1) s.group->all_gather(src, flat)->wait();
      else ops::copy_(flat, src);
      for (size_t i = 0; i < pb.ks.size(); ++i)
        if (pb.layout.segments[i].group == g) whole[pb.ks[i]] = pb.layout.view(flat, i).to(cpu_device(0)).clone();
    }
  }
  NamedTensors out;
  for (size_t k = 0; k < s.params.size(); ++k) out.emplace_back(s.names[k], whole[k]);
  return out;
}

void ShardedDataParallel::load_shards(const std::function<Tensor(const Piece&)>& values) {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lk(s.mu);
  NoGradGuard no_grad;
  for (size_t i = 0; i < s.pieces.size(); ++i) {
    Tensor v = values(s.pieces[i]);
    const int64_t n = s.pieces[i].end - s.pieces[i].begin;
    CHORUS_CHECK(v.defined() && v.numel() == n, "ShardedDataParallel: the values loaded for '", s.pieces[i].name,
                 "' [", s.pieces[i].begin, ", ", s.pieces[i].end, ") hold ", v.defined() ? v.numel() : 0,
                 " elements, expected ", n);
    ops::copy_(s.shard_params[i], ops::to_device(v.reshape({n}), s.shard_params[i].device()));
    s.shard_params[i].bump_version();
  }
  for (auto& bk : s.buckets) {
    bk.stale = true;
    bk.held = false;
    if (!s.stage3()) bk.gathered = false;  // the next forward gathers
  }
  for (size_t b = 0; b < s.buckets.size(); ++b) s.release(b);
}

ShardedDataParallel::Held ShardedDataParallel::held_bytes() const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  Held h;
  for (const auto& bk : impl_->buckets)
    for (const auto& f : bk.flats) {
      if (bk.gathered) h.full_weights += static_cast<int64_t>(f.full.nbytes());
      if (impl_->stage3() || f.master_dtype != f.dtype) h.shard_weights += static_cast<int64_t>(f.master.nbytes());
      if (f.grad_full.defined()) h.full_grads += static_cast<int64_t>(f.grad_full.nbytes());
    }
  // Note [Sharded gradient shards]: the shards live in the pieces' gradients
  // (and, during the backward, the reduce-scatters' outputs); those inside a
  // full buffer (stage 1: its own segments, and the casts placed beside
  // them) are counted there.
  std::unordered_set<const Storage*> full, seen;
  for (const auto& bk : impl_->buckets)
    for (const auto& f : bk.flats)
      if (f.grad_full.defined()) full.insert(f.grad_full.storage().get());
  auto count = [&](const Tensor& t) {
    if (!t.defined()) return;
    const Storage* st = t.storage().get();
    if (full.count(st) == 0 && seen.insert(st).second) h.shard_grads += static_cast<int64_t>(st->nbytes());
  };
  for (const auto& bk : impl_->buckets)
    for (const auto& f : bk.flats) count(f.rs_out);
  for (const Tensor& p : impl_->shard_params) count(p.grad());
  h.peak_full_grads = impl_->peak_full_grads;
  for (size_t b = 0; b < impl_->buckets.size(); ++b) {
    int64_t bytes = 0;
    for (const auto& f : impl_->buckets[b].flats) bytes += f.padded * static_cast<int64_t>(dtype_size(f.dtype));
    h.largest_bucket_grads = std::max(h.largest_bucket_grads, bytes);
  }
  return h;
}

}  // namespace chorus::dist
