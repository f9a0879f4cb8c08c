#include "chorus/data/sampler.h"

#include <numeric>
#include <utility>

#include "chorus/core/error.h"
#include "chorus/data/random_streams.h"

namespace chorus::data {

std::vector<int64_t> random_permutation(int64_t n, uint64_t seed, int64_t epoch) {
  CHORUS_CHECK(n >= 0, "random_permutation: n must be >= 0, got ", n);
  std::vector<int64_t> p(static_cast<size_t>(n));
  std::iota(p.begin(), p.end(), int64_t{0});
  // Fisher-Yates from the back: the swap partner of position i is drawn from
  // the counter (i, epoch), so the permutation is a function of (seed, epoch).
  for (int64_t i = n - 1; i > 0; --i) {
    const philox::U4 r = detail::random4(seed, detail::Stream::kShuffle, static_cast<uint64_t>(i),
                                         static_cast<uint64_t>(epoch));
    const auto j = static_cast<int64_t>(detail::below(r.x, r.y, static_cast<uint64_t>(i) + 1));
    std::swap(p[i], p[j]);
  }
  return p;
}

SequentialSampler::SequentialSampler(int64_t n) : n_(n) {
  CHORUS_CHECK(n >= 0, "SequentialSampler: size must be >= 0, got ", n);
}

std::vector<int64_t> SequentialSampler::indices(int64_t) const {
  std::vector<int64_t> v(static_cast<size_t>(n_));
  std::iota(v.begin(), v.end(), int64_t{0});
  return v;
}

RandomSampler::RandomSampler(int64_t n, uint64_t seed) : n_(n), seed_(seed) {
  CHORUS_CHECK(n >= 0, "RandomSampler: size must be >= 0, got ", n);
}

std::vector<int64_t> RandomSampler::indices(int64_t epoch) const {
  return random_permutation(n_, seed_, epoch);
}

DistributedSampler::DistributedSampler(int64_t dataset_size, int64_t num_replicas, int64_t rank,
                                       bool shuffle, uint64_t seed, bool drop_last)
    : n_(dataset_size), num_replicas_(num_replicas), rank_(rank), shuffle_(shuffle), seed_(seed) {
  CHORUS_CHECK(dataset_size >= 0, "DistributedSampler: dataset size must be >= 0, got ", dataset_size);
  CHORUS_CHECK(num_replicas >= 1, "DistributedSampler: num_replicas must be >= 1, got ", num_replicas);
  CHORUS_CHECK(rank >= 0 && rank < num_replicas, "DistributedSampler: rank ", rank,
               " out of range [0, ", num_replicas, ")");
  // PyTorch's arithmetic: round the share down when dropping, up when padding.
  per_replica_ = drop_last ? n_ / num_replicas_ : (n_ + num_replicas_ - 1) / num_replicas_;
}

std::vector<int64_t> DistributedSampler::indices(int64_t epoch) const {
  std::vector<int64_t> order = shuffle_ ? random_permutation(n_, seed_, epoch)
                                        : SequentialSampler(n_).indices(epoch);
  const int64_t total = per_replica_ * num_replicas_;
  // Pad by repeating from the start (several times over when n < replicas).
  for (int64_t i = 0; static_cast<int64_t>(order.size()) < total; ++i) order.push_back(order[i]);
  std::vector<int64_t> mine;
  mine.reserve(static_cast<size_t>(per_replica_));
  for (int64_t i = rank_; i < total; i += num_replicas_) mine.push_back(order[i]);
  return mine;
}

ShardSampler::ShardSampler(int64_t dataset_size, int64_t num_replicas, int64_t rank)
    : n_(dataset_size), num_replicas_(num_replicas), rank_(rank) {
  CHORUS_CHECK(dataset_size >= 0, "ShardSampler: dataset size must be >= 0, got ", dataset_size);
  CHORUS_CHECK(num_replicas >= 1, "ShardSampler: num_replicas must be >= 1, got ", num_replicas);
  CHORUS_CHECK(rank >= 0 && rank < num_replicas, "ShardSampler: rank ", rank, " out of range [0, ", num_replicas, ")");
  size_ = n_ > rank_ ? (n_ - rank_ + num_replicas_ - 1) / num_replicas_ : 0;
}

std::vector<int64_t> ShardSampler::indices(int64_t) const {
  std::vector<int64_t> mine;
  mine.reserve(static_cast<size_t>(size_));
  for (int64_t i = rank_; i < n_; i += num_replicas_) mine.push_back(i);
  return mine;
}

}  // namespace chorus::data
