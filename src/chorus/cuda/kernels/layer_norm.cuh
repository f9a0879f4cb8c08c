// Layer norm on CUDA, the helpers its forward (layer_norm_forward.cu) and
// backward (layer_norm_backward.cu) share: the parameters' pointers, their
// 16-byte loads and their dtype. As cpu/transformer.cpp, float math
// throughout; rows are laid out over warps or blocks as
// cuda/kernels/row_reduce.cuh says. Include only from the two.
//
// Apart from transformer.cu (attention's softmax, the fused classifier):
// their kernels, launch logic and Notes were two thirds of that file and
// share with the rest only the row helpers, which row_reduce.cuh holds for
// all of them.
//
// The parameter gradients are column sums over every row into float32 dgamma
// and dbeta (the op layer converts them afterwards where gamma is 16-bit).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>

#include "chorus/cuda/runtime/context.h"
#include "chorus/cuda/kernels/dtype_dispatch.cuh"
#include "chorus/cuda/kernels/kernels.h"
#include "chorus/cuda/kernels/row_reduce.cuh"
#include "chorus/cuda/kernels/tensor_iter.cuh"

namespace chorus::cuda {

namespace {

// The parameter pointer of dtype G, or null for an undefined tensor.
template <typename G>
const G* param_ptr(const Tensor& t) {
  return t.defined() ? t.data<G>() : nullptr;
}

// The V parameters of columns col..col+V-1 as floats, or fill where p is null.
template <typename G, int V, typename I>
__device__ __forceinline__ void load_params(const G* __restrict__ p, I col, float fill, float (&out)[V]) {
  constexpr int GV = 16 / sizeof(G);
  if (!p) {
#pragma unroll
    for (int j = 0; j < V; ++j) out[j] = fill;
  } else if constexpr (V % GV == 0) {
#pragma unroll
    for (int i = 0; i < V / GV; ++i) {
      const Vec<G, GV> g = *reinterpret_cast<const Vec<G, GV>*>(p + col + i * GV);
#pragma unroll
      for (int j = 0; j < GV; ++j) out[i * GV + j] = to_acc(g.v[j]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) out[j] = to_acc(p[col + j]);
  }
}

int64_t rows_of(const Tensor& t) { return t.size(-1) ? t.numel() / t.size(-1) : 0; }

// Runs f.template operator()<G>() with G the element type of the layer norm's
// parameters: x's own, or float for float32 master weights.
template <typename T, typename F>
void with_param_type(const Tensor& gamma, const Tensor& beta, DType x_dtype, const char* op, F&& f) {
  DType g = gamma.defined() ? gamma.dtype() : beta.defined() ? beta.dtype() : x_dtype;
  CHORUS_CHECK((!gamma.defined() || gamma.dtype() == g) && (!beta.defined() || beta.dtype() == g), op,
               ": gamma and beta must share a dtype");
  if (g == kFloat32) return f.template operator()<float>();
  CHORUS_CHECK(g == x_dtype, op, ": gamma must be float32 or x's dtype ", dtype_name(x_dtype), ", got ",
               dtype_name(g));
  f.template operator()<T>();
}

}  // namespace

}  // namespace chorus::cuda
