#include "chorus/autograd/grad_mode.h"

namespace chorus {

namespace {
thread_local bool t_grad_enabled = true;
thread_local bool t_recomputing = false;
}

bool grad_enabled() { return t_grad_enabled; }
void set_grad_enabled(bool on) { t_grad_enabled = on; }
NoGradGuard::NoGradGuard() : prev_(t_grad_enabled) { t_grad_enabled = false; }
NoGradGuard::~NoGradGuard() { t_grad_enabled = prev_; }

bool recomputing() { return t_recomputing; }
RecomputeGuard::RecomputeGuard() : prev_(t_recomputing) { t_recomputing = true; }
RecomputeGuard::~RecomputeGuard() { t_recomputing = prev_; }

}  // namespace chorus
