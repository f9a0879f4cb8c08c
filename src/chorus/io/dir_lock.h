// One job per checkpoint directory (issue 47, item 12).
//
// Note [Checkpoint directory lock]: two jobs writing one checkpoint directory
// prune each other's checkpoints and half-written saves, and the loser used
// to fail later with a misleading "cannot rename". The process that writes
// checkpoints (rank 0) holds an flock(2) on "<dir>/lock" for as long as it
// trains, and writes its host and pid into the file; a second job's writer
// fails at once with an IOError naming the directory and the holder. The lock
// is the kernel's: it goes with the process (a killed job leaves nothing to
// clean up, and --max-restarts' next attempt takes it again). On NFS, Linux
// maps flock to POSIX byte-range locks, which the server keeps.
#pragma once

#include <string>

namespace chorus::io {

class CheckpointDirLock {
 public:
  // Creates `dir` when missing and locks it; IOError naming `dir` and the job
  // that holds it ("host H, pid P") when another process does.
  explicit CheckpointDirLock(const std::string& dir);
  ~CheckpointDirLock();  // unlocks (never throws)
  CheckpointDirLock(const CheckpointDirLock&) = delete;
  CheckpointDirLock& operator=(const CheckpointDirLock&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;  // <dir>/lock
  int fd_ = -1;
};

// "host H, pid P": who this process is, as the lock file records it.
std::string lock_holder_line();

}  // namespace chorus::io
