// The safetensors file format (https://github.com/huggingface/safetensors):
// what Python's `safetensors.torch.load_file` reads and `save_file` writes.
//
//   bytes [0, 8)        N, the header length, unsigned 64-bit little-endian
//   bytes [8, 8+N)      JSON: {"<name>": {"dtype": "F32", "shape": [2, 3],
//                              "data_offsets": [begin, end]}, ...,
//                              "__metadata__": {"<key>": "<value>"}}
//                       padded with spaces to a multiple of 8 bytes
//   bytes [8+N, EOF)    the data section: each tensor's raw little-endian,
//                       row-major bytes at [begin, end) relative to 8+N
//
// Design note: the reader trusts nothing. Every field is checked, the tensors
// must tile the data section exactly (no overlap, gap, truncation or trailing
// bytes: the same rules as the reference Rust reader), and each error is an
// IOError that names the file, the tensor and the byte range involved, so a
// truncated or corrupted checkpoint is diagnosed instead of loaded as garbage.
// The writer orders tensors by decreasing element size, which with the
// 8-byte-padded header keeps every tensor aligned to its element size, as the
// reference writer does.
#pragma once

#include <map>
#include <string>

#include "chorus/nn/module.h"

namespace chorus::io {

// Writes `tensors` (any device, any layout; copied to the host as needed) and
// string `metadata` to `path`, atomically (temporary file, fsync, rename).
// Throws ValueError for duplicate or reserved names, IOError for file errors.
void save_safetensors(const std::string& path, const nn::NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata = {});

// Reads every tensor (on cpu:0, in file order) and, if asked, the metadata.
// Throws IOError naming the file and what is wrong where.
nn::NamedTensors load_safetensors(const std::string& path,
                                  std::map<std::string, std::string>* metadata = nullptr);

// The format's dtype names ("F32", "BF16", ...) and back; the parse returns
// false for a name Chorus has no dtype for.
const char* safetensors_dtype_name(DType t);
bool parse_safetensors_dtype(const std::string& name, DType* out);

}  // namespace chorus::io
