// The transformer's row-wise kernels on the CPU: layer norm, attention's
// (causal) softmax and the fused classifier + cross entropy. Rows are
// independent, so each kernel splits its rows over parallel_for; every row is
// computed in a scratch buffer of the compute type (cpu/row_io.h), double
// when any operand is float64 (the gradient checks), float otherwise.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "chorus/core/error.h"
#include "chorus/cpu/kernels.h"
#include "chorus/cpu/parallel.h"
#include "chorus/cpu/row_io.h"

namespace chorus::cpu {
namespace {

void check_rows(const char* op, const char* arg, const Tensor& t, const Shape& shape) {
  detail::check_defined(t, op, arg);
  CHORUS_CHECK(is_floating(t.dtype()), op, ": ", arg, " must have a floating dtype, got ", t.describe());
  CHORUS_CHECK(t.is_contiguous() && t.sizes() == shape, op, ": ", arg, " must be contiguous ", shape_str(shape),
               ", got ", t.describe());
}

// Rows per parallel chunk: about 64k elements of work each.
int64_t grain_for(int64_t cols) { return std::max<int64_t>(1, 65536 / std::max<int64_t>(cols, 1)); }

}  // namespace

namespace {

// Normalises row [cols] in place: (row - m) * rs * g + b, returning m and rs.
template <typename C>
void normalize_row(C* row, int64_t cols, const C* g, const C* b, double eps, C& m, C& rs) {
  m = 0;
  for (int64_t j = 0; j < cols; ++j) m += row[j];
  m /= static_cast<C>(cols);
  C v = 0;  // two passes: the variance of centred values, never E[x^2] - m^2
  for (int64_t j = 0; j < cols; ++j) v += (row[j] - m) * (row[j] - m);
  v /= static_cast<C>(cols);
  rs = C(1) / std::sqrt(v + static_cast<C>(eps));
  for (int64_t j = 0; j < cols; ++j) row[j] = (row[j] - m) * rs * g[j] + b[j];
}

// The checks of layer norm's forward operands; returns the rows.
int64_t check_norm_forward(const char* op, const Tensor& x, const Tensor& gamma, const Tensor& beta, const Tensor& y,
                           const Tensor& mean, const Tensor& rstd) {
  detail::check_defined(x, op, "x");
  CHORUS_CHECK(x.dim() >= 1, op, ": x needs at least one dim, got ", x.describe());
  const int64_t cols = x.size(-1), rows = cols ? x.numel() / cols : 0;
  check_rows(op, "x", x, x.sizes());
  check_rows(op, "y", y, x.sizes());
  check_rows(op, "mean", mean, Shape{rows});
  check_rows(op, "rstd", rstd, Shape{rows});
  if (gamma.defined()) check_rows(op, "gamma", gamma, Shape{cols});
  if (beta.defined()) check_rows(op, "beta", beta, Shape{cols});
  return rows;
}

// The layer norm of each row of src (x, or x + r stored into sum first).
template <typename C>
void norm_rows(const Tensor& x, const Tensor& r, const Tensor& sum, const Tensor& gamma, const Tensor& beta,
               double eps, const Tensor& y, const Tensor& mean, const Tensor& rstd, int64_t rows) {
  const int64_t cols = x.size(-1);
  std::vector<C> g(cols, C(1)), b(cols, C(0));
  if (gamma.defined()) load_row(gamma, 0, cols, g.data());
  if (beta.defined()) load_row(beta, 0, cols, b.data());
  parallel_for(rows, grain_for(cols), [&](int64_t r0, int64_t r1) {
    std::vector<C> row(cols), other(r.defined() ? cols : 0);
    for (int64_t i = r0; i < r1; ++i) {
      load_row(x, i * cols, cols, row.data());
      if (r.defined()) {
        // The norm reads the sum as stored (rounded to its dtype), as a
        // layer norm after a separate add would.
        load_row(r, i * cols, cols, other.data());
        for (int64_t j = 0; j < cols; ++j) row[j] += other[j];
        store_row(row.data(), sum, i * cols, cols);
        load_row(sum, i * cols, cols, row.data());
      }
      C m, rs;
      normalize_row(row.data(), cols, g.data(), b.data(), eps, m, rs);
      store_row(row.data(), y, i * cols, cols);
      store_row(&m, mean, i, 1);
      store_row(&rs, rstd, i, 1);
    }
  });
}

}  // namespace

void layer_norm_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta, double eps, const Tensor& y,
                        const Tensor& mean, const Tensor& rstd) {
  const int64_t rows = check_norm_forward("layer_norm_forward", x, gamma, beta, y, mean, rstd);
  with_compute_type({&x, &y}, [&](auto tag) {
    norm_rows<decltype(tag)>(x, Tensor(), Tensor(), gamma, beta, eps, y, mean, rstd, rows);
  });
}

void add_layer_norm_forward(const Tensor& x, const Tensor& r, const Tensor& gamma, const Tensor& beta, double eps,
                            const Tensor& sum, const Tensor& y, const Tensor& mean, const Tensor& rstd) {
  const char* op = "add_layer_norm_forward";
  const int64_t rows = check_norm_forward(op, x, gamma, beta, y, mean, rstd);
  check_rows(op, "r", r, x.sizes());
  check_rows(op, "sum", sum, x.sizes());
  CHORUS_CHECK(r.dtype() == x.dtype() && sum.dtype() == x.dtype(), op, ": x, r and sum must share a dtype, got ",
               x.describe(), ", ", r.describe(), ", ", sum.describe());
  with_compute_type({&x, &y}, [&](auto tag) {
    norm_rows<decltype(tag)>(x, r, sum, gamma, beta, eps, y, mean, rstd, rows);
  });
}

void layer_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                         const Tensor& rstd, const Tensor& dres, const Tensor& dx, const Tensor& dgamma,
                         const Tensor& dbeta) {
  const char* op = "layer_norm_backward";
  detail::check_defined(x, op, "x");
  const int64_t cols = x.size(-1), rows = cols ? x.numel() / cols : 0;
  check_rows(op, "x", x, x.sizes());
  check_rows(op, "dy", dy, x.sizes());
  check_rows(op, "dx", dx, x.sizes());
  if (dres.defined()) check_rows(op, "dres", dres, x.sizes());
  check_rows(op, "mean", mean, Shape{rows});
  check_rows(op, "rstd", rstd, Shape{rows});
  if (gamma.defined()) check_rows(op, "gamma", gamma, Shape{cols});
  if (dgamma.defined()) check_rows(op, "dgamma", dgamma, Shape{cols});
  if (dbeta.defined()) check_rows(op, "dbeta", dbeta, Shape{cols});
  with_compute_type({&x, &dy, &dx}, [&](auto tag) {
    using C = decltype(tag);
    std::vector<C> g(cols, C(1));
    if (gamma.defined()) load_row(gamma, 0, cols, g.data());
    std::vector<C> mu(rows), rs(rows);
    load_row(mean, 0, rows, mu.data());
    load_row(rstd, 0, rows, rs.data());
    // dx per row, in parallel. With xhat = (x - m) * rs and dxhat = dy * g:
    // dx = rs * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), plus dres.
    parallel_for(rows, grain_for(cols), [&](int64_t r0, int64_t r1) {
      std::vector<C> xr(cols), gr(cols), dr(dres.defined() ? cols : 0);
      for (int64_t r = r0; r < r1; ++r) {
        load_row(x, r * cols, cols, xr.data());
        load_row(dy, r * cols, cols, gr.data());
        C s1 = 0, s2 = 0;
        for (int64_t j = 0; j < cols; ++j) {
          xr[j] = (xr[j] - mu[r]) * rs[r];
          gr[j] *= g[j];
          s1 += gr[j];
          s2 += gr[j] * xr[j];
        }
        s1 /= static_cast<C>(cols);
        s2 /= static_cast<C>(cols);
        for (int64_t j = 0; j < cols; ++j) xr[j] = rs[r] * (gr[j] - s1 - xr[j] * s2);
        if (dres.defined()) {
          load_row(dres, r * cols, cols, dr.data());
          for (int64_t j = 0; j < cols; ++j) xr[j] += dr[j];
        }
        store_row(xr.data(), dx, r * cols, cols);
      }
    });
    if (!dgamma.defined() && !dbeta.defined()) return;
    // dgamma = sum_rows dy * xhat, dbeta = sum_rows dy: columns split over
    // threads, each summing its columns over all rows in row order (the same
    // sums whatever the thread count).
    std::vector<C> dg(cols, C(0)), db(cols, C(0));
    parallel_for(cols, std::max<int64_t>(1, cols / 64), [&](int64_t c0, int64_t c1) {
      const int64_t n = c1 - c0;
      std::vector<C> xr(n), gr(n);
      for (int64_t r = 0; r < rows; ++r) {
        load_row(x, r * cols + c0, n, xr.data());
        load_row(dy, r * cols + c0, n, gr.data());
        for (int64_t j = 0; j < n; ++j) {
          dg[c0 + j] += gr[j] * (xr[j] - mu[r]) * rs[r];
          db[c0 + j] += gr[j];
        }
      }
    });
    if (dgamma.defined()) store_row(dg.data(), dgamma, 0, cols);
    if (dbeta.defined()) store_row(db.data(), dbeta, 0, cols);
  });
}

void attention_softmax_forward(const Tensor& x, double scale, bool causal, const Tensor& y) {
  const char* op = "attention_softmax_forward";
  detail::check_defined(x, op, "x");
  CHORUS_CHECK(x.dim() == 3, op, ": scores must be [batch, T, S], got ", x.describe());
  check_rows(op, "x", x, x.sizes());
  check_rows(op, "y", y, x.sizes());
  const int64_t t = x.size(1), s = x.size(2), rows = x.size(0) * t;
  CHORUS_CHECK(!causal || s >= t, op, ": a causal mask needs S >= T, got ", x.describe());
  with_compute_type({&x, &y}, [&](auto tag) {
    using C = decltype(tag);
    const C sc = static_cast<C>(scale);
    parallel_for(rows, grain_for(s), [&](int64_t r0, int64_t r1) {
      std::vector<C> row(s);
      for (int64_t r = r0; r < r1; ++r) {
        // Query i sees keys 0 .. i + (S - T): the last T keys line up with the T queries.
        const int64_t visible = causal ? (r % t) + (s - t) + 1 : s;
        load_row(x, r * s, s, row.data());
        C m = -std::numeric_limits<C>::infinity();
        for (int64_t j = 0; j < visible; ++j) m = std::max(m, row[j] * sc);
        C sum = 0;
        for (int64_t j = 0; j < visible; ++j) sum += (row[j] = std::exp(row[j] * sc - m));
        const C inv = C(1) / sum;
        for (int64_t j = 0; j < visible; ++j) row[j] *= inv;
        for (int64_t j = visible; j < s; ++j) row[j] = 0;
        store_row(row.data(), y, r * s, s);
      }
    });
  });
}

void attention_softmax_backward(const Tensor& dy, const Tensor& y, double scale, bool /*causal: y is 0 there*/,
                                const Tensor& dx) {
  const char* op = "attention_softmax_backward";
  detail::check_defined(y, op, "y");
  CHORUS_CHECK(y.dim() == 3, op, ": probabilities must be [batch, T, S], got ", y.describe());
  check_rows(op, "y", y, y.sizes());
  check_rows(op, "dy", dy, y.sizes());
  check_rows(op, "dx", dx, y.sizes());
  const int64_t s = y.size(2), rows = y.size(0) * y.size(1);
  with_compute_type({&dy, &y, &dx}, [&](auto tag) {
    using C = decltype(tag);
    const C sc = static_cast<C>(scale);
    parallel_for(rows, grain_for(s), [&](int64_t r0, int64_t r1) {
      std::vector<C> g(s), p(s);
      for (int64_t r = r0; r < r1; ++r) {
        load_row(dy, r * s, s, g.data());
        load_row(y, r * s, s, p.data());
        C dot = 0;
        for (int64_t j = 0; j < s; ++j) dot += g[j] * p[j];
        for (int64_t j = 0; j < s; ++j) p[j] = sc * p[j] * (g[j] - dot);  // masked: p = 0
        store_row(p.data(), dx, r * s, s);
      }
    });
  });
}

void cross_entropy_fused(const Tensor& logits, const Tensor& target, int64_t valid_cols, int64_t ignore_index,
                         const Tensor& losses, const Tensor& dlogits, const Tensor& grad_scale) {
  const char* op = "cross_entropy_fused";
  detail::check_defined(logits, op, "logits");
  detail::check_defined(target, op, "target");
  CHORUS_CHECK(logits.dim() == 2, op, ": logits must be [rows, vocabulary], got ", logits.describe());
  const int64_t n = logits.size(0), v = logits.size(1);
  check_rows(op, "logits", logits, logits.sizes());
  check_rows(op, "dlogits", dlogits, logits.sizes());
  check_rows(op, "losses", losses, Shape{n});
  CHORUS_CHECK(valid_cols >= 1 && valid_cols <= v, op, ": valid_cols ", valid_cols, " must be in [1, ", v, "]");
  CHORUS_CHECK(target.dtype() == kInt64 && target.is_contiguous() && target.sizes() == Shape{n}, op,
               ": target must be contiguous int64 [", n, "], got ", target.describe());
  const int64_t* tg = target.data<int64_t>();
  // Every target checked before anything is written: a bad batch leaves the outputs alone.
  for (int64_t r = 0; r < n; ++r) {
    CHORUS_CHECK(tg[r] == ignore_index || (tg[r] >= 0 && tg[r] < valid_cols), op, ": target ", tg[r], " at row ",
                 r, " is outside the vocabulary of ", valid_cols, " tokens");
  }
  CHORUS_CHECK(!grad_scale.defined() || grad_scale.numel() == 1, op, ": grad_scale must have one element, got ",
               grad_scale.describe());
  const double scale = grad_scale.defined() ? grad_scale.item() : 1.0;
  with_compute_type({&logits, &losses}, [&](auto tag) {
    using C = decltype(tag);
    const C sc = static_cast<C>(scale);
    parallel_for(n, grain_for(v), [&](int64_t r0, int64_t r1) {
      std::vector<C> row(v);
      for (int64_t r = r0; r < r1; ++r) {
        C loss = 0;
        if (tg[r] == ignore_index) {
          std::fill(row.begin(), row.end(), C(0));
        } else {
          load_row(logits, r * v, v, row.data());
          C m = -std::numeric_limits<C>::infinity();
          for (int64_t j = 0; j < valid_cols; ++j) m = std::max(m, row[j]);
          C sum = 0;
          for (int64_t j = 0; j < valid_cols; ++j) sum += std::exp(row[j] - m);
          const C log_sum = std::log(sum);
          loss = -((row[tg[r]] - m) - log_sum);
          for (int64_t j = 0; j < valid_cols; ++j) row[j] = std::exp((row[j] - m) - log_sum);
          for (int64_t j = valid_cols; j < v; ++j) row[j] = 0;
          row[tg[r]] -= C(1);
          if (sc != C(1))
            for (int64_t j = 0; j < valid_cols; ++j) row[j] *= sc;
        }
        store_row(&loss, losses, r, 1);
        store_row(row.data(), dlogits, r * v, v);
      }
    });
  });
}

void scale_unless_one(const Tensor& x, const Tensor& scale) {
  const char* op = "scale_unless_one";
  detail::check_defined(x, op, "x");
  CHORUS_CHECK(scale.defined() && scale.numel() == 1, op, ": scale must have one element");
  CHORUS_CHECK(x.is_contiguous() && is_floating(x.dtype()), op, ": x must be a contiguous floating tensor, got ",
               x.describe());
  const double s = scale.item();
  if (s == 1.0 || x.numel() == 0) return;
  const int64_t n = x.numel();
  with_compute_type({&x}, [&](auto tag) {
    using C = decltype(tag);
    parallel_for(n, 1 << 14, [&](int64_t i0, int64_t i1) {
      std::vector<C> buf(static_cast<size_t>(i1 - i0));
      load_row(x, i0, i1 - i0, buf.data());
      for (C& e : buf) e *= static_cast<C>(s);
      store_row(buf.data(), x, i0, i1 - i0);
    });
  });
}

// The CPU has no fused attention: ops/ runs the composite (scores, softmax,
// products), which is what a fused kernel computes without storing the scores.
bool attention_fused_forward(const Tensor&, const Tensor&, const Tensor&, double, bool, const Tensor&,
                             const Tensor&) {
  return false;
}
bool attention_fused_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                              const Tensor&, double, bool, const Tensor&, const Tensor&, const Tensor&) {
  return false;
}

}  // namespace chorus::cpu
