#include "chorus/io/dir_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "chorus/core/error.h"

namespace chorus::io {

namespace {
constexpr const char* kLockFile = "lock";

// The holder's line as it wrote it (at most a few hundred bytes).
std::string read_holder(int fd) {
  char buf[512];
  ssize_t n = ::pread(fd, buf, sizeof(buf) - 1, 0);
  if (n <= 0) return "";
  std::string s(buf, static_cast<size_t>(n));
  while (!s.empty() && (s.back() == '\n' || s.back() == '\0')) s.pop_back();
  for (char& c : s)
    if (c < 32 || c == 127) c = '?';  // a line for a terminal, whatever the file holds
  return s;
}
}  // namespace

std::string lock_holder_line() {
  char host[256] = {};
  if (::gethostname(host, sizeof(host) - 1) != 0) std::strcpy(host, "unknown");
  return std::string("host ") + host + ", pid " + std::to_string(::getpid());
}

CheckpointDirLock::CheckpointDirLock(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) CHORUS_THROW(IOError, dir, ": cannot create the checkpoint directory: ", ec.message());
  path_ = (std::filesystem::path(dir) / kLockFile).string();
  fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) CHORUS_THROW(IOError, path_, ": cannot open the checkpoint directory's lock file: ", std::strerror(errno));
  int rc;
  do rc = ::flock(fd_, LOCK_EX | LOCK_NB);
  while (rc != 0 && errno == EINTR);
  if (rc != 0) {
    const int err = errno;
    const std::string holder = err == EWOULDBLOCK ? read_holder(fd_) : "";
    ::close(fd_);
    fd_ = -1;
    if (err == EWOULDBLOCK)
      CHORUS_THROW(IOError, dir, ": the checkpoint directory is in use by another job (",
                   holder.empty() ? "it has not written its host and pid yet" : holder,
                   "); two jobs on one directory would prune each other's checkpoints. Wait for it to end, stop "
                   "it, or use another --checkpoint-dir");
    CHORUS_THROW(IOError, path_, ": cannot lock the checkpoint directory: ", std::strerror(err));
  }
  const std::string line = lock_holder_line() + "\n";
  if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, line.data(), line.size(), 0) != static_cast<ssize_t>(line.size())) {
    const int err = errno;
    ::close(fd_);
    fd_ = -1;
    CHORUS_THROW(IOError, path_, ": cannot write the lock holder: ", std::strerror(err));
  }
}

CheckpointDirLock::~CheckpointDirLock() {
  if (fd_ < 0) return;
  // Emptied first: a reader that finds the file unlocked finds no stale name in it.
  [[maybe_unused]] const int rc = ::ftruncate(fd_, 0);
  ::close(fd_);  // releases the lock
}

}  // namespace chorus::io
