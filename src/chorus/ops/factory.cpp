#include "chorus/ops/factory.h"

#include <cmath>

#include "chorus/core/backend.h"
#include "chorus/core/error.h"
#include "chorus/core/graph_capture.h"
#include "chorus/core/rng.h"
#include "chorus/ops/copy.h"
#include "chorus/ops/dispatch.h"

namespace chorus {

Device TensorOptions::resolved_device() const { return device ? *device : current_device(); }

namespace {
Tensor finish(Tensor t, const TensorOptions& o) {
  if (o.requires_grad) t.set_requires_grad(true);
  return t;
}
template <typename V>
Tensor from_host(const std::vector<V>& data, const Shape& shape, DType host_dtype, TensorOptions opts) {
  CHORUS_CHECK(static_cast<int64_t>(data.size()) == numel_of(shape), "from_vector: ", data.size(),
               " values do not fill shape ", shape_str(shape), " (", numel_of(shape), " elements)");
  Tensor host = detail::empty_tensor(shape, host_dtype, cpu_device(0));
  if (!data.empty()) std::memcpy(host.raw_data(), data.data(), data.size() * sizeof(V));
  Tensor t = ops::to_device(ops::to_dtype(host, opts.dtype), opts.resolved_device());
  if (t.is_same(host)) t = ops::clone(host);
  return finish(t, opts);
}
}  // namespace

Tensor empty(const Shape& shape, TensorOptions o) {
  return finish(detail::empty_tensor(shape, o.dtype, o.resolved_device()), o);
}

Tensor full(const Shape& shape, double value, TensorOptions o) {
  Tensor t = detail::empty_tensor(shape, o.dtype, o.resolved_device());
  ops::fill_(t, value);
  return finish(t, o);
}
Tensor zeros(const Shape& shape, TensorOptions o) { return full(shape, 0.0, o); }
Tensor ones(const Shape& shape, TensorOptions o) { return full(shape, 1.0, o); }
Tensor zeros_like(const Tensor& t) { return zeros(t.sizes(), {t.dtype(), t.device()}); }
Tensor ones_like(const Tensor& t) { return ones(t.sizes(), {t.dtype(), t.device()}); }
Tensor empty_like(const Tensor& t) { return detail::empty_tensor(t.sizes(), t.dtype(), t.device()); }

Tensor arange(double start, double end, double step, TensorOptions o) {
  CHORUS_CHECK(step != 0, "arange: step must be non-zero");
  int64_t n = static_cast<int64_t>(std::ceil((end - start) / step));
  if (n < 0) n = 0;
  std::vector<double> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = start + static_cast<double>(i) * step;
  return from_vector(v, {n}, o);
}
Tensor arange(int64_t end, TensorOptions o) { return arange(0.0, static_cast<double>(end), 1.0, o); }

Tensor rand(const Shape& shape, TensorOptions o) {
  CHORUS_CHECK(is_floating(o.dtype), "rand: dtype must be floating, got ", dtype_name(o.dtype));
  Tensor t = detail::empty_tensor(shape, o.dtype, o.resolved_device());
  if (t.device().is_cuda()) check_not_capturing("drawing random numbers");
  CHORUS_KERNEL(t.device(), uniform, t, 0.0, 1.0, default_generator().reserve(t.numel()));
  return finish(t, o);
}

Tensor randn(const Shape& shape, TensorOptions o) {
  CHORUS_CHECK(is_floating(o.dtype), "randn: dtype must be floating, got ", dtype_name(o.dtype));
  Tensor t = detail::empty_tensor(shape, o.dtype, o.resolved_device());
  if (t.device().is_cuda()) check_not_capturing("drawing random numbers");
  CHORUS_KERNEL(t.device(), normal, t, 0.0, 1.0, default_generator().reserve(2 * t.numel()));
  return finish(t, o);
}

Tensor randint(int64_t lo, int64_t hi, const Shape& shape, TensorOptions o) {
  CHORUS_CHECK(hi > lo, "randint: empty range [", lo, ", ", hi, ")");
  Tensor t = detail::empty_tensor(shape, o.dtype, o.resolved_device());
  if (t.device().is_cuda()) check_not_capturing("drawing random numbers");
  CHORUS_KERNEL(t.device(), randint, t, lo, hi, default_generator().reserve(t.numel()));
  return finish(t, o);
}

Tensor from_vector(const std::vector<float>& d, const Shape& s, TensorOptions o) {
  return from_host(d, s, kFloat32, o);
}
Tensor from_vector(const std::vector<double>& d, const Shape& s, TensorOptions o) {
  if (!is_floating(o.dtype)) {
    std::vector<int64_t> i(d.size());
    for (size_t k = 0; k < d.size(); ++k) i[k] = static_cast<int64_t>(d[k]);
    return from_host(i, s, kInt64, o);
  }
  // float64 keeps every bit (gradient checks need it); other float dtypes
  // round from float, as before.
  if (o.dtype == kFloat64) return from_host(d, s, kFloat64, o);
  std::vector<float> f(d.begin(), d.end());
  return from_host(f, s, kFloat32, o);
}
Tensor from_vector(const std::vector<int64_t>& d, const Shape& s, TensorOptions o) {
  return from_host(d, s, kInt64, o);
}
Tensor scalar_tensor(double v, TensorOptions o) { return full({}, v, o); }

}  // namespace chorus
