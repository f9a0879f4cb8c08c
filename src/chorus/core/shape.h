// Shapes and strides: plain vectors of int64_t, with the helpers every layer
// needs (element counts, contiguous strides, broadcasting, dim wrapping).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace chorus {

using Shape = std::vector<int64_t>;

int64_t numel_of(const Shape& s);
Shape contiguous_strides(const Shape& sizes);
// NumPy broadcasting of two shapes; throws ValueError naming `op` and both shapes.
Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op);
// Wraps a possibly negative dim into [0, ndim); throws ValueError naming `op`.
int64_t wrap_dim(int64_t dim, int64_t ndim, const char* op);
std::string shape_str(const Shape& s);  // "[2, 3, 4]"

}  // namespace chorus
