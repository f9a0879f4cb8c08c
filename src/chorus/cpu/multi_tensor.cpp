// The kernel set's multi-tensor norm and scale on the CPU (gradient clipping).
#include "chorus/cpu/dtype_dispatch.h"
#include "chorus/cpu/kernels.h"

namespace chorus::cpu {

void sum_squares_multi(const TensorList& xs, const Tensor& out) {
  double total = 0;  // float64 accumulation for every input dtype
  for (const Tensor& x : xs) {
    CHORUS_CHECK(x.is_contiguous() && is_floating(x.dtype()),
                 "sum_squares_multi: tensors must be contiguous and floating, got ", x.describe());
    CHORUS_CPU_DISPATCH(x.dtype(), T, {
      const T* p = x.data<T>();
      for (int64_t i = 0; i < x.numel(); ++i) {
        const double v = static_cast<double>(to_compute(p[i]));
        total += v * v;
      }
    });
  }
  if (out.dtype() == kFloat64) {
    out.data<double>()[0] = total;
  } else {
    out.data<float>()[0] = static_cast<float>(total);
  }
}

void scale_multi(const TensorList& xs, const Tensor& scale) {
  const double c = scale.dtype() == kFloat64 ? scale.data<double>()[0] : static_cast<double>(scale.data<float>()[0]);
  for (const Tensor& x : xs) {
    CHORUS_CHECK(x.is_contiguous() && is_floating(x.dtype()), "scale_multi: tensors must be contiguous and floating, got ",
                 x.describe());
    CHORUS_CPU_DISPATCH(x.dtype(), T, {
      T* p = x.data<T>();
      for (int64_t i = 0; i < x.numel(); ++i)
        p[i] = from_compute<T>(static_cast<ComputeT<T>>(static_cast<double>(to_compute(p[i])) * c));
    });
  }
}

}  // namespace chorus::cpu
