// Tensor factories. Without an explicit device they use the thread's current
// device (DeviceGuard / set_device).
#pragma once

#include <optional>
#include <vector>

#include "chorus/core/tensor.h"

namespace chorus {

struct TensorOptions {
  DType dtype = kFloat32;
  std::optional<Device> device;  // current device when empty
  bool requires_grad = false;
  TensorOptions() = default;
  TensorOptions(DType t) : dtype(t) {}
  TensorOptions(Device d) : device(d) {}
  TensorOptions(DType t, Device d) : dtype(t), device(d) {}
  Device resolved_device() const;
};

Tensor empty(const Shape& shape, TensorOptions opts = {});
Tensor zeros(const Shape& shape, TensorOptions opts = {});
Tensor ones(const Shape& shape, TensorOptions opts = {});
Tensor full(const Shape& shape, double value, TensorOptions opts = {});
Tensor zeros_like(const Tensor& t);
Tensor ones_like(const Tensor& t);
Tensor empty_like(const Tensor& t);
// [start, end) in steps; int64 unless opts says otherwise.
Tensor arange(double start, double end, double step = 1, TensorOptions opts = {kInt64});
Tensor arange(int64_t end, TensorOptions opts = {kInt64});
// Uniform [0, 1), standard normal, integers in [lo, hi): from the default
// generator (Philox; identical on every device for the same seed).
Tensor rand(const Shape& shape, TensorOptions opts = {});
Tensor randn(const Shape& shape, TensorOptions opts = {});
Tensor randint(int64_t lo, int64_t hi, const Shape& shape, TensorOptions opts = {kInt64});
// A tensor holding a copy of host data (row-major), converted to opts.dtype.
Tensor from_vector(const std::vector<float>& data, const Shape& shape, TensorOptions opts = {});
Tensor from_vector(const std::vector<double>& data, const Shape& shape, TensorOptions opts = {});
Tensor from_vector(const std::vector<int64_t>& data, const Shape& shape, TensorOptions opts = {kInt64});
Tensor scalar_tensor(double v, TensorOptions opts = {});

}  // namespace chorus
