// Softmax, log-softmax and cross entropy over the last dim, on the CPU.
//
// Each row is converted into a scratch buffer of the compute type C, computed
// there and stored back, so one code path serves every floating dtype in any
// mix of inputs and outputs. C is float (the kernel-set rule, and what the
// CUDA kernels do), or double when any operand is float64: the CPU-only
// float64 exists for gradient checks, which float math would spoil.
// Stability: every row subtracts its max before exp, so exp never overflows
// and the largest term is exactly 1 (the sum is >= 1, its log is finite).
//
// Cross entropy validates all targets before writing anything, so a bad batch
// leaves the outputs untouched and the error names the first offending row.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <vector>

#include "chorus/core/error.h"
#include "chorus/cpu/kernels.h"
#include "chorus/cpu/row_io.h"

namespace chorus::cpu {
namespace {

void check_float_tensor(const char* op, const char* arg, const Tensor& t, const Shape& shape) {
  detail::check_defined(t, op, arg);
  CHORUS_CHECK(is_floating(t.dtype()), op, ": ", arg, " must have a floating dtype, got ",
               t.describe());
  CHORUS_CHECK(t.is_contiguous(), op, ": ", arg, " must be contiguous, got ", t.describe());
  CHORUS_CHECK(t.sizes() == shape, op, ": ", arg, " must have shape ", shape_str(shape), ", got ",
               t.describe());
}

struct Rows {
  int64_t rows, cols;
};

Rows rows_of(const char* op, const char* arg, const Tensor& x) {
  detail::check_defined(x, op, arg);
  CHORUS_CHECK(x.dim() >= 1, op, ": needs at least one dim, got ", x.describe());
  const int64_t cols = x.size(-1);
  return {cols == 0 ? 0 : x.numel() / cols, cols};
}

// In place: row <- log_softmax(row) = (row - max) - log(sum(exp(row - max))).
// Shifting first and subtracting the small log(sum) after keeps the result
// accurate when the logits are large (m + log(sum) would round at |m|'s scale).
template <typename C>
void log_softmax_row(C* row, int64_t cols) {
  C m = -std::numeric_limits<C>::infinity();
  for (int64_t j = 0; j < cols; ++j) m = std::max(m, row[j]);
  C sum = 0;
  for (int64_t j = 0; j < cols; ++j) sum += std::exp(row[j] -= m);
  const C log_sum = std::log(sum);
  for (int64_t j = 0; j < cols; ++j) row[j] -= log_sum;
}

template <typename C>
void softmax_row(C* row, int64_t cols) {
  C m = -std::numeric_limits<C>::infinity();
  for (int64_t j = 0; j < cols; ++j) m = std::max(m, row[j]);
  C sum = 0;
  for (int64_t j = 0; j < cols; ++j) sum += (row[j] = std::exp(row[j] - m));
  const C inv = C(1) / sum;
  for (int64_t j = 0; j < cols; ++j) row[j] *= inv;
}

// Checks logits [B, C], int64 targets [B] all in [0, C); returns {B, C}.
Rows check_targets(const char* op, const char* arg, const Tensor& logits, const Tensor& target) {
  detail::check_defined(logits, op, arg);
  detail::check_defined(target, op, "target");
  CHORUS_CHECK(logits.dim() == 2, op, ": ", arg, " must be [batch, classes], got ",
               logits.describe());
  const int64_t b = logits.size(0), c = logits.size(1);
  CHORUS_CHECK(target.dtype() == kInt64 && target.is_contiguous() && target.sizes() == Shape{b},
               op, ": target must be contiguous int64 of shape [", b, "], got ",
               target.describe());
  const int64_t* t = target.data<int64_t>();
  for (int64_t r = 0; r < b; ++r) {
    CHORUS_CHECK(t[r] >= 0 && t[r] < c, op, ": target ", t[r], " at row ", r,
                 " is out of range for ", c, " classes (need 0 <= target < ", c, ")");
  }
  return {b, c};
}

}  // namespace

void softmax_forward(const Tensor& x, const Tensor& y, bool log) {
  const char* op = log ? "log_softmax_forward" : "softmax_forward";
  const Rows r = rows_of(op, "x", x);
  check_float_tensor(op, "x", x, x.sizes());
  check_float_tensor(op, "y", y, x.sizes());
  with_compute_type({&x, &y}, [&](auto tag) {
    using C = decltype(tag);
    std::vector<C> row(r.cols);
    for (int64_t i = 0; i < r.rows; ++i) {
      load_row(x, i * r.cols, r.cols, row.data());
      if (log) {
        log_softmax_row(row.data(), r.cols);
      } else {
        softmax_row(row.data(), r.cols);
      }
      store_row(row.data(), y, i * r.cols, r.cols);
    }
  });
}

void softmax_backward(const Tensor& dy, const Tensor& y, const Tensor& dx, bool log) {
  const char* op = log ? "log_softmax_backward" : "softmax_backward";
  const Rows r = rows_of(op, "y", y);
  check_float_tensor(op, "y", y, y.sizes());
  check_float_tensor(op, "dy", dy, y.sizes());
  check_float_tensor(op, "dx", dx, y.sizes());
  with_compute_type({&dy, &y, &dx}, [&](auto tag) {
    using C = decltype(tag);
    std::vector<C> g(r.cols), out(r.cols);
    for (int64_t i = 0; i < r.rows; ++i) {
      load_row(dy, i * r.cols, r.cols, g.data());
      load_row(y, i * r.cols, r.cols, out.data());
      C sum = 0;
      if (log) {
        // y = x - lse(x): dx = dy - softmax(x) * sum(dy), and softmax(x) = exp(y).
        for (int64_t j = 0; j < r.cols; ++j) sum += g[j];
        for (int64_t j = 0; j < r.cols; ++j) out[j] = g[j] - std::exp(out[j]) * sum;
      } else {
        // The Jacobian diag(y) - y y^T applied to dy.
        for (int64_t j = 0; j < r.cols; ++j) sum += g[j] * out[j];
        for (int64_t j = 0; j < r.cols; ++j) out[j] = out[j] * (g[j] - sum);
      }
      store_row(out.data(), dx, i * r.cols, r.cols);
    }
  });
}

void cross_entropy_forward(const Tensor& logits, const Tensor& target, double smoothing,
                           const Tensor& losses, const Tensor& probs) {
  const char* op = "cross_entropy_forward";
  const Rows r = check_targets(op, "logits", logits, target);
  check_float_tensor(op, "logits", logits, logits.sizes());
  check_float_tensor(op, "probs", probs, logits.sizes());
  check_float_tensor(op, "losses", losses, Shape{r.rows});
  CHORUS_CHECK(smoothing >= 0 && smoothing <= 1, op, ": label smoothing must be in [0, 1], got ",
               smoothing);
  const int64_t* t = target.data<int64_t>();
  with_compute_type({&logits, &losses, &probs}, [&](auto tag) {
    using C = decltype(tag);
    const C keep = static_cast<C>(1.0 - smoothing);
    const C spread = static_cast<C>(smoothing / static_cast<double>(r.cols));
    std::vector<C> row(r.cols);
    for (int64_t i = 0; i < r.rows; ++i) {
      load_row(logits, i * r.cols, r.cols, row.data());
      log_softmax_row(row.data(), r.cols);
      C sum_logp = 0;
      for (int64_t j = 0; j < r.cols; ++j) sum_logp += row[j];
      const C loss = -keep * row[t[i]] - spread * sum_logp;
      store_row(&loss, losses, i, 1);
      for (int64_t j = 0; j < r.cols; ++j) row[j] = std::exp(row[j]);
      store_row(row.data(), probs, i * r.cols, r.cols);
    }
  });
}

void cross_entropy_backward(const Tensor& dloss, const Tensor& probs, const Tensor& target,
                            double smoothing, const Tensor& dlogits) {
  const char* op = "cross_entropy_backward";
  const Rows r = check_targets(op, "probs", probs, target);
  check_float_tensor(op, "probs", probs, probs.sizes());
  check_float_tensor(op, "dloss", dloss, Shape{r.rows});
  check_float_tensor(op, "dlogits", dlogits, probs.sizes());
  const int64_t* t = target.data<int64_t>();
  with_compute_type({&dloss, &probs, &dlogits}, [&](auto tag) {
    using C = decltype(tag);
    const C keep = static_cast<C>(1.0 - smoothing);
    const C spread = static_cast<C>(smoothing / static_cast<double>(r.cols));
    std::vector<C> dl(r.rows), row(r.cols);
    load_row(dloss, 0, r.rows, dl.data());
    for (int64_t i = 0; i < r.rows; ++i) {
      load_row(probs, i * r.cols, r.cols, row.data());
      for (int64_t j = 0; j < r.cols; ++j) row[j] = dl[i] * (row[j] - spread);
      row[t[i]] -= dl[i] * keep;
      store_row(row.data(), dlogits, i * r.cols, r.cols);
    }
  });
}

}  // namespace chorus::cpu
