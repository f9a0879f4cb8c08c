// File reads for the dataset loaders, gzip or raw.
//
// zlib's gzread reads a file that is not gzip-compressed as it is
// ("transparent" mode), so one path serves `train-images-idx3-ubyte` and
// `train-images-idx3-ubyte.gz` alike. Data sets are read once, at start-up,
// into memory; the callers then parse from a buffer and can name the exact
// byte offset where a file goes wrong.
//
// Design note [Bounded reads]: a small gzip file can expand without bound
// (18 MB of gzip is 4 GiB of zeros), so no read is open-ended: a format with
// a header (IDX) reads the header first and then exactly the bytes it
// promises, through FileReader; a headerless one (CIFAR-10) passes a maximum
// to read_file. Buffers grow as bytes arrive, never to a size a header
// claims, and a failed allocation is an OutOfMemoryError naming the file and
// the size.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace chorus::data::detail {

// True for a regular file (after symlinks), false when there is none. Throws
// IOError when the answer is unknowable (e.g. the directory cannot be
// searched: permission denied), so that is never reported as "not found".
bool file_exists(const std::string& path);

// A file opened for sequential reading, decompressed if it is gzip.
class FileReader {
 public:
  // Throws IOError naming the file when it cannot be opened.
  explicit FileReader(std::string path);
  ~FileReader();
  FileReader(const FileReader&) = delete;
  FileReader& operator=(const FileReader&) = delete;

  // Appends up to `n` bytes to *out, fewer only at the end of the file;
  // returns how many. Throws IOError (read error, corrupt or cut gzip data,
  // with the decompressed offset) or OutOfMemoryError naming the file.
  uint64_t read(uint64_t n, std::vector<uint8_t>* out);
  // True when there is nothing more to read.
  bool at_end();
  // Decompressed bytes read so far.
  uint64_t offset() const { return offset_; }
  bool compressed() const { return compressed_; }
  const std::string& path() const { return path_; }

 private:
  void check_stream_end();

  std::string path_;
  void* gz_ = nullptr;  // gzFile
  bool compressed_ = false;
  uint64_t offset_ = 0;
};

// The file's contents, decompressed if it is gzip, at most `max_bytes` of
// them: a longer file is an IOError naming it and the limit (`what_limit`
// says why there is one). Other errors as FileReader's.
std::vector<uint8_t> read_file(const std::string& path,
                               uint64_t max_bytes = std::numeric_limits<uint64_t>::max(),
                               const std::string& what_limit = "");

// Big-endian 32-bit integer at `p` (IDX headers).
inline uint32_t read_be32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

}  // namespace chorus::data::detail
