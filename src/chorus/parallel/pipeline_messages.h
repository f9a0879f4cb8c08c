// The messages a pipeline's stages exchange between processes (Pipeline's
// stage_group) over its links (parallel/pipeline_links.h): an activation
// forward, a gradient back.
//
// Note [Pipeline messages]: a tensor crosses as two messages on its link, a
// header (dtype, number of dimensions, sizes: at most 8-d) then the tensor
// itself, each under a tag of its own, so that the receiver can allocate
// the tensor before its data arrive. The sender keeps each message's Work
// (and through it the tensor) until the work is done: it is waited for then,
// or at the end of the step, never before it is done (Note [Pipeline links]:
// no rank waits for its own sends).
//
// Note [Received headers off the compute stream]: a message between ranks
// is a header (dtype and shape), read on the host to allocate the tensor,
// then the tensor. The header used to be received and copied to the host on
// the compute stream, and reading it (a device-to-host copy and
// cudaStreamSynchronize of that stream) waited for every kernel issued
// before it: at each task with an input from another rank the host stopped
// until its own GPU had run dry, even when the input had long arrived, and
// then issued the task's eager kernels to an idle GPU -- every micro-batch
// on the slowest stage (whose inputs are always there first) began with the
// GPU waiting for the host. And the tensor's receive, posted only after
// that, could not start before this rank's previous task ended. Now both
// receives and the header's read run on this direction's copy stream
// (idle on a stage group otherwise): the host waits for the header alone,
// the tensor arrives beside the compute, and the compute stream waits for it
// by an event only where the task starts (wait_arrival, as for a copy
// between devices of one process). The copy stream holds only this link's
// receives, in the link's order, so it waits for nothing a receive did not
// wait for before (Note [Pipeline links]). Over Gloo (CPU) nothing changes:
// there are no streams.
//
#pragma once

#include <mutex>
#include <optional>
#include <vector>

#include "chorus/core/stream.h"
#include "chorus/core/tensor.h"
#include "chorus/distributed/process_group.h"

namespace chorus::parallel {

// Posts v (made contiguous) on `link`, this rank its sender, as a header
// under header_tag and the data under data_tag, adding both Works to `sends`
// (under sends_mu) after dropping those already done. ValueError for a
// tensor of more than 8 dimensions.
void send_message(const dist::ProcessGroupPtr& link, const Tensor& v, int header_tag, int data_tag,
                  std::vector<dist::WorkPtr>& sends, std::mutex& sends_mu);

// Receives one message from `link`, this rank its receiver, onto `device`.
// With `side` (a GPU's copy stream: Note [Received headers off the compute
// stream]) both receives run there and the current stream waits for the
// tensor by an event. `from` (the sender's rank) names it in the error for a
// malformed header.
Tensor recv_message(const dist::ProcessGroupPtr& link, int header_tag, int data_tag, const Device& device,
                    const std::optional<Stream>& side, int from);

// The receiver's side of a copy made on another stream: its current stream
// waits for `ready`, and the block (allocated on the copy stream) is kept
// until that stream is done with it. Nothing to do without an event.
void wait_arrival(const Tensor& t, const std::optional<Event>& ready);

}  // namespace chorus::parallel
