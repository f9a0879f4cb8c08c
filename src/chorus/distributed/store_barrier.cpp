#include "chorus/distributed/store_barrier.h"

#include <vector>

#include "chorus/core/error.h"

namespace chorus::dist {

void store_barrier(Store& store, const std::string& name, int rank, int size, std::chrono::milliseconds timeout,
                   const std::string& what) {
  CHORUS_CHECK(size >= 1 && rank >= 0 && rank < size, "store_barrier: rank ", rank, " is out of range for ", size,
               " ranks");
  if (size == 1) return;
  const std::string base = "chorus/barrier/" + name + "/";
  auto keys_of = [&](const char* phase, int from) {
    std::vector<std::string> keys;
    for (int r = from; r < size; ++r) keys.push_back(base + phase + std::to_string(r));
    return keys;
  };
  const std::vector<std::string> arrived = keys_of("arrived/", 0), left = keys_of("left/", 1);
  try {
    store.set(arrived[static_cast<size_t>(rank)], std::string("1"));
    store.wait(arrived, timeout);
    if (rank != 0) {
      (void)store.add(left[static_cast<size_t>(rank - 1)], 1);  // answered: the server has it
    } else {
      store.wait(left, timeout);
    }
  } catch (const std::exception& e) {
    // Who is missing: those that never arrived, else those that never left.
    std::string missing, verb = "did not arrive";
    try {
      for (int r = 0; r < size; ++r)
        if (!store.check({arrived[static_cast<size_t>(r)]})) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      if (missing.empty() && rank == 0) {
        verb = "arrived but did not finish (died right after?)";
        for (int r = 1; r < size; ++r)
          if (!store.check({left[static_cast<size_t>(r - 1)]})) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      }
    } catch (const std::exception&) {
      CHORUS_THROW(DistError, what, ": the store is unreachable (rank 0, or the launcher hosting the store, has "
                                    "probably died); cause: ", e.what());
    }
    CHORUS_THROW(DistError, what, ": rank(s) ", missing.empty() ? std::string("?") : missing, " ", verb, " within ",
                 static_cast<double>(timeout.count()) / 1000.0,
                 " s (dead, or failed earlier: their own output says why); cause: ", e.what());
  }
}

}  // namespace chorus::dist
