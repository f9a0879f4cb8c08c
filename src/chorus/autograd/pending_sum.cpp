#include "chorus/autograd/pending_sum.h"

#include <mutex>
#include <set>
#include <utility>

#include "chorus/autograd/grad_mode.h"
#include "chorus/autograd/side_work.h"
#include "chorus/core/error.h"
#include "chorus/core/graph_capture.h"
#include "chorus/ops/elementwise.h"

namespace chorus::autograd {

namespace {
// One lock for every pending sum: they are taken once a step, per parameter.
std::mutex& pending_mutex() {
  static auto* mu = new std::mutex;  // leaked: gradients may be settled at exit
  return *mu;
}
// Note [Pending sums in a captured step]: a replay of a captured step
// rewrites every gradient and its part in device memory, but none of the host
// state, so a part that a reader outside the graph settled (added in place and
// forgot) after one replay would be forgotten for the next, whose gradient
// again holds only its own half. So each part given during a capture is given
// again after each replay (an on_each_replay action) -- unless the capture
// itself settled it: then the graph adds it at every replay, and giving it
// again would add it twice. This set names the parts settled during a
// capture, with the capture's generation: a part, not its gradient, whose
// address a short-lived view may hand on to another (the part stays alive
// with the replay action that names it). A reader that keeps a gradient's
// handle across replays and reads it directly (not through .grad()) sees the
// pending part again after each replay, as it would after a backward.
std::set<std::pair<const TensorImpl*, uint64_t>>& settled_in_capture() {
  static auto* s = new std::set<std::pair<const TensorImpl*, uint64_t>>;
  return *s;
}

}  // namespace

void settle_sum(const Tensor& t) {
  if (!t.defined()) return;
  std::shared_ptr<TensorImpl> part;
  {
    std::lock_guard<std::mutex> lock(pending_mutex());
    part = std::move(t.impl()->sum_pending);
    t.impl()->sum_pending = nullptr;
    if (part && capture_in_progress()) settled_in_capture().insert({part.get(), capture_generation()});
  }
  if (!part) return;
  join_beside_before_write(t);  // Note [Weight gradients beside the data gradient]
  NoGradGuard no_grad;
  // own + part: one float addition, as the fused update's, so a settled
  // gradient and an update that read both parts see the same bits.
  ops::binary_(BinaryOp::Add, t, Tensor(part), 1.0);
}

Tensor pending_sum(const Tensor& t) {
  if (!t.defined()) return Tensor();
  std::lock_guard<std::mutex> lock(pending_mutex());
  return t.impl()->sum_pending ? Tensor(t.impl()->sum_pending) : Tensor();
}

Tensor unsettled_grad(const Tensor& leaf) {
  AutogradMeta* m = leaf.autograd_meta();
  return m && m->grad ? Tensor(m->grad) : Tensor();
}

void set_pending_sum(const Tensor& t, const Tensor& part) {
  CHORUS_CHECK(t.defined() && part.defined(), "set_pending_sum: undefined tensor");
  CHORUS_CHECK(part.sizes() == t.sizes() && part.strides() == t.strides() && part.dtype() == t.dtype() &&
                   part.device() == t.device(),
               "set_pending_sum: the part ", part.describe(), " (strides ", shape_str(part.strides()),
               ") does not match the gradient ", t.describe(), " (strides ", shape_str(t.strides()), ")");
  {
    std::lock_guard<std::mutex> lock(pending_mutex());
    CHORUS_CHECK(!t.impl()->sum_pending, "set_pending_sum: ", t.describe(), " already has a pending part");
    t.impl()->sum_pending = part.impl_ptr();
  }
  if (!capture_in_progress()) return;
  // Note [Pending sums in a captured step].
  const std::weak_ptr<TensorImpl> grad = t.impl_ptr();
  const std::shared_ptr<TensorImpl> kept = part.impl_ptr();
  const std::pair<const TensorImpl*, uint64_t> key{kept.get(), capture_generation()};
  on_each_replay([grad, kept, key] {
    std::shared_ptr<TensorImpl> g = grad.lock();
    if (!g) return;
    std::lock_guard<std::mutex> lock(pending_mutex());
    if (!settled_in_capture().count(key)) g->sum_pending = kept;
  });
}

}  // namespace chorus::autograd
