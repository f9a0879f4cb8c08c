#include "chorus/autograd/autocast.h"

namespace chorus {

namespace {
thread_local std::optional<DType> t_autocast;
}

std::optional<DType> autocast_dtype(const Tensor& t) {
  if (!t_autocast || !t.defined() || !t.device().is_cuda() || !is_floating(t.dtype())) return std::nullopt;
  return t_autocast;
}

std::optional<DType> current_autocast() { return t_autocast; }

AutocastGuard::AutocastGuard(std::optional<DType> dtype) : prev_(t_autocast) { t_autocast = dtype; }
AutocastGuard::~AutocastGuard() { t_autocast = prev_; }

}  // namespace chorus
