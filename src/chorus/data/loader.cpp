#include "chorus/data/loader.h"

#include <algorithm>
#include <system_error>

#include "chorus/core/error.h"

namespace chorus::data {

DataLoader::DataLoader(std::shared_ptr<const Dataset> dataset, std::shared_ptr<const Sampler> sampler,
                       DataLoaderOptions options, std::vector<std::shared_ptr<const Transform>> transforms)
    : dataset_(std::move(dataset)),
      sampler_(std::move(sampler)),
      options_(std::move(options)),
      transform_(std::move(transforms)) {
  CHORUS_CHECK(dataset_ != nullptr, "DataLoader: dataset is null");
  CHORUS_CHECK(options_.batch_size > 0, "DataLoader: batch_size must be > 0, got ",
               options_.batch_size);
  CHORUS_CHECK(options_.num_workers >= 0, "DataLoader: num_workers must be >= 0, got ",
               options_.num_workers);
  CHORUS_CHECK(options_.num_workers <= kMaxWorkers, "DataLoader: num_workers must be at most ", kMaxWorkers,
               ", got ", options_.num_workers);
  CHORUS_CHECK(options_.prefetch_batches >= 1, "DataLoader: prefetch_batches must be >= 1, got ",
               options_.prefetch_batches);
  if (!sampler_) sampler_ = std::make_shared<SequentialSampler>(dataset_->size());
  image_shape_ = transform_.output_shape(dataset_->image_shape());
  if (options_.device) check_device(*options_.device);
  workers_.reserve(static_cast<size_t>(options_.num_workers));
  for (int i = 0; i < options_.num_workers; ++i) {
    try {
      workers_.emplace_back([this] { worker_loop(); });
    } catch (const std::system_error& e) {
      // A joinable std::thread must never be destroyed: stop the ones started.
      stop_workers();
      CHORUS_THROW(Error, "DataLoader: cannot start worker thread ", i + 1, " of ", options_.num_workers, ": ",
                   e.code().message(), " (a process or thread limit? use fewer workers)");
    }
  }
}

DataLoader::~DataLoader() { stop_workers(); }

void DataLoader::stop_workers() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (std::thread& t : workers_) t.join();
  workers_.clear();
}

int64_t DataLoader::num_batches() const {
  const int64_t n = sampler_->size(), b = options_.batch_size;
  return n / b + (!options_.drop_last && n % b != 0);  // not (n + b - 1) / b: b may be near INT64_MAX
}

void DataLoader::start_epoch(int64_t epoch, int64_t first_batch) {
  const int64_t batches = num_batches();
  CHORUS_CHECK(first_batch >= 0 && first_batch <= batches, "DataLoader::start_epoch: first_batch ",
               first_batch, " out of range [0, ", batches, "]");
  auto indices = std::make_shared<const std::vector<int64_t>>(sampler_->indices(epoch));
  CHORUS_CHECK(static_cast<int64_t>(indices->size()) == sampler_->size(),
               "DataLoader: the sampler returned ", indices->size(), " indices for epoch ", epoch,
               " but its size() is ", sampler_->size());
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++generation_;
    started_ = true;
    epoch_ = epoch;
    end_ = batches;
    next_claim_ = next_deliver_ = first_batch;
    indices_ = std::move(indices);
    ready_.clear();
  }
  work_cv_.notify_all();
}

bool DataLoader::claimable() const {
  const int64_t in_flight = static_cast<int64_t>(options_.num_workers) * options_.prefetch_batches;
  return next_claim_ < end_ && next_claim_ < next_deliver_ + in_flight;
}

void DataLoader::worker_loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    work_cv_.wait(lock, [this] { return stop_ || claimable(); });
    if (stop_) return;
    const int64_t k = next_claim_++;
    const uint64_t generation = generation_;
    const int64_t epoch = epoch_;
    std::shared_ptr<const std::vector<int64_t>> indices = indices_;
    lock.unlock();

    Result r;
    try {
      r.batch = build_batch(*indices, epoch, k);
    } catch (...) {
      r.error = std::current_exception();
    }

    lock.lock();
    if (generation == generation_) {
      ready_.emplace(k, std::move(r));
      ready_cv_.notify_all();
    }
  }
}

bool DataLoader::next(Batch* out) {
  CHORUS_CHECK(out != nullptr, "DataLoader::next: out is null");
  Result r;
  if (workers_.empty()) {
    CHORUS_CHECK(started_, "DataLoader::next: call start_epoch(epoch) first");
    if (next_deliver_ >= end_) return false;
    const int64_t k = next_deliver_++;
    try {
      r.batch = build_batch(*indices_, epoch_, k);
    } catch (...) {
      next_deliver_ = end_;  // the epoch ends at its first failure, as with workers
      throw;
    }
  } else {
    std::unique_lock<std::mutex> lock(mu_);
    CHORUS_CHECK(started_, "DataLoader::next: call start_epoch(epoch) first");
    if (next_deliver_ >= end_) return false;
    const int64_t k = next_deliver_;
    ready_cv_.wait(lock, [&] { return ready_.count(k) != 0; });
    auto it = ready_.find(k);
    r = std::move(it->second);
    ready_.erase(it);
    ++next_deliver_;
    if (r.error) {
      // Stop the epoch: nothing past a failed batch is delivered, and the
      // workers stop claiming.
      next_claim_ = next_deliver_ = end_;
      ready_.clear();
      ++generation_;
    }
    lock.unlock();
    work_cv_.notify_all();  // a prefetch slot is free
    if (r.error) std::rethrow_exception(r.error);
  }
  if (options_.device) {
    r.batch.images = r.batch.images.to(*options_.device);
    r.batch.labels = r.batch.labels.to(*options_.device);
  }
  *out = std::move(r.batch);
  return true;
}

Batch DataLoader::build_batch(const std::vector<int64_t>& indices, int64_t epoch, int64_t k) const {
  const int64_t n = static_cast<int64_t>(indices.size());
  const int64_t begin = k * options_.batch_size;
  const int64_t count = std::min(options_.batch_size, n - begin);
  const int64_t image_numel = numel_of(image_shape_);
  const Shape source_shape = dataset_->image_shape();

  Batch b;
  Shape shape{count};
  shape.insert(shape.end(), image_shape_.begin(), image_shape_.end());
  b.images = chorus::detail::empty_tensor(shape, kFloat32, cpu_device());
  b.labels = chorus::detail::empty_tensor({count}, kInt64, cpu_device());
  float* images = b.images.data<float>();
  int64_t* labels = b.labels.data<int64_t>();

  // Without transforms the dataset writes straight into the batch.
  std::vector<float> source(transform_.empty() ? 0 : static_cast<size_t>(numel_of(source_shape)));
  for (int64_t i = 0; i < count; ++i) {
    const int64_t index = indices[begin + i];
    CHORUS_CHECK(index >= 0 && index < dataset_->size(), "DataLoader: sampler position ", begin + i,
                 " of epoch ", epoch, " gave index ", index, ", outside ", dataset_->name(),
                 " of size ", dataset_->size());
    float* dst = images + i * image_numel;
    if (transform_.empty()) {
      dataset_->get(index, dst, &labels[i]);
    } else {
      dataset_->get(index, source.data(), &labels[i]);
      transform_.apply(source.data(), source_shape, dst,
                       RandomKey{options_.seed, epoch, index, 0});
    }
  }
  return b;
}

}  // namespace chorus::data
