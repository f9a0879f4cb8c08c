// CIFAR-10 binary batches: the input is test_batch.bin.
#include "chorus/core/error.h"
#include "chorus/data/cifar.h"
#include "fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  chorus::fuzz::write_scratch("test_batch.bin", data, size);
  try {
    chorus::data::Cifar10Dataset d(chorus::fuzz::scratch_dir().string(), false);
    std::vector<float> image(3 * 32 * 32);
    int64_t label = -1;
    for (int64_t i = 0; i < d.size(); ++i) {
      d.get(i, image.data(), &label);
      if (label < 0 || label > 9) __builtin_trap();
    }
  } catch (const chorus::Error&) {
  }
  return 0;
}
