// IDX files as read_idx_ubyte reads them, raw: the input is the file.
#include "chorus/core/error.h"
#include "chorus/data/mnist.h"
#include "fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = chorus::fuzz::write_scratch("images-idx-ubyte", data, size);
  for (int ndim : {1, 3}) {
    try {
      chorus::data::IdxArray a = chorus::data::read_idx_ubyte(path, ndim);
      uint64_t n = 1;
      for (int64_t d : a.dims) n *= static_cast<uint64_t>(d);
      if (a.bytes.size() != n) __builtin_trap();  // the payload is exactly what the header says
    } catch (const chorus::Error&) {
    }
  }
  return 0;
}
