// safetensors: bitwise round trips for every dtype; the written bytes checked
// by an independent minimal reader (the format as Python's safetensors reads
// it); a file written byte by byte as Python writes it; and every kind of
// corruption refused with an IOError that names the file.
#include "chorus/io/safetensors.h"

#include <gtest/gtest.h>

#include <cstring>
#include <nlohmann/json.hpp>
#include <random>

#include "chorus/core/error.h"
#include "chorus/ops/factory.h"
#include "io/io_test_util.h"

namespace chorus::io {
namespace {

using namespace testing;
using json = nlohmann::json;

// A tensor of random bytes (any bit pattern, NaN payloads included: the
// round trip must be bitwise); bools get 0 or 1.
Tensor random_tensor(DType dt, const Shape& shape, uint32_t seed) {
  Tensor t = chorus::detail::empty_tensor(shape, dt, cpu_device(0));
  std::mt19937 gen(seed);
  auto* b = static_cast<uint8_t*>(t.raw_data());
  for (size_t i = 0; i < t.nbytes(); ++i) b[i] = dt == kBool ? gen() % 2 : static_cast<uint8_t>(gen());
  return t;
}

std::string bytes_of(const Tensor& t) {
  Tensor c = t.contiguous();
  return std::string(static_cast<const char*>(c.raw_data()), c.nbytes());
}

nn::NamedTensors every_dtype() {
  return {{"f32", random_tensor(kFloat32, {3, 5}, 1)},   {"bf16", random_tensor(kBFloat16, {7}, 2)},
          {"f16", random_tensor(kFloat16, {2, 2, 3}, 3)}, {"i64", random_tensor(kInt64, {4}, 4)},
          {"i32", random_tensor(kInt32, {3, 1}, 5)},      {"u8", random_tensor(kUInt8, {9}, 6)},
          {"bool", random_tensor(kBool, {5}, 7)},         {"f64", random_tensor(kFloat64, {2, 3}, 8)},
          {"scalar", random_tensor(kFloat32, {}, 9)},     {"empty", random_tensor(kFloat32, {0, 4}, 10)}};
}

const Tensor& find(const nn::NamedTensors& ts, const std::string& name) {
  for (auto& [n, t] : ts)
    if (n == name) return t;
  throw std::runtime_error("no tensor " + name);
}

TEST(Safetensors, RoundTripIsBitwiseForEveryDtype) {
  ScratchDir dir;
  const std::string path = dir.file("all.safetensors");
  nn::NamedTensors in = every_dtype();
  in.emplace_back("strided", random_tensor(kFloat32, {4, 6}, 11).t());  // saved as its values
  save_safetensors(path, in, {{"format", "pt"}, {"note", "with \"quotes\" and ünïcode"}});
  std::map<std::string, std::string> meta;
  nn::NamedTensors out = load_safetensors(path, &meta);
  ASSERT_EQ(out.size(), in.size());
  for (auto& [name, t] : in) {
    const Tensor& got = find(out, name);
    EXPECT_EQ(got.dtype(), t.dtype()) << name;
    EXPECT_EQ(got.sizes(), t.sizes()) << name;
    EXPECT_TRUE(got.device().is_cpu()) << name;
    EXPECT_EQ(bytes_of(got), bytes_of(t)) << name;
  }
  EXPECT_EQ(meta, (std::map<std::string, std::string>{{"format", "pt"}, {"note", "with \"quotes\" and ünïcode"}}));
  // The dtype names of the format.
  const std::map<std::string, std::string> want = {{"f32", "F32"}, {"bf16", "BF16"}, {"f16", "F16"}, {"i64", "I64"},
                                                   {"i32", "I32"}, {"u8", "U8"},     {"bool", "BOOL"}, {"f64", "F64"}};
  const std::string bytes = read_bytes(path);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  json header = json::parse(bytes.substr(8, n));
  for (auto& [name, code] : want) EXPECT_EQ(header[name]["dtype"], code) << name;
}

// An independent reader: only the format's definition, nlohmann and memcmp.
TEST(Safetensors, WrittenBytesFollowTheFormat) {
  ScratchDir dir;
  const std::string path = dir.file("fmt.safetensors");
  nn::NamedTensors in = every_dtype();
  save_safetensors(path, in, {{"k", "v"}});
  const std::string bytes = read_bytes(path);
  ASSERT_GE(bytes.size(), 8u);
  uint64_t n = 0;
  for (int b = 0; b < 8; ++b) n |= uint64_t(uint8_t(bytes[b])) << (8 * b);  // little-endian, whatever the host
  ASSERT_LE(8 + n, bytes.size());
  EXPECT_EQ(n % 8, 0u) << "header padded to a multiple of 8";
  const std::string text = bytes.substr(8, n);
  EXPECT_EQ(text.front(), '{');
  const size_t last = text.find_last_not_of(' ');
  EXPECT_EQ(text[last], '}') << "padding is spaces only";
  json header = json::parse(text);
  ASSERT_TRUE(header.is_object());
  EXPECT_EQ(header["__metadata__"], json({{"k", "v"}}));
  const uint64_t data_size = bytes.size() - 8 - n;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (auto& [name, t] : in) {
    ASSERT_TRUE(header.contains(name)) << name;
    const json& e = header[name];
    std::vector<int64_t> shape = e["shape"].get<std::vector<int64_t>>();
    EXPECT_EQ(Shape(shape.begin(), shape.end()), t.sizes()) << name;
    const uint64_t begin = e["data_offsets"][0], end = e["data_offsets"][1];
    ASSERT_EQ(end - begin, t.nbytes()) << name;
    ASSERT_LE(end, data_size) << name;
    if (t.nbytes()) EXPECT_EQ(begin % t.element_size(), 0u) << name << " is aligned to its element size";
    EXPECT_EQ(bytes.substr(8 + n + begin, end - begin), bytes_of(t)) << name;
    ranges.emplace_back(begin, end);
  }
  EXPECT_EQ(header.size(), in.size() + 1);
  // The tensors tile the data section: what the reference reader demands.
  std::sort(ranges.begin(), ranges.end());
  uint64_t covered = 0;
  for (auto [b, e] : ranges) {
    EXPECT_EQ(b, covered);
    covered = e;
  }
  EXPECT_EQ(covered, data_size);
}

// Bytes as `safetensors.torch.save_file({"a": torch.tensor([[1., 2.], [3., 4.]]),
// "b": torch.tensor([7], dtype=torch.int64)}, path, metadata={"format": "pt"})` lays them out.
TEST(Safetensors, ReadsAFileWrittenByPython) {
  ScratchDir dir;
  const std::string path = dir.file("python.safetensors");
  std::string text =
      R"({"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2,2],"data_offsets":[8,24]},)"
      R"("b":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}})";
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string bytes(8, '\0');
  for (int b = 0; b < 8; ++b) bytes[b] = char((text.size() >> (8 * b)) & 0xff);
  bytes += text;
  const int64_t seven = 7;
  bytes.append(reinterpret_cast<const char*>(&seven), 8);
  const float a[] = {1, 2, 3, 4};
  bytes.append(reinterpret_cast<const char*>(a), sizeof(a));
  write_bytes(path, bytes);

  std::map<std::string, std::string> meta;
  nn::NamedTensors out = load_safetensors(path, &meta);
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0].first, "b") << "file order";
  EXPECT_EQ(find(out, "b").dtype(), kInt64);
  EXPECT_EQ(*find(out, "b").data<int64_t>(), 7);
  EXPECT_EQ(find(out, "a").sizes(), (Shape{2, 2}));
  EXPECT_EQ(find(out, "a").to_vector<float>(), (std::vector<float>{1, 2, 3, 4}));
  EXPECT_EQ(meta.at("format"), "pt");
}

// ---- corruption ------------------------------------------------------------------

// A real checkpoint-like file to damage.
std::string write_model_file(const ScratchDir& dir, const std::string& name) {
  const std::string path = dir.file(name);
  save_safetensors(path,
                   {{"fc.weight", random_tensor(kFloat32, {16, 64}, 1)},
                    {"fc.bias", random_tensor(kFloat32, {16}, 2)},
                    {"steps", random_tensor(kInt64, {3}, 3)}},
                   {{"format", "pt"}});
  return path;
}

uint64_t header_length(const std::string& bytes) {
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  return n;
}

// A file with the given header text (padded) and `data_size` data bytes.
std::string raw_file(const ScratchDir& dir, const std::string& name, std::string header, size_t data_size) {
  header.append((8 - header.size() % 8) % 8, ' ');
  std::string bytes(8, '\0');
  for (int b = 0; b < 8; ++b) bytes[b] = char((header.size() >> (8 * b)) & 0xff);
  bytes += header + std::string(data_size, '\x01');
  write_bytes(dir.file(name), bytes);
  return dir.file(name);
}

TEST(Safetensors, TruncatedFilesAreRefusedNamingTheFile) {
  ScratchDir dir;
  const std::string good = write_model_file(dir, "checkpoint.safetensors");
  const std::string bytes = read_bytes(good);
  const uint64_t n = header_length(bytes);
  const std::string path = dir.file("cut.safetensors");
  for (size_t cut : {size_t(0), size_t(3), size_t(7), size_t(8), size_t(12), size_t(8 + n / 2), size_t(8 + n - 1),
                     size_t(8 + n), size_t(8 + n + 5), size_t(8 + n + 100), bytes.size() - 1}) {
    SCOPED_TRACE("cut at " + std::to_string(cut));
    write_bytes(path, bytes.substr(0, cut));
    expect_throw_with<IOError>([&] { load_safetensors(path); }, {path});
  }
  write_bytes(path, bytes.substr(0, 5));
  expect_throw_with<IOError>([&] { load_safetensors(path); }, {path, "file is 5 bytes, too short"});
  write_bytes(path, bytes.substr(0, 8 + n - 1));
  expect_throw_with<IOError>([&] { load_safetensors(path); }, {path, "runs past the end of the file"});
  // Cut inside the data: the message names the tensor and both sizes. fc.weight
  // is first (all tensors are 4- or 8-byte; I64 sorts first), so cut in it.
  write_bytes(path, bytes.substr(0, 8 + n + 1000));
  expect_throw_with<IOError>([&] { load_safetensors(path); },
                             {path, "tensor 'fc.weight' needs bytes [24, 4120) but the file's data section has 1000 bytes"});
}

TEST(Safetensors, TrailingBytesAreRefused) {
  ScratchDir dir;
  const std::string path = write_model_file(dir, "m.safetensors");
  write_bytes(path, read_bytes(path) + "junk");
  expect_throw_with<IOError>([&] { load_safetensors(path); }, {path, "4 trailing bytes"});
}

TEST(Safetensors, FlippedHeaderBytesNeverLoadGarbage) {
  ScratchDir dir;
  const std::string good = write_model_file(dir, "m.safetensors");
  const std::string bytes = read_bytes(good);
  const uint64_t n = header_length(bytes);
  const nn::NamedTensors want = load_safetensors(good);
  const std::string path = dir.file("flipped.safetensors");
  int refused = 0;
  for (size_t pos = 0; pos < 8 + n; ++pos) {
    for (uint8_t mask : {uint8_t(0x01), uint8_t(0x10), uint8_t(0x80)}) {
      std::string bad = bytes;
      bad[pos] = char(bad[pos] ^ mask);
      write_bytes(path, bad);
      try {
        // A flip that still parses (a letter of a name, padding) must load the same data.
        nn::NamedTensors got = load_safetensors(path);
        ASSERT_EQ(got.size(), want.size()) << "flip at " << pos;
        for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(bytes_of(got[i].second), bytes_of(want[i].second));
      } catch (const IOError& e) {
        ++refused;
        ASSERT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
      }
    }
  }
  EXPECT_GT(refused, int(n));  // most flips break something
}

TEST(Safetensors, HeaderErrorsAreNamedPrecisely) {
  ScratchDir dir;
  auto refuse = [&](const std::string& name, const std::string& header, size_t data,
                    std::initializer_list<std::string> needles) {
    SCOPED_TRACE(name);
    const std::string path = raw_file(dir, name, header, data);
    std::vector<std::string> all(needles);
    all.push_back(path);
    try {
      load_safetensors(path);
      ADD_FAILURE() << "accepted " << header;
    } catch (const IOError& e) {
      for (auto& needle : all)
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what() << " lacks " << needle;
    }
  };
  refuse("json.safetensors", R"({"a": {"dtype": "F32", "shape": [1], )", 4, {"is not valid JSON"});
  refuse("array.safetensors", R"([1, 2])", 0, {"expected an object"});
  refuse("dtype.safetensors", R"({"a":{"dtype":"F8_E4M3","shape":[2],"data_offsets":[0,2]}})", 2,
         {"tensor 'a' has unknown dtype \"F8_E4M3\""});
  refuse("range.safetensors", R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 8,
         {"tensor 'a' needs bytes [0, 16) but the file's data section has 8 bytes"});
  refuse("shape.safetensors", R"({"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,20]}})", 20,
         {"tensor 'a': shape [2, 3] of F32 needs 24 bytes but data_offsets [0, 20] span 20"});
  refuse("overlap.safetensors",
         R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
         16, {"tensors 'a' (bytes [0, 16)) and 'b' (bytes [8, 16)) overlap"});
  refuse("gap.safetensors",
         R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[12,20]}})",
         20, {"bytes [8, 12) of the data section belong to no tensor"});
  refuse("reversed.safetensors", R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", 8, {"end before they begin"});
  refuse("negative.safetensors", R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4, {"not a non-negative integer"});
  refuse("offsets.safetensors", R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0]}})", 4, {"\"data_offsets\" is [0]"});
  refuse("missing.safetensors", R"({"a":{"dtype":"F32","data_offsets":[0,4]}})", 4, {"tensor 'a': header entry has no \"shape\""});
  refuse("meta.safetensors", R"({"__metadata__":{"n":3}})", 0, {"metadata value \"n\" is JSON number"});
  refuse("bignum.safetensors", R"({"a":{"dtype":"F32","shape":[1)" + std::string(400, '0') + R"(],"data_offsets":[0,4]}})", 4,
         {"is not valid JSON"});
  refuse("huge.safetensors", R"({"a":{"dtype":"F64","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", 8,
         {"needs more than 2^64 bytes"});
}

// Issue 15: a header nesting 100,000 levels deep crashed the reader (the
// error message dumped the value recursively). Depth is bounded while parsing.
TEST(Safetensors, DeeplyNestedHeaderIsRefusedNotACrash) {
  ScratchDir dir;
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  const std::map<std::string, std::string> headers = {
      {"shape", R"({"a":{"dtype":"F32","shape":)" + deep + R"(,"data_offsets":[0,4]}})"},
      {"data_offsets", R"({"a":{"dtype":"F32","shape":[1],"data_offsets":)" + deep + "}}"},
      {"metadata", R"({"__metadata__":{"k":)" + deep + "}}"}};
  for (const auto& [field, header] : headers) {
    SCOPED_TRACE(field);
    const std::string path = raw_file(dir, field + ".safetensors", header, 4);
    expect_throw_with<IOError>([&] { load_safetensors(path); }, {path, "nests deeper than"});
  }
}

TEST(Safetensors, BoolBytesMustBeZeroOrOne) {
  ScratchDir dir;
  const std::string path = raw_file(dir, "b.safetensors", R"({"m":{"dtype":"BOOL","shape":[3],"data_offsets":[0,3]}})", 3);
  EXPECT_EQ(load_safetensors(path)[0].second.numel(), 3);  // 0x01 bytes are true
  std::string bytes = read_bytes(path);
  bytes[bytes.size() - 2] = 7;
  write_bytes(path, bytes);
  expect_throw_with<IOError>([&] { load_safetensors(path); }, {path, "tensor 'm' (BOOL) holds byte 7 at file offset"});
}

TEST(Safetensors, MissingFileAndBadNames) {
  ScratchDir dir;
  const std::string path = dir.file("nope.safetensors");
  expect_throw_with<IOError>([&] { load_safetensors(path); }, {path, "cannot open"});
  expect_throw_with<ValueError>([&] { save_safetensors(path, {{"a", zeros({1})}, {"a", zeros({2})}}); },
                                {"tensor name 'a' appears twice"});
  expect_throw_with<ValueError>([&] { save_safetensors(path, {{"__metadata__", zeros({1})}}); }, {"reserved"});
  EXPECT_FALSE(fs::exists(path)) << "a refused save writes nothing";
  expect_throw_with<IOError>([&] { save_safetensors(dir.file("no/such/dir/x.safetensors"), {{"a", zeros({1})}}); },
                             {"no/such/dir/x.safetensors"});
}

TEST(Safetensors, SavesGpuTensors_CUDA) {
  if (!cuda_is_available()) GTEST_SKIP() << "no CUDA device";
  ScratchDir dir;
  const std::string path = dir.file("gpu.safetensors");
  Tensor cpu = randn({64, 33});  // finite values: copy kernels need not preserve NaN payloads
  Tensor gpu = cpu.to(cuda_device(0));
  // A strided GPU view, saved as its values.
  save_safetensors(path, {{"w", gpu}, {"wt", gpu.t()}});
  nn::NamedTensors out = load_safetensors(path);
  EXPECT_EQ(bytes_of(find(out, "w")), bytes_of(cpu));
  EXPECT_EQ(bytes_of(find(out, "wt")), bytes_of(cpu.t()));
}

}  // namespace
}  // namespace chorus::io
