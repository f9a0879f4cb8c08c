// Differentiable tensor functions (the free-function form of Tensor's math
// methods), recorded by autograd when any input requires grad.
#pragma once

#include <vector>

#include "chorus/core/tensor.h"

namespace chorus {

Tensor add(const Tensor& a, const Tensor& b, double alpha = 1.0);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
Tensor maximum(const Tensor& a, const Tensor& b);
Tensor add_scalar(const Tensor& a, double s);
Tensor mul_scalar(const Tensor& a, double s);
Tensor rsub_scalar(double s, const Tensor& a);  // s - a
Tensor pow(const Tensor& a, double e);
Tensor neg(const Tensor& a);
Tensor exp(const Tensor& a);
Tensor log(const Tensor& a);
Tensor sqrt(const Tensor& a);
Tensor tanh(const Tensor& a);
Tensor sigmoid(const Tensor& a);
Tensor relu(const Tensor& a);
Tensor abs(const Tensor& a);

Tensor sum(const Tensor& a, const Shape& dims = {}, bool keepdim = false);
Tensor mean(const Tensor& a, const Shape& dims = {}, bool keepdim = false);
Tensor amax(const Tensor& a, int64_t dim, bool keepdim = false);  // values of max over dim
Tensor argmax(const Tensor& a, int64_t dim, bool keepdim = false);
Tensor matmul(const Tensor& a, const Tensor& b);

Tensor cat(const TensorList& ts, int64_t dim = 0);
Tensor stack(const TensorList& ts, int64_t dim = 0);
TensorList split(const Tensor& t, int64_t split_size, int64_t dim = 0);
TensorList split_sizes(const Tensor& t, const std::vector<int64_t>& sizes, int64_t dim = 0);
TensorList chunk(const Tensor& t, int64_t chunks, int64_t dim = 0);
Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index);
Tensor gather(const Tensor& x, int64_t dim, const Tensor& index);

Tensor softmax(const Tensor& x, int64_t dim);
Tensor log_softmax(const Tensor& x, int64_t dim);

// Differentiable device / dtype moves (gradients flow back across devices).
Tensor to_device(const Tensor& t, const Device& d);
Tensor to_dtype(const Tensor& t, DType dt);

void backward(const Tensor& root, const Tensor& grad = Tensor(), bool retain_graph = false);
// One pass from several roots (Note [Several roots] in autograd/engine.h):
// grads empty, or one per root.
void backward(const TensorList& roots, const TensorList& grads = {}, bool retain_graph = false);

}  // namespace chorus
