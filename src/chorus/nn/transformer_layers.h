// The transformer's layers: Embedding, LayerNorm and GELU (PyTorch's names and
// parameter names, so state dicts move between the two).
#pragma once

#include <utility>

#include "chorus/nn/module.h"

namespace chorus::nn {

struct EmbeddingOptions {
  int64_t num, dim;
};
// weight [num, dim], N(0, 1) as PyTorch's default (models set their own).
class Embedding : public Module {
 public:
  explicit Embedding(EmbeddingOptions o);
  // index: integers of any shape -> [..., dim]
  Tensor forward(const Tensor& index) override;
  Tensor& weight() { return own_parameters()[0].second; }
  std::string extra_repr() const override;
  EmbeddingOptions options_for_clone() const { return opts_; }
  CHORUS_MODULE_CLONEABLE(Embedding)
 private:
  EmbeddingOptions opts_;
};

struct LayerNormOptions {
  int64_t dim;
  double eps = 1e-5;
  bool affine = true;
};
class LayerNorm : public Module {
 public:
  explicit LayerNorm(LayerNormOptions o);
  Tensor forward(const Tensor& x) override;
  // (x + r, forward(x + r)) as one op (functional::add_layer_norm): a
  // residual add and the norm beside it.
  std::pair<Tensor, Tensor> forward_add(const Tensor& x, const Tensor& r);
  std::string extra_repr() const override;
  LayerNormOptions options_for_clone() const { return opts_; }
  CHORUS_MODULE_CLONEABLE(LayerNorm)
 private:
  LayerNormOptions opts_;
};

struct GELUOptions {
  bool tanh_approximation = false;  // PyTorch's approximate="tanh" (GPT-2's)
};
class GELU : public Module {
 public:
  explicit GELU(GELUOptions o = {});
  Tensor forward(const Tensor& x) override;
  std::string extra_repr() const override;
  GELUOptions options_for_clone() const { return opts_; }
  CHORUS_MODULE_CLONEABLE(GELU)
 private:
  GELUOptions opts_;
};

}  // namespace chorus::nn
