// Durable, atomic file writes for checkpoints (POSIX).
//
// Design note: a checkpoint must never be seen half-written, even after a
// crash or power loss. Each file is written under a temporary name in the
// same directory, fsync'ed, then rename()d onto its final name (rename is
// atomic within one filesystem), and the directory is fsync'ed so that the
// rename itself survives. Readers therefore see the old file or the new one,
// never a mix. Every failure throws IOError naming the file and the errno text.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace chorus::io::detail {

class AtomicFile {
 public:
  // Creates "<path>.tmp-<pid>-<n>" for writing.
  explicit AtomicFile(std::string path);
  // Removes the temporary file unless commit() succeeded (never throws).
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  void write(const void* data, size_t nbytes);
  // fsync, close, rename onto the final path, fsync the directory.
  void commit();
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::string tmp_path_;
  int fd_ = -1;
  uint64_t written_ = 0;  // bytes so far, for messages
  bool committed_ = false;
};

void write_file_atomically(const std::string& path, const std::string& contents);
// Makes a completed rename/create/unlink inside `dir` durable.
void fsync_directory(const std::string& dir);
// rename(2), throwing IOError naming both paths.
void rename_path(const std::string& from, const std::string& to);
// The whole file; IOError naming it when it cannot be read.
std::string read_file(const std::string& path);
// A name unique within this process run, for temporary files and directories.
std::string unique_suffix();
// Note [Checkpoints removed whole]: removing a directory file by file and
// being killed half-way leaves a directory under its old name that has lost
// some files -- an old checkpoint pruned that way looked complete by name and
// was not whole (tests/distributed/mesh_dead_rank.sh caught one, a rank
// killed while it pruned). So `path` is first renamed, in one step, to
// `prefix` + its name + a unique suffix beside it (debris the next prune
// sweeps), and only then removed. Returns "" or the error.
std::string remove_directory_atomically(const std::string& path, const std::string& prefix);

}  // namespace chorus::io::detail
