// Tensor's autograd, conversion, view and math methods (see Note [Where
// Tensor's methods live] in core/tensor.h).
#include "chorus/autograd/engine.h"
#include "chorus/autograd/functions.h"
#include "chorus/autograd/node.h"
#include "chorus/autograd/grad_finisher.h"
#include "chorus/core/error.h"
#include "chorus/ops/copy.h"
#include "chorus/ops/elementwise.h"
#include "chorus/ops/factory.h"
#include "chorus/ops/reduce.h"
#include "chorus/ops/views.h"

namespace chorus {

namespace {
AutogradMeta& meta(const Tensor& t) {
  CHORUS_CHECK(t.defined(), "autograd on an undefined tensor");
  auto& m = t.impl()->autograd;
  if (!m) m = std::make_unique<AutogradMeta>();
  return *m;
}

// A differentiable view: same storage, gradient mapped back by `backward`.
Tensor view_op(const char* name, const Tensor& self, Tensor out, autograd::BackwardFn backward) {
  return autograd::record(name, std::move(out), {self}, std::move(backward));
}

// Gradient of a strided sub-view: zeros of the base shape with g copied into
// the same sub-view.
template <typename MakeView>
Tensor scatter_into_zeros(const Tensor& g, const Shape& base_shape, MakeView make) {
  Tensor z = zeros(base_shape, {g.dtype(), g.device()});
  ops::copy_(make(z), g);
  return z;
}
}  // namespace

// ---- autograd ------------------------------------------------------------------
bool Tensor::requires_grad() const { return autograd_meta() && autograd_meta()->requires_grad; }

Tensor& Tensor::set_requires_grad(bool r) {
  AutogradMeta& m = meta(*this);
  CHORUS_CHECK(!m.grad_fn || r, "set_requires_grad(false) on a non-leaf tensor; use detach()");
  CHORUS_CHECK(!r || is_floating(dtype()), "requires_grad needs a floating tensor, got ", describe());
  m.requires_grad = r;
  return *this;
}

bool Tensor::is_leaf() const { return !autograd_meta() || !autograd_meta()->grad_fn; }

Tensor Tensor::grad() const {
  AutogradMeta* m = autograd_meta();
  if (!m || !m->grad) return Tensor();
  Tensor g(m->grad);
  autograd::finish_grad(g);  // Note [Gradient finishers]: the whole value
  return g;
}

void Tensor::set_grad(const Tensor& g) const {
  if (g.defined())
    CHORUS_CHECK(g.sizes() == sizes(), "set_grad: gradient ", g.describe(), " does not match ", describe());
  meta(*this).grad = g.defined() ? g.impl_ptr() : nullptr;
}

void Tensor::zero_grad() const {
  if (autograd_meta()) autograd_meta()->grad = nullptr;
}

const std::shared_ptr<autograd::Node>& Tensor::grad_fn() const {
  static const std::shared_ptr<autograd::Node> none;
  return autograd_meta() ? autograd_meta()->grad_fn : none;
}

uint32_t Tensor::output_nr() const { return autograd_meta() ? autograd_meta()->output_nr : 0; }

void Tensor::set_grad_fn(std::shared_ptr<autograd::Node> fn, uint32_t nr) const {
  AutogradMeta& m = meta(*this);
  m.grad_fn = std::move(fn);
  m.output_nr = nr;
  m.requires_grad = true;
}

void Tensor::backward(const Tensor& grad, bool retain_graph) const {
  autograd::run_backward(*this, grad, retain_graph);
}

Tensor Tensor::detach() const {
  detail::check_defined(*this, "detach", "self");
  return detail::make_view(*this, sizes(), strides(), storage_offset());
}

void Tensor::register_post_accumulate_hook(GradHook hook, bool reads_grad) const {
  CHORUS_CHECK(is_leaf() && requires_grad(), "register_post_accumulate_hook: only leaf tensors that require grad have hooks");
  meta(*this).post_accumulate_hooks.push_back(std::move(hook));
  if (reads_grad) ++meta(*this).reading_hooks;
}

// ---- conversions ------------------------------------------------------------------
Tensor Tensor::to(const Device& d) const { return chorus::to_device(*this, d); }
Tensor Tensor::to(DType t) const { return chorus::to_dtype(*this, t); }
Tensor Tensor::to(const Device& d, DType t) const { return chorus::to_dtype(chorus::to_device(*this, d), t); }

Tensor Tensor::contiguous() const {
  if (is_contiguous()) return *this;
  return autograd::record("ContiguousBackward", ops::contiguous(*this), {*this},
                          [](const TensorList& g) { return TensorList{g[0]}; });
}

Tensor Tensor::clone() const {
  return autograd::record("CloneBackward", ops::clone(*this), {*this},
                          [](const TensorList& g) { return TensorList{g[0]}; });
}

Tensor& Tensor::copy_(const Tensor& src) { ops::copy_(*this, src); return *this; }
Tensor& Tensor::zero_() { ops::fill_(*this, 0); return *this; }
Tensor& Tensor::fill_(double v) { ops::fill_(*this, v); return *this; }
Tensor& Tensor::uniform_(double lo, double hi) {
  Tensor r = chorus::rand(sizes(), {dtype(), device()});
  ops::copy_(*this, ops::unary(UnaryOp::AddScalar, ops::unary(UnaryOp::MulScalar, r, hi - lo), lo));
  return *this;
}
Tensor& Tensor::normal_(double mean, double std) {
  Tensor r = chorus::randn(sizes(), {dtype(), device()});
  ops::copy_(*this, ops::unary(UnaryOp::AddScalar, ops::unary(UnaryOp::MulScalar, r, std), mean));
  return *this;
}
double Tensor::item() const { return ops::item(*this); }

template <typename T>
std::vector<T> Tensor::to_vector() const {
  DType want = std::is_same_v<T, float> ? kFloat32 : std::is_same_v<T, double> ? kFloat64
             : std::is_same_v<T, int64_t> ? kInt64 : std::is_same_v<T, int32_t> ? kInt32
             : std::is_same_v<T, uint8_t> ? kUInt8 : kBool;
  Tensor h = ops::contiguous(ops::to_dtype(ops::to_device(*this, cpu_device(0)), want));
  std::vector<T> v(static_cast<size_t>(numel()));
  if (!v.empty()) std::memcpy(v.data(), h.raw_data(), v.size() * sizeof(T));
  return v;
}
template std::vector<float> Tensor::to_vector<float>() const;
template std::vector<double> Tensor::to_vector<double>() const;
template std::vector<int64_t> Tensor::to_vector<int64_t>() const;
template std::vector<int32_t> Tensor::to_vector<int32_t>() const;
template std::vector<uint8_t> Tensor::to_vector<uint8_t>() const;

// ---- views ----------------------------------------------------------------------------
Tensor Tensor::view(const Shape& shape) const {
  Shape s = sizes();
  return view_op("ViewBackward", *this, ops::view(*this, shape),
                 [s](const TensorList& g) { return TensorList{ops::reshape(g[0], s)}; });
}

Tensor Tensor::reshape(const Shape& shape) const {
  Shape s = sizes();
  return view_op("ReshapeBackward", *this, ops::reshape(*this, shape),
                 [s](const TensorList& g) { return TensorList{ops::reshape(g[0], s)}; });
}

Tensor Tensor::flatten(int64_t start, int64_t end) const {
  if (dim() == 0) return reshape({1});
  start = wrap_dim(start, dim(), "flatten");
  end = wrap_dim(end, dim(), "flatten");
  CHORUS_CHECK(start <= end, "flatten: start dim ", start, " is after end dim ", end);
  Shape s;
  for (int64_t d = 0; d < start; ++d) s.push_back(size(d));
  int64_t n = 1;
  for (int64_t d = start; d <= end; ++d) n *= size(d);
  s.push_back(n);
  for (int64_t d = end + 1; d < dim(); ++d) s.push_back(size(d));
  return reshape(s);
}

Tensor Tensor::permute(const Shape& dims) const {
  Tensor out = ops::permute(*this, dims);
  Shape inv(dims.size());
  for (size_t i = 0; i < dims.size(); ++i) inv[wrap_dim(dims[i], dim(), "permute")] = static_cast<int64_t>(i);
  return view_op("PermuteBackward", *this, out, [inv](const TensorList& g) { return TensorList{ops::permute(g[0], inv)}; });
}

Tensor Tensor::transpose(int64_t a, int64_t b) const {
  Shape p(dim());
  for (int64_t i = 0; i < dim(); ++i) p[i] = i;
  std::swap(p[wrap_dim(a, dim(), "transpose")], p[wrap_dim(b, dim(), "transpose")]);
  return permute(p);
}

Tensor Tensor::slice(int64_t d, int64_t start, int64_t end, int64_t step) const {
  Shape s = sizes();
  Tensor out = ops::slice(*this, d, start, end, step);
  return view_op("SliceBackward", *this, out, [s, d, start, end, step](const TensorList& g) {
    return TensorList{scatter_into_zeros(g[0], s, [&](const Tensor& z) { return ops::slice(z, d, start, end, step); })};
  });
}

Tensor Tensor::narrow(int64_t d, int64_t start, int64_t length) const {
  int64_t w = wrap_dim(d, dim(), "narrow");
  CHORUS_CHECK(start >= 0 && length >= 0 && start + length <= size(w), "narrow: [", start, ", ", start + length,
               ") is out of range for dim ", w, " of size ", size(w));
  return slice(w, start, start + length, 1);
}

Tensor Tensor::select(int64_t d, int64_t index) const {
  Shape s = sizes();
  Tensor out = ops::select(*this, d, index);
  return view_op("SelectBackward", *this, out, [s, d, index](const TensorList& g) {
    return TensorList{scatter_into_zeros(g[0], s, [&](const Tensor& z) { return ops::select(z, d, index); })};
  });
}

Tensor Tensor::expand(const Shape& shape) const {
  Shape s = sizes();
  return view_op("ExpandBackward", *this, ops::expand(*this, shape),
                 [s](const TensorList& g) { return TensorList{ops::sum_to(g[0], s)}; });
}

Tensor Tensor::squeeze(int64_t d) const {
  Shape s = sizes();
  return view_op("SqueezeBackward", *this, ops::squeeze(*this, d),
                 [s](const TensorList& g) { return TensorList{ops::reshape(g[0], s)}; });
}

Tensor Tensor::unsqueeze(int64_t d) const {
  Shape s = sizes();
  return view_op("UnsqueezeBackward", *this, ops::unsqueeze(*this, d),
                 [s](const TensorList& g) { return TensorList{ops::reshape(g[0], s)}; });
}

// ---- math -----------------------------------------------------------------------------
Tensor Tensor::add(const Tensor& o, double alpha) const { return chorus::add(*this, o, alpha); }
Tensor Tensor::sub(const Tensor& o) const { return chorus::sub(*this, o); }
Tensor Tensor::mul(const Tensor& o) const { return chorus::mul(*this, o); }
Tensor Tensor::div(const Tensor& o) const { return chorus::div(*this, o); }
Tensor Tensor::add(double s) const { return add_scalar(*this, s); }
Tensor Tensor::mul(double s) const { return mul_scalar(*this, s); }
Tensor Tensor::pow(double e) const { return chorus::pow(*this, e); }
Tensor Tensor::neg() const { return chorus::neg(*this); }
Tensor Tensor::exp() const { return chorus::exp(*this); }
Tensor Tensor::log() const { return chorus::log(*this); }
Tensor Tensor::sqrt() const { return chorus::sqrt(*this); }
Tensor Tensor::tanh() const { return chorus::tanh(*this); }
Tensor Tensor::sigmoid() const { return chorus::sigmoid(*this); }
Tensor Tensor::relu() const { return chorus::relu(*this); }
Tensor Tensor::abs() const { return chorus::abs(*this); }
Tensor Tensor::sum() const { return chorus::sum(*this); }
Tensor Tensor::sum(const Shape& dims, bool keepdim) const { return chorus::sum(*this, dims, keepdim); }
Tensor Tensor::mean() const { return chorus::mean(*this); }
Tensor Tensor::mean(const Shape& dims, bool keepdim) const { return chorus::mean(*this, dims, keepdim); }
Tensor Tensor::max() const { return chorus::amax(reshape({-1}), 0); }
Tensor Tensor::max(int64_t d, bool keepdim) const { return chorus::amax(*this, d, keepdim); }
Tensor Tensor::argmax(int64_t d, bool keepdim) const { return chorus::argmax(*this, d, keepdim); }
Tensor Tensor::matmul(const Tensor& o) const { return chorus::matmul(*this, o); }
Tensor Tensor::eq(const Tensor& o) const { return ops::binary(BinaryOp::Eq, *this, o); }
Tensor Tensor::ne(const Tensor& o) const { return ops::binary(BinaryOp::Ne, *this, o); }
Tensor Tensor::lt(const Tensor& o) const { return ops::binary(BinaryOp::Lt, *this, o); }
Tensor Tensor::le(const Tensor& o) const { return ops::binary(BinaryOp::Le, *this, o); }
Tensor Tensor::gt(const Tensor& o) const { return ops::binary(BinaryOp::Gt, *this, o); }
Tensor Tensor::ge(const Tensor& o) const { return ops::binary(BinaryOp::Ge, *this, o); }

Tensor& Tensor::add_(const Tensor& o, double alpha) { ops::binary_(BinaryOp::Add, *this, o, alpha); return *this; }
Tensor& Tensor::mul_(double s) { ops::unary_(UnaryOp::MulScalar, *this, s); return *this; }
Tensor& Tensor::mul_(const Tensor& o) { ops::binary_(BinaryOp::Mul, *this, o, 1.0); return *this; }

Tensor operator+(const Tensor& a, const Tensor& b) { return add(a, b); }
Tensor operator-(const Tensor& a, const Tensor& b) { return sub(a, b); }
Tensor operator*(const Tensor& a, const Tensor& b) { return mul(a, b); }
Tensor operator/(const Tensor& a, const Tensor& b) { return div(a, b); }
Tensor operator+(const Tensor& a, double s) { return add_scalar(a, s); }
Tensor operator-(const Tensor& a, double s) { return add_scalar(a, -s); }
Tensor operator*(const Tensor& a, double s) { return mul_scalar(a, s); }
Tensor operator/(const Tensor& a, double s) { return mul_scalar(a, 1.0 / s); }
Tensor operator*(double s, const Tensor& a) { return mul_scalar(a, s); }
Tensor operator+(double s, const Tensor& a) { return add_scalar(a, s); }
Tensor operator-(double s, const Tensor& a) { return rsub_scalar(s, a); }
Tensor operator-(const Tensor& a) { return neg(a); }

}  // namespace chorus
