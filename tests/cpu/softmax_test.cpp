// CPU softmax / log-softmax / cross-entropy kernels against naive double
// implementations written here from the definitions. Backward kernels are
// checked against central finite differences of those double references, so
// the gradient formulas are tested independently of the kernels' own algebra.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "chorus/core/error.h"
#include "chorus/cpu/kernels.h"
#include "testing/random.h"

namespace chorus::cpu {
namespace {

using Vec = std::vector<double>;

Tensor tensor_of(const Shape& s, DType dt, const Vec& v) {
  Tensor t = detail::empty_tensor(s, dt, Device(DeviceType::CPU, 0));
  for (size_t i = 0; i < v.size(); ++i) {
    switch (dt) {
      case kFloat32: t.data<float>()[i] = static_cast<float>(v[i]); break;
      case kBFloat16: t.data<BFloat16>()[i] = BFloat16(static_cast<float>(v[i])); break;
      case kFloat64: t.data<double>()[i] = v[i]; break;
      default: ADD_FAILURE() << "unexpected dtype " << dt;
    }
  }
  return t;
}

Tensor empty(const Shape& s, DType dt) {
  return detail::empty_tensor(s, dt, Device(DeviceType::CPU, 0));
}

Vec values_of(const Tensor& t) {
  Vec v(t.numel());
  for (int64_t i = 0; i < t.numel(); ++i) {
    switch (t.dtype()) {
      case kFloat32: v[i] = t.data<float>()[i]; break;
      case kBFloat16: v[i] = static_cast<float>(t.data<BFloat16>()[i]); break;
      case kFloat64: v[i] = t.data<double>()[i]; break;
      default: ADD_FAILURE() << "unexpected dtype " << t.dtype();
    }
  }
  return v;
}

// Values as the dtype stores them, so references see the kernels' exact input.
Vec rounded(const Vec& v, DType dt) { return values_of(tensor_of({int64_t(v.size())}, dt, v)); }

Vec random_vec(size_t n, uint32_t seed, double scale) { return chorus::testing::random_doubles(n, seed, -scale, scale); }

Tensor targets_of(const std::vector<int64_t>& t) {
  Tensor out = empty({int64_t(t.size())}, kInt64);
  std::copy(t.begin(), t.end(), out.data<int64_t>());
  return out;
}

// ---- naive references, double, straight from the definitions ----

Vec ref_softmax(const Vec& x, int64_t rows, int64_t cols, bool log) {
  Vec y(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    const double* xr = &x[r * cols];
    double m = *std::max_element(xr, xr + cols), s = 0;
    for (int64_t j = 0; j < cols; ++j) s += std::exp(xr[j] - m);
    for (int64_t j = 0; j < cols; ++j)
      y[r * cols + j] = log ? xr[j] - m - std::log(s) : std::exp(xr[j] - m) / s;
  }
  return y;
}

Vec ref_cross_entropy(const Vec& x, const std::vector<int64_t>& t, int64_t cols, double eps) {
  const int64_t rows = int64_t(t.size());
  const Vec logp = ref_softmax(x, rows, cols, true);
  Vec loss(rows);
  for (int64_t r = 0; r < rows; ++r) {
    double sum = 0;
    for (int64_t j = 0; j < cols; ++j) sum += logp[r * cols + j];
    loss[r] = -(1 - eps) * logp[r * cols + t[r]] - eps / cols * sum;
  }
  return loss;
}

// d/dx of sum(w * f(x)) by central differences.
Vec finite_difference_grad(const std::function<Vec(const Vec&)>& f, const Vec& x, const Vec& w) {
  const double h = 1e-6;
  Vec g(x.size()), xp = x;
  auto weighted = [&](const Vec& v) {
    const Vec y = f(v);
    double s = 0;
    for (size_t i = 0; i < y.size(); ++i) s += w[i] * y[i];
    return s;
  };
  for (size_t i = 0; i < x.size(); ++i) {
    xp[i] = x[i] + h;
    const double up = weighted(xp);
    xp[i] = x[i] - h;
    const double down = weighted(xp);
    xp[i] = x[i];
    g[i] = (up - down) / (2 * h);
  }
  return g;
}

void expect_near_all(const Vec& got, const Vec& want, double tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_NEAR(got[i], want[i], tol * std::max(1.0, std::abs(want[i]))) << what << " at " << i;
}

constexpr int64_t kRows = 7, kCols = 13;

TEST(SoftmaxCpu, ForwardMatchesNaiveDouble) {
  for (DType dt : {kFloat32, kBFloat16, kFloat64}) {
    for (bool log : {false, true}) {
      Vec x = rounded(random_vec(kRows * kCols, 1, 4.0), dt);
      // One row far from zero: only a max-subtracting softmax survives it.
      for (int64_t j = 0; j < kCols; ++j) x[j] = rounded({1000.0 + x[j]}, dt)[0];
      Tensor y = empty({kRows, kCols}, dt);
      softmax_forward(tensor_of({kRows, kCols}, dt, x), y, log);
      const double tol = dt == kBFloat16 ? 1e-2 : dt == kFloat32 ? 1e-5 : 1e-12;
      expect_near_all(values_of(y), ref_softmax(x, kRows, kCols, log), tol,
                      std::string(dtype_name(dt)) + (log ? " log_softmax" : " softmax"));
    }
  }
}

TEST(SoftmaxCpu, SoftmaxBackwardMatchesFiniteDifferences) {
  const Vec x = random_vec(kRows * kCols, 2, 3.0), dy = random_vec(kRows * kCols, 3, 1.0);
  const Vec want = finite_difference_grad(
      [](const Vec& v) { return ref_softmax(v, kRows, kCols, false); }, x, dy);
  for (DType dt : {kFloat32, kFloat64}) {
    Tensor y = empty({kRows, kCols}, dt), dx = empty({kRows, kCols}, dt);
    softmax_forward(tensor_of({kRows, kCols}, dt, x), y, false);
    softmax_backward(tensor_of({kRows, kCols}, dt, dy), y, dx, false);
    expect_near_all(values_of(dx), want, dt == kFloat32 ? 1e-5 : 1e-8, dtype_name(dt));
  }
}

TEST(SoftmaxCpu, LogSoftmaxBackwardMatchesFiniteDifferences) {
  const Vec x = random_vec(kRows * kCols, 4, 3.0), dy = random_vec(kRows * kCols, 5, 1.0);
  const Vec want = finite_difference_grad(
      [](const Vec& v) { return ref_softmax(v, kRows, kCols, true); }, x, dy);
  for (DType dt : {kFloat32, kFloat64}) {
    Tensor y = empty({kRows, kCols}, dt), dx = empty({kRows, kCols}, dt);
    softmax_forward(tensor_of({kRows, kCols}, dt, x), y, true);
    softmax_backward(tensor_of({kRows, kCols}, dt, dy), y, dx, true);
    expect_near_all(values_of(dx), want, dt == kFloat32 ? 1e-5 : 1e-8, dtype_name(dt));
  }
}

TEST(SoftmaxCpu, BackwardInBFloat16IsCloseToFiniteDifferences) {
  const Vec x = rounded(random_vec(kRows * kCols, 6, 3.0), kBFloat16);
  const Vec dy = rounded(random_vec(kRows * kCols, 7, 1.0), kBFloat16);
  for (bool log : {false, true}) {
    const Vec want = finite_difference_grad(
        [log](const Vec& v) { return ref_softmax(v, kRows, kCols, log); }, x, dy);
    Tensor y = empty({kRows, kCols}, kBFloat16), dx = empty({kRows, kCols}, kBFloat16);
    softmax_forward(tensor_of({kRows, kCols}, kBFloat16, x), y, log);
    softmax_backward(tensor_of({kRows, kCols}, kBFloat16, dy), y, dx, log);
    expect_near_all(values_of(dx), want, 3e-2, log ? "log_softmax" : "softmax");
  }
}

const std::vector<int64_t> kTargets = {3, 0, 12, 7, 7, 1, 5};

TEST(CrossEntropyCpu, ForwardMatchesNaiveWithAndWithoutSmoothing) {
  for (DType dt : {kFloat32, kBFloat16}) {
    for (double eps : {0.0, 0.1}) {
      const Vec x = rounded(random_vec(kRows * kCols, 8, 5.0), dt);
      Tensor losses = empty({kRows}, kFloat32), probs = empty({kRows, kCols}, kFloat32);
      cross_entropy_forward(tensor_of({kRows, kCols}, dt, x), targets_of(kTargets), eps, losses,
                            probs);
      const std::string what = std::string(dtype_name(dt)) + " eps=" + std::to_string(eps);
      // Inputs are the same bf16-rounded values, so only float math differs.
      expect_near_all(values_of(losses), ref_cross_entropy(x, kTargets, kCols, eps), 1e-5, what);
      expect_near_all(values_of(probs), ref_softmax(x, kRows, kCols, false), 1e-6, what);
    }
  }
}

TEST(CrossEntropyCpu, BackwardMatchesFiniteDifferences) {
  const Vec x = random_vec(kRows * kCols, 9, 3.0), dloss = random_vec(kRows, 10, 1.0);
  for (double eps : {0.0, 0.1}) {
    const Vec want = finite_difference_grad(
        [eps](const Vec& v) { return ref_cross_entropy(v, kTargets, kCols, eps); }, x, dloss);
    Tensor losses = empty({kRows}, kFloat32), probs = empty({kRows, kCols}, kFloat32);
    cross_entropy_forward(tensor_of({kRows, kCols}, kFloat32, x), targets_of(kTargets), eps,
                          losses, probs);
    Tensor dlogits = empty({kRows, kCols}, kFloat32);
    cross_entropy_backward(tensor_of({kRows}, kFloat32, dloss), probs, targets_of(kTargets), eps,
                           dlogits);
    expect_near_all(values_of(dlogits), want, 1e-5, "eps=" + std::to_string(eps));
  }
}

TEST(CrossEntropyCpu, OutOfRangeTargetNamesValueRowAndClasses) {
  Tensor losses = empty({3}, kFloat32), probs = empty({3, 10}, kFloat32);
  Tensor logits = tensor_of({3, 10}, kFloat32, random_vec(30, 11, 1.0));
  for (int64_t bad : {10, -1}) {
    try {
      cross_entropy_forward(logits, targets_of({1, 2, bad}), 0.0, losses, probs);
      FAIL() << "no error for target " << bad;
    } catch (const ValueError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("target " + std::to_string(bad)), std::string::npos) << msg;
      EXPECT_NE(msg.find("row 2"), std::string::npos) << msg;
      EXPECT_NE(msg.find("10 classes"), std::string::npos) << msg;
    }
  }
  Tensor dlogits = empty({3, 10}, kFloat32);
  EXPECT_THROW(cross_entropy_backward(tensor_of({3}, kFloat32, {1, 1, 1}), probs,
                                      targets_of({0, 99, 1}), 0.0, dlogits),
               ValueError);
}

}  // namespace
}  // namespace chorus::cpu
