// Weight initialisation (in place, no autograd), as torch.nn.init.
#pragma once

#include "chorus/core/tensor.h"

namespace chorus::nn::init {

// fan_in / fan_out of a [out, in, *kernel] weight.
std::pair<int64_t, int64_t> fans(const Tensor& w);
void uniform_(Tensor& t, double lo, double hi);
void normal_(Tensor& t, double mean, double std);
void constant_(Tensor& t, double v);
// Kaiming (He): std = gain / sqrt(fan), gain = sqrt(2) for ReLU.
void kaiming_normal_(Tensor& w, bool fan_out = false);
void kaiming_uniform_(Tensor& w, double a = 0.0);
void xavier_uniform_(Tensor& w, double gain = 1.0);
void xavier_normal_(Tensor& w, double gain = 1.0);

}  // namespace chorus::nn::init
