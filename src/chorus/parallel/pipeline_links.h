// The send/recv channels of a pipeline whose stages run in several processes
// (Pipeline's stage_group): one 2-rank process group per direction and link.
//
// Note [Pipeline links]: stage s runs on rank s % P. Activations go from
// rank r to rank r+1, gradients from r to r-1; with several (virtual) stages
// per rank (the interleaved schedule) they also wrap around, the last rank's
// activations to rank 0 and rank 0's gradients to the last rank: a ring.
//
// NCCL runs a communicator's operations in order on one stream, and a send
// ends only when its receive runs. With one communicator per direction for
// the whole pipeline, each rank's stream holds its sends and its receives in
// the order it posted them: in a ring where every rank posts a send and then
// a receive, each send waits for a receive that stands behind another rank's
// send -- a circular wait. (Megatron-LM avoids it by posting each send
// together with its matching receive, batch_isend_irecv.)
//
// Here each link (r -> r+1 for activations, r -> r-1 for gradients, mod P)
// is a communicator of its own. Its stream holds only sends on the sending
// rank and only receives on the receiving one, and these are in the same
// order: parallel::link_order_mismatch (parallel/pipeline_schedule.h) checks
// it for the lists a step runs (Megatron's order keeps it: every rank takes
// the (chunk, micro-batch) pairs in one order, and the chunk a message leaves
// from and the one it reaches are in that order alike). Why nothing then waits
// in a cycle:
//   - the k-th send on a link matches the k-th receive, so a message waits
//     only for the messages before it on its own link, which the receiver
//     needs earlier anyway;
//   - no rank ever waits for its own send (the sends are waited for only at
//     the end of the step), so a send that cannot run yet holds up nothing
//     but the later sends of its link;
//   - what remains is each rank doing its list in order and a task waiting
//     for its inputs: exactly what parallel::simulate runs, and every list
//     is accepted only once it runs to the end there (Note [Schedules never
//     deadlock]).
// NCCL connects a pair of ranks at their first send/recv, and that blocks
// the host until the peer arrives too; make_pipeline_links exchanges one
// message on every link as it creates it, all ranks taking the links in one
// order, so no step ever waits on a connection. Over Gloo sends are
// asynchronous and receives are matched by tag in any order: the links cost
// nothing there, and the same code runs on both backends.
//
// Note [Pipeline links at exit]: NCCL tears a communicator down together
// with its peers (ncclCommFinalize and ncclCommDestroy communicate, and our
// communicators are blocking), so every rank must destroy the communicators
// it shares with others in one order, as it created them. `out` and `in`
// name a link by this rank's role on it, which differs between the two ends:
// the link rank 0 holds as out[0] is rank 1's in[0]. Left to the members'
// destructors (in before out, [1] before [0]), pp=2 rank 0 destroyed the
// gradient link first and rank 1 the activation link first, each then
// waiting in ncclCommFinalize for the other: `chorus train --mesh pp=2` on
// two GPUs ran all its steps and hung as it returned. So `created` holds the
// links in the order every rank created them, and the links are released
// from it, newest first, after `out` and `in` let go of theirs. (Gloo's
// teardown does not communicate, which is why only GPUs showed it.)
#pragma once

#include <array>
#include <vector>

#include "chorus/distributed/process_group.h"

namespace chorus::parallel {

struct PipelineLinks {
  // [0]: activations (to rank + 1), [1]: gradients (to rank - 1), mod P.
  // out[dir]: this rank sends on it as its rank kSender; in[dir]: it
  // receives on it as its rank kReceiver. Null where the pipeline has no
  // such link (without a ring: the last rank's activations, the first's
  // gradients).
  std::array<dist::ProcessGroupPtr, 2> out, in;
  // This rank's links in the order all ranks created them (Note [Pipeline
  // links at exit]).
  std::vector<dist::ProcessGroupPtr> created;
  static constexpr int kSender = 0, kReceiver = 1;

  PipelineLinks() = default;
  PipelineLinks(PipelineLinks&&) noexcept = default;
  PipelineLinks& operator=(PipelineLinks&& other) noexcept;
  PipelineLinks(const PipelineLinks&) = delete;
  PipelineLinks& operator=(const PipelineLinks&) = delete;
  ~PipelineLinks() { release(); }
  // Drops every link, the newest first (a no-op when there are none).
  void release() noexcept;
};

// Collective over `group` (every rank calls it with the same `ring`). A group
// of one rank has no links.
PipelineLinks make_pipeline_links(const dist::ProcessGroupPtr& group, bool ring);

}  // namespace chorus::parallel
