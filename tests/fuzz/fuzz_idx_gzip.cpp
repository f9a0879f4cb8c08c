// IDX files through gzip. The first byte picks how the rest becomes the
// file: 0, the rest gzip-compressed (a valid stream: fuzzes the IDX parser
// behind zlib); 1, the rest after a gzip member header (fuzzes zlib's error
// paths: corrupt and cut streams); otherwise, the rest compressed and then
// cut or with bytes flipped where the first byte says.
#include <zlib.h>

#include <string>

#include "chorus/core/error.h"
#include "chorus/data/mnist.h"
#include "fuzz/fuzz_util.h"

namespace {

std::string gzip(const uint8_t* data, size_t size) {
  z_stream z{};
  deflateInit2(&z, Z_BEST_SPEED, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY);
  std::string out(deflateBound(&z, size), '\0');
  z.next_in = const_cast<Bytef*>(data);
  z.avail_in = static_cast<uInt>(size);
  z.next_out = reinterpret_cast<Bytef*>(out.data());
  z.avail_out = static_cast<uInt>(out.size());
  deflate(&z, Z_FINISH);
  out.resize(z.total_out);
  deflateEnd(&z);
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t mode = data[0];
  std::string file;
  if (mode == 1) {
    file = std::string("\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03", 10) + std::string(reinterpret_cast<const char*>(data + 1), size - 1);
  } else {
    file = gzip(data + 1, size - 1);
    if (mode >= 2 && !file.empty()) {
      const size_t at = (mode * 7u) % file.size();
      if (mode & 1) file.resize(at);
      else file[at] = static_cast<char>(file[at] ^ mode);
    }
  }
  const std::string path =
      chorus::fuzz::write_scratch("images-idx-ubyte.gz", reinterpret_cast<const uint8_t*>(file.data()), file.size());
  for (int ndim : {1, 3}) {
    try {
      chorus::data::read_idx_ubyte(path, ndim);
    } catch (const chorus::Error&) {
    }
  }
  return 0;
}
