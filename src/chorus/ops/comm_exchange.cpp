// exchange_each_after and exchange_possible (ops/comm.h; Note [Gradient sums
// in the update] in data_parallel/reducer.h).
#include <atomic>
#include <string>

#include "chorus/core/backend.h"
#include "chorus/core/error.h"
#include "chorus/ops/comm.h"
#include "chorus/ops/copy.h"
#include "chorus/ops/on_stream.h"
#ifdef CHORUS_WITH_CUDA
#include "chorus/cuda/runtime/context.h"
#include "chorus/cuda/kernels/peer_all_reduce.h"
#endif

namespace chorus::ops {

namespace {

std::atomic<uint64_t> exchanges{0};

// A fresh tensor with t's sizes and strides (dense) on t's device.
Tensor fresh_like(const Tensor& t) {
  return chorus::detail::empty_dense_strided(Shape(t.sizes()), Shape(t.strides()), t.dtype(), t.device());
}

}  // namespace

uint64_t exchange_calls() { return exchanges.load(std::memory_order_relaxed); }

bool exchange_possible(const std::vector<Device>& devices) {
  if (devices.size() != 2 || devices[0] == devices[1]) return false;
  if (devices[0].is_cpu() && devices[1].is_cpu()) return true;
#ifdef CHORUS_WITH_CUDA
  if (devices[0].is_cuda() && devices[1].is_cuda())
    return cuda::peer_access_enabled(devices[0].index, devices[1].index) &&
           cuda::peer_access_enabled(devices[1].index, devices[0].index);
#endif
  return false;
}

std::vector<std::vector<Tensor>> exchange_each_after(const std::vector<std::vector<Tensor>>& bufs,
                                                     const std::vector<Event>& ready) {
  const char* op = "exchange_each_after";
  CHORUS_CHECK(ready.size() == 2, op, ": ", ready.size(), " devices (events); it exchanges between two");
  std::vector<std::vector<Tensor>> parts(bufs.size());
  for (size_t t = 0; t < bufs.size(); ++t) {
    const std::vector<Tensor>& g = bufs[t];
    CHORUS_CHECK(g.size() == 2 && g[0].defined() && g[1].defined(), op, ": tensor ", t,
                 " needs one defined buffer on each of the two devices");
    for (size_t i = 0; i < 2; ++i)
      CHORUS_CHECK(g[i].device() == ready[i].device(), op, ": buffer ", i, " of tensor ", t, " is on ",
                   g[i].device().str(), " but event ", i, " is on ", ready[i].device().str());
    CHORUS_CHECK(g[0].device() != g[1].device(), op, ": both buffers of tensor ", t, " are on ", g[0].device().str());
    CHORUS_CHECK(g[0].sizes() == g[1].sizes() && g[0].strides() == g[1].strides() && g[0].dtype() == g[1].dtype() &&
                     same_dense_layout({&g[0]}) && same_dense_layout({&g[1]}),
                 op, ": the buffers of tensor ", t, " (", g[0].describe(), ", ", g[1].describe(),
                 ") must be dense with the same sizes, strides and dtype");
  }
  if (bufs.empty()) return parts;
  exchanges.fetch_add(1, std::memory_order_relaxed);
  const Device d0 = ready[0].device(), d1 = ready[1].device();
#ifdef CHORUS_WITH_CUDA
  if (d0.is_cuda() && d1.is_cuda()) {
    CHORUS_CHECK(cuda::peer_access_enabled(d0.index, d1.index) && cuda::peer_access_enabled(d1.index, d0.index), op,
                 ": ", d0.str(), " and ", d1.str(), " have no peer access both ways");
    void* streams[2] = {cuda::peer_stream(d0.index), cuda::peer_stream(d1.index)};
    cuda::peer_exchange_wait(d0.index, d1.index, ready[0].handle(), ready[1].handle());
    std::vector<void*> srcs[2], dsts[2];
    std::vector<size_t> bytes;
    for (size_t t = 0; t < bufs.size(); ++t) {
      for (size_t i = 0; i < 2; ++i) {
        // Taken in the copy stream's order, after its wait: it cannot be
        // memory the backward's kernels still use (Note [Copy-engine
        // all-reduce]); inside a capture it comes from the graph's pool.
        OnStream on(bufs[t][i].device(), streams[i]);
        parts[t].push_back(fresh_like(bufs[t][i]));
        srcs[i].push_back(bufs[t][i].raw_data());
        dsts[i].push_back(parts[t][i].raw_data());
      }
      bytes.push_back(static_cast<size_t>(bufs[t][0].nbytes()));
    }
    cuda::peer_exchange_copy(d0.index, d1.index, srcs[0], srcs[1], dsts[0], dsts[1], bytes);
    for (size_t t = 0; t < bufs.size(); ++t)
      for (size_t i = 0; i < 2; ++i) {
        // The other device's copy stream reads this buffer: a free waits for it.
        const Tensor& b = bufs[t][i];
        backend(b.device()).record_use(b.storage()->data(), b.device(), bufs[t][1 - i].device(), streams[1 - i]);
      }
    return parts;
  }
#endif
  CHORUS_CHECK(d0.is_cpu() && d1.is_cpu(), op, ": ", d0.str(), " and ", d1.str(),
               " are not two GPUs or two CPU devices");
  for (size_t t = 0; t < bufs.size(); ++t)
    for (size_t i = 0; i < 2; ++i) {
      parts[t].push_back(fresh_like(bufs[t][i]));
      copy_(parts[t][i], bufs[t][1 - i]);
    }
  return parts;
}

}  // namespace chorus::ops
