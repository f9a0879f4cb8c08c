// TensorBoardWriter: scalars in TensorBoard's event-file format, written by a
// small hand encoder (no protobuf library).
//
// Design note: an event file is a TFRecord stream, each record
//   uint64 length (little-endian) | uint32 masked CRC32C of those 8 bytes |
//   data | uint32 masked CRC32C of data
// whose data is one serialized `Event` protocol buffer:
//   Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
//   Summary { repeated Value value = 1; }
//   Value   { string tag = 1; float simple_value = 2; }
// The first record carries file_version "brain.Event:2"; every later one a
// Summary of one step's scalars. Those few fields are the whole format
// TensorBoard needs for scalars, so they are encoded here by hand (varints,
// fixed64 for the double, fixed32 for the float). Every record is flushed at
// once, so TensorBoard shows a run while it trains and a killed run keeps
// what it logged. The file is named events.out.tfevents.<unix seconds>.<host>
// as TensorFlow names it (TensorBoard reads files whose name contains
// "tfevents"); one directory is one run in TensorBoard's list.
#pragma once

#include <cstddef>
#include <cstdint>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

namespace chorus::io {

// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), as TFRecord uses.
uint32_t crc32c(const void* data, size_t n);
// TFRecord's masked form: ((crc >> 15) | (crc << 17)) + 0xa282ead8.
uint32_t masked_crc32c(const void* data, size_t n);

class TensorBoardWriter {
 public:
  // Creates `run_dir` (and its parents) and a new event file in it; IOError
  // naming the path when it cannot.
  explicit TensorBoardWriter(const std::string& run_dir);

  // One Event at `step` holding every (tag, value) pair; wall_time is now.
  // Values are stored as float32 (TensorBoard's simple_value).
  void add_scalars(int64_t step, const std::vector<std::pair<std::string, double>>& scalars);

  const std::string& path() const { return path_; }

 private:
  void write_record(const std::string& event);

  std::string path_;
  std::ofstream out_;
};

}  // namespace chorus::io
