// Saving a sharded checkpoint without stopping training for the disk, nor
// for the copy to host memory.
//
// Note [Background checkpoint writes]: training may change the weights and
// the optimizer's moments as soon as save() returns, so save() freezes them
// first -- but on the device, not on the host. Every piece held outside host
// memory (cpu:0; a logical CPU device such as cpu:1 counts as a device, so
// the tests take this path without a GPU) is cloned on its own device,
// issued on the caller's current stream (so stream-ordered after the
// optimizer step that produced it, and before the next step that changes
// it): a device-to-device copy at the device's memory bandwidth, where a
// copy into pageable host memory runs far slower and training would wait
// for it (measured stalls: docs/checkpoints.md). The caller passes the live
// tensors (an optimizer's live_state(), not state()'s copies). Timing events
// around the clones measure what they cost the training stream. save() returns once the clones are issued; its host time is the
// stall it reports, and the clones' device time is read later
// (last_snapshot_device_ms()). Pieces already in host memory are cloned there
// at once.
//
// A background thread waits for the snapshot's events, copies it to host
// memory on a stream of its own per device (the thread's default stream is
// the one training issues to, Note [One default stream per device] in
// cuda/runtime/context.cpp, so copies there would queue behind and in front of the
// training kernels), frees the device copy, then writes the files and takes
// part in the commit (Note [Sharded commit]).
//
// The snapshot costs one more copy of the rank's state on the device, for as
// long as the background copy takes (a step or two). It must fit in memory
// the training does not use at its peak: the driver's free memory (the
// allocator's pool keeps what training ever used reserved, so that is what
// lies outside it), plus what this writer's previous snapshot left reserved
// in the pool, less a margin of 1 GiB. When it does not fit (or the clones
// run out of memory all the same), that save falls back to the synchronous
// copy to host memory -- slower, never out of memory -- and says so once.
//
// Note [Stall by phase]: save()'s stall is timed phase by phase with one
// steady clock (PhaseClock: each lap charges the time since the previous one
// to a phase), so the phases add up to the stall. The caller's own phases
// (the checkpointer assembling its pieces and names) come first; then the
// writer's: joining the previous save's finished thread ("join", later saves
// only; a wait for one still running is counted apart, as wait_ms), the
// placement rule (device_bytes, the devices' busy probe below and the
// free-memory check: "placement"), and
// for a device snapshot copying the save's lists ("plan"), allocating the
// buffers ("allocate"), making the views and cloning what is already in host
// memory ("views"), creating and recording the start events ("events"),
// issuing the copies and the end events ("copies") and waiting for the host
// clones ("host copies"); for the fallback, the synchronous copy ("copy to
// host"); and last starting the background thread ("start"). Totals keep
// the first save's phases and the later ones' sums: the first save's stall
// was three times the later ones' on GPUs (gpt2-xl ZeRO-1: 31.7 against
// 9.5 ms) while allocating the snapshot ahead did not shorten it, so the
// run's end line says where a first save's extra time goes. With them,
// whether each device still ran earlier work as the save began (an event
// recorded and queried at once): in those GPU runs the later saves first
// waited seconds for the previous write, so they began on an idle device
// and the first on a busy one, and a call that waits for room in the
// device's queue would take longer in the first alone.
//
// One save is in flight at a time: a new save() first waits for the
// previous one, so snapshots never pile up and the store's keys of
// consecutive saves never interleave. That wait is part of the stall save()
// returns (and is named once in a warning): saves closer together than the
// disk writes them stop training for the rest of the write. A failure in the
// background reaches the caller from the next wait() or save(); the
// destructor waits and logs one.
#pragma once

#include <chrono>
#include <cstddef>
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "chorus/core/device.h"
#include "chorus/io/sharded_checkpoint.h"

namespace chorus::io {

struct ShardedSnapshot;  // a save frozen for the background (sharded_writer.cpp)

// A stall's host time by phase (Note [Stall by phase]), in the order the
// phases first ran; a phase named twice adds up.
struct StallPhases {
  std::vector<std::pair<std::string, double>> ms;
  void add(const std::string& phase, double ms);
  void add(const StallPhases& other);  // phase by phase
  double total() const;
};

// Laps of one steady clock, started at construction (or at `from`): lap()
// charges the time since the previous lap to `phase` and returns it.
class PhaseClock {
 public:
  explicit PhaseClock(StallPhases& out) : PhaseClock(out, std::chrono::steady_clock::now()) {}
  PhaseClock(StallPhases& out, std::chrono::steady_clock::time_point from) : out_(out), last_(from) {}
  double lap(const std::string& phase);
  // The time since the previous lap, charged to no phase.
  double skip();

 private:
  StallPhases& out_;
  std::chrono::steady_clock::time_point last_;
};

struct ShardedWriterOptions {
  // The largest snapshot (bytes, all devices) taken on the devices; above it
  // a save copies to the host synchronously. nullopt: as free memory allows
  // (Note [Background checkpoint writes]). Tests set 0 to take the fallback.
  std::optional<size_t> snapshot_limit_bytes;
};

class ShardedCheckpointWriter {
 public:
  // `options.key_prefix` is extended with a save counter, so every rank's
  // writer must see the same sequence of saves (as a training loop does).
  ShardedCheckpointWriter(std::string dir, ShardedSaveOptions options, ShardedWriterOptions writer = {});
  ~ShardedCheckpointWriter();
  ShardedCheckpointWriter(const ShardedCheckpointWriter&) = delete;
  ShardedCheckpointWriter& operator=(const ShardedCheckpointWriter&) = delete;

  // Waits for the previous save (rethrowing its failure), snapshots `save`'s
  // tensors, starts the copy to host memory and the write, and returns the
  // host time it blocked in ms (the wait for the previous save included).
  // `gather`: the host time the caller spent assembling `save` (its pieces
  // and names) by phase, counted in the stall as well (Note [Stall by
  // phase]); `gather_ms`: the same as one phase, "assemble".
  double save(const ShardedSave& save, const StallPhases& gather);
  double save(const ShardedSave& save, double gather_ms = 0);
  // Note [The snapshot's memory set aside]: the first save's stall was six
  // times the later ones' on a GPU, nearly all of it in "allocate" (gpt2-xl
  // ZeRO-1 on one H200: 36.6 of 45.3 ms, against 0.07 ms later; benchmarks
  // journal, session 41): the snapshot's device memory, GiBs, is new to the
  // allocator's stream-ordered pool at the first save and mapped then; later
  // saves find it in the pool, which keeps what a freed snapshot leaves
  // (cuda/runtime/allocator.h). An allocation ahead of the training did not
  // help (session 39), because capturing the step's CUDA graph trims the pool.
  // set_aside(save) allocates the device buffers a save of these tensors
  // would, under the same placement rule, and frees them back into the
  // allocator at once, so that the first save finds them as the later ones
  // do; the caller calls it once, after the step is captured and before the
  // first save. Returns the host time it took in ms, or -1 when it did
  // nothing (nothing outside host memory, no room on a device, or a save
  // already made).
  double set_aside(const ShardedSave& save);
  // Waits for the save in flight; rethrows its failure. Returns the path of
  // the last checkpoint written ("" before any).
  std::string wait();
  // True while a write is in flight.
  bool busy() const;

  double last_stall_ms() const { return last_stall_ms_; }  // save()'s host time
  // The device time the last save's clones took on the training stream (the
  // slowest device; 0 for a save without a device snapshot). Known once the
  // background thread saw the clones finish: read it after wait().
  double last_snapshot_device_ms() const;
  // The devices the last save snapshotted on (empty: none).
  const std::vector<Device>& last_snapshot_devices() const { return last_devices_; }
  double last_write_ms() const;  // the background copy, write and commit
  // Totals over this writer's saves; device_ms counts the saves whose
  // background work finished (all of them after wait()).
  // stall_ms: save()'s host time less its waits for a previous save, which
  // add up in wait_ms (saves closer together than the disk writes them).
  // first_stall_ms: the first save's host stall alone (it also allocates the
  // snapshot's device memory, which the allocator's pool keeps for the next).
  // first_phases: the first save's stall by phase; later_phases: the later
  // saves' phases summed (Note [Stall by phase]). Each adds up to its stall.
  struct Totals {
    int64_t saves = 0;
    double stall_ms = 0, device_ms = 0, wait_ms = 0, first_stall_ms = 0;
    StallPhases first_phases, later_phases;
    // Whether a device still ran earlier work as the save began: the first
    // save's (-1: it had nothing outside host memory), and how many of the
    // later saves with something on a device (later_on_device) found one busy.
    int first_device_busy = -1;
    int64_t later_device_busy = 0, later_on_device = 0;
  };
  Totals totals() const;
  const std::string& dir() const { return dir_; }

 private:
  void join_and_rethrow();
  // Why a snapshot of `bytes` (per device) is not taken on the devices; ""
  // when it is.
  std::string why_not_on_device(const std::map<Device, size_t>& bytes) const;
  void write_in_background(ShardedSnapshot snap, ShardedSaveOptions o);

  std::string dir_;
  ShardedSaveOptions options_;
  ShardedWriterOptions writer_options_;
  int64_t saves_ = 0;
  std::thread worker_;
  // Bytes of the last device snapshot per device: freed into the allocator's
  // pool, which keeps them reserved for the next one.
  std::map<Device, size_t> reserved_;
  mutable std::mutex mu_;  // guards the fields the worker sets
  bool running_ = false;
  std::exception_ptr error_;
  std::string last_path_;
  double last_write_ms_ = 0;
  double last_snapshot_device_ms_ = 0;
  double last_stall_ms_ = 0;
  std::vector<Device> last_devices_;
  Totals totals_;  // stall_ms and saves set by save(), device_ms by the worker
};

// `save` with every tensor copied to cpu:0 (contiguous, own storage), so
// that the caller may change the originals at once. Waits for the copies.
ShardedSave copy_to_host(const ShardedSave& save);

}  // namespace chorus::io
