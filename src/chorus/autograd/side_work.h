// Work of the backward pass issued on a second stream of the device, beside
// the gradients every later node waits for.
//
// Note [Weight gradients beside the data gradient]: in a convolution's
// backward the data gradient dx is on the critical path (the layer below waits
// for it); the weight gradient is not (only the optimizer reads it, after the
// whole backward). On one stream the GPU runs them in turn, and the memory-bound
// kernels between two convolutions (batch norm's backward, ReLU's mask) run
// alone on a GPU whose arithmetic units are idle. So a convolution issues its
// weight gradient (and its conversion to the parameter's
// dtype: Note [Float filter gradients from 16-bit data] in cuda/conv/conv.cpp) on a
// side stream of the device, forked from the current stream before its data
// gradient, and the current stream waits for it ("joins") only where something
// must read it:
//   - at the next weight gradient issued beside (after that layer's data
//     gradient): at most one is in flight, and the activation and gradient it
//     reads are held (not freed) until then, one layer's worth of memory;
//   - where a node of the engine would compute with the result (a sum of
//     several gradients, a conversion, AccumulateGrad adding into an existing
//     .grad or running hooks that read it: join_beside_for; a write in place
//     into what the side work reads: join_beside_before_write);
//   - at the end of the backward pass (the engine joins every device), so the
//     optimizer, and a CUDA graph's capture, see one stream again.
// Under capture the fork and the joins become edges of the graph. The engine
// allows side work on its threads (BesideScope): the caller's for a backward of
// one device, each device's worker under DataParallel. A node that reads such a
// gradient joins first, unless it orders its reads itself
// (Node::orders_beside_reads): DataParallel's replica nodes record their
// bucket's ready event on the side stream after it waits for the main one
// (beside_merge), so the reduction follows both and the replica goes on; DDP's
// hooks only note that a gradient is final (reads_grad = false) and its bucket
// gather joins before it copies: on 2 H100s DataParallel WRN-28-10 scaled
// better with the merge than with the replica nodes joining, and DDP gained
// from the side stream only then (benchmarks journal, session 25). Graphed
// bf16 steps, same binary with and without, gained on one H100 and one H200,
// WRN-16-4 most (session 25). CHORUS_WGRAD_STREAM=0 turns it off (to compare).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>

#include "chorus/core/stream.h"
#include "chorus/core/tensor.h"

namespace chorus::autograd {

// Whether work may go beside on `d` now: a CUDA device, inside a BesideScope,
// not turned off by the environment or set_beside_enabled(false).
bool beside_allowed(const Device& d);
void set_beside_enabled(bool on);

// Runs on_main() on d's current stream, then beside() on d's side stream,
// ordered after everything issued to the current stream before this call.
// `hold` (what beside() reads) is kept alive until the next join. beside()'s
// results may be read on the current stream only after a join.
TensorList run_beside(const Device& d, TensorList hold, const std::function<void()>& on_main,
                      const std::function<TensorList()>& beside);

// The current stream (the one that forked it) waits for d's pending side work.
void join_beside(const Device& d);
// join_beside, where `g` is a result of the pending side work of its device
// (the caller reads it).
void join_beside_for(const Tensor& g);
// join_beside, where `g` is a result of the pending side work or shares memory
// with what that work reads (the caller writes into g in place).
void join_beside_before_write(const Tensor& g);
// join_beside on every device with pending side work.
void join_all_beside();
// A stream whose work follows both the current stream's work so far and d's
// pending side work, without making the current stream wait: d's side stream,
// after it waits for the current stream (nullopt: nothing pending on d; the
// current stream will do). For an event that something else waits for
// (DataParallel's bucket reductions).
std::optional<Stream> beside_merge(const Device& d);

// How many times run_beside has run work beside (tests, diagnostics).
int64_t beside_runs();

// Allows side work on this thread while alive (the engine's thread of a
// backward pass), and when it ends joins the side work of `only` (a device
// thread of the multi-device engine), or of every device (nullopt).
class BesideScope {
 public:
  explicit BesideScope(std::optional<Device> only = std::nullopt);
  ~BesideScope();
  BesideScope(const BesideScope&) = delete;
  BesideScope& operator=(const BesideScope&) = delete;

 private:
  bool prev_;
  std::optional<Device> only_;
};

}  // namespace chorus::autograd
