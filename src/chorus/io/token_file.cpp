#include "chorus/io/token_file.h"

#include <cstring>

#include "chorus/core/error.h"
#include "chorus/io/file_util.h"

namespace chorus::io {

// llm.c's header (data/tokens.h reads it; io/ may not use data/).
constexpr int32_t kTokenFileMagic = 20240520;
constexpr int64_t kTokenFileHeaderInts = 256;

void write_token_file(const std::string& path, const std::vector<int64_t>& ids) {
  std::string out(static_cast<size_t>(kTokenFileHeaderInts) * 4 + ids.size() * 2, '\0');
  int32_t header[kTokenFileHeaderInts] = {};
  header[0] = kTokenFileMagic;
  header[1] = 1;
  CHORUS_CHECK(ids.size() <= static_cast<size_t>(INT32_MAX), "token file '", path, "': ", ids.size(),
               " tokens do not fit llm.c's header (at most ", INT32_MAX, ")");
  header[2] = static_cast<int32_t>(ids.size());
  std::memcpy(out.data(), header, sizeof(header));
  for (size_t i = 0; i < ids.size(); ++i) {
    CHORUS_CHECK(ids[i] >= 0 && ids[i] <= 65535, "token file '", path, "': id ", ids[i], " at position ", i,
                 " does not fit 16 bits");
    const uint16_t v = static_cast<uint16_t>(ids[i]);
    std::memcpy(out.data() + sizeof(header) + 2 * i, &v, 2);
  }
  detail::write_file_atomically(path, out);
}

}  // namespace chorus::io
