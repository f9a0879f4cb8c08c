// Whole-file reads for the dataset loaders, gzip or raw.
//
// zlib's gzread reads a file that is not gzip-compressed as it is
// ("transparent" mode), so one path serves `train-images-idx3-ubyte` and
// `train-images-idx3-ubyte.gz` alike. Data sets are read once, at start-up,
// into memory; the callers then parse from a buffer and can name the exact
// byte offset where a file goes wrong.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace chorus::data::detail {

bool file_exists(const std::string& path);

// The file's contents, decompressed if it is gzip. Throws IOError naming the
// file: cannot open, read error, or corrupt / truncated gzip data (with the
// number of bytes decompressed before the fault and zlib's own message).
std::vector<uint8_t> read_file(const std::string& path);

// Big-endian 32-bit integer at `p` (IDX headers).
inline uint32_t read_be32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

}  // namespace chorus::data::detail
