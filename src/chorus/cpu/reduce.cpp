// CPU reductions of the kernel set. Sums accumulate in double on the CPU, which
// makes the CPU a tighter reference for the GPU's float accumulation.
#include <cmath>
#include <limits>

#include "chorus/cpu/dtype_dispatch.h"
#include "chorus/cpu/kernels.h"
#include "chorus/cpu/parallel.h"

namespace chorus::cpu {

void reduce(ReduceOp op, const Tensor& x, const Tensor& out, const std::vector<bool>& red) {
  const int64_t nd = x.dim();
  // Split dims into kept (outer, in order) and reduced (inner, in order).
  std::vector<int64_t> kept_sizes, kept_strides, red_sizes, red_strides;
  for (int64_t d = 0; d < nd; ++d) {
    if (red[d]) {
      red_sizes.push_back(x.size(d));
      red_strides.push_back(x.stride(d));
    } else {
      kept_sizes.push_back(x.size(d));
      kept_strides.push_back(x.stride(d));
    }
  }
  int64_t n_out = 1, n_red = 1;
  for (int64_t s : kept_sizes) n_out *= s;
  for (int64_t s : red_sizes) n_red *= s;
  const bool is_arg = op == ReduceOp::Argmax || op == ReduceOp::Argmin;
  CHORUS_CHECK(n_red > 0 || op == ReduceOp::Sum || op == ReduceOp::Mean,
               "reduce: cannot take max/min/argmax of an empty dimension of ", x.describe());

  CHORUS_CPU_DISPATCH(x.dtype(), T, {
    const T* base = x.data<T>();
    parallel_for(n_out, 16, [&](int64_t begin, int64_t end) {
      std::vector<int64_t> idx(red_sizes.size());
      for (int64_t o = begin; o < end; ++o) {
        int64_t off = 0, rem = o;
        for (int64_t d = static_cast<int64_t>(kept_sizes.size()) - 1; d >= 0; --d) {
          off += (rem % kept_sizes[d]) * kept_strides[d];
          rem /= kept_sizes[d];
        }
        std::fill(idx.begin(), idx.end(), 0);
        double acc = (op == ReduceOp::Max || op == ReduceOp::Argmax)
                         ? -std::numeric_limits<double>::infinity()
                         : (op == ReduceOp::Min || op == ReduceOp::Argmin)
                               ? std::numeric_limits<double>::infinity()
                               : 0.0;
        int64_t best = 0;
        bool nan_seen = false;
        int64_t roff = 0;
        for (int64_t r = 0; r < n_red; ++r) {
          double v = static_cast<double>(to_compute(base[off + roff]));
          switch (op) {
            case ReduceOp::Sum:
            case ReduceOp::Mean: acc += v; break;
            case ReduceOp::Max:
            case ReduceOp::Argmax:
              if (std::isnan(v)) { if (!nan_seen) { nan_seen = true; acc = v; best = r; } }
              else if (!nan_seen && v > acc) { acc = v; best = r; }
              break;
            case ReduceOp::Min:
            case ReduceOp::Argmin:
              if (std::isnan(v)) { if (!nan_seen) { nan_seen = true; acc = v; best = r; } }
              else if (!nan_seen && v < acc) { acc = v; best = r; }
              break;
          }
          // Advance the multi-index over the reduced dims (last fastest).
          for (int64_t d = static_cast<int64_t>(idx.size()) - 1; d >= 0; --d) {
            roff += red_strides[d];
            if (++idx[d] < red_sizes[d]) break;
            roff -= red_strides[d] * red_sizes[d];
            idx[d] = 0;
          }
        }
        if (op == ReduceOp::Mean) acc = n_red ? acc / static_cast<double>(n_red) : std::nan("");
        if (is_arg) {
          out.data<int64_t>()[o] = best;
        } else {
          out.data<T>()[o] = from_compute<T>(static_cast<ComputeT<T>>(acc));
        }
      }
    });
  });
}

}  // namespace chorus::cpu
