// IDX / MNIST reading: small files written here (gzip and raw) read back
// exactly; every malformed file gives an IOError naming it; and the real
// Fashion-MNIST from Debian's dataset-fashion-mnist where it is installed.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "chorus/core/error.h"
#include "chorus/data/mnist.h"
#include "data/data_test_util.h"

namespace chorus::data {
namespace {

using testing::idx_bytes;
using testing::TempDir;
using testing::test_byte;

constexpr uint32_t kRows = 5, kCols = 4;

struct SmallSet {
  std::vector<uint8_t> pixels, labels;
};

SmallSet make_set(uint32_t n, uint64_t salt) {
  SmallSet s;
  for (uint32_t i = 0; i < n * kRows * kCols; ++i) s.pixels.push_back(test_byte(i, salt));
  for (uint32_t i = 0; i < n; ++i) s.labels.push_back(test_byte(i, salt + 1) % 10);
  return s;
}

// Writes one split ("train" or "t10k") of a small IDX data set.
void write_split(const TempDir& dir, const std::string& split, const SmallSet& s, bool gz) {
  const uint32_t n = static_cast<uint32_t>(s.labels.size());
  auto write = gz ? testing::write_gz : testing::write_raw;
  const std::string ext = gz ? ".gz" : "";
  write(dir.file(split + "-images-idx3-ubyte" + ext), idx_bytes({n, kRows, kCols}, s.pixels));
  write(dir.file(split + "-labels-idx1-ubyte" + ext), idx_bytes({n}, s.labels));
}

// The IOError message of loading `dir`'s training split ("" if none).
std::string load_error(const TempDir& dir) {
  try {
    MnistDataset d(dir.str(), true);
  } catch (const IOError& e) {
    return e.what();
  }
  return "";
}

void expect_reads_back(const TempDir& dir, bool train, const SmallSet& s) {
  MnistDataset d(dir.str(), train, Normalize::mnist());
  ASSERT_EQ(d.size(), static_cast<int64_t>(s.labels.size()));
  EXPECT_EQ(d.image_shape(), (Shape{1, kRows, kCols}));
  EXPECT_EQ(d.num_classes(), 10);
  std::vector<float> image(kRows * kCols);
  for (int64_t i = 0; i < d.size(); ++i) {
    int64_t label = -1;
    d.get(i, image.data(), &label);
    EXPECT_EQ(label, s.labels[i]);
    EXPECT_EQ(d.label(i), s.labels[i]);
    for (uint32_t p = 0; p < kRows * kCols; ++p) {
      const uint8_t raw = s.pixels[i * kRows * kCols + p];
      ASSERT_EQ(d.pixels(i)[p], raw);
      ASSERT_NEAR(image[p], (raw / 255.0 - 0.1307) / 0.3081, 1e-5) << "example " << i << " pixel " << p;
    }
  }
}

TEST(DataIdx, ReadsGzipAndRawExactly) {
  for (bool gz : {true, false}) {
    SCOPED_TRACE(gz ? "gzip" : "raw");
    TempDir dir;
    SmallSet train = make_set(7, 1), test = make_set(3, 2);
    write_split(dir, "train", train, gz);
    write_split(dir, "t10k", test, gz);
    expect_reads_back(dir, true, train);
    expect_reads_back(dir, false, test);
  }
}

TEST(DataIdx, DefaultNormalizationIsFashionMnist) {
  TempDir dir;
  SmallSet s = make_set(2, 3);
  write_split(dir, "train", s, true);
  auto d = load_mnist(dir.str(), true);
  std::vector<float> image(kRows * kCols);
  int64_t label;
  d->get(1, image.data(), &label);
  EXPECT_NEAR(image[3], (s.pixels[kRows * kCols + 3] / 255.0 - 0.2860) / 0.3530, 1e-5);
}

TEST(DataIdx, OutOfRangeIndexIsValueError) {
  TempDir dir;
  write_split(dir, "train", make_set(2, 4), false);
  MnistDataset d(dir.str(), true);
  std::vector<float> image(kRows * kCols);
  int64_t label;
  EXPECT_THROW(d.get(2, image.data(), &label), ValueError);
  EXPECT_THROW(d.get(-1, image.data(), &label), ValueError);
}

TEST(DataIdx, MissingFileNamesItAndTheFix) {
  TempDir dir;
  const std::string msg = load_error(dir);
  EXPECT_NE(msg.find(dir.file("train-images-idx3-ubyte")), std::string::npos) << msg;
  EXPECT_NE(msg.find("not found"), std::string::npos) << msg;
  EXPECT_NE(msg.find("dataset-fashion-mnist"), std::string::npos) << msg;
  EXPECT_NE(msg.find("--data-dir"), std::string::npos) << msg;
}

TEST(DataIdx, BadMagicNumber) {
  TempDir dir;
  SmallSet s = make_set(3, 5);
  write_split(dir, "train", s, false);
  std::vector<uint8_t> bytes = idx_bytes({3, kRows, kCols}, s.pixels);
  bytes[3] = 0x07;  // 2055
  testing::write_raw(dir.file("train-images-idx3-ubyte"), bytes);
  const std::string msg = load_error(dir);
  EXPECT_NE(msg.find(dir.file("train-images-idx3-ubyte")), std::string::npos) << msg;
  EXPECT_NE(msg.find("expected 2051"), std::string::npos) << msg;
  EXPECT_NE(msg.find("got 2055"), std::string::npos) << msg;
}

TEST(DataIdx, LabelsFileWithImagesMagic) {
  TempDir dir;
  SmallSet s = make_set(3, 6);
  write_split(dir, "train", s, true);
  testing::write_gz(dir.file("train-labels-idx1-ubyte.gz"), idx_bytes({3, kRows, kCols}, s.pixels));
  const std::string msg = load_error(dir);
  EXPECT_NE(msg.find("train-labels-idx1-ubyte.gz"), std::string::npos) << msg;
  EXPECT_NE(msg.find("expected 2049"), std::string::npos) << msg;
  EXPECT_NE(msg.find("got 2051"), std::string::npos) << msg;
}

TEST(DataIdx, TruncatedImageData) {
  for (bool gz : {true, false}) {
    SCOPED_TRACE(gz ? "gzip" : "raw");
    TempDir dir;
    SmallSet s = make_set(4, 7);
    write_split(dir, "train", s, gz);
    std::vector<uint8_t> bytes = idx_bytes({4, kRows, kCols}, s.pixels);
    bytes.resize(bytes.size() - 10);
    const std::string name = std::string("train-images-idx3-ubyte") + (gz ? ".gz" : "");
    (gz ? testing::write_gz : testing::write_raw)(dir.file(name), bytes);
    const std::string msg = load_error(dir);
    EXPECT_NE(msg.find(dir.file(name)), std::string::npos) << msg;
    EXPECT_NE(msg.find("expected 80 bytes of image data"), std::string::npos) << msg;
    EXPECT_NE(msg.find("got 70"), std::string::npos) << msg;
    EXPECT_NE(msg.find("byte offset 86"), std::string::npos) << msg;
  }
}

TEST(DataIdx, TruncatedHeader) {
  TempDir dir;
  write_split(dir, "train", make_set(2, 8), false);
  testing::write_raw(dir.file("train-images-idx3-ubyte"), {0, 0, 8, 3, 0, 0});
  const std::string msg = load_error(dir);
  EXPECT_NE(msg.find(dir.file("train-images-idx3-ubyte")), std::string::npos) << msg;
  EXPECT_NE(msg.find("truncated header"), std::string::npos) << msg;
}

TEST(DataIdx, ImageLabelCountMismatch) {
  TempDir dir;
  SmallSet s = make_set(5, 9);
  write_split(dir, "train", s, false);
  s.labels.pop_back();
  testing::write_raw(dir.file("train-labels-idx1-ubyte"), idx_bytes({4}, s.labels));
  const std::string msg = load_error(dir);
  EXPECT_NE(msg.find("count mismatch"), std::string::npos) << msg;
  EXPECT_NE(msg.find(dir.file("train-images-idx3-ubyte")), std::string::npos) << msg;
  EXPECT_NE(msg.find(dir.file("train-labels-idx1-ubyte")), std::string::npos) << msg;
  EXPECT_NE(msg.find("5 images"), std::string::npos) << msg;
  EXPECT_NE(msg.find("4 labels"), std::string::npos) << msg;
}

TEST(DataIdx, LabelOutOfRange) {
  TempDir dir;
  SmallSet s = make_set(5, 10);
  s.labels[3] = 12;
  write_split(dir, "train", s, false);
  const std::string msg = load_error(dir);
  EXPECT_NE(msg.find(dir.file("train-labels-idx1-ubyte")), std::string::npos) << msg;
  EXPECT_NE(msg.find("label 12 of example 3"), std::string::npos) << msg;
  EXPECT_NE(msg.find("byte offset 11"), std::string::npos) << msg;
}

TEST(DataIdx, CorruptGzip) {
  TempDir dir;
  SmallSet s = make_set(50, 11);
  write_split(dir, "train", s, true);
  const std::string path = dir.file("train-images-idx3-ubyte.gz");
  std::vector<uint8_t> gz = testing::read_raw(path);
  ASSERT_GT(gz.size(), 40u);
  for (size_t i = 12; i < gz.size() - 8; i += 3) gz[i] ^= 0x5a;  // the deflate stream
  testing::write_raw(path, gz);
  const std::string msg = load_error(dir);
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find("corrupt gzip"), std::string::npos) << msg;
}

TEST(DataIdx, CutGzipStream) {
  TempDir dir;
  SmallSet s = make_set(50, 12);
  write_split(dir, "train", s, true);
  const std::string path = dir.file("train-images-idx3-ubyte.gz");
  std::vector<uint8_t> gz = testing::read_raw(path);
  gz.resize(gz.size() / 2);
  testing::write_raw(path, gz);
  const std::string msg = load_error(dir);
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find("corrupt gzip"), std::string::npos) << msg;
}

// The published facts of Fashion-MNIST: 60000 + 10000 28x28 images, ten
// balanced classes (6000 / 1000 each), pixel mean 0.2860 and std 0.3530.
TEST(DataIdx, RealFashionMnist) {
  if (!std::filesystem::is_directory(kFashionMnistDir))
    GTEST_SKIP() << kFashionMnistDir << " not installed (Debian package dataset-fashion-mnist)";
  for (bool train : {true, false}) {
    SCOPED_TRACE(train ? "train" : "test");
    MnistDataset d(kFashionMnistDir, train);
    const int64_t n = train ? 60000 : 10000;
    ASSERT_EQ(d.size(), n);
    EXPECT_EQ(d.image_shape(), (Shape{1, 28, 28}));
    std::vector<int64_t> per_class(10, 0);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t label = d.label(i);
      ASSERT_TRUE(label >= 0 && label < 10) << "example " << i << " label " << label;
      ++per_class[label];
    }
    for (int64_t c = 0; c < 10; ++c) EXPECT_EQ(per_class[c], n / 10) << "class " << c;
    if (train) {
      double sum = 0, sum2 = 0;
      for (int64_t i = 0; i < n; ++i)
        for (int p = 0; p < 28 * 28; ++p) {
          const double x = d.pixels(i)[p] / 255.0;
          sum += x;
          sum2 += x * x;
        }
      const double count = static_cast<double>(n) * 28 * 28, mean = sum / count;
      EXPECT_NEAR(mean, 0.2860, 5e-4);
      EXPECT_NEAR(std::sqrt(sum2 / count - mean * mean), 0.3530, 5e-4);
    }
  }
}

}  // namespace
}  // namespace chorus::data
