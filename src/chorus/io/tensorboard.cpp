#include "chorus/io/tensorboard.h"

#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "chorus/core/error.h"

namespace chorus::io {

namespace {

std::array<uint32_t, 256> make_crc_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    t[i] = c;
  }
  return t;
}

// Protocol-buffer wire format, the few pieces an Event needs.
void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out += static_cast<char>((v & 0x7F) | 0x80);
    v >>= 7;
  }
  out += static_cast<char>(v);
}
void put_key(std::string& out, int field, int wire_type) { put_varint(out, (uint64_t(field) << 3) | wire_type); }
template <typename T>
void put_fixed(std::string& out, T v) {  // little-endian, as the wire format wants
  unsigned char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  out.append(reinterpret_cast<const char*>(b), sizeof(T));
}
void put_bytes(std::string& out, int field, const std::string& bytes) {
  put_key(out, field, 2);
  put_varint(out, bytes.size());
  out += bytes;
}

double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// Event header: wall_time (1, fixed64 double) and step (2, varint int64).
std::string event_head(int64_t step) {
  std::string e;
  put_key(e, 1, 1);
  put_fixed(e, unix_seconds());
  put_key(e, 2, 0);
  put_varint(e, static_cast<uint64_t>(step));
  return e;
}

std::string host_name() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0 || !buf[0]) return "localhost";
  return buf;
}

}  // namespace

uint32_t crc32c(const void* data, size_t n) {
  static const std::array<uint32_t, 256> table = make_crc_table();
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) c = table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

uint32_t masked_crc32c(const void* data, size_t n) {
  const uint32_t c = crc32c(data, n);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

TensorBoardWriter::TensorBoardWriter(const std::string& run_dir) {
  std::error_code ec;
  std::filesystem::create_directories(run_dir, ec);
  if (ec) CHORUS_THROW(IOError, run_dir, ": cannot create the TensorBoard run directory: ", ec.message());
  const long long now = static_cast<long long>(unix_seconds());
  path_ = run_dir + "/events.out.tfevents." + std::to_string(now) + "." + host_name();
  // Two writers started in the same second on one host (ranks with
  // --tensorboard-all-ranks write to directories of their own; this is a
  // second job in the same run directory): keep both files.
  for (int k = 1; std::filesystem::exists(path_); ++k)
    path_ = run_dir + "/events.out.tfevents." + std::to_string(now) + "." + host_name() + "." + std::to_string(k);
  out_.open(path_, std::ios::binary | std::ios::trunc);
  if (!out_) CHORUS_THROW(IOError, path_, ": cannot open the TensorBoard event file for writing: ", std::strerror(errno));
  std::string e = event_head(0);
  put_bytes(e, 3, "brain.Event:2");
  write_record(e);
}

void TensorBoardWriter::add_scalars(int64_t step, const std::vector<std::pair<std::string, double>>& scalars) {
  if (scalars.empty()) return;
  std::string summary;
  for (const auto& [tag, v] : scalars) {
    std::string value;
    put_bytes(value, 1, tag);
    put_key(value, 2, 5);
    put_fixed(value, static_cast<float>(v));
    put_bytes(summary, 1, value);
  }
  std::string e = event_head(step);
  put_bytes(e, 5, summary);
  write_record(e);
}

void TensorBoardWriter::write_record(const std::string& event) {
  std::string rec;
  put_fixed(rec, static_cast<uint64_t>(event.size()));
  put_fixed(rec, masked_crc32c(rec.data(), 8));
  rec += event;
  put_fixed(rec, masked_crc32c(event.data(), event.size()));
  out_.write(rec.data(), static_cast<std::streamsize>(rec.size()));
  out_.flush();
  if (!out_) CHORUS_THROW(IOError, path_, ": writing the TensorBoard event file failed: ", std::strerror(errno));
}

}  // namespace chorus::io
