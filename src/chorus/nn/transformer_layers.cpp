#include "chorus/nn/transformer_layers.h"

#include "chorus/core/error.h"
#include "chorus/nn/functional.h"
#include "chorus/nn/init.h"
#include "chorus/ops/factory.h"

namespace chorus::nn {

Embedding::Embedding(EmbeddingOptions o) : Module("Embedding"), opts_(o) {
  CHORUS_CHECK(o.num > 0 && o.dim > 0, "Embedding: sizes must be positive, got ", o.num, " x ", o.dim);
  Tensor w = empty({o.num, o.dim});
  init::normal_(w, 0.0, 1.0);
  register_parameter("weight", w);
}
Tensor Embedding::forward(const Tensor& index) { return functional::embedding(weight(), index); }
std::string Embedding::extra_repr() const { return std::to_string(opts_.num) + ", " + std::to_string(opts_.dim); }

LayerNorm::LayerNorm(LayerNormOptions o) : Module("LayerNorm"), opts_(o) {
  CHORUS_CHECK(o.dim > 0 && o.eps > 0, "LayerNorm: dim and eps must be positive, got ", o.dim, " and ", o.eps);
  if (o.affine) {
    register_parameter("weight", ones({o.dim}));
    register_parameter("bias", zeros({o.dim}));
  }
}
Tensor LayerNorm::forward(const Tensor& x) {
  Tensor in = on_own_device(x);
  if (!opts_.affine) return functional::layer_norm(in, Tensor(), Tensor(), opts_.eps);
  return functional::layer_norm(in, own_parameters()[0].second, own_parameters()[1].second, opts_.eps);
}
std::pair<Tensor, Tensor> LayerNorm::forward_add(const Tensor& x, const Tensor& r) {
  Tensor a = on_own_device(x), b = on_own_device(r);
  if (!opts_.affine) return functional::add_layer_norm(a, b, Tensor(), Tensor(), opts_.eps);
  return functional::add_layer_norm(a, b, own_parameters()[0].second, own_parameters()[1].second, opts_.eps);
}
std::string LayerNorm::extra_repr() const {
  return "(" + std::to_string(opts_.dim) + ",), eps=" + std::to_string(opts_.eps) +
         (opts_.affine ? "" : ", elementwise_affine=False");
}

GELU::GELU(GELUOptions o) : Module("GELU"), opts_(o) {}
Tensor GELU::forward(const Tensor& x) { return functional::gelu(x, opts_.tanh_approximation); }
std::string GELU::extra_repr() const { return opts_.tanh_approximation ? "approximate='tanh'" : ""; }

}  // namespace chorus::nn
