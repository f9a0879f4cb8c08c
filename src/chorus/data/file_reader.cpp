#include "chorus/data/file_reader.h"

#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <new>

#include "chorus/core/error.h"

namespace chorus::data::detail {

bool file_exists(const std::string& path) {
  std::error_code ec;
  const auto st = std::filesystem::status(path, ec);
  if (ec && ec != std::errc::no_such_file_or_directory && ec != std::errc::not_a_directory)
    CHORUS_THROW(IOError, "cannot look for ", path, ": ", ec.message());
  return std::filesystem::is_regular_file(st);
}

namespace {

gzFile gz(void* f) { return static_cast<gzFile>(f); }

// zlib's own words, without the "<path>: " it puts in front (our messages
// name the file already).
std::string gz_message(gzFile f, const std::string& path) {
  int code = 0;
  const char* msg = gzerror(f, &code);
  if (code == Z_ERRNO) return std::strerror(errno);
  std::string m = msg ? msg : "unknown zlib error";
  if (m.starts_with(path + ": ")) m.erase(0, path.size() + 2);
  return m;
}

}  // namespace

FileReader::FileReader(std::string path) : path_(std::move(path)) {
  errno = 0;
  gzFile f = gzopen(path_.c_str(), "rb");
  if (f == nullptr)
    CHORUS_THROW(IOError, "cannot open ", path_, ": ", errno ? std::strerror(errno) : "out of memory in zlib");
  gz_ = f;
  gzbuffer(f, 1 << 20);  // fewer syscalls than the 8 KiB default on 50 MB files
  compressed_ = gzdirect(f) == 0;
}

FileReader::~FileReader() { gzclose(gz(gz_)); }

uint64_t FileReader::read(uint64_t n, std::vector<uint8_t>* out) {
  uint64_t got = 0;
  while (got < n) {
    // Reads grow geometrically (64 KiB, then the size so far, up to 1 GiB a
    // call: gzread takes an unsigned int), so small files stay cheap and the
    // buffer never runs far ahead of the bytes that really arrive.
    const size_t at = out->size();
    const uint64_t chunk = std::min<uint64_t>(n - got, std::clamp<uint64_t>(at, uint64_t{1} << 16, uint64_t{1} << 30));
    try {
      out->resize(at + chunk);
    } catch (const std::bad_alloc&) {
      out->resize(at);
      CHORUS_THROW(OutOfMemoryError, path_, ": out of memory growing the read buffer to ", at + chunk,
                   " bytes (", offset_ + got, " bytes read so far)");
    } catch (const std::length_error&) {
      CHORUS_THROW(OutOfMemoryError, path_, ": ", at + chunk, " bytes do not fit in memory");
    }
    const int r = gzread(gz(gz_), out->data() + at, static_cast<unsigned>(chunk));
    if (r < 0) {
      out->resize(at);
      if (compressed_)
        CHORUS_THROW(IOError, "corrupt gzip data in ", path_, " after ", offset_ + got,
                     " decompressed bytes: ", gz_message(gz(gz_), path_));
      CHORUS_THROW(IOError, "read error in ", path_, " at byte offset ", offset_ + got, ": ",
                   gz_message(gz(gz_), path_));
    }
    out->resize(at + static_cast<size_t>(r));
    got += static_cast<uint64_t>(r);
    if (r == 0) break;
  }
  offset_ += got;
  if (got < n) check_stream_end();
  return got;
}

bool FileReader::at_end() {
  std::vector<uint8_t> probe;
  if (read(1, &probe) == 0) return true;
  // Not at the end: the probe byte is counted, which callers that ask only
  // before giving up (read_file) do not mind.
  return false;
}

// A gzip stream cut short ends without an error from gzread on some zlib
// versions; gzerror still says "unexpected end of file".
void FileReader::check_stream_end() {
  int code = Z_OK;
  gzerror(gz(gz_), &code);
  if (code != Z_OK && code != Z_STREAM_END)
    CHORUS_THROW(IOError, "corrupt gzip data in ", path_, " after ", offset_,
                 " decompressed bytes: ", gz_message(gz(gz_), path_));
}

std::vector<uint8_t> read_file(const std::string& path, uint64_t max_bytes, const std::string& what_limit) {
  FileReader f(path);
  std::vector<uint8_t> out;
  f.read(max_bytes, &out);
  if (out.size() == max_bytes && !f.at_end())
    CHORUS_THROW(IOError, path, ": longer than ", max_bytes, " bytes",
                 f.compressed() ? " once decompressed" : "", what_limit.empty() ? "" : "; ", what_limit);
  out.shrink_to_fit();
  return out;
}

}  // namespace chorus::data::detail
