// The metrics CSV reader: `--metrics run.csv --resume` reads the header of
// an existing file (the input) and may rewrite the file with new columns.
#include "chorus/core/error.h"
#include "chorus/io/metrics.h"
#include "fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = chorus::fuzz::write_scratch("run.csv", data, size);
  try {
    chorus::io::MetricsWriter w(path, /*append=*/true);
    w.write({{"step", 1}, {"loss", 0.5}});
    w.write({{"epoch", 1}, {"test_loss", 0.25}, {"summary", {{"model", "cnn"}}}});
  } catch (const chorus::Error&) {
  }
  return 0;
}
