#include "chorus/core/rng.h"

namespace chorus {

void Generator::manual_seed(uint64_t seed) {
  std::lock_guard<std::mutex> g(mu_);
  state_.seed = seed;
  state_.offset = 0;
}

RngState Generator::reserve(uint64_t n_words) {
  std::lock_guard<std::mutex> g(mu_);
  RngState s = state_;
  state_.offset += (n_words + 3) / 4;
  return s;
}

RngState Generator::state() const {
  std::lock_guard<std::mutex> g(mu_);
  return state_;
}

void Generator::set_state(const RngState& s) {
  std::lock_guard<std::mutex> g(mu_);
  state_ = s;
}

namespace {
thread_local Generator* t_override = nullptr;
}

Generator& default_generator() {
  static Generator g;
  return t_override ? *t_override : g;
}

GeneratorGuard::GeneratorGuard(Generator& g) : prev_(t_override) { t_override = &g; }
GeneratorGuard::~GeneratorGuard() { t_override = prev_; }

void manual_seed(uint64_t seed) { default_generator().manual_seed(seed); }

}  // namespace chorus
