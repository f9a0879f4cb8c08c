// The metadata half of Tensor (see Note [Where Tensor's methods live]).
#include "chorus/core/tensor.h"

#include <cmath>
#include <cstdio>
#include <sstream>

#include "chorus/core/backend.h"
#include "chorus/core/error.h"

namespace chorus {

namespace {
const TensorImpl& need(const std::shared_ptr<TensorImpl>& p) {
  if (!p) CHORUS_THROW(ValueError, "operation on an undefined tensor");
  return *p;
}

double read_element(const char* p, DType t) {
  switch (t) {
    case kFloat32: return *reinterpret_cast<const float*>(p);
    case kBFloat16: return static_cast<float>(*reinterpret_cast<const BFloat16*>(p));
    case kFloat16: return static_cast<float>(*reinterpret_cast<const Float16*>(p));
    case kInt64: return static_cast<double>(*reinterpret_cast<const int64_t*>(p));
    case kInt32: return *reinterpret_cast<const int32_t*>(p);
    case kUInt8: return *reinterpret_cast<const uint8_t*>(p);
    case kBool: return *reinterpret_cast<const bool*>(p) ? 1 : 0;
    case kFloat64: return *reinterpret_cast<const double*>(p);
  }
  return 0;
}
}  // namespace

const Shape& Tensor::sizes() const { return need(impl_).sizes; }
const Shape& Tensor::strides() const { return need(impl_).strides; }
int64_t Tensor::size(int64_t d) const { return sizes()[wrap_dim(d, dim(), "size")]; }
int64_t Tensor::stride(int64_t d) const { return strides()[wrap_dim(d, dim(), "stride")]; }
int64_t Tensor::storage_offset() const { return need(impl_).offset; }
DType Tensor::dtype() const { return need(impl_).dtype; }
Device Tensor::device() const { return need(impl_).storage->device(); }
const std::shared_ptr<Storage>& Tensor::storage() const { return need(impl_).storage; }

void* Tensor::raw_data() const {
  const TensorImpl& i = need(impl_);
  return static_cast<char*>(i.storage->data()) + i.offset * static_cast<int64_t>(dtype_size(i.dtype));
}

bool Tensor::is_contiguous() const {
  const TensorImpl& i = need(impl_);
  int64_t expected = 1;
  for (int64_t d = static_cast<int64_t>(i.sizes.size()) - 1; d >= 0; --d) {
    if (i.sizes[d] == 1) continue;
    if (i.strides[d] != expected) return false;
    expected *= i.sizes[d];
  }
  return true;
}

std::string Tensor::describe() const {
  if (!impl_) return "undefined tensor";
  return std::string(dtype_name(dtype())) + shape_str(sizes()) + " on " + device().str();
}

std::string Tensor::str() const {
  if (!impl_) return "tensor(undefined)";
  // Copy the whole storage to the host once, then walk the strided view.
  const TensorImpl& i = *impl_;
  std::vector<char> host(i.storage->nbytes());
  backend(device()).copy(host.data(), cpu_device(0), i.storage->data(), device(), host.size());
  size_t es = dtype_size(i.dtype);
  std::ostringstream os;
  const int64_t nd = dim();
  const int64_t n = numel();
  const bool integral = !is_floating(i.dtype);
  const int64_t kEdge = 3;  // elements shown at each end of a long dimension
  std::function<void(int64_t, int64_t)> rec = [&](int64_t d, int64_t off) {
    if (d == nd) {
      double v = read_element(host.data() + off * static_cast<int64_t>(es), i.dtype);
      char buf[32];
      if (i.dtype == kBool) std::snprintf(buf, sizeof buf, "%s", v != 0 ? "true" : "false");
      else if (integral) std::snprintf(buf, sizeof buf, "%lld", static_cast<long long>(v));
      else std::snprintf(buf, sizeof buf, "%.4f", v);
      os << buf;
      return;
    }
    os << "[";
    int64_t len = i.sizes[d];
    for (int64_t k = 0; k < len; ++k) {
      if (len > 2 * kEdge && k == kEdge) {
        os << "...";
        k = len - kEdge - 1;
        if (k + 1 < len) os << ", ";
        continue;
      }
      rec(d + 1, off + k * i.strides[d]);
      if (k + 1 < len) os << (d + 1 == nd ? ", " : ",\n" + std::string(d + 8, ' '));
    }
    os << "]";
  };
  os << "tensor(";
  if (n == 0) os << "[]";
  else rec(0, i.offset);
  os << ", " << describe() << ")";
  return os.str();
}

std::ostream& operator<<(std::ostream& os, const Tensor& t) { return os << t.str(); }

namespace detail {

Tensor empty_tensor(const Shape& sizes, DType dtype, Device device) { return empty_tensor(Shape(sizes), dtype, device); }

Tensor empty_tensor(Shape&& sizes, DType dtype, Device device) {
  for (int64_t s : sizes)
    CHORUS_CHECK(s >= 0, "negative dimension in shape ", shape_str(sizes));
  check_device(device);
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = std::make_shared<Storage>(static_cast<size_t>(numel_of(sizes)) * dtype_size(dtype), device);
  impl->strides = contiguous_strides(sizes);
  impl->sizes = std::move(sizes);
  impl->dtype = dtype;
  return Tensor(std::move(impl));
}

Tensor empty_dense_strided(Shape&& sizes, Shape&& strides, DType dtype, Device device) {
  CHORUS_CHECK(sizes.size() == strides.size(), "empty_dense_strided: ", sizes.size(), " sizes but ",
               strides.size(), " strides");
  for (int64_t s : sizes)
    CHORUS_CHECK(s >= 0, "negative dimension in shape ", shape_str(sizes));
  check_device(device);
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = std::make_shared<Storage>(static_cast<size_t>(numel_of(sizes)) * dtype_size(dtype), device);
  impl->sizes = std::move(sizes);
  impl->strides = std::move(strides);
  impl->dtype = dtype;
  return Tensor(std::move(impl));
}

Tensor make_view(const Tensor& base, const Shape& sizes, const Shape& strides, int64_t offset) {
  return make_view(base, Shape(sizes), Shape(strides), offset);
}

Tensor make_view(const Tensor& base, Shape&& sizes, Shape&& strides, int64_t offset) {
  auto impl = std::make_shared<TensorImpl>(base.impl()->version);  // views share the version counter
  impl->storage = base.storage();
  impl->sizes = std::move(sizes);
  impl->strides = std::move(strides);
  impl->offset = offset;
  impl->dtype = base.dtype();
  return Tensor(std::move(impl));
}

void check_defined(const Tensor& t, const char* op, const char* arg) {
  CHORUS_CHECK(t.defined(), op, ": argument '", arg, "' is an undefined tensor");
}

}  // namespace detail

}  // namespace chorus
