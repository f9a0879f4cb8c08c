// DataLoader: turns a Dataset + Sampler into a stream of batches, assembled
// by worker threads ahead of the training loop.
//
// Note [Batch determinism]: batch k of epoch e holds the examples at sampler
// positions [k*B, (k+1)*B) of sampler.indices(e), augmented with randomness
// keyed by (seed, e, dataset index) (transforms.h). Nothing depends on which
// worker builds a batch, on the worker count, or on history, so
// start_epoch(e, k) after a restart yields exactly the batches k, k+1, ...
// the interrupted run would have seen.
//
// Threads: workers claim batch numbers in order from a shared counter and
// may finish out of order; finished batches wait in a map until next()
// reaches them, so delivery is in order. At most num_workers *
// prefetch_batches batches are claimed but not yet delivered, which bounds
// memory. An exception thrown while building batch k is rethrown by the
// next() that would have returned batch k, and ends the epoch. With
// num_workers = 0 next() builds each batch itself on the caller's thread.
// The destructor stops the workers between batches and joins them, so it
// returns after at most one batch's work even mid-epoch.
//
// Device: with options.device set, next() moves the batch there on the
// caller's thread, so the copy is ordered on that thread's current stream
// (asynchronous on a GPU, see DESIGN.md "Devices and execution").
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "chorus/core/device.h"
#include "chorus/data/dataset.h"
#include "chorus/data/sampler.h"
#include "chorus/data/transforms.h"

namespace chorus::data {

// More worker threads than this is a mistake, not a configuration.
inline constexpr int kMaxWorkers = 256;

struct DataLoaderOptions {
  int64_t batch_size = 64;
  int num_workers = 0;           // 0: batches are built inside next()
  int prefetch_batches = 2;      // per worker, as PyTorch's prefetch_factor
  bool drop_last = false;        // drop a last batch smaller than batch_size
  uint64_t seed = 0;             // keys the transforms' randomness
  std::optional<Device> device;  // where next() delivers batches; host when empty
};

class DataLoader {
 public:
  // `sampler` null means SequentialSampler over the whole dataset. Throws
  // ValueError for batch_size <= 0, num_workers outside [0, kMaxWorkers],
  // prefetch_batches < 1, or transforms that do not fit the dataset's image
  // shape; Error when a worker thread cannot be started (the others are
  // stopped first).
  DataLoader(std::shared_ptr<const Dataset> dataset, std::shared_ptr<const Sampler> sampler,
             DataLoaderOptions options, std::vector<std::shared_ptr<const Transform>> transforms = {});
  ~DataLoader();
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  // Batches per epoch.
  int64_t num_batches() const;
  // Shape of one image after the transforms, [C, H, W].
  const Shape& image_shape() const { return image_shape_; }
  const Dataset& dataset() const { return *dataset_; }
  const DataLoaderOptions& options() const { return options_; }

  // Begins epoch `epoch` at batch `first_batch` (0 <= first_batch <=
  // num_batches(), to resume mid-epoch), abandoning any epoch in progress.
  void start_epoch(int64_t epoch, int64_t first_batch = 0);
  // The next batch of the epoch into *out; false once the epoch is done.
  // Call from one thread at a time.
  bool next(Batch* out);

 private:
  struct Result {
    Batch batch;
    std::exception_ptr error;
  };

  Batch build_batch(const std::vector<int64_t>& indices, int64_t epoch, int64_t k) const;
  void worker_loop();
  void stop_workers();
  bool claimable() const;  // under mu_

  std::shared_ptr<const Dataset> dataset_;
  std::shared_ptr<const Sampler> sampler_;
  DataLoaderOptions options_;
  Compose transform_;
  Shape image_shape_;

  // Epoch state, guarded by mu_. `generation_` changes with every
  // start_epoch so that workers drop batches of an abandoned epoch.
  std::mutex mu_;
  std::condition_variable work_cv_;   // workers: a batch can be claimed, or stop
  std::condition_variable ready_cv_;  // next(): a batch has been finished
  bool stop_ = false;
  bool started_ = false;
  uint64_t generation_ = 0;
  int64_t epoch_ = 0;
  int64_t end_ = 0;           // batches in this epoch
  int64_t next_claim_ = 0;    // next batch number a worker takes
  int64_t next_deliver_ = 0;  // next batch number next() returns
  std::shared_ptr<const std::vector<int64_t>> indices_;
  std::map<int64_t, Result> ready_;
  std::vector<std::thread> workers_;
};

}  // namespace chorus::data
