#include "chorus/data/cifar.h"

#include <new>

#include "chorus/core/error.h"
#include "chorus/data/file_reader.h"

namespace chorus::data {

namespace {

constexpr int64_t kPlane = 32 * 32;
constexpr uint64_t kMaxCifarFileBytes = 100000 * kCifarRecordBytes;

// `dir` itself when it holds the files, else its cifar-10-batches-bin/.
std::string locate(const std::string& dir, const std::string& first_file) {
  if (detail::file_exists(dir + "/" + first_file)) return dir;
  const std::string sub = dir + "/cifar-10-batches-bin";
  if (detail::file_exists(sub + "/" + first_file)) return sub;
  CHORUS_THROW(IOError, "CIFAR-10 file ", first_file, " not found in ", dir, " nor in ", sub,
               "; unpack the binary version (cifar-10-binary.tar.gz) there or pass --data-dir");
}

}  // namespace

Cifar10Dataset::Cifar10Dataset(const std::string& dir, bool train, Normalize normalize)
    : name_(std::string("cifar10 ") + (train ? "train" : "test") + " (" + dir + ")"),
      table_(normalize, 3, "cifar10 in " + dir) {
  std::vector<std::string> names;
  if (train) {
    for (int i = 1; i <= 5; ++i) names.push_back("data_batch_" + std::to_string(i) + ".bin");
  } else {
    names.push_back("test_batch.bin");
  }
  const std::string root = locate(dir, names[0]);

  for (const std::string& n : names) {
    const std::string path = root + "/" + n;
    if (!detail::file_exists(path))
      CHORUS_THROW(IOError, "CIFAR-10 file ", path, " not found (the other batches are in ", root,
                   "); the training set needs data_batch_1.bin .. data_batch_5.bin");
    // Note [Bounded reads]: a batch file holds 10000 records; 10x that is corruption (or a gzip bomb).
    std::vector<uint8_t> file = detail::read_file(path, kMaxCifarFileBytes,
                                                  "a CIFAR-10 batch file holds 10000 records of 3073 bytes");
    const int64_t bytes = static_cast<int64_t>(file.size());
    if (bytes == 0 || bytes % kCifarRecordBytes != 0)
      CHORUS_THROW(IOError, path, ": size ", bytes, " bytes is not a positive multiple of the ",
                   kCifarRecordBytes, "-byte record (1 label byte + 3072 pixel bytes); expected ",
                   10000 * kCifarRecordBytes, " bytes for 10000 records",
                   bytes > 0 ? "; a partial record starts at byte offset " +
                                   std::to_string(bytes - bytes % kCifarRecordBytes)
                             : std::string());
    for (int64_t r = 0; r < bytes / kCifarRecordBytes; ++r) {
      const int label = file[r * kCifarRecordBytes];
      if (label > 9)
        CHORUS_THROW(IOError, path, ": record ", r, " (byte offset ", r * kCifarRecordBytes,
                     ") has label ", label, "; CIFAR-10 labels are 0-9");
    }
    try {
      records_.insert(records_.end(), file.begin(), file.end());
    } catch (const std::bad_alloc&) {
      CHORUS_THROW(OutOfMemoryError, path, ": out of memory holding ", records_.size() + file.size(),
                   " bytes of CIFAR-10 records");
    }
  }
  count_ = static_cast<int64_t>(records_.size()) / kCifarRecordBytes;
}

const uint8_t* Cifar10Dataset::pixels(int64_t index) const {
  check_index(index);
  return records_.data() + index * kCifarRecordBytes + 1;
}

int64_t Cifar10Dataset::label(int64_t index) const {
  check_index(index);
  return records_[index * kCifarRecordBytes];
}

void Cifar10Dataset::get(int64_t index, float* image_out, int64_t* label_out) const {
  table_.convert(pixels(index), kPlane, image_out);
  *label_out = records_[index * kCifarRecordBytes];
}

std::shared_ptr<Dataset> load_cifar10(const std::string& dir, bool train, Normalize normalize) {
  return std::make_shared<Cifar10Dataset>(dir, train, std::move(normalize));
}

}  // namespace chorus::data
