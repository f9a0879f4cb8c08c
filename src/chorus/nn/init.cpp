#include "chorus/nn/init.h"

#include <cmath>

#include "chorus/autograd/grad_mode.h"
#include "chorus/core/error.h"

namespace chorus::nn::init {

std::pair<int64_t, int64_t> fans(const Tensor& w) {
  CHORUS_CHECK(w.dim() >= 2, "init: fan in/out need a weight of at least 2 dims, got ", w.describe());
  int64_t receptive = 1;
  for (int64_t d = 2; d < w.dim(); ++d) receptive *= w.size(d);
  return {w.size(1) * receptive, w.size(0) * receptive};
}

void uniform_(Tensor& t, double lo, double hi) { NoGradGuard g; t.uniform_(lo, hi); }
void normal_(Tensor& t, double mean, double std) { NoGradGuard g; t.normal_(mean, std); }
void constant_(Tensor& t, double v) { NoGradGuard g; t.fill_(v); }

void kaiming_normal_(Tensor& w, bool fan_out) {
  auto [fi, fo] = fans(w);
  normal_(w, 0.0, std::sqrt(2.0) / std::sqrt(static_cast<double>(fan_out ? fo : fi)));
}

void kaiming_uniform_(Tensor& w, double a) {
  auto [fi, fo] = fans(w);
  double gain = std::sqrt(2.0 / (1.0 + a * a));
  double bound = gain * std::sqrt(3.0 / static_cast<double>(fi));
  uniform_(w, -bound, bound);
}

void xavier_uniform_(Tensor& w, double gain) {
  auto [fi, fo] = fans(w);
  double bound = gain * std::sqrt(6.0 / static_cast<double>(fi + fo));
  uniform_(w, -bound, bound);
}

void xavier_normal_(Tensor& w, double gain) {
  auto [fi, fo] = fans(w);
  normal_(w, 0.0, gain * std::sqrt(2.0 / static_cast<double>(fi + fo)));
}

}  // namespace chorus::nn::init
