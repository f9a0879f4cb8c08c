// Test support for io/: a scratch directory removed at the end of the test,
// raw file helpers, and a check that an exception names the file.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace chorus::io::testing {

namespace fs = std::filesystem;

class ScratchDir {
 public:
  ScratchDir() {
    static std::atomic<int> n{0};
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = fs::temp_directory_path() /
            ("chorus-io-" + std::to_string(::getpid()) + "-" + std::to_string(n++) + "-" + (info ? info->name() : "x"));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

inline std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

inline void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// Runs `f`, expecting exception E whose message contains every needle.
template <typename E, typename F>
std::string expect_throw_with(F&& f, std::initializer_list<std::string> needles) {
  try {
    f();
    ADD_FAILURE() << "expected an exception";
  } catch (const E& e) {
    for (const auto& needle : needles)
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
          << "message \"" << e.what() << "\" lacks \"" << needle << "\"";
    return e.what();
  }
  return "";
}

}  // namespace chorus::io::testing
