// CIFAR-10 binary reading: small batch files written here read back exactly,
// from the directory itself or its cifar-10-batches-bin/ folder; malformed
// files give an IOError naming the file.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "chorus/core/error.h"
#include "chorus/data/cifar.h"
#include "data/data_test_util.h"

namespace chorus::data {
namespace {

using testing::TempDir;
using testing::test_byte;

// `records` records whose label and pixels are a function of (file, record).
std::vector<uint8_t> cifar_file(int file, int records) {
  std::vector<uint8_t> v;
  for (int r = 0; r < records; ++r) {
    v.push_back(static_cast<uint8_t>((file * 7 + r) % 10));
    for (int p = 0; p < 3072; ++p) v.push_back(test_byte(p, file * 1000 + r));
  }
  return v;
}

// Records per training file in these tests (the real files hold 10000).
constexpr int kPerFile[5] = {3, 1, 2, 4, 2};

void write_cifar(const std::string& dir) {
  std::filesystem::create_directories(dir);
  for (int f = 1; f <= 5; ++f)
    testing::write_raw(dir + "/data_batch_" + std::to_string(f) + ".bin", cifar_file(f, kPerFile[f - 1]));
  testing::write_raw(dir + "/test_batch.bin", cifar_file(0, 3));
}

std::string load_error(const std::string& dir, bool train = true) {
  try {
    Cifar10Dataset d(dir, train);
  } catch (const IOError& e) {
    return e.what();
  }
  return "";
}

void expect_reads_back(const std::string& dir) {
  Cifar10Dataset train(dir, true), test(dir, false);
  EXPECT_EQ(train.size(), 12);
  EXPECT_EQ(test.size(), 3);
  EXPECT_EQ(train.image_shape(), (Shape{3, 32, 32}));
  EXPECT_EQ(train.num_classes(), 10);
  const float mean[3] = {0.4914f, 0.4822f, 0.4465f}, stdev[3] = {0.2470f, 0.2435f, 0.2616f};
  std::vector<float> image(3072);
  int64_t i = 0;
  for (int f = 1; f <= 5; ++f) {
    const std::vector<uint8_t> expected = cifar_file(f, kPerFile[f - 1]);
    for (int r = 0; r < kPerFile[f - 1]; ++r, ++i) {
      int64_t label = -1;
      train.get(i, image.data(), &label);
      const uint8_t* rec = &expected[r * 3073];
      EXPECT_EQ(label, rec[0]);
      EXPECT_EQ(train.label(i), rec[0]);
      for (int p = 0; p < 3072; ++p) {
        ASSERT_EQ(train.pixels(i)[p], rec[1 + p]);
        const int c = p / 1024;
        ASSERT_NEAR(image[p], (rec[1 + p] / 255.0 - mean[c]) / stdev[c], 1e-5)
            << "example " << i << " pixel " << p;
      }
    }
  }
  const std::vector<uint8_t> t = cifar_file(0, 3);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(test.label(r), t[r * 3073]);
    EXPECT_EQ(test.pixels(r)[3071], t[r * 3073 + 3072]);
  }
}

TEST(DataCifar, ReadsBackExactly) {
  TempDir dir;
  write_cifar(dir.str());
  expect_reads_back(dir.str());
}

TEST(DataCifar, FindsBatchesSubfolder) {
  TempDir dir;
  write_cifar(dir.file("cifar-10-batches-bin"));
  expect_reads_back(dir.str());
}

TEST(DataCifar, MissingDirectoryNamesBothPlaces) {
  TempDir dir;
  const std::string msg = load_error(dir.str());
  EXPECT_NE(msg.find("data_batch_1.bin"), std::string::npos) << msg;
  EXPECT_NE(msg.find(dir.file("cifar-10-batches-bin")), std::string::npos) << msg;
  EXPECT_NE(msg.find("--data-dir"), std::string::npos) << msg;
}

TEST(DataCifar, MissingOneBatch) {
  TempDir dir;
  write_cifar(dir.str());
  std::filesystem::remove(dir.file("data_batch_4.bin"));
  const std::string msg = load_error(dir.str());
  EXPECT_NE(msg.find(dir.file("data_batch_4.bin")), std::string::npos) << msg;
  EXPECT_NE(msg.find("not found"), std::string::npos) << msg;
  EXPECT_EQ(load_error(dir.str(), false), "");  // the test split is complete
}

TEST(DataCifar, SizeNotAMultipleOfTheRecord) {
  TempDir dir;
  write_cifar(dir.str());
  std::vector<uint8_t> bytes = cifar_file(2, 2);
  bytes.resize(bytes.size() - 100);  // 6046 bytes
  testing::write_raw(dir.file("data_batch_2.bin"), bytes);
  const std::string msg = load_error(dir.str());
  EXPECT_NE(msg.find(dir.file("data_batch_2.bin")), std::string::npos) << msg;
  EXPECT_NE(msg.find("size 6046 bytes"), std::string::npos) << msg;
  EXPECT_NE(msg.find("3073-byte record"), std::string::npos) << msg;
  EXPECT_NE(msg.find("byte offset 3073"), std::string::npos) << msg;
}

TEST(DataCifar, EmptyFile) {
  TempDir dir;
  write_cifar(dir.str());
  testing::write_raw(dir.file("test_batch.bin"), {});
  const std::string msg = load_error(dir.str(), false);
  EXPECT_NE(msg.find(dir.file("test_batch.bin")), std::string::npos) << msg;
  EXPECT_NE(msg.find("size 0 bytes"), std::string::npos) << msg;
}

TEST(DataCifar, LabelAboveNine) {
  TempDir dir;
  write_cifar(dir.str());
  std::vector<uint8_t> bytes = cifar_file(3, 2);
  bytes[3073] = 10;
  testing::write_raw(dir.file("data_batch_3.bin"), bytes);
  const std::string msg = load_error(dir.str());
  EXPECT_NE(msg.find(dir.file("data_batch_3.bin")), std::string::npos) << msg;
  EXPECT_NE(msg.find("record 1 (byte offset 3073) has label 10"), std::string::npos) << msg;
}

}  // namespace
}  // namespace chorus::data
