#include "chorus/parallel/scatter_gather.h"

#include "chorus/autograd/functions.h"
#include "chorus/core/error.h"

namespace chorus::parallel {

int64_t batch_size(const nn::Value& x, int64_t dim) {
  if (x.is_tensor()) {
    const Tensor& t = x.tensor();
    return t.size(wrap_dim(dim, t.dim(), "DataParallel (batch dim)"));
  }
  if (x.is_list()) {
    for (const auto& e : x.list()) return batch_size(e, dim);
  } else {
    for (const auto& [k, e] : x.map()) return batch_size(e, dim);
  }
  CHORUS_THROW(ValueError, "DataParallel: the input holds no tensor");
}

nn::Value scatter(const nn::Value& x, int64_t dim, int64_t start, int64_t len, const Device& device) {
  if (x.is_tensor()) {
    const Tensor& t = x.tensor();
    const int64_t d = wrap_dim(dim, t.dim(), "DataParallel (batch dim)");
    return nn::Value(chorus::to_device(t.narrow(d, start, len), device));
  }
  if (x.is_list()) {
    nn::Value::List out;
    for (const auto& e : x.list()) out.push_back(scatter(e, dim, start, len, device));
    return nn::Value(std::move(out));
  }
  nn::Value::Map out;
  for (const auto& [k, e] : x.map()) out.emplace(k, scatter(e, dim, start, len, device));
  return nn::Value(std::move(out));
}

nn::Value gather(const std::vector<nn::Value>& parts, int64_t dim, const Device& device) {
  const nn::Value& first = parts[0];
  if (first.is_tensor()) {
    TensorList ts;
    for (const auto& o : parts) ts.push_back(chorus::to_device(o.tensor(), device));
    if (ts.size() == 1) return nn::Value(ts[0]);
    if (ts[0].dim() == 0) {
      // Scalars (e.g. a loss computed inside the module) gather as a vector.
      for (auto& p : ts) p = p.unsqueeze(0);
      return nn::Value(chorus::cat(ts, 0));
    }
    return nn::Value(chorus::cat(ts, wrap_dim(dim, ts[0].dim(), "DataParallel (gather)")));
  }
  if (first.is_list()) {
    nn::Value::List out;
    for (size_t i = 0; i < first.list().size(); ++i) {
      std::vector<nn::Value> col;
      for (const auto& o : parts) col.push_back(o.list().at(i));
      out.push_back(gather(col, dim, device));
    }
    return nn::Value(std::move(out));
  }
  nn::Value::Map out;
  for (const auto& [k, v] : first.map()) {
    std::vector<nn::Value> col;
    for (const auto& o : parts) col.push_back(o.map().at(k));
    out.emplace(k, gather(col, dim, device));
  }
  return nn::Value(std::move(out));
}

}  // namespace chorus::parallel
