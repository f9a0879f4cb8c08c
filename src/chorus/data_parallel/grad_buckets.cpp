#include "chorus/data_parallel/grad_buckets.h"

#include <algorithm>

#include "chorus/core/error.h"

namespace chorus::dist {

GradBuckets::GradBuckets(const std::vector<Tensor>& params, int64_t bucket_bytes, int64_t first_bucket_bytes,
                         const std::vector<size_t>& order, int64_t last_bucket_bytes, const std::vector<DType>& as)
    : bucket_of(params.size()), index_in_bucket(params.size()) {
  CHORUS_CHECK(as.empty() || as.size() == params.size(), "gradient buckets: ", as.size(), " dtypes for ",
               params.size(), " parameters");
  auto dtype_of = [&](size_t k) { return as.empty() ? params[k].dtype() : as[k]; };
  CHORUS_CHECK(bucket_bytes >= 0 && first_bucket_bytes >= 0 && last_bucket_bytes >= 0,
               "gradient buckets: bucket sizes must be >= 0, got bucket_bytes ", bucket_bytes,
               ", first_bucket_bytes ", first_bucket_bytes, " and last_bucket_bytes ", last_bucket_bytes);
  std::vector<size_t> fill = order;
  if (fill.empty())
    for (size_t k = params.size(); k-- > 0;) fill.push_back(k);
  CHORUS_CHECK(fill.size() == params.size(), "gradient buckets: the order names ", fill.size(),
               " parameters but there are ", params.size());
  std::vector<char> seen(params.size(), 0);
  for (size_t k : fill) {
    CHORUS_CHECK(k < params.size() && !seen[k], "gradient buckets: the order is not a permutation of the ",
                 params.size(), " parameters (", k, " is ", k < params.size() ? "repeated" : "out of range", ")");
    seen[k] = 1;
  }
  auto bytes_of = [&](size_t k) { return params[k].numel() * static_cast<int64_t>(dtype_size(dtype_of(k))); };
  // The tail: the last parameters to fill, together at most last_bucket_bytes
  // (at least one), get a bucket of their own.
  size_t tail = fill.size();
  if (last_bucket_bytes > 0 && fill.size() > 1) {
    int64_t sum = 0;
    while (tail > 1 && sum + bytes_of(fill[tail - 1]) <= last_bucket_bytes) sum += bytes_of(fill[--tail]);
    if (tail == fill.size()) --tail;  // the last parameter alone is larger: it is the tail
  }
  std::vector<size_t> ks;
  std::vector<Tensor> ps;
  std::vector<DType> dts;
  int64_t bytes = 0;
  auto close = [&] {
    buckets.push_back({ks, FlatLayout(ps, dts), ps[0].device()});
    ks.clear();
    ps.clear();
    dts.clear();
    bytes = 0;
  };
  for (size_t i = 0; i < fill.size(); ++i) {
    const size_t k = fill[i];
    // A bucket is one flat buffer per dtype on one device: a parameter on
    // another device (a model-parallel module) starts a new one.
    if (!ps.empty() && (ps.back().device() != params[k].device() || i == tail)) close();
    bucket_of[k] = buckets.size();
    index_in_bucket[k] = ks.size();
    ks.push_back(k);
    ps.push_back(params[k]);
    dts.push_back(dtype_of(k));
    bytes += bytes_of(k);
    const int64_t cap = buckets.empty() && first_bucket_bytes > 0 ? first_bucket_bytes : bucket_bytes;
    if (cap > 0 && bytes >= cap && i + 1 < fill.size()) close();
  }
  if (!ks.empty()) close();
}

GradBuckets GradBuckets::from_groups(const std::vector<Tensor>& params,
                                     const std::vector<std::vector<size_t>>& groups, const std::vector<DType>& as) {
  CHORUS_CHECK(as.empty() || as.size() == params.size(), "gradient buckets: ", as.size(), " dtypes for ",
               params.size(), " parameters");
  GradBuckets out;
  out.bucket_of.assign(params.size(), 0);
  out.index_in_bucket.assign(params.size(), 0);
  std::vector<char> seen(params.size(), 0);
  for (const std::vector<size_t>& ks : groups) {
    CHORUS_CHECK(!ks.empty(), "gradient buckets: bucket ", out.buckets.size(), " is empty");
    std::vector<Tensor> ps;
    std::vector<DType> dts;
    for (size_t k : ks) {
      CHORUS_CHECK(k < params.size() && !seen[k], "gradient buckets: the groups do not partition the ",
                   params.size(), " parameters (", k, " is ", k < params.size() ? "repeated" : "out of range", ")");
      CHORUS_CHECK(params[k].device() == params[ks[0]].device(), "gradient buckets: bucket ", out.buckets.size(),
                   " holds parameters on ", params[ks[0]].device().str(), " and ", params[k].device().str());
      seen[k] = 1;
      out.bucket_of[k] = out.buckets.size();
      out.index_in_bucket[k] = ps.size();
      ps.push_back(params[k]);
      dts.push_back(as.empty() ? params[k].dtype() : as[k]);
    }
    out.buckets.push_back({ks, FlatLayout(ps, dts), ps[0].device()});
  }
  for (size_t k = 0; k < params.size(); ++k)
    CHORUS_CHECK(seen[k], "gradient buckets: parameter ", k, " is in no group");
  return out;
}

GradBuckets::Place GradBuckets::place(size_t k) const {
  CHORUS_CHECK(k < bucket_of.size(), "gradient buckets: parameter ", k, " out of range (", bucket_of.size(),
               " parameters)");
  const Bucket& b = buckets[bucket_of[k]];
  const FlatLayout::Segment& s = b.layout.segments[index_in_bucket[k]];
  return {bucket_of[k], s.group, s.offset, numel_of(s.sizes)};
}

int64_t GradBuckets::padded_numel(size_t b, size_t g, int world) const {
  CHORUS_CHECK(b < buckets.size() && g < buckets[b].layout.groups(), "gradient buckets: no group ", g, " in bucket ",
               b, " (", buckets.size(), " buckets)");
  CHORUS_CHECK(world > 0, "gradient buckets: the world size must be positive, got ", world);
  // Each shard starts as aligned as a fresh tensor (FlatLayout::kAlignBytes).
  const int64_t align =
      std::max<int64_t>(1, FlatLayout::kAlignBytes / static_cast<int64_t>(dtype_size(buckets[b].layout.dtypes[g])));
  const int64_t per = (buckets[b].layout.numels[g] + world - 1) / world;
  return (per + align - 1) / align * align * world;
}

GradBuckets::Range GradBuckets::shard(size_t b, size_t g, int rank, int world) const {
  const int64_t per = padded_numel(b, g, world) / world;
  CHORUS_CHECK(rank >= 0 && rank < world, "gradient buckets: rank ", rank, " out of range (world size ", world, ")");
  return {per * rank, per * (rank + 1)};
}

GradBuckets::Range GradBuckets::shard_of_param(size_t k, int rank, int world) const {
  const Place p = place(k);
  const Range s = shard(p.bucket, p.group, rank, world);
  const int64_t begin = std::max(s.begin, p.offset), end = std::min(s.end, p.offset + p.numel);
  return begin < end ? Range{begin, end} : Range{begin, begin};
}

}  // namespace chorus::dist
