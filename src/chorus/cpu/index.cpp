// Indexing kernels on the CPU: index_select, index_add, gather, scatter_add.
//
// index_select / index_add see contiguous tensors as [outer, dim, inner] and
// move whole `inner` runs, so index_select is a memcpy per index and works for
// every dtype. gather / scatter_add follow PyTorch: `index` has as many dims as
// the data tensors and may be smaller than them in every dim; they walk the
// index positions with an odometer that keeps one running offset per tensor.
// Reads are plain copies (any dtype, by element size); the adds go through
// the CPU compute type (dtype_dispatch.h), so bf16/f16 add in float.
//
// Every op checks all its indices before touching the output, so a bad index
// leaves `out` as it was. A 0-d tensor behaves as shape [1], as in PyTorch.
#include <cstdint>
#include <cstring>
#include <vector>

#include "chorus/core/error.h"
#include "chorus/cpu/dtype_dispatch.h"
#include "chorus/cpu/kernels.h"

namespace chorus::cpu {
namespace {

Shape dims_of(const Tensor& t) { return t.dim() == 0 ? Shape{1} : t.sizes(); }

struct OuterDimInner {
  int64_t outer = 1, dim = 1, inner = 1;
};

OuterDimInner split_at(const Shape& s, int64_t dim) {
  OuterDimInner v;
  for (int64_t d = 0; d < dim; ++d) v.outer *= s[d];
  v.dim = s[dim];
  for (size_t d = dim + 1; d < s.size(); ++d) v.inner *= s[d];
  return v;
}

void check_contiguous(const char* op, const char* arg, const Tensor& t) {
  detail::check_defined(t, op, arg);
  CHORUS_CHECK(t.is_contiguous(), op, ": ", arg, " must be contiguous, got ", t.describe());
}

void check_index_tensor(const char* op, const Tensor& index) {
  check_contiguous(op, "index", index);
  CHORUS_CHECK(index.dtype() == kInt64, op, ": index must be int64, got ", index.describe());
}

void check_indices_in_range(const char* op, const Tensor& index, int64_t size) {
  const int64_t* idx = index.data<int64_t>();
  for (int64_t i = 0; i < index.numel(); ++i) {
    CHORUS_CHECK(idx[i] >= 0 && idx[i] < size, op, ": index ", idx[i], " at position ", i,
                 " is out of range for a dim of size ", size);
  }
}

// dst += src in the compute type (float for bf16/f16, as everywhere on the CPU).
template <typename T>
void add_into(T& dst, T src) {
  dst = from_compute<T>(to_compute(dst) + to_compute(src));
}

// Calls f(T{}) with T an unsigned type of t's element size: a gather copies
// bytes, whatever they mean, so it needs no per-dtype code.
template <typename F>
void dispatch_copy_size(const Tensor& t, F&& f) {
  switch (t.element_size()) {
    case 1: return f(uint8_t{});
    case 2: return f(uint16_t{});
    case 4: return f(uint32_t{});
    default: return f(uint64_t{});
  }
}

// Walks every position of `index` (contiguous, shape `shape`) in row-major
// order and calls f(i, data_off, other_off): i is the linear position,
// data_off the offset in the full tensor with the `dim` coordinate left out
// (the caller adds index[i] * data_strides[dim]), other_off the offset in the
// index-shaped tensor (out for gather, src for scatter_add).
template <typename F>
void for_each_position(const Shape& shape, int64_t dim, const Shape& data_strides,
                       const Shape& other_strides, F&& f) {
  const int64_t nd = static_cast<int64_t>(shape.size());
  const int64_t n = numel_of(shape);
  std::vector<int64_t> coord(nd, 0);
  int64_t data_off = 0, other_off = 0;
  for (int64_t i = 0; i < n; ++i) {
    f(i, data_off, other_off);
    for (int64_t d = nd - 1; d >= 0; --d) {
      const int64_t ds = d == dim ? 0 : data_strides[d];
      if (++coord[d] < shape[d]) {
        data_off += ds;
        other_off += other_strides[d];
        break;
      }
      data_off -= ds * (shape[d] - 1);
      other_off -= other_strides[d] * (shape[d] - 1);
      coord[d] = 0;
    }
  }
}

// PyTorch's gather/scatter shape rule: index has data's number of dims, and
// index.size(d) <= limit.size(d) for every d (except `dim` when skip_dim).
void check_index_fits(const char* op, const Shape& index, const Shape& limit, const char* what,
                      int64_t dim, bool skip_dim) {
  bool ok = index.size() == limit.size();
  for (size_t d = 0; ok && d < index.size(); ++d) {
    if (skip_dim && static_cast<int64_t>(d) == dim) continue;
    ok = index[d] <= limit[d];
  }
  CHORUS_CHECK(ok, op, ": index of shape ", shape_str(index), " does not fit ", what,
               " of shape ", shape_str(limit), " (same number of dims needed, and index.size(d) <= ",
               what, ".size(d)", skip_dim ? " for d != dim" : "", ")");
}

}  // namespace

void index_select(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& out) {
  const char* op = "index_select";
  check_contiguous(op, "x", x);
  check_contiguous(op, "out", out);
  check_index_tensor(op, index);
  const Shape xs = dims_of(x);
  dim = wrap_dim(dim, x.dim(), op);
  Shape want = xs;
  want[dim] = index.numel();
  CHORUS_CHECK(dims_of(out) == want && out.dtype() == x.dtype(), op, ": out must be ",
               dtype_name(x.dtype()), shape_str(want), ", got ", out.describe());
  const OuterDimInner v = split_at(xs, dim);
  check_indices_in_range(op, index, v.dim);
  const int64_t k = index.numel();
  const size_t run = static_cast<size_t>(v.inner) * x.element_size();
  const int64_t* idx = index.data<int64_t>();
  const char* src = static_cast<const char*>(x.raw_data());
  char* dst = static_cast<char*>(out.raw_data());
  for (int64_t o = 0; o < v.outer; ++o)
    for (int64_t i = 0; i < k; ++i)
      std::memcpy(dst + (o * k + i) * run, src + (o * v.dim + idx[i]) * run, run);
}

void index_add(const Tensor& out, int64_t dim, const Tensor& index, const Tensor& src) {
  const char* op = "index_add";
  check_contiguous(op, "out", out);
  check_contiguous(op, "src", src);
  check_index_tensor(op, index);
  const Shape os = dims_of(out);
  dim = wrap_dim(dim, out.dim(), op);
  Shape want = os;
  want[dim] = index.numel();
  CHORUS_CHECK(dims_of(src) == want && src.dtype() == out.dtype(), op, ": src must be ",
               dtype_name(out.dtype()), shape_str(want), ", got ", src.describe());
  const OuterDimInner v = split_at(os, dim);
  check_indices_in_range(op, index, v.dim);
  const int64_t k = index.numel();
  const int64_t* idx = index.data<int64_t>();
  CHORUS_CPU_DISPATCH(out.dtype(), T, {
    T* dst = out.data<T>();
    const T* s = src.data<T>();
    for (int64_t o = 0; o < v.outer; ++o)
      for (int64_t i = 0; i < k; ++i) {
        T* d = dst + (o * v.dim + idx[i]) * v.inner;
        const T* from = s + (o * k + i) * v.inner;
        for (int64_t j = 0; j < v.inner; ++j) add_into(d[j], from[j]);
      }
  });
}

void gather(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& out) {
  const char* op = "gather";
  check_contiguous(op, "x", x);
  check_contiguous(op, "out", out);
  check_index_tensor(op, index);
  const Shape xs = dims_of(x), is = dims_of(index);
  dim = wrap_dim(dim, x.dim(), op);
  check_index_fits(op, is, xs, "x", dim, /*skip_dim=*/true);
  CHORUS_CHECK(dims_of(out) == is && out.dtype() == x.dtype(), op, ": out must be ",
               dtype_name(x.dtype()), shape_str(is), " (index's shape), got ", out.describe());
  check_indices_in_range(op, index, xs[dim]);
  const Shape x_strides = contiguous_strides(xs), out_strides = contiguous_strides(is);
  const int64_t* idx = index.data<int64_t>();
  const int64_t dim_stride = x_strides[dim];
  dispatch_copy_size(x, [&](auto tag) {
    using T = decltype(tag);
    const T* from = static_cast<const T*>(x.raw_data());
    T* to = static_cast<T*>(out.raw_data());
    for_each_position(is, dim, x_strides, out_strides, [&](int64_t i, int64_t xo, int64_t oo) {
      to[oo] = from[xo + idx[i] * dim_stride];
    });
  });
}

void scatter_add(const Tensor& out, int64_t dim, const Tensor& index, const Tensor& src) {
  const char* op = "scatter_add";
  check_contiguous(op, "out", out);
  check_contiguous(op, "src", src);
  check_index_tensor(op, index);
  const Shape os = dims_of(out), is = dims_of(index), ss = dims_of(src);
  dim = wrap_dim(dim, out.dim(), op);
  check_index_fits(op, is, os, "out", dim, /*skip_dim=*/true);
  check_index_fits(op, is, ss, "src", dim, /*skip_dim=*/false);
  CHORUS_CHECK(src.dtype() == out.dtype(), op, ": src must have out's dtype ",
               dtype_name(out.dtype()), ", got ", src.describe());
  check_indices_in_range(op, index, os[dim]);
  const Shape out_strides = contiguous_strides(os), src_strides = contiguous_strides(ss);
  const int64_t* idx = index.data<int64_t>();
  const int64_t dim_stride = out_strides[dim];
  CHORUS_CPU_DISPATCH(out.dtype(), T, {
    T* to = out.data<T>();
    const T* from = src.data<T>();
    for_each_position(is, dim, out_strides, src_strides, [&](int64_t i, int64_t oo, int64_t so) {
      add_into(to[oo + idx[i] * dim_stride], from[so]);
    });
  });
}

}  // namespace chorus::cpu
