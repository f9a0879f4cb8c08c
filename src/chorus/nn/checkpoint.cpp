// Note [Recomputed blocks]: checkpoint() records one node whose inputs are x
// and every parameter of the module -- so the backward reaches the parameters
// as leaves, and DDP's hooks and unused-parameter accounting see them as in
// an ordinary step -- and whose backward (1) puts stand-in leaves in the
// module's parameter slots (each standing for its parameter, so autocast
// reuses the parameter's kept 16-bit copy), (2) runs the forward again with
// grad mode, the caller's autocast and the forward's random-number position,
// (3) runs a backward pass of its own over that small graph, and (4) returns
// the stand-ins' gradients as the parameters' (the outer pass accumulates
// them, firing the parameters' hooks once). RecomputeGuard tells layers with
// running statistics not to count the batch twice.
#include "chorus/nn/checkpoint.h"

#include <utility>
#include <vector>

#include "chorus/autograd/autocast.h"
#include "chorus/autograd/engine.h"
#include "chorus/autograd/grad_mode.h"
#include "chorus/autograd/node.h"
#include "chorus/core/rng.h"

namespace chorus::nn {

namespace {

void collect_slots(Module& m, std::vector<Tensor*>& out) {
  for (auto& [name, p] : m.own_parameters())
    if (p.defined()) out.push_back(&p);
  for (const auto& [name, child] : m.named_children()) collect_slots(*child, out);
}

// Restores grad mode when it leaves scope.
class GradModeScope {
 public:
  explicit GradModeScope(bool on) : prev_(grad_enabled()) { set_grad_enabled(on); }
  ~GradModeScope() { set_grad_enabled(prev_); }
  GradModeScope(const GradModeScope&) = delete;
  GradModeScope& operator=(const GradModeScope&) = delete;

 private:
  bool prev_;
};

}  // namespace

Tensor checkpoint(Module& m, const Tensor& x) {
  std::vector<Tensor*> slots;
  collect_slots(m, slots);
  TensorList inputs{x};
  for (Tensor* s : slots) inputs.push_back(*s);
  if (!grad_enabled() || !autograd::any_requires_grad(inputs)) return m.forward(x);
  const RngState rng = default_generator().state();
  const std::optional<DType> cast = current_autocast();
  Tensor y;
  {
    NoGradGuard no_grad;
    y = m.forward(x);
  }
  Module* mp = &m;
  Tensor xd = x.detach();
  const bool x_grad = x.requires_grad();
  return autograd::record("CheckpointBackward", y, inputs, [mp, xd, x_grad, rng, cast](const TensorList& g) {
    std::vector<Tensor*> now;
    collect_slots(*mp, now);
    // (1) stand-ins for the parameters, put back whatever happens below.
    std::vector<Tensor> saved, leaves;
    for (Tensor* s : now) {
      saved.push_back(*s);
      Tensor leaf = s->detach();
      leaf.set_requires_grad(s->requires_grad());
      if (leaf.requires_grad()) {
        const AutogradMeta* sm = s->autograd_meta();
        std::shared_ptr<TensorImpl> stands = sm ? sm->stands_for.lock() : nullptr;
        leaf.autograd_meta()->stands_for = stands ? stands : s->impl_ptr();
      }
      leaves.push_back(leaf);
      *s = leaf;
    }
    struct Restore {
      std::vector<Tensor*>& slots;
      std::vector<Tensor>& saved;
      ~Restore() {
        for (size_t i = 0; i < slots.size(); ++i) *slots[i] = saved[i];
      }
    } restore{now, saved};
    Tensor xl = xd.detach();
    xl.set_requires_grad(x_grad);
    // (2) the forward again, drawing the same random numbers.
    Tensor y2;
    {
      GradModeScope grad_on(true);
      AutocastGuard ac(cast);
      RecomputeGuard recompute;
      Generator gen;
      gen.set_state(rng);
      GeneratorGuard gg(gen);
      y2 = mp->forward(xl);
    }
    // (3) its backward.
    if (y2.requires_grad()) autograd::run_backward(y2, g[0], /*retain_graph=*/false);
    // (4) what the outer pass accumulates.
    TensorList out{x_grad ? xl.grad() : Tensor()};
    for (const Tensor& l : leaves) out.push_back(l.requires_grad() ? l.grad() : Tensor());
    return out;
  });
}

}  // namespace chorus::nn
