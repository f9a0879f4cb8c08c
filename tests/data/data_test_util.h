// Helpers for the data tests: a temporary directory removed at scope exit,
// and writers for files in the formats the loaders read.
#pragma once

#include <zlib.h>

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "chorus/core/error.h"

// Address-space limits (run_with_memory_limit) cannot work beside a
// sanitizer's shadow memory; tests that need them skip under one.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define CHORUS_TEST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define CHORUS_TEST_SANITIZED 1
#endif
#endif

namespace chorus::data::testing {

class TempDir {
 public:
  TempDir() {
    static std::atomic<int> counter{0};
    path_ = std::filesystem::temp_directory_path() /
            ("chorus_data_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string str() const { return path_.string(); }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

inline void write_raw(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  if (!f) throw std::runtime_error("cannot write " + path);
}

inline void write_gz(const std::string& path, const std::vector<uint8_t>& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  if (!f) throw std::runtime_error("cannot write " + path);
  if (!bytes.empty()) gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size()));
  gzclose(f);
}

inline std::vector<uint8_t> read_raw(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

inline void put_be32(std::vector<uint8_t>& v, uint32_t x) {
  for (int s = 24; s >= 0; s -= 8) v.push_back(static_cast<uint8_t>(x >> s));
}

// An IDX unsigned-byte file: magic 0x0800 + dims.size(), the dims, payload.
inline std::vector<uint8_t> idx_bytes(const std::vector<uint32_t>& dims,
                                      const std::vector<uint8_t>& payload) {
  std::vector<uint8_t> v;
  put_be32(v, 0x0800u + static_cast<uint32_t>(dims.size()));
  for (uint32_t d : dims) put_be32(v, d);
  v.insert(v.end(), payload.begin(), payload.end());
  return v;
}

// Bytes that look random but are a fixed function of (i, salt).
inline uint8_t test_byte(uint64_t i, uint64_t salt) {
  uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ (salt * 0xBF58476D1CE4E5B9ull);
  x ^= x >> 31;
  x *= 0x94D049BB133111EBull;
  return static_cast<uint8_t>(x >> 40);
}

// Runs `body` in a child whose address space may grow by `extra_mib` MiB.
// Returns "ok", or the exception's type and message, or how the child died.
inline std::string run_with_memory_limit(size_t extra_mib, const std::function<void()>& body) {
  int fds[2];
  if (pipe(fds) != 0) return "pipe failed";
  const pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    size_t vm_pages = 0;
    std::ifstream("/proc/self/statm") >> vm_pages;
    const rlim_t limit = vm_pages * static_cast<rlim_t>(sysconf(_SC_PAGESIZE)) + (rlim_t(extra_mib) << 20);
    rlimit rl{limit, limit};
    setrlimit(RLIMIT_AS, &rl);
    std::string result = "ok";
    try {
      body();
    } catch (const OutOfMemoryError& e) {
      result = std::string("OutOfMemoryError: ") + e.what();
    } catch (const IOError& e) {
      result = std::string("IOError: ") + e.what();
    } catch (const ValueError& e) {
      result = std::string("ValueError: ") + e.what();
    } catch (const Error& e) {
      result = std::string("Error: ") + e.what();
    } catch (const std::exception& e) {
      result = std::string("other exception: ") + e.what();
    }
    (void)!write(fds[1], result.data(), result.size());
    _exit(0);
  }
  close(fds[1]);
  std::string result;
  char buf[4096];
  for (ssize_t n; (n = read(fds[0], buf, sizeof buf)) > 0;) result.append(buf, static_cast<size_t>(n));
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  if (WIFSIGNALED(status)) return "killed by signal " + std::to_string(WTERMSIG(status)) + "; " + result;
  return result;
}

}  // namespace chorus::data::testing
