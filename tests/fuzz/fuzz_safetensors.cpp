// safetensors files: the input is the file.
#include "chorus/core/error.h"
#include "chorus/io/safetensors.h"
#include "fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = chorus::fuzz::write_scratch("model.safetensors", data, size);
  try {
    std::map<std::string, std::string> meta;
    chorus::nn::NamedTensors ts = chorus::io::load_safetensors(path, &meta);
    uint64_t bytes = 0;
    for (const auto& [name, t] : ts) bytes += t.nbytes();
    if (bytes > size) __builtin_trap();  // every tensor's bytes come from the file
  } catch (const chorus::Error&) {
  }
  return 0;
}
