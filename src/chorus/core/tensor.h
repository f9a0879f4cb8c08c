// Tensor: a strided view (sizes, strides, offset, dtype) of a shared Storage,
// plus the autograd state of that view.
//
// Note [Where Tensor's methods live]: this header declares the whole method set
// users expect (t.add(u), t.sum(), t.backward()...), as PyTorch's TensorBody
// does, but core/ defines only the metadata and raw-view parts. The math is
// defined by ops/ (raw computation) and autograd/ (differentiable wrappers) in
// the same library, so core never includes a higher layer's header.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "chorus/core/device.h"
#include "chorus/core/dtype.h"
#include "chorus/core/shape.h"
#include "chorus/core/storage.h"

namespace chorus {

namespace autograd {
class Node;
class GradFinisher;
}

class Tensor;
using TensorList = std::vector<Tensor>;

// Hook run when a leaf's gradient for this backward pass is final (after it has
// been accumulated into .grad()). DistributedDataParallel hangs its buckets here.
using GradHook = std::function<void(Tensor& param)>;

struct AutogradMeta {
  bool requires_grad = false;
  std::shared_ptr<autograd::Node> grad_fn;  // null for leaves
  uint32_t output_nr = 0;                   // which output of grad_fn this is
  std::shared_ptr<struct TensorImpl> grad;  // accumulated gradient of a leaf
  std::vector<GradHook> post_accumulate_hooks;
  // How many of them read the gradient (the others only note that it is final:
  // DDP's buckets, which read it later; Note [Weight gradients beside the data
  // gradient] in autograd/side_work.h).
  size_t reading_hooks = 0;
  std::weak_ptr<autograd::Node> grad_accumulator;  // cached AccumulateGrad of a leaf
  std::string label;  // a module parameter's "<Module type>.<name>", for messages
  // The parameter this tensor stands in for during one forward (DataParallel's
  // recorded aliases, Note [Gradient nodes] in data_parallel/reducer.h): autocast keeps
  // and reuses that parameter's 16-bit copy (Note [Autocast weight copies]).
  std::weak_ptr<TensorImpl> stands_for;
  // Autocast casts this parameter at each use instead of keeping its 16-bit
  // copy between steps: ZeRO-3's gathered weights, whose kept copies would be
  // a second whole model (Note [Autocast weight copies], data_parallel/sharded.h).
  bool no_kept_copy = false;
  // On a gradient: what it still needs to hold its whole value, or whether it
  // may be kept where it is (Note [Gradient finishers] in
  // autograd/grad_finisher.h); Tensor::grad() runs it.
  std::shared_ptr<autograd::GradFinisher> finisher;
};

struct TensorImpl {
  TensorImpl() = default;
  // A view: shares `shared_version` with its base (no counter of its own is
  // allocated, then dropped: an op's host path makes several views).
  explicit TensorImpl(std::shared_ptr<uint32_t> shared_version) : version(std::move(shared_version)) {}

  std::shared_ptr<Storage> storage;
  Shape sizes;
  Shape strides;
  int64_t offset = 0;  // in elements
  DType dtype = kFloat32;
  std::unique_ptr<AutogradMeta> autograd;
  // Bumped by in-place ops; saved tensors check it in backward.
  std::shared_ptr<uint32_t> version = std::make_shared<uint32_t>(0);
};

class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  // ---- metadata (core) ----------------------------------------------------
  bool defined() const { return impl_ != nullptr; }
  const Shape& sizes() const;
  const Shape& shape() const { return sizes(); }
  int64_t size(int64_t dim) const;
  const Shape& strides() const;
  int64_t stride(int64_t dim) const;
  int64_t dim() const { return static_cast<int64_t>(sizes().size()); }
  int64_t numel() const { return numel_of(sizes()); }
  int64_t storage_offset() const;
  DType dtype() const;
  Device device() const;
  size_t element_size() const { return dtype_size(dtype()); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * element_size(); }
  bool is_contiguous() const;
  // Address of element [0, 0, ...] (storage base + offset).
  void* raw_data() const;
  template <typename T>
  T* data() const { return static_cast<T*>(raw_data()); }
  const std::shared_ptr<Storage>& storage() const;
  TensorImpl* impl() const { return impl_.get(); }
  const std::shared_ptr<TensorImpl>& impl_ptr() const { return impl_; }
  bool is_same(const Tensor& o) const { return impl_ == o.impl_; }
  uint32_t version() const { return *impl_->version; }
  void bump_version() const { ++*impl_->version; }
  std::string str() const;  // readable printing, as PyTorch's repr
  std::string describe() const;  // "float32[2, 3] on cuda:0", for error messages

  // ---- autograd (autograd/) -------------------------------------------------
  bool requires_grad() const;
  Tensor& set_requires_grad(bool r);
  Tensor& requires_grad_(bool r = true) { return set_requires_grad(r); }
  bool is_leaf() const;
  Tensor grad() const;                 // undefined if none yet
  void set_grad(const Tensor& g) const;
  void zero_grad() const;              // drops .grad (set to none)
  const std::shared_ptr<autograd::Node>& grad_fn() const;
  uint32_t output_nr() const;
  void set_grad_fn(std::shared_ptr<autograd::Node> fn, uint32_t output_nr) const;
  void backward(const Tensor& grad = Tensor(), bool retain_graph = false) const;
  Tensor detach() const;               // shares storage, no autograd history
  // reads_grad = false: the hook only notes that the gradient is final and
  // reads it later, after autograd::join_beside_for(grad()).
  void register_post_accumulate_hook(GradHook hook, bool reads_grad = true) const;
  AutogradMeta* autograd_meta() const { return impl_ ? impl_->autograd.get() : nullptr; }

  // ---- conversions and copies (ops/) -----------------------------------------
  Tensor to(const Device& d) const;
  Tensor to(DType t) const;
  Tensor to(const Device& d, DType t) const;
  Tensor contiguous() const;
  Tensor clone() const;
  Tensor& copy_(const Tensor& src);    // broadcasting copy, any devices/dtypes
  Tensor& zero_();
  Tensor& fill_(double v);
  Tensor& uniform_(double lo, double hi);
  Tensor& normal_(double mean, double std);
  double item() const;
  template <typename T>
  T item() const { return static_cast<T>(item()); }
  template <typename T>
  std::vector<T> to_vector() const;    // copies to the host, row-major

  // ---- views (autograd/ for the differentiable ones) --------------------------
  Tensor view(const Shape& shape) const;
  Tensor reshape(const Shape& shape) const;
  Tensor flatten(int64_t start = 0, int64_t end = -1) const;
  Tensor permute(const Shape& dims) const;
  Tensor transpose(int64_t a, int64_t b) const;
  Tensor t() const { return transpose(0, 1); }
  Tensor narrow(int64_t dim, int64_t start, int64_t length) const;
  Tensor select(int64_t dim, int64_t index) const;
  Tensor slice(int64_t dim, int64_t start, int64_t end, int64_t step = 1) const;
  Tensor expand(const Shape& shape) const;
  Tensor squeeze(int64_t dim) const;
  Tensor unsqueeze(int64_t dim) const;
  Tensor operator[](int64_t i) const { return select(0, i); }

  // ---- math (autograd/) ---------------------------------------------------------
  Tensor add(const Tensor& o, double alpha = 1.0) const;
  Tensor sub(const Tensor& o) const;
  Tensor mul(const Tensor& o) const;
  Tensor div(const Tensor& o) const;
  Tensor add(double s) const;
  Tensor mul(double s) const;
  Tensor pow(double e) const;
  Tensor neg() const;
  Tensor exp() const;
  Tensor log() const;
  Tensor sqrt() const;
  Tensor tanh() const;
  Tensor sigmoid() const;
  Tensor relu() const;
  Tensor abs() const;
  Tensor sum() const;
  Tensor sum(const Shape& dims, bool keepdim = false) const;
  Tensor mean() const;
  Tensor mean(const Shape& dims, bool keepdim = false) const;
  Tensor max() const;
  Tensor max(int64_t dim, bool keepdim = false) const;  // values
  Tensor argmax(int64_t dim, bool keepdim = false) const;
  Tensor matmul(const Tensor& o) const;
  Tensor eq(const Tensor& o) const;
  Tensor ne(const Tensor& o) const;
  Tensor lt(const Tensor& o) const;
  Tensor le(const Tensor& o) const;
  Tensor gt(const Tensor& o) const;
  Tensor ge(const Tensor& o) const;

  // In place, never recorded by autograd (optimizer updates, accumulation).
  Tensor& add_(const Tensor& o, double alpha = 1.0);
  Tensor& mul_(double s);
  Tensor& mul_(const Tensor& o);

 private:
  std::shared_ptr<TensorImpl> impl_;
};

Tensor operator+(const Tensor& a, const Tensor& b);
Tensor operator-(const Tensor& a, const Tensor& b);
Tensor operator*(const Tensor& a, const Tensor& b);
Tensor operator/(const Tensor& a, const Tensor& b);
Tensor operator+(const Tensor& a, double s);
Tensor operator-(const Tensor& a, double s);
Tensor operator*(const Tensor& a, double s);
Tensor operator/(const Tensor& a, double s);
Tensor operator*(double s, const Tensor& a);
Tensor operator+(double s, const Tensor& a);
Tensor operator-(double s, const Tensor& a);
Tensor operator-(const Tensor& a);
std::ostream& operator<<(std::ostream& os, const Tensor& t);

namespace detail {
// An uninitialised tensor of the given shape (contiguous) on `device`.
Tensor empty_tensor(const Shape& sizes, DType dtype, Device device);
Tensor empty_tensor(Shape&& sizes, DType dtype, Device device);
// An uninitialised tensor with the given strides, which must describe a dense
// layout (a permutation of contiguous strides, e.g. channels-last): numel
// elements of storage. One tensor, no view over a contiguous one.
Tensor empty_dense_strided(Shape&& sizes, Shape&& strides, DType dtype, Device device);
// A view of `base`'s storage with new geometry (no autograd).
Tensor make_view(const Tensor& base, const Shape& sizes, const Shape& strides, int64_t offset);
Tensor make_view(const Tensor& base, Shape&& sizes, Shape&& strides, int64_t offset);
// Checks that `t` is defined, naming the op and argument.
void check_defined(const Tensor& t, const char* op, const char* arg);
}  // namespace detail

// Tensors by name, in order: state dicts, optimizer state, checkpoints.
using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

}  // namespace chorus
