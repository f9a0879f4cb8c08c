// Support for the fuzz harnesses (tests/fuzz/fuzz_*.cpp): the parsers take
// paths, so each input is written to a scratch file first. Every harness
// accepts any chorus::Error (a refused input is the expected outcome) and
// lets anything else escape: a crash, a sanitizer report, or an exception
// of another type (std::bad_alloc, nlohmann's, std::out_of_range) is a bug.
#pragma once

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

namespace chorus::fuzz {

// A directory of this process's own, created once, removed at exit.
inline const std::filesystem::path& scratch_dir() {
  struct Dir {
    std::filesystem::path path;
    Dir() : path(std::filesystem::temp_directory_path() / ("chorus-fuzz-" + std::to_string(::getpid()))) {
      std::filesystem::create_directories(path);
    }
    ~Dir() {
      std::error_code ec;
      std::filesystem::remove_all(path, ec);
    }
  };
  static Dir dir;
  return dir.path;
}

inline std::string write_scratch(const std::string& name, const uint8_t* data, size_t size) {
  const std::string path = (scratch_dir() / name).string();
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(reinterpret_cast<const char*>(data),
                                                                 static_cast<std::streamsize>(size));
  return path;
}

}  // namespace chorus::fuzz
