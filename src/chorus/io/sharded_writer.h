// Saving a sharded checkpoint without stopping training for the disk.
//
// Note [Background checkpoint writes]: training may change the weights and
// the optimizer's moments as soon as save() returns, so save() copies every
// piece to host memory first (from a GPU: device-to-host copies, then a wait
// for them) -- that copy is the whole stall, and save() returns its length.
// A background thread then writes the files and takes part in the commit
// (Note [Sharded commit]). One save is in flight at a time: a new save()
// first waits for the previous one, so the host copies never pile up and
// the store's keys of consecutive saves never interleave. A failure of the
// background write reaches the caller from the next wait() or save(); the
// destructor waits and logs one.
#pragma once

#include <exception>
#include <mutex>
#include <string>
#include <thread>

#include "chorus/io/sharded_checkpoint.h"

namespace chorus::io {

class ShardedCheckpointWriter {
 public:
  // `options.key_prefix` is extended with a save counter, so every rank's
  // writer must see the same sequence of saves (as a training loop does).
  ShardedCheckpointWriter(std::string dir, ShardedSaveOptions options);
  ~ShardedCheckpointWriter();
  ShardedCheckpointWriter(const ShardedCheckpointWriter&) = delete;
  ShardedCheckpointWriter& operator=(const ShardedCheckpointWriter&) = delete;

  // Waits for the previous save (rethrowing its failure), copies `save`'s
  // tensors to the host, starts the write and returns the stall in ms.
  double save(const ShardedSave& save);
  // Waits for the save in flight; rethrows its failure. Returns the path of
  // the last checkpoint written ("" before any).
  std::string wait();
  // True while a write is in flight.
  bool busy() const;

  double last_stall_ms() const { return last_stall_ms_; }  // save()'s host copy
  double last_write_ms() const;                             // the background write and commit
  const std::string& dir() const { return dir_; }

 private:
  void join_and_rethrow();

  std::string dir_;
  ShardedSaveOptions options_;
  int64_t saves_ = 0;
  std::thread worker_;
  mutable std::mutex mu_;  // guards the fields the worker sets
  bool running_ = false;
  std::exception_ptr error_;
  std::string last_path_;
  double last_write_ms_ = 0;
  double last_stall_ms_ = 0;
};

// `save` with every tensor copied to cpu:0 (contiguous, own storage), so
// that the caller may change the originals at once.
ShardedSave copy_to_host(const ShardedSave& save);

}  // namespace chorus::io
