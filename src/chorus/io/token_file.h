// Writing llm.c's token files (data/tokens.h reads them): `chorus tokenize`.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace chorus::io {

// Writes ids as a token file (int32 header[256] = {20240520, 1, count}, then
// uint16 ids), atomically: a reader never sees half of it. ValueError for an
// id that does not fit 16 bits or more tokens than the header can count.
void write_token_file(const std::string& path, const std::vector<int64_t>& ids);

}  // namespace chorus::io
