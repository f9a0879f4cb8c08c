#include "chorus/data/file_reader.h"

#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "chorus/core/error.h"

namespace chorus::data::detail {

bool file_exists(const std::string& path) {
  std::error_code ec;
  return std::filesystem::is_regular_file(path, ec);
}

namespace {

// Closes the gzFile on every path out, exceptions included.
struct GzCloser {
  gzFile f;
  ~GzCloser() { gzclose(f); }
};

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

std::vector<uint8_t> read_file(const std::string& path) {
  errno = 0;
  gzFile f = gzopen(path.c_str(), "rb");
  if (f == nullptr)
    CHORUS_THROW(IOError, "cannot open ", path, ": ",
                 errno ? std::strerror(errno) : "out of memory in zlib");
  GzCloser closer{f};
  gzbuffer(f, 1 << 20);  // fewer syscalls than the 8 KiB default on 50 MB files
  const bool compressed = gzdirect(f) == 0;

  std::vector<uint8_t> out;
  for (;;) {
    // Reads grow geometrically (64 KiB, then the size so far, up to 1 GiB a
    // call: gzread takes an unsigned int), so small files stay cheap.
    const size_t at = out.size();
    const size_t chunk = std::clamp<size_t>(at, size_t{1} << 16, size_t{1} << 30);
    out.resize(at + chunk);
    const int n = gzread(f, out.data() + at, static_cast<unsigned>(chunk));
    if (n < 0) {
      out.resize(at);
      if (compressed)
        CHORUS_THROW(IOError, "corrupt gzip data in ", path, " after ", at,
                     " decompressed bytes: ", gz_message(f, path));
      CHORUS_THROW(IOError, "read error in ", path, " at byte offset ", at, ": ", gz_message(f, path));
    }
    out.resize(at + static_cast<size_t>(n));
    if (n == 0) break;
  }
  // A gzip stream cut short ends without an error from gzread on some zlib
  // versions; gzerror still says "unexpected end of file".
  int code = Z_OK;
  gzerror(f, &code);
  if (code != Z_OK && code != Z_STREAM_END)
    CHORUS_THROW(IOError, "corrupt gzip data in ", path, " after ", out.size(),
                 " decompressed bytes: ", gz_message(f, path));
  out.shrink_to_fit();
  return out;
}

}  // namespace chorus::data::detail
