// Differentiable functions: forward through ops/, backward formulas as closures
// recorded on the graph (Note [Saved tensors are freed after backward]).
#include "chorus/autograd/functions.h"

#include "chorus/autograd/engine.h"
#include "chorus/autograd/node.h"
#include "chorus/core/error.h"
#include "chorus/ops/copy.h"
#include "chorus/ops/elementwise.h"
#include "chorus/ops/factory.h"
#include "chorus/ops/indexing.h"
#include "chorus/ops/linalg.h"
#include "chorus/ops/nn.h"
#include "chorus/ops/reduce.h"
#include "chorus/ops/views.h"

namespace chorus {

using autograd::record;


namespace {
// Gradient of a broadcast operand: summed down to its shape, on its device.
Tensor reduce_grad(const Tensor& g, const Shape& shape) { return ops::sum_to(g, shape); }
Tensor bin(BinaryOp op, const Tensor& a, const Tensor& b) { return ops::binary(op, a, b, 1.0); }
Tensor un(UnaryOp op, const Tensor& a, double s = 0) { return ops::unary(op, a, s); }
}  // namespace

Tensor add(const Tensor& a, const Tensor& b, double alpha) {
  Shape sa = a.sizes(), sb = b.sizes();
  return record("AddBackward", ops::binary(BinaryOp::Add, a, b, alpha), {a, b}, [sa, sb, alpha](const TensorList& g) {
    Tensor gb = alpha == 1.0 ? g[0] : un(UnaryOp::MulScalar, g[0], alpha);
    return TensorList{reduce_grad(g[0], sa), reduce_grad(gb, sb)};
  });
}

Tensor sub(const Tensor& a, const Tensor& b) {
  Shape sa = a.sizes(), sb = b.sizes();
  return record("SubBackward", ops::binary(BinaryOp::Sub, a, b, 1.0), {a, b}, [sa, sb](const TensorList& g) {
    return TensorList{reduce_grad(g[0], sa), reduce_grad(un(UnaryOp::Neg, g[0]), sb)};
  });
}

Tensor mul(const Tensor& a, const Tensor& b) {
  Tensor ad = a.detach(), bd = b.detach();
  bool na = a.requires_grad(), nb = b.requires_grad();
  return record("MulBackward", bin(BinaryOp::Mul, a, b), {a, b}, [ad, bd, na, nb](const TensorList& g) {
    return TensorList{na ? reduce_grad(bin(BinaryOp::Mul, g[0], bd), ad.sizes()) : Tensor(),
                      nb ? reduce_grad(bin(BinaryOp::Mul, g[0], ad), bd.sizes()) : Tensor()};
  });
}

Tensor div(const Tensor& a, const Tensor& b) {
  Tensor ad = a.detach(), bd = b.detach();
  bool na = a.requires_grad(), nb = b.requires_grad();
  return record("DivBackward", bin(BinaryOp::Div, a, b), {a, b}, [ad, bd, na, nb](const TensorList& g) {
    Tensor ga, gb;
    if (na) ga = reduce_grad(bin(BinaryOp::Div, g[0], bd), ad.sizes());
    if (nb) {
      // d(a/b)/db = -a / b^2
      Tensor t = bin(BinaryOp::Div, bin(BinaryOp::Mul, g[0], ad), un(UnaryOp::Square, bd));
      gb = reduce_grad(un(UnaryOp::Neg, t), bd.sizes());
    }
    return TensorList{ga, gb};
  });
}

Tensor maximum(const Tensor& a, const Tensor& b) {
  Tensor ad = a.detach(), bd = b.detach();
  return record("MaximumBackward", bin(BinaryOp::Max, a, b), {a, b}, [ad, bd](const TensorList& g) {
    Tensor amask = ops::to_dtype(bin(BinaryOp::Ge, ad, bd), g[0].dtype());
    Tensor bmask = ops::to_dtype(bin(BinaryOp::Lt, ad, bd), g[0].dtype());
    return TensorList{reduce_grad(bin(BinaryOp::Mul, g[0], amask), ad.sizes()),
                      reduce_grad(bin(BinaryOp::Mul, g[0], bmask), bd.sizes())};
  });
}

Tensor add_scalar(const Tensor& a, double s) {
  return record("AddScalarBackward", un(UnaryOp::AddScalar, a, s), {a},
                [](const TensorList& g) { return TensorList{g[0]}; });
}

Tensor mul_scalar(const Tensor& a, double s) {
  return record("MulScalarBackward", un(UnaryOp::MulScalar, a, s), {a},
                [s](const TensorList& g) { return TensorList{un(UnaryOp::MulScalar, g[0], s)}; });
}

Tensor rsub_scalar(double s, const Tensor& a) {
  return record("RSubScalarBackward", un(UnaryOp::RSubScalar, a, s), {a},
                [](const TensorList& g) { return TensorList{un(UnaryOp::Neg, g[0])}; });
}

Tensor pow(const Tensor& a, double e) {
  Tensor ad = a.detach();
  return record("PowBackward", un(UnaryOp::Pow, a, e), {a}, [ad, e](const TensorList& g) {
    Tensor d = un(UnaryOp::MulScalar, un(UnaryOp::Pow, ad, e - 1), e);
    return TensorList{bin(BinaryOp::Mul, g[0], d)};
  });
}

Tensor neg(const Tensor& a) {
  return record("NegBackward", un(UnaryOp::Neg, a), {a},
                [](const TensorList& g) { return TensorList{un(UnaryOp::Neg, g[0])}; });
}

Tensor exp(const Tensor& a) {
  Tensor y = un(UnaryOp::Exp, a);
  Tensor yd = y.detach();  // detached: saving y itself would make a cycle y -> grad_fn -> y
  return record("ExpBackward", y, {a}, [yd](const TensorList& g) { return TensorList{bin(BinaryOp::Mul, g[0], yd)}; });
}

Tensor log(const Tensor& a) {
  Tensor ad = a.detach();
  return record("LogBackward", un(UnaryOp::Log, a), {a},
                [ad](const TensorList& g) { return TensorList{bin(BinaryOp::Div, g[0], ad)}; });
}

Tensor sqrt(const Tensor& a) {
  Tensor y = un(UnaryOp::Sqrt, a);
  Tensor yd = y.detach();  // detached: saving y itself would make a cycle y -> grad_fn -> y
  return record("SqrtBackward", y, {a}, [yd](const TensorList& g) {
    return TensorList{bin(BinaryOp::Div, un(UnaryOp::MulScalar, g[0], 0.5), yd)};
  });
}

Tensor tanh(const Tensor& a) {
  Tensor y = un(UnaryOp::Tanh, a);
  Tensor yd = y.detach();  // detached: saving y itself would make a cycle y -> grad_fn -> y
  return record("TanhBackward", y, {a}, [yd](const TensorList& g) { return TensorList{bin(BinaryOp::TanhGrad, g[0], yd)}; });
}

Tensor sigmoid(const Tensor& a) {
  Tensor y = un(UnaryOp::Sigmoid, a);
  Tensor yd = y.detach();  // detached: saving y itself would make a cycle y -> grad_fn -> y
  return record("SigmoidBackward", y, {a},
                [yd](const TensorList& g) { return TensorList{bin(BinaryOp::SigmoidGrad, g[0], yd)}; });
}

Tensor relu(const Tensor& a) {
  Tensor ad = a.detach();
  return record("ReluBackward", un(UnaryOp::Relu, a), {a},
                [ad](const TensorList& g) { return TensorList{bin(BinaryOp::ReluGrad, g[0], ad)}; });
}

Tensor abs(const Tensor& a) {
  Tensor ad = a.detach();
  return record("AbsBackward", un(UnaryOp::Abs, a), {a},
                [ad](const TensorList& g) { return TensorList{bin(BinaryOp::Mul, g[0], un(UnaryOp::Sign, ad))}; });
}

Tensor sum(const Tensor& a, const Shape& dims, bool keepdim) {
  Shape sa = a.sizes();
  Shape kept = sa;
  if (dims.empty()) std::fill(kept.begin(), kept.end(), 1);
  for (int64_t d : dims) kept[wrap_dim(d, a.dim(), "sum")] = 1;
  return record("SumBackward", ops::reduce(ReduceOp::Sum, a, dims, keepdim), {a}, [sa, kept](const TensorList& g) {
    return TensorList{ops::expand(ops::reshape(g[0], kept), sa)};
  });
}

Tensor mean(const Tensor& a, const Shape& dims, bool keepdim) {
  Shape sa = a.sizes();
  Shape kept = sa;
  int64_t count = 1;
  if (dims.empty()) {
    count = a.numel();
    std::fill(kept.begin(), kept.end(), 1);
  }
  for (int64_t d : dims) {
    int64_t w = wrap_dim(d, a.dim(), "mean");
    count *= sa[w];
    kept[w] = 1;
  }
  return record("MeanBackward", ops::reduce(ReduceOp::Mean, a, dims, keepdim), {a}, [sa, kept, count](const TensorList& g) {
    Tensor s = un(UnaryOp::MulScalar, ops::reshape(g[0], kept), 1.0 / static_cast<double>(count));
    return TensorList{ops::expand(s, sa)};
  });
}

Tensor amax(const Tensor& a, int64_t dim, bool keepdim) {
  dim = wrap_dim(dim, a.dim(), "max");
  Tensor idx = ops::reduce(ReduceOp::Argmax, a, {dim}, true);
  Tensor vals = ops::gather(a, dim, idx);
  Shape sa = a.sizes();
  Tensor out = keepdim ? vals : ops::squeeze(vals, dim);
  return record("MaxBackward", out, {a}, [idx, sa, dim](const TensorList& g) {
    Tensor gk = ops::reshape(g[0], idx.sizes());
    return TensorList{ops::scatter_add_zeros(sa, dim, idx, gk)};
  });
}

Tensor argmax(const Tensor& a, int64_t dim, bool keepdim) {
  return ops::reduce(ReduceOp::Argmax, a, {wrap_dim(dim, a.dim(), "argmax")}, keepdim);
}

Tensor matmul(const Tensor& a, const Tensor& b) {
  Tensor ad = a.detach(), bd = b.detach();
  bool na = a.requires_grad(), nb = b.requires_grad();
  return record("MatmulBackward", ops::matmul(a, b), {a, b}, [ad, bd, na, nb](const TensorList& g) {
    Tensor ga, gb;
    auto tr = [](const Tensor& t) { return ops::permute(t, t.dim() == 2 ? Shape{1, 0} : Shape{0, 2, 1}); };
    if (na) ga = ops::matmul(g[0], tr(bd));  // [.., M, N] @ [N, K]
    if (nb) {
      if (bd.dim() == 2) {
        // Fold all leading dims of a and g into rows: b.grad = a^T @ g.
        int64_t k = ad.size(-1), n = g[0].size(-1);
        Tensor a2 = ops::reshape(ad, {-1, k}), g2 = ops::reshape(g[0], {-1, n});
        gb = ops::matmul(tr(a2), g2);
      } else {
        gb = ops::matmul(tr(ad), g[0]);
      }
    }
    return TensorList{ga, gb};
  });
}

Tensor cat(const TensorList& ts, int64_t dim) {
  Tensor out = ops::cat(ts, dim);
  int64_t d = wrap_dim(dim, ts[0].dim(), "cat");
  std::vector<int64_t> sizes;
  for (const Tensor& t : ts) sizes.push_back(t.size(d));
  return record("CatBackward", out, ts, [sizes, d](const TensorList& g) {
    TensorList grads;
    int64_t pos = 0;
    for (int64_t s : sizes) {
      grads.push_back(ops::slice(g[0], d, pos, pos + s, 1));
      pos += s;
    }
    return grads;
  });
}

Tensor stack(const TensorList& ts, int64_t dim) {
  CHORUS_CHECK(!ts.empty(), "stack: expected at least one tensor");
  TensorList us;
  int64_t d = wrap_dim(dim, ts[0].dim() + 1, "stack");
  for (const Tensor& t : ts) {
    CHORUS_CHECK(t.sizes() == ts[0].sizes(), "stack: tensors must all have shape ", shape_str(ts[0].sizes()),
                 ", got ", shape_str(t.sizes()));
    us.push_back(t.unsqueeze(d));
  }
  return cat(us, d);
}

TensorList split_sizes(const Tensor& t, const std::vector<int64_t>& sizes, int64_t dim) {
  int64_t d = wrap_dim(dim, t.dim(), "split");
  int64_t total = 0;
  for (int64_t s : sizes) {
    CHORUS_CHECK(s >= 0, "split: negative size ", s);
    total += s;
  }
  CHORUS_CHECK(total == t.size(d), "split: sizes sum to ", total, " but dim ", d, " has size ", t.size(d));
  TensorList outs;
  int64_t pos = 0;
  for (int64_t s : sizes) {
    outs.push_back(t.narrow(d, pos, s));
    pos += s;
  }
  return outs;
}

TensorList split(const Tensor& t, int64_t split_size, int64_t dim) {
  CHORUS_CHECK(split_size > 0, "split: split size must be positive, got ", split_size);
  int64_t d = wrap_dim(dim, t.dim(), "split");
  std::vector<int64_t> sizes;
  for (int64_t pos = 0; pos < t.size(d); pos += split_size) sizes.push_back(std::min(split_size, t.size(d) - pos));
  return split_sizes(t, sizes, d);
}

TensorList chunk(const Tensor& t, int64_t chunks, int64_t dim) {
  CHORUS_CHECK(chunks > 0, "chunk: number of chunks must be positive, got ", chunks);
  int64_t d = wrap_dim(dim, t.dim(), "chunk");
  int64_t size = (t.size(d) + chunks - 1) / chunks;
  return split(t, std::max<int64_t>(size, 1), d);
}

Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index) {
  int64_t d = wrap_dim(dim, x.dim(), "index_select");
  Shape sx = x.sizes();
  Tensor idx = index;
  Tensor out = record("IndexSelectBackward", ops::index_select(x, d, index), {x}, [sx, d, idx](const TensorList& g) {
    // Note [Gradient addends]: x's other gradient, when one waits (a tied
    // embedding's: the classifier's weight gradient, [vocabulary, width]),
    // takes the selected rows' gradients in place -- no zeroed gradient of
    // x's size and no add of two of them after it.
    const Tensor addend = autograd::take_gradient_addend(0);
    if (addend.defined() && addend.sizes() == sx && addend.dtype() == g[0].dtype() &&
        addend.device() == g[0].device() && addend.is_contiguous()) {
      ops::index_add_(addend, d, idx, g[0]);
      return TensorList{addend};
    }
    Tensor dx = ops::index_add_zeros(sx, d, idx, g[0]);
    return TensorList{addend.defined() ? ops::binary(BinaryOp::Add, dx, addend, 1.0) : dx};
  });
  if (out.grad_fn()) out.grad_fn()->takes_addends = true;
  return out;
}

Tensor gather(const Tensor& x, int64_t dim, const Tensor& index) {
  int64_t d = wrap_dim(dim, x.dim(), "gather");
  Shape sx = x.sizes();
  Tensor idx = index;
  return record("GatherBackward", ops::gather(x, d, index), {x}, [sx, d, idx](const TensorList& g) {
    return TensorList{ops::scatter_add_zeros(sx, d, idx, g[0])};
  });
}

Tensor softmax(const Tensor& x, int64_t dim) {
  Tensor y = ops::softmax(x, dim, false);
  Tensor yd = y.detach();  // detached: saving y itself would make a cycle y -> grad_fn -> y
  return record("SoftmaxBackward", y, {x}, [yd, dim](const TensorList& g) {
    return TensorList{ops::softmax_backward(g[0], yd, dim, false)};
  });
}

Tensor log_softmax(const Tensor& x, int64_t dim) {
  Tensor y = ops::softmax(x, dim, true);
  Tensor yd = y.detach();  // detached: saving y itself would make a cycle y -> grad_fn -> y
  return record("LogSoftmaxBackward", y, {x}, [yd, dim](const TensorList& g) {
    return TensorList{ops::softmax_backward(g[0], yd, dim, true)};
  });
}

Tensor to_device(const Tensor& t, const Device& d) {
  if (t.device() == d) return t;
  Device src = t.device();
  return record("ToDeviceBackward", ops::to_device(t, d), {t},
                [src](const TensorList& g) { return TensorList{ops::to_device(g[0], src)}; });
}

Tensor to_dtype(const Tensor& t, DType dt) {
  if (t.dtype() == dt) return t;
  DType src = t.dtype();
  return record("ToDtypeBackward", ops::to_dtype(t, dt), {t},
                [src](const TensorList& g) { return TensorList{ops::to_dtype(g[0], src)}; });
}

void backward(const Tensor& root, const Tensor& grad, bool retain_graph) {
  autograd::run_backward(root, grad, retain_graph);
}

void backward(const TensorList& roots, const TensorList& grads, bool retain_graph) {
  autograd::run_backward(roots, grads, retain_graph);
}

}  // namespace chorus
