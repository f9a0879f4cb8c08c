// GradBuckets: the bucket plan of the gradient reducer (data_parallel/reducer.h) --
// which parameters' gradients travel together, and where each lives in its
// bucket's flat buffers. The same plan serves every front end: DataParallel's
// replicas (one process), DistributedDataParallel (one replica per process),
// and a sharded optimizer (ZeRO: each rank owns one contiguous 1/N of every
// flat buffer, shard()).
//
// Note [Gradient buckets]: the parameters' gradients travel in buckets of
// about `bucket_bytes` (25 MiB by default), filled from the last parameter to
// the first -- the order in which a backward pass usually produces their
// gradients -- so the sum of the last layers' gradients travels while the
// first layers' are still being computed, instead of the whole model's after
// the last backward op. `first_bucket_bytes` (when smaller) closes the first
// bucket early so that communication starts as soon as possible;
// `last_bucket_bytes` (when > 0) gives the last parameters to fill (the first
// layers) a bucket of their own of at most that size, since what the last
// bucket carries is sent after the backward's last op, with nothing left to
// hide it behind; the bucket before it closes early enough for its sum to
// overlap the first layers' backward. A bucket holds the parameters of one
// device (a module spread over devices gets a bucket chain per stretch of
// parameters on one device) and one flat buffer per dtype (FlatLayout).
#pragma once

#include <cstdint>
#include <vector>

#include "chorus/core/device.h"
#include "chorus/core/tensor.h"
#include "chorus/data_parallel/flat_layout.h"

namespace chorus::dist {

struct GradBuckets {
  struct Bucket {
    std::vector<size_t> ks;  // parameter indices, last parameters first
    FlatLayout layout;       // of their gradients, segment i for ks[i]
    Device device = cpu_device(0);  // of every parameter in it
  };
  std::vector<Bucket> buckets;
  std::vector<size_t> bucket_of, index_in_bucket;  // [k]

  // bucket_bytes 0: one bucket. first_bucket_bytes 0: as bucket_bytes.
  // `order`: the parameter indices in the order to fill the buckets (each
  // once: the order gradients became ready, DDP's rebuild); empty: from the
  // last parameter to the first. ValueError if it is not a permutation, or
  // for a negative size. last_bucket_bytes 0: no separate tail bucket.
  GradBuckets() = default;
  // `as` (both constructors): the dtype each parameter's segment holds when
  // not its own (FlatLayout); empty: their own.
  GradBuckets(const std::vector<Tensor>& params, int64_t bucket_bytes, int64_t first_bucket_bytes = 0,
              const std::vector<size_t>& order = {}, int64_t last_bucket_bytes = 0,
              const std::vector<DType>& as = {});

  // Explicit buckets (ZeRO-3's units: each module sharded as one gathers as
  // one bucket): groups[i] is bucket i's parameter indices, in the order of
  // their segments. ValueError unless the groups partition the parameters
  // and each holds parameters of one device.
  static GradBuckets from_groups(const std::vector<Tensor>& params, const std::vector<std::vector<size_t>>& groups,
                                 const std::vector<DType>& as = {});

  size_t size() const { return buckets.size(); }

  // Where parameter k's gradient lives: bucket, dtype group and element
  // offset in that group's flat buffer.
  struct Place {
    size_t bucket = 0, group = 0;
    int64_t offset = 0, numel = 0;
  };
  Place place(size_t k) const;

  // Sharding (ZeRO): group g of bucket b split into `world` equal contiguous
  // shards, the buffer padded at its end to padded_numel(b, g, world) so that
  // a reduce-scatter or all-gather over it moves equal pieces. shard() is
  // rank's [begin, end) in elements; a parameter may straddle two shards.
  struct Range {
    int64_t begin = 0, end = 0;
    int64_t numel() const { return end - begin; }
  };
  int64_t padded_numel(size_t b, size_t g, int world) const;
  Range shard(size_t b, size_t g, int rank, int world) const;
  // The part of parameter k's segment (in elements of its flat buffer) that
  // rank's shard holds; empty (begin == end) when none.
  Range shard_of_param(size_t k, int rank, int world) const;
};

}  // namespace chorus::dist
