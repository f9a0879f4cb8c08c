#include "chorus/io/file_util.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "chorus/core/error.h"

namespace chorus::io::detail {

namespace {
std::string errno_text() { return std::strerror(errno); }

std::string parent_dir(const std::string& path) {
  std::filesystem::path p = std::filesystem::path(path).parent_path();
  return p.empty() ? "." : p.string();
}
}  // namespace

std::string unique_suffix() {
  static std::atomic<uint64_t> counter{0};
  return std::to_string(::getpid()) + "-" + std::to_string(counter++);
}

AtomicFile::AtomicFile(std::string path) : path_(std::move(path)) {
  tmp_path_ = path_ + ".tmp-" + unique_suffix();
  fd_ = ::open(tmp_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) CHORUS_THROW(IOError, path_, ": cannot create ", tmp_path_, " for writing: ", errno_text());
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(tmp_path_.c_str());
}

void AtomicFile::write(const void* data, size_t nbytes) {
  const char* p = static_cast<const char*>(data);
  while (nbytes > 0) {
    ssize_t n = ::write(fd_, p, nbytes);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EFBIG) {
      // Past the process's file size limit (ulimit -f), with SIGXFSZ ignored
      // as chorus does (Note [File size limit] in apps/cli.cpp).
      rlimit lim{};
      const bool limited = ::getrlimit(RLIMIT_FSIZE, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY;
      CHORUS_THROW(IOError, path_, ": write failed at byte ", written_, ": ", errno_text(),
                   limited ? " (the file size limit, ulimit -f, is " + std::to_string(lim.rlim_cur) + " bytes)" : "",
                   "; the file was not written and what was there before is unchanged");
    }
    if (n <= 0)
      CHORUS_THROW(IOError, path_, ": write failed at byte ", written_, ": ", n < 0 ? errno_text() : "no progress");
    p += n;
    nbytes -= static_cast<size_t>(n);
    written_ += static_cast<uint64_t>(n);
  }
}

void AtomicFile::commit() {
  // The data must be on disk before the rename makes it visible, or a crash
  // could leave the final name pointing at an empty file.
  if (::fsync(fd_) != 0) CHORUS_THROW(IOError, path_, ": fsync failed: ", errno_text());
  int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) CHORUS_THROW(IOError, path_, ": close failed: ", errno_text());
  rename_path(tmp_path_, path_);
  committed_ = true;
  fsync_directory(parent_dir(path_));
}

void write_file_atomically(const std::string& path, const std::string& contents) {
  AtomicFile f(path);
  f.write(contents.data(), contents.size());
  f.commit();
}

void fsync_directory(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) CHORUS_THROW(IOError, dir, ": cannot open directory to fsync it: ", errno_text());
  int rc = ::fsync(fd);
  int err = errno;
  ::close(fd);
  if (rc != 0) CHORUS_THROW(IOError, dir, ": fsync of directory failed: ", std::strerror(err));
}

std::string remove_directory_atomically(const std::string& path, const std::string& prefix) {
  namespace fs = std::filesystem;
  const fs::path p(path);
  const fs::path aside = p.parent_path() / (prefix + p.filename().string() + "-" + unique_suffix());
  if (std::rename(path.c_str(), aside.c_str()) != 0) return "cannot move " + path + " aside: " + errno_text();
  std::error_code ec;
  if (fs::remove_all(aside, ec) == static_cast<std::uintmax_t>(-1))
    return "cannot remove " + aside.string() + ": " + ec.message();
  return "";
}

void rename_path(const std::string& from, const std::string& to) {
  if (std::rename(from.c_str(), to.c_str()) != 0)
    CHORUS_THROW(IOError, to, ": cannot rename ", from, " to it: ", errno_text());
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) CHORUS_THROW(IOError, path, ": cannot open for reading: ", errno_text());
  std::ostringstream os;
  os << in.rdbuf();
  if (in.bad()) CHORUS_THROW(IOError, path, ": read failed: ", errno_text());
  return os.str();
}

}  // namespace chorus::io::detail
