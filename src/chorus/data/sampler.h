// Samplers: which dataset indices an epoch visits, and in what order.
//
// Design: a sampler is stateless; indices(epoch) is a pure function of its
// settings and the epoch (PyTorch's set_epoch(e) + __iter__ in one call), so
// a loader restarted from a checkpoint at epoch e sees exactly the order the
// first run saw, and one sampler may be shared between threads. Shuffles are
// Fisher-Yates driven by Philox keyed by (seed, epoch): the same on every
// machine and every rank, which DistributedSampler relies on.
#pragma once

#include <cstdint>
#include <vector>

namespace chorus::data {

class Sampler {
 public:
  virtual ~Sampler() = default;
  // The indices of epoch `epoch`, in visiting order.
  virtual std::vector<int64_t> indices(int64_t epoch) const = 0;
  // indices(e).size(), the same for every epoch.
  virtual int64_t size() const = 0;
};

// A random permutation of [0, n) determined by (seed, epoch).
std::vector<int64_t> random_permutation(int64_t n, uint64_t seed, int64_t epoch);

// 0, 1, ..., n-1 every epoch.
class SequentialSampler : public Sampler {
 public:
  explicit SequentialSampler(int64_t n);
  std::vector<int64_t> indices(int64_t epoch) const override;
  int64_t size() const override { return n_; }

 private:
  int64_t n_;
};

// A fresh permutation of [0, n) each epoch, reproducible from the seed.
class RandomSampler : public Sampler {
 public:
  RandomSampler(int64_t n, uint64_t seed);
  std::vector<int64_t> indices(int64_t epoch) const override;
  int64_t size() const override { return n_; }

 private:
  int64_t n_;
  uint64_t seed_;
};

// Rank `rank`'s share of a data set split over `num_replicas` processes, as
// torch.utils.data.DistributedSampler: every rank takes the same (optionally
// shuffled) order, made a multiple of num_replicas by repeating its first
// indices (or, with drop_last, by dropping its tail), and keeps positions
// rank, rank + num_replicas, ... So all ranks get the same number of
// examples, the shares are disjoint apart from the padding, and together
// they cover the data set (without drop_last).
class DistributedSampler : public Sampler {
 public:
  DistributedSampler(int64_t dataset_size, int64_t num_replicas, int64_t rank, bool shuffle = true,
                     uint64_t seed = 0, bool drop_last = false);
  std::vector<int64_t> indices(int64_t epoch) const override;
  int64_t size() const override { return per_replica_; }

 private:
  int64_t n_, num_replicas_, rank_;
  bool shuffle_;
  uint64_t seed_;
  int64_t per_replica_;
};

// Rank `rank`'s examples rank, rank + num_replicas, ... of [0, n), in order,
// with no padding: over all ranks every example exactly once (evaluation
// under DDP, whose per-rank sums are then added up). Shares differ in size
// by at most one.
class ShardSampler : public Sampler {
 public:
  ShardSampler(int64_t dataset_size, int64_t num_replicas, int64_t rank);
  std::vector<int64_t> indices(int64_t epoch) const override;
  int64_t size() const override { return size_; }

 private:
  int64_t n_, num_replicas_, rank_, size_;
};

}  // namespace chorus::data
