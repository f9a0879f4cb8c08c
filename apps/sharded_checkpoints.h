// Checkpoints of a --strategy zero run (data_parallel/sharded.h): every rank writes its
// pieces of the weights and of AdamW's state (io/sharded_checkpoint.h) in the
// background, and a run at any world size or stage -- or a one-process, DP or
// DDP run -- resumes from them; a zero run also resumes from a one-process
// checkpoint (Note [Checkpoints at any layout]).
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "chorus/data_parallel/sharded.h"
#include "chorus/io/checkpoint.h"
#include "chorus/io/sharded_writer.h"
#include "chorus/optim/optimizer.h"
#include "train_dist.h"

namespace chorus::app {

using CheckpointCheck = std::function<void(const io::TrainingState&, const std::string&)>;

// The kind of checkpoint `dir` holds newest: its path and whether it is
// sharded; nullopt when none.
struct FoundCheckpoint {
  std::string path;
  bool sharded = false;
};
std::optional<FoundCheckpoint> find_newest_checkpoint(const std::string& dir);

// A zero run's checkpoints: save() snapshots this rank's pieces on its
// device (the stall, returned in ms; Note [Background checkpoint writes] in
// io/sharded_writer.h), then copies them to host memory and writes them in
// the background, the ranks committing through the job's store; wait()
// joins the write (and rethrows).
class ShardedCheckpointer {
 public:
  ShardedCheckpointer(std::string dir, std::shared_ptr<dist::ShardedDataParallel> sdp, optim::Optimizer& opt,
                      const RankContext& ranks, int keep_last = 3);
  double save(const io::TrainingState& state);
  // Note [The snapshot's memory set aside] (io/sharded_writer.h): once, after
  // the step is captured and before the first save; the host ms, or -1.
  double set_aside();
  std::string wait();
  double last_write_ms() const { return writer_.last_write_ms(); }
  const io::ShardedCheckpointWriter& writer() const { return writer_; }

 private:
  // The save of this rank's pieces, optimizer state and replicated tensors;
  // `clock` times the assembly's phases.
  io::ShardedSave assemble(const io::TrainingState& state, io::PhaseClock& clock);

  std::shared_ptr<dist::ShardedDataParallel> sdp_;
  optim::Optimizer& opt_;
  io::ShardedCheckpointWriter writer_;
};

// The words after a save's stall: where the shards were snapshotted and
// what goes on in the background (or that they were copied to the host).
std::string snapshot_where(const std::vector<Device>& devices);
// The run's closing line on its sharded saves: the mean stall per save, on
// the host and in device copies, and its share of a `step_ms` step.
std::string stall_summary(const io::ShardedCheckpointWriter::Totals& t, double step_ms);
// The line after it (Note [Stall by phase] in io/sharded_writer.h): the first
// save's stall by phase, and the later saves' mean by phase; "" before any
// save. stall_phases_json: the same for --json, {"first": {phase: ms},
// "later": {phase: mean ms}} ("later" only after two saves or more).
std::string stall_phases_summary(const io::ShardedCheckpointWriter::Totals& t);
nlohmann::ordered_json stall_phases_json(const io::ShardedCheckpointWriter::Totals& t);

// Loads checkpoint `found` into a zero run's pieces and optimizer: each rank
// reads its own ranges of a sharded checkpoint written at any layout, or
// slices a one-process checkpoint's full tensors. `check` sees the state
// before any tensor is read. Returns the checkpoint's state.
io::TrainingState load_into_shards(const FoundCheckpoint& found, dist::ShardedDataParallel& sdp, optim::Optimizer& opt,
                                   const CheckpointCheck& check);

// Loads a sharded checkpoint into a whole model and its optimizer (one
// process, DP, DDP, a pipeline).
io::TrainingState load_sharded_into_full(const std::string& ckpt, nn::Module& model, optim::Optimizer& opt,
                                         const CheckpointCheck& check);

// --resume at any layout (Note [Checkpoints at any layout]): the newest
// checkpoint in `dir`, of either kind, into a zero run's pieces (`sdp` given:
// every rank calls it) or into the whole `model`; a one-process checkpoint
// into a whole model goes through io::resume_checkpoint (which skips
// unreadable ones: Note [Unreadable checkpoints]). No path: none found.
io::Resumed resume_at_any_layout(const std::string& dir, nn::Module& model, optim::Optimizer& opt,
                                 dist::ShardedDataParallel* sdp, bool start_fresh, const CheckpointCheck& check);
// Checkpoint `ckpt`, of either kind, into a whole model: what the other ranks
// of a DDP run load once rank 0 has chosen it.
io::TrainingState load_at_any_layout(const std::string& ckpt, nn::Module& model, optim::Optimizer& opt,
                                     const CheckpointCheck& check);
// The file that holds checkpoint `ckpt`'s state (index.json of a sharded
// one, else state.json): what errors about it name.
std::string state_file_of(const std::string& ckpt);

}  // namespace chorus::app
