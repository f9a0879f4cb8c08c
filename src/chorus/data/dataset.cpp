#include "chorus/data/dataset.h"

#include "chorus/core/error.h"

namespace chorus::data {

void Dataset::check_index(int64_t index) const {
  CHORUS_CHECK(index >= 0 && index < size(), name(), ": example index ", index,
               " out of range [0, ", size(), ")");
}

}  // namespace chorus::data
