#include "chorus/autograd/autocast.h"

#include <memory>
#include <mutex>
#include <unordered_map>

#include "chorus/autograd/functions.h"
#include "chorus/autograd/grad_mode.h"
#include "chorus/autograd/node.h"
#include "chorus/core/graph_capture.h"
#include "chorus/core/persistent_alloc.h"
#include "chorus/ops/copy.h"

namespace chorus {

namespace {
thread_local std::optional<DType> t_autocast;

// Note [Autocast weight copies]: parameter -> its kept copy and the parameter
// version the copy holds.
struct KeptCopy {
  std::weak_ptr<TensorImpl> param;
  Tensor copy;
  uint32_t version = 0;

  // Whether the copy still mirrors `p`: the version, and the device and
  // geometry, which Module::to and to_channels_last change without a version
  // bump (the values stay the same).
  bool current_for(const Tensor& p) const {
    return version == p.version() && copy.device() == p.device() && copy.sizes() == p.sizes() &&
           copy.strides() == p.strides();
  }
};

struct CopyRegistry {
  std::mutex mu;
  std::unordered_map<const TensorImpl*, KeptCopy> copies;

  // The entry of `p` if it is p's (not a dead parameter's at a reused address).
  KeptCopy* find(const Tensor& p) {
    auto it = copies.find(p.impl());
    if (it == copies.end()) return nullptr;
    if (it->second.param.lock().get() != p.impl()) {
      copies.erase(it);
      return nullptr;
    }
    return &it->second;
  }
  void drop_dead() {
    for (auto it = copies.begin(); it != copies.end();)
      it = it->second.param.expired() ? copies.erase(it) : std::next(it);
  }
};

CopyRegistry& registry() {
  static CopyRegistry* r = new CopyRegistry();  // leaked: copies may outlive static destruction order
  return *r;
}
}  // namespace

std::optional<DType> autocast_dtype(const Tensor& t) {
  if (!t_autocast || !t.defined() || !t.device().is_cuda() || !is_floating(t.dtype())) return std::nullopt;
  return t_autocast;
}

std::optional<DType> current_autocast() { return t_autocast; }

AutocastGuard::AutocastGuard(std::optional<DType> dtype) : prev_(t_autocast) { t_autocast = dtype; }
AutocastGuard::~AutocastGuard() { t_autocast = prev_; }

Tensor autocast_weight_data(const Tensor& w, DType dt) {
  if (!w.defined() || w.dtype() == dt) return w.detach();
  // A stand-in for a parameter (DataParallel's recorded alias) keeps the
  // parameter's copy: `p` is whose copy this is, `w` what the graph records.
  std::shared_ptr<TensorImpl> stands_for;
  if (const AutogradMeta* m = w.autograd_meta()) stands_for = m->stands_for.lock();
  const Tensor p = stands_for ? Tensor(stands_for) : w;
  const AutogradMeta* pm = p.autograd_meta();
  const bool keep = (stands_for ? p.is_leaf() : w.is_leaf() && w.requires_grad()) && grad_enabled() &&
                    !(pm && pm->no_kept_copy) &&
                    p.dtype() == kFloat32 && p.device().is_cuda() && (dt == kBFloat16 || dt == kFloat16) &&
                    p.sizes() == w.sizes() && p.strides() == w.strides();
  if (!keep) return ops::to_dtype(w.detach(), dt);
  CopyRegistry& r = registry();
  Tensor copy;
  {
    std::lock_guard<std::mutex> lk(r.mu);
    if (KeptCopy* k = r.find(p); k && k->current_for(p) && k->copy.dtype() == dt) copy = k->copy;
  }
  if (!copy.defined()) {
    // Kept for the run: Note [Persistent allocations] (a copy not kept below
    // is a rare transient, and harmless there).
    PersistentAllocations persistent;
    copy = ops::to_dtype(w.detach(), dt);
    // Kept only where the optimizer can write it element for element: the
    // parameter's own layout, memory of no graph's.
    if (!capture_in_progress() && copy.strides() == p.strides() && copy.is_contiguous() == p.is_contiguous()) {
      std::lock_guard<std::mutex> lk(r.mu);
      r.drop_dead();
      r.copies[p.impl()] = KeptCopy{p.impl_ptr(), copy, p.version()};
    }
  }
  // A fresh handle on the copy for this step's graph: the kept tensor itself
  // never becomes a node's output.
  return detail::make_view(copy, copy.sizes(), copy.strides(), copy.storage_offset());
}

Tensor autocast_weight(const Tensor& w, DType dt) {
  if (!w.defined() || w.dtype() == dt) return w;
  const DType src = w.dtype();
  return autograd::record("ToDtypeBackward", autocast_weight_data(w, dt), {w},
                          [src](const TensorList& g) { return TensorList{ops::to_dtype(g[0], src)}; });
}

Tensor autocast_copy_for_update(const Tensor& param) {
  CopyRegistry& r = registry();
  std::lock_guard<std::mutex> lk(r.mu);
  KeptCopy* k = r.find(param);
  return k && k->current_for(param) ? k->copy : Tensor();
}

void autocast_copy_written(const Tensor& param) {
  CopyRegistry& r = registry();
  std::lock_guard<std::mutex> lk(r.mu);
  if (KeptCopy* k = r.find(param)) {
    k->copy.bump_version();  // graphs that saved the old copy see it changed
    k->version = param.version();
  }
}

size_t autocast_copies_kept() {
  CopyRegistry& r = registry();
  std::lock_guard<std::mutex> lk(r.mu);
  r.drop_dead();
  return r.copies.size();
}

}  // namespace chorus
