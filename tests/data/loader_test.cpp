// DataLoader: batches hold exactly the sampler's examples (checked against
// the dataset read directly), the same with 0, 1 and 3 workers, resume
// mid-epoch reproduces the uninterrupted run, worker exceptions reach
// next(), and destruction mid-epoch returns promptly.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "chorus/core/error.h"
#include "chorus/data/loader.h"
#include "chorus/data/synthetic.h"
#include "data/data_test_util.h"

namespace chorus::data {
namespace {

std::shared_ptr<Dataset> small_synthetic(int64_t n = 103) {
  return make_synthetic({.size = n, .image_shape = {3, 8, 8}, .num_classes = 10, .seed = 17});
}

std::vector<std::shared_ptr<const Transform>> augmentation() {
  return {std::make_shared<RandomCrop>(8, 2), std::make_shared<RandomHorizontalFlip>()};
}

struct HostBatch {
  std::vector<float> images;
  std::vector<int64_t> labels;
  Shape shape;
  bool operator==(const HostBatch&) const = default;
};

HostBatch host(const Batch& b) {
  HostBatch h;
  h.shape = b.images.sizes();
  const float* x = b.images.data<float>();
  const int64_t* y = b.labels.data<int64_t>();
  h.images.assign(x, x + b.images.numel());
  h.labels.assign(y, y + b.labels.numel());
  return h;
}

std::vector<HostBatch> epoch(DataLoader& loader, int64_t e, int64_t first = 0) {
  loader.start_epoch(e, first);
  std::vector<HostBatch> out;
  Batch b;
  while (loader.next(&b)) out.push_back(host(b));
  return out;
}

TEST(DataLoader, BatchesHoldTheSamplersExamples) {
  auto ds = small_synthetic();
  auto sampler = std::make_shared<RandomSampler>(ds->size(), 5);
  DataLoader loader(ds, sampler, {.batch_size = 10, .num_workers = 2});
  EXPECT_EQ(loader.num_batches(), 11);
  const std::vector<HostBatch> batches = epoch(loader, 3);
  ASSERT_EQ(batches.size(), 11u);
  const std::vector<int64_t> order = sampler->indices(3);
  std::vector<float> image(192);
  for (size_t k = 0; k < batches.size(); ++k) {
    const int64_t count = k < 10 ? 10 : 3;
    ASSERT_EQ(batches[k].shape, (Shape{count, 3, 8, 8}));
    for (int64_t i = 0; i < count; ++i) {
      int64_t label;
      ds->get(order[k * 10 + i], image.data(), &label);
      EXPECT_EQ(batches[k].labels[i], label);
      EXPECT_EQ(0, std::memcmp(&batches[k].images[i * 192], image.data(), sizeof(float) * 192));
    }
  }
}

TEST(DataLoader, DropLast) {
  auto ds = small_synthetic();
  DataLoader loader(ds, nullptr, {.batch_size = 10, .drop_last = true});
  EXPECT_EQ(loader.num_batches(), 10);
  const std::vector<HostBatch> batches = epoch(loader, 0);
  ASSERT_EQ(batches.size(), 10u);
  EXPECT_EQ(batches.back().labels.front(), 90 % 10);  // sequential sampler by default
}

TEST(DataLoader, SameBatchesWhateverTheWorkerCount) {
  auto ds = small_synthetic();
  auto sampler = std::make_shared<RandomSampler>(ds->size(), 1);
  std::vector<std::vector<HostBatch>> runs;
  for (int workers : {0, 1, 3}) {
    DataLoader loader(ds, sampler, {.batch_size = 8, .num_workers = workers, .seed = 9}, augmentation());
    std::vector<HostBatch> all = epoch(loader, 0);
    std::vector<HostBatch> e1 = epoch(loader, 1);
    all.insert(all.end(), e1.begin(), e1.end());
    runs.push_back(std::move(all));
  }
  ASSERT_EQ(runs[0].size(), 2u * 13u);
  EXPECT_TRUE(runs[0] == runs[1]);
  EXPECT_TRUE(runs[0] == runs[2]);
  EXPECT_FALSE(runs[0][0] == runs[0][13]);  // epoch 1 is shuffled and augmented anew
}

TEST(DataLoader, AugmentationChangesImagesNotLabels) {
  auto ds = small_synthetic();
  DataLoader plain(ds, nullptr, {.batch_size = 16});
  DataLoader augmented(ds, nullptr, {.batch_size = 16, .num_workers = 2}, augmentation());
  const std::vector<HostBatch> a = epoch(plain, 0), b = epoch(augmented, 0);
  ASSERT_EQ(a.size(), b.size());
  for (size_t k = 0; k < a.size(); ++k) {
    EXPECT_EQ(a[k].labels, b[k].labels);
    EXPECT_EQ(a[k].shape, b[k].shape);
  }
  EXPECT_NE(a[0].images, b[0].images);
}

TEST(DataLoader, ResumeMidEpochIsExact) {
  auto ds = small_synthetic();
  auto sampler = std::make_shared<RandomSampler>(ds->size(), 2);
  const DataLoaderOptions o{.batch_size = 8, .num_workers = 2, .seed = 4};
  std::vector<HostBatch> full;
  {
    DataLoader loader(ds, sampler, o, augmentation());
    full = epoch(loader, 6);
  }
  // A fresh loader (as after a restart) resuming at batch 5 of epoch 6.
  DataLoader resumed(ds, sampler, o, augmentation());
  const std::vector<HostBatch> tail = epoch(resumed, 6, 5);
  ASSERT_EQ(tail.size(), full.size() - 5);
  for (size_t k = 0; k < tail.size(); ++k) EXPECT_TRUE(tail[k] == full[5 + k]) << "batch " << 5 + k;
  EXPECT_TRUE(epoch(resumed, 6, resumed.num_batches()).empty());
  EXPECT_THROW(resumed.start_epoch(6, resumed.num_batches() + 1), ValueError);
}

TEST(DataLoader, RestartingAnEpochMidwayStartsClean) {
  auto ds = small_synthetic();
  DataLoader loader(ds, nullptr, {.batch_size = 4, .num_workers = 3, .prefetch_batches = 1});
  const std::vector<HostBatch> reference = epoch(loader, 0);
  Batch b;
  loader.start_epoch(1);
  ASSERT_TRUE(loader.next(&b));
  ASSERT_TRUE(loader.next(&b));
  EXPECT_TRUE(epoch(loader, 0) == reference);
}

TEST(DataLoader, RejectsBadOptions) {
  auto ds = small_synthetic();
  EXPECT_THROW(DataLoader(ds, nullptr, {.batch_size = 0}), ValueError);
  EXPECT_THROW(DataLoader(ds, nullptr, {.batch_size = -3}), ValueError);
  EXPECT_THROW(DataLoader(ds, nullptr, {.num_workers = -1}), ValueError);
  EXPECT_THROW(DataLoader(ds, nullptr, {.prefetch_batches = 0}), ValueError);
  EXPECT_THROW(DataLoader(ds, nullptr, {}, {std::make_shared<RandomCrop>(20)}), ValueError);
  DataLoader loader(ds, nullptr, {});
  Batch b;
  EXPECT_THROW(loader.next(&b), ValueError);  // no start_epoch yet
}

// Issue 15: --batch-size 9223372036854775807 overflowed the batch count
// (signed overflow) and the run did 0 steps. One batch holds everything.
TEST(DataLoader, HugeBatchSizeIsOneBatch) {
  auto ds = small_synthetic(10);
  DataLoader loader(ds, nullptr, {.batch_size = INT64_MAX});
  EXPECT_EQ(loader.num_batches(), 1);
  auto batches = epoch(loader, 0);
  ASSERT_EQ(batches.size(), 1u);
  EXPECT_EQ(batches[0].labels.size(), 10u);
  DataLoader dropping(ds, nullptr, {.batch_size = INT64_MAX, .drop_last = true});
  EXPECT_EQ(dropping.num_batches(), 0);
}

// Issue 15: --workers 30000 (or 64 under `ulimit -u 40`) aborted with
// "terminate called without an active exception". Absurd counts are refused
// up front; a thread that cannot be created is a clear error, after the
// ones already started are stopped. The child process runs with too little
// address space for 64 thread stacks.
TEST(DataLoader, WorkerThatCannotStartIsAClearError) {
  auto ds = small_synthetic();
  try {
    DataLoader(ds, nullptr, {.num_workers = 30000});
    ADD_FAILURE() << "30000 workers accepted";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("num_workers must be at most 256, got 30000"), std::string::npos) << e.what();
  }
#ifdef CHORUS_TEST_SANITIZED
  GTEST_SKIP() << "address-space limits and sanitizer shadow memory do not mix";
#endif
  const std::string result = testing::run_with_memory_limit(48, [&] {
    DataLoader loader(ds, nullptr, {.num_workers = 64});
  });
  EXPECT_EQ(result.rfind("Error: DataLoader: cannot start worker thread ", 0), 0u) << result;
  EXPECT_NE(result.find(" of 64: Resource temporarily unavailable"), std::string::npos) << result;
}

TEST(DataLoader, SamplerIndexOutsideTheDataset) {
  auto ds = small_synthetic(10);
  DataLoader loader(ds, std::make_shared<SequentialSampler>(12), {.batch_size = 5});
  loader.start_epoch(0);
  Batch b;
  EXPECT_TRUE(loader.next(&b));  // indices 0-4
  EXPECT_TRUE(loader.next(&b));  // 5-9
  EXPECT_THROW(loader.next(&b), ValueError);  // 10, 11
  EXPECT_FALSE(loader.next(&b));  // the epoch ended at the failure
}

// Fails on one index; optionally slow, to keep workers busy.
class FaultyDataset : public Dataset {
 public:
  FaultyDataset(int64_t bad, std::chrono::microseconds delay) : bad_(bad), delay_(delay) {}
  int64_t size() const override { return 200; }
  Shape image_shape() const override { return {1, 2, 2}; }
  int64_t num_classes() const override { return 2; }
  std::string name() const override { return "faulty"; }
  void get(int64_t index, float* image, int64_t* label) const override {
    std::this_thread::sleep_for(delay_);
    if (index == bad_) CHORUS_THROW(IOError, "example ", index, " is unreadable");
    for (int i = 0; i < 4; ++i) image[i] = static_cast<float>(index);
    *label = index % 2;
  }

 private:
  int64_t bad_;
  std::chrono::microseconds delay_;
};

TEST(DataLoader, WorkerExceptionReachesNext) {
  for (int workers : {0, 1, 3}) {
    SCOPED_TRACE(workers);
    DataLoader loader(std::make_shared<FaultyDataset>(57, std::chrono::microseconds(0)), nullptr,
                      {.batch_size = 10, .num_workers = workers});
    loader.start_epoch(0);
    Batch b;
    for (int k = 0; k < 5; ++k) {
      ASSERT_TRUE(loader.next(&b));
      EXPECT_EQ(b.images.data<float>()[0], k * 10.0f);
    }
    try {
      loader.next(&b);
      ADD_FAILURE() << "expected the IOError of example 57";
    } catch (const IOError& e) {
      EXPECT_NE(std::string(e.what()).find("example 57 is unreadable"), std::string::npos) << e.what();
    }
    EXPECT_FALSE(loader.next(&b));
    // The loader is usable again from the next start_epoch.
    loader.start_epoch(1, 6);
    ASSERT_TRUE(loader.next(&b));
    EXPECT_EQ(b.images.data<float>()[0], 60.0f);
  }
}

TEST(DataLoader, DestructionMidEpochDoesNotHang) {
  auto ds = std::make_shared<FaultyDataset>(-1, std::chrono::microseconds(500));
  const auto start = std::chrono::steady_clock::now();
  for (int round = 0; round < 3; ++round) {
    DataLoader loader(ds, nullptr, {.batch_size = 8, .num_workers = 3, .prefetch_batches = 2});
    loader.start_epoch(0);
    Batch b;
    ASSERT_TRUE(loader.next(&b));
  }  // workers are mid-batch here
  { DataLoader never_started(ds, nullptr, {.num_workers = 2}); }
  // Each destruction waits for at most one batch per worker (8 x 0.5 ms).
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}

TEST(DataLoader, MovesBatchesToTheRequestedDevice) {
  auto ds = small_synthetic();
  DataLoader loader(ds, nullptr, {.batch_size = 8, .device = cpu_device(1)});
  loader.start_epoch(0);
  Batch b;
  ASSERT_TRUE(loader.next(&b));
  EXPECT_EQ(b.images.device(), cpu_device(1));
  EXPECT_EQ(b.labels.device(), cpu_device(1));
  EXPECT_EQ(b.images.dtype(), kFloat32);
  EXPECT_EQ(b.labels.dtype(), kInt64);
}

}  // namespace
}  // namespace chorus::data
