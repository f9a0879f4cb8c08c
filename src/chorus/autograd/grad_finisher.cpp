#include "chorus/autograd/grad_finisher.h"

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
// One lock for every finisher slot and pending part: they are taken once a
// step, per parameter.
std::mutex& finisher_mutex() {
  static auto* mu = new std::mutex;  // leaked: gradients may be finished at exit
  return *mu;
}

// Note [Pending sums in a captured step]: a replay of a captured step
// rewrites every gradient and its part in device memory, but none of the host
// state, so a part that a reader outside the graph finished (added in place
// and forgot) after one replay would be forgotten for the next, whose gradient
// again holds only its own half. So each part given during a capture is given
// again after each replay (an on_each_replay action) -- unless the capture
// itself finished it: then the graph adds it at every replay, and giving it
// again would add it twice. This set names the parts finished during a
// capture, with the capture's generation: a part, not its gradient, whose
// address a short-lived view may hand on to another (the part stays alive
// with the replay action that names it). A reader that keeps a gradient's
// handle across replays and reads it directly (not through .grad()) sees the
// pending part again after each replay, as it would after a backward.
std::set<std::pair<const TensorImpl*, uint64_t>>& finished_in_capture() {
  static auto* s = new std::set<std::pair<const TensorImpl*, uint64_t>>;
  return *s;
}

// A view that owns its elements and has nothing pending (shared: stateless).
class OwnedView final : public GradFinisher {
 public:
  void finish(const Tensor&) override {}
  bool owns_elements() const override { return true; }
};

// A gradient plus a part still to add (Note [Gradient sums in the update]).
class PendingSum final : public GradFinisher {
 public:
  explicit PendingSum(bool owned) : owned_(owned) {}
  void finish(const Tensor& grad) override {
    std::shared_ptr<TensorImpl> part;
    {
      std::lock_guard<std::mutex> lock(finisher_mutex());
      part = std::move(part_);
      part_ = nullptr;
      if (part && capture_in_progress()) finished_in_capture().insert({part.get(), capture_generation()});
    }
    if (!part) return;
    join_beside_before_write(grad);  // Note [Weight gradients beside the data gradient]
    NoGradGuard no_grad;
    // own + part: one float addition, as the fused update's, so a finished
    // gradient and an update that read both parts see the same bits.
    ops::binary_(BinaryOp::Add, grad, Tensor(part), 1.0);
  }
  Tensor pending() const override {
    std::lock_guard<std::mutex> lock(finisher_mutex());
    return part_ ? Tensor(part_) : Tensor();
  }
  bool owns_elements() const override { return owned_; }

  std::shared_ptr<TensorImpl> part_;  // guarded by finisher_mutex()
  bool owned_;
};

// Caller holds finisher_mutex().
std::shared_ptr<GradFinisher>& slot_of(const Tensor& t) {
  auto& m = t.impl()->autograd;
  if (!m) m = std::make_unique<AutogradMeta>();
  return m->finisher;
}
}  // namespace

std::shared_ptr<GradFinisher> grad_finisher(const Tensor& t) {
  AutogradMeta* m = t.defined() ? t.autograd_meta() : nullptr;
  if (!m) return nullptr;
  std::lock_guard<std::mutex> lock(finisher_mutex());
  return m->finisher;
}

void set_grad_finisher(const Tensor& t, std::shared_ptr<GradFinisher> finisher) {
  CHORUS_CHECK(t.defined(), "set_grad_finisher: undefined tensor");
  std::lock_guard<std::mutex> lock(finisher_mutex());
  slot_of(t) = std::move(finisher);
}

void finish_grad(const Tensor& t) {
  if (std::shared_ptr<GradFinisher> f = grad_finisher(t)) f->finish(t);
}

Tensor pending_part(const Tensor& t) {
  std::shared_ptr<GradFinisher> f = grad_finisher(t);
  return f ? f->pending() : Tensor();
}

bool owns_elements(const Tensor& t) {
  std::shared_ptr<GradFinisher> f = grad_finisher(t);
  return f && f->owns_elements();
}

Tensor unfinished_grad(const Tensor& leaf) {
  AutogradMeta* m = leaf.autograd_meta();
  return m && m->grad ? Tensor(m->grad) : Tensor();
}

void mark_owned_view(const Tensor& t) {
  CHORUS_CHECK(t.defined(), "mark_owned_view: undefined tensor");
  static const auto owned = std::make_shared<OwnedView>();
  std::lock_guard<std::mutex> lock(finisher_mutex());
  std::shared_ptr<GradFinisher>& slot = slot_of(t);
  if (!slot) {
    slot = owned;
  } else if (auto* p = dynamic_cast<PendingSum*>(slot.get())) {
    p->owned_ = true;
  } else {
    CHORUS_CHECK(slot->owns_elements(), "mark_owned_view: ", t.describe(), " already has a finisher of another kind");
  }
}

void set_pending_sum(const Tensor& t, const Tensor& part) {
  CHORUS_CHECK(t.defined() && part.defined(), "set_pending_sum: undefined tensor");
  CHORUS_CHECK(part.sizes() == t.sizes() && part.strides() == t.strides() && part.dtype() == t.dtype() &&
                   part.device() == t.device(),
               "set_pending_sum: the part ", part.describe(), " (strides ", shape_str(part.strides()),
               ") does not match the gradient ", t.describe(), " (strides ", shape_str(t.strides()), ")");
  std::shared_ptr<PendingSum> pending;
  {
    std::lock_guard<std::mutex> lock(finisher_mutex());
    std::shared_ptr<GradFinisher>& slot = slot_of(t);
    pending = std::dynamic_pointer_cast<PendingSum>(slot);
    if (!pending) {
      CHORUS_CHECK(!slot || dynamic_cast<OwnedView*>(slot.get()), "set_pending_sum: ", t.describe(),
                   " already has a finisher of another kind");
      pending = std::make_shared<PendingSum>(slot != nullptr);
      slot = pending;
    }
    CHORUS_CHECK(!pending->part_, "set_pending_sum: ", t.describe(), " already has a pending part");
    pending->part_ = part.impl_ptr();
  }
  if (!capture_in_progress()) return;
  // Note [Pending sums in a captured step].
  const std::weak_ptr<PendingSum> weak = pending;
  const std::shared_ptr<TensorImpl> kept = part.impl_ptr();
  const std::pair<const TensorImpl*, uint64_t> key{kept.get(), capture_generation()};
  on_each_replay([weak, kept, key] {
    std::shared_ptr<PendingSum> p = weak.lock();
    if (!p) return;
    std::lock_guard<std::mutex> lock(finisher_mutex());
    if (!finished_in_capture().count(key)) p->part_ = kept;
  });
}

}  // namespace chorus::autograd
