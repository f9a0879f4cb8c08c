// TensorBoardWriter: CRC-32C against published check values, and the TFRecord
// framing of the file it writes (lengths and masked CRCs read back by hand).
// tests/apps/observability.sh decodes a training run's events in Python.
#include "chorus/io/tensorboard.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "chorus/core/error.h"
#include "io/io_test_util.h"

namespace chorus::io {
namespace {

using namespace testing;

// RFC 3720 (iSCSI) appendix B.4 and the usual "123456789" check value.
TEST(TensorBoardCrc32c, KnownVectors) {
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);
  EXPECT_EQ(crc32c("", 0), 0u);
  std::vector<unsigned char> zeros(32, 0), ones(32, 0xFF), up(32), down(32);
  for (int i = 0; i < 32; ++i) {
    up[i] = static_cast<unsigned char>(i);
    down[i] = static_cast<unsigned char>(31 - i);
  }
  EXPECT_EQ(crc32c(zeros.data(), 32), 0x8A9136AAu);
  EXPECT_EQ(crc32c(ones.data(), 32), 0x62A8AB43u);
  EXPECT_EQ(crc32c(up.data(), 32), 0x46DD794Eu);
  EXPECT_EQ(crc32c(down.data(), 32), 0x113FDB5Cu);
}

TEST(TensorBoardCrc32c, MaskIsTfRecords) {
  const uint32_t c = crc32c("123456789", 9);
  EXPECT_EQ(masked_crc32c("123456789", 9), ((c >> 15) | (c << 17)) + 0xa282ead8u);
}

uint64_t le64(const std::string& s, size_t at) {
  uint64_t v = 0;
  std::memcpy(&v, s.data() + at, 8);
  return v;
}
uint32_t le32(const std::string& s, size_t at) {
  uint32_t v = 0;
  std::memcpy(&v, s.data() + at, 4);
  return v;
}

TEST(TensorBoardWriter, RecordsAreFramedWithMaskedCrcs) {
  ScratchDir dir;
  std::string path;
  {
    TensorBoardWriter w(dir.file("runs/a"));
    path = w.path();
    w.add_scalars(7, {{"train/loss", 0.25}, {"train/lr", 0.05}});
    w.add_scalars(8, {});  // nothing to say: no record
  }
  EXPECT_NE(std::filesystem::path(path).filename().string().find("events.out.tfevents."), std::string::npos);
  const std::string bytes = read_bytes(path);
  size_t at = 0;
  int records = 0;
  while (at < bytes.size()) {
    ASSERT_LE(at + 12, bytes.size());
    const uint64_t n = le64(bytes, at);
    EXPECT_EQ(le32(bytes, at + 8), masked_crc32c(bytes.data() + at, 8));
    ASSERT_LE(at + 12 + n + 4, bytes.size());
    EXPECT_EQ(le32(bytes, at + 12 + n), masked_crc32c(bytes.data() + at + 12, n));
    if (records == 0) EXPECT_NE(bytes.substr(at + 12, n).find("brain.Event:2"), std::string::npos);
    if (records == 1) EXPECT_NE(bytes.substr(at + 12, n).find("train/loss"), std::string::npos);
    at += 12 + n + 4;
    ++records;
  }
  EXPECT_EQ(records, 2) << "the file version, then one event per step with scalars";
}

TEST(TensorBoardWriter, UnwritableDirectoryNamesIt) {
  ScratchDir dir;
  write_bytes(dir.file("plain"), "x");
  try {
    TensorBoardWriter w(dir.file("plain/run"));
    FAIL() << "expected IOError";
  } catch (const IOError& e) {
    EXPECT_NE(std::string(e.what()).find("plain/run"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace chorus::io
