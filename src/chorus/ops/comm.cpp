#include "chorus/ops/comm.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string>

#include "chorus/core/backend.h"
#include "chorus/core/error.h"
#include "chorus/ops/copy.h"
#include "chorus/ops/elementwise.h"
#include "chorus/ops/factory.h"
#include "chorus/ops/on_stream.h"
#ifdef CHORUS_WITH_CUDA
#include "chorus/cuda/runtime/nccl.h"
#include "chorus/cuda/kernels/peer_all_reduce.h"
#endif

namespace chorus::ops {

namespace {

void check_buffer(const Tensor& t, const Tensor& like, const char* op, const char* what) {
  CHORUS_CHECK(t.defined(), op, ": ", what, " is an undefined tensor");
  CHORUS_CHECK(t.is_contiguous(), op, ": ", what, " must be contiguous, got ", t.describe(), " with strides ",
               shape_str(t.strides()));
  CHORUS_CHECK(t.sizes() == like.sizes() && t.dtype() == like.dtype(), op, ": ", what, " is ", t.describe(),
               " but the first buffer is ", like.describe(), "; every buffer needs the same shape and dtype");
}

void check_distinct(const std::vector<Tensor>& ts, const char* op) {
  for (size_t i = 0; i < ts.size(); ++i)
    for (size_t j = 0; j < i; ++j)
      CHORUS_CHECK(ts[i].device() != ts[j].device(), op, ": two buffers are on ", ts[i].device().str(),
                   "; each device may appear once");
}

#ifdef CHORUS_WITH_CUDA
bool all_cuda(const std::vector<Tensor>& ts) {
  for (const Tensor& t : ts)
    if (!t.device().is_cuda()) return false;
  return true;
}
#endif

#ifdef CHORUS_WITH_NCCL

// The caller's current stream of each device now waits for the collective
// (Note [In-process NCCL]); naming it keeps the buffers alive until then even
// when they were allocated on another stream.
void record_uses(const std::vector<Tensor>& ts) {
  for (const Tensor& t : ts) backend(t.device()).record_use(t.storage()->data(), t.device(), t.device());
}
#endif

}  // namespace

void broadcast_coalesced(const Tensor& src, const std::vector<Tensor>& dsts) {
  const char* op = "broadcast_coalesced";
  CHORUS_CHECK(src.defined(), op, ": the source is an undefined tensor");
  check_buffer(src, src, op, "the source");
  std::vector<Tensor> all{src};
  for (const Tensor& d : dsts) {
    check_buffer(d, src, op, "a destination");
    all.push_back(d);
  }
  check_distinct(all, op);
  if (dsts.empty() || src.numel() == 0) return;
#ifdef CHORUS_WITH_NCCL
  if (all_cuda(all)) {
    std::vector<int> devices;
    std::vector<void*> bufs;
    for (const Tensor& t : all) {
      devices.push_back(t.device().index);
      bufs.push_back(t.raw_data());
    }
    cuda::nccl_broadcast(devices, bufs, src.nbytes());
    record_uses(all);
    for (const Tensor& d : dsts) d.bump_version();
    return;
  }
#endif
  for (const Tensor& d : dsts) copy_(d, src);
}

namespace {

// Checks reduce_sum's arguments; whether dst is srcs[0]'s buffer.
bool check_reduce(const std::vector<Tensor>& srcs, const Tensor& dst, const char* op) {
  CHORUS_CHECK(!srcs.empty(), op, ": no source buffers");
  CHORUS_CHECK(srcs[0].defined(), op, ": the first source is an undefined tensor");
  for (const Tensor& s : srcs) check_buffer(s, srcs[0], op, "a source");
  check_buffer(dst, srcs[0], op, "the destination");
  check_distinct(srcs, op);
  CHORUS_CHECK(dst.device() == srcs[0].device(), op, ": the destination is on ", dst.device().str(),
               " but must be on the first source's device, ", srcs[0].device().str());
  return dst.raw_data() == srcs[0].raw_data();
}

// In order, one source at a time: on CPU devices the result does not depend
// on how the threads ran. binary_ brings each operand to dst's device.
void reduce_fallback(const std::vector<Tensor>& srcs, const Tensor& dst, bool dst_is_first) {
  if (!dst_is_first) copy_(dst, srcs[0]);
  for (size_t i = 1; i < srcs.size(); ++i) binary_(BinaryOp::Add, dst, srcs[i], 1.0);
}

#ifdef CHORUS_WITH_NCCL
bool nccl_reduces(const std::vector<Tensor>& srcs, const Tensor& dst) {
  return srcs.size() > 1 && all_cuda(srcs) && cuda::nccl_can_reduce(dst.dtype());
}

// The NCCL path of reduce_sum (ready == nullptr: ordered by the current
// streams, which wait for it) and of reduce_sum_after (ordered by the events;
// the buffers are named on the communication streams, so a free waits there).
void nccl_reduce(const std::vector<Tensor>& srcs, const Tensor& dst, const std::vector<Event>* ready) {
  std::vector<int> devices;
  std::vector<const void*> bufs;
  std::vector<void*> events;
  for (size_t i = 0; i < srcs.size(); ++i) {
    devices.push_back(srcs[i].device().index);
    bufs.push_back(srcs[i].raw_data());
    if (ready) events.push_back((*ready)[i].handle());
  }
  const size_t count = static_cast<size_t>(dst.numel());
  std::vector<Tensor> used = srcs;
  used.push_back(dst);
  if (ready) {
    cuda::nccl_reduce_sum_after(devices, bufs, dst.raw_data(), count, dst.dtype(), events);
    for (const Tensor& t : used)
      backend(t.device()).record_use(t.storage()->data(), t.device(), t.device(),
                                     cuda::nccl_stream(t.device().index));
  } else {
    cuda::nccl_reduce_sum(devices, bufs, dst.raw_data(), count, dst.dtype());
    record_uses(used);
  }
  dst.bump_version();
}
#endif

}  // namespace

void reduce_sum_after(const std::vector<Tensor>& srcs, const Tensor& dst, const std::vector<Event>& ready) {
  const char* op = "reduce_sum_after";
  const bool dst_is_first = check_reduce(srcs, dst, op);
  CHORUS_CHECK(ready.size() == srcs.size(), op, ": ", ready.size(), " events for ", srcs.size(), " sources");
  for (size_t i = 0; i < srcs.size(); ++i)
    CHORUS_CHECK(ready[i].device() == srcs[i].device(), op, ": the event of source ", i, " is on ",
                 ready[i].device().str(), " but the source is on ", srcs[i].device().str());
  if (srcs[0].numel() == 0) return;
#ifdef CHORUS_WITH_NCCL
  if (nccl_reduces(srcs, dst)) {
    nccl_reduce(srcs, dst, &ready);
    return;
  }
#endif
  reduce_fallback(srcs, dst, dst_is_first);
}

namespace {

std::atomic<uint64_t> copy_engine_calls{0};

#ifdef CHORUS_WITH_CUDA

// The copy-engine path of all_reduce_sum_after (Note [Copy-engine
// all-reduce] in cuda/kernels/peer_all_reduce.h); false when it does not apply (not
// all on CUDA, no peer access between some pair, a dtype it does not sum).
bool copy_engine_all_reduce_over(const std::vector<Tensor>& bufs, const std::vector<Event>& ready) {
  if (!all_cuda(bufs)) return false;
  std::vector<int> devices;
  for (const Tensor& t : bufs) devices.push_back(t.device().index);
  if (!cuda::peer_all_reduce_supported(devices, bufs[0].dtype())) return false;
  const size_t count = static_cast<size_t>(bufs[0].numel());
  const int64_t scratch_elems =
      static_cast<int64_t>(cuda::peer_all_reduce_scratch(count, bufs.size(), bufs[0].dtype()));
  std::vector<void*> ptrs, scratch_ptrs, events, streams;
  for (size_t i = 0; i < bufs.size(); ++i) {
    ptrs.push_back(bufs[i].raw_data());
    events.push_back(ready[i].handle());
    streams.push_back(cuda::peer_stream(devices[i]));
  }
  cuda::peer_all_reduce_wait(devices, events);
  // Scratch taken and freed on each device's copy stream, after its waits.
  std::vector<Tensor> scratch;
  for (size_t i = 0; i < bufs.size(); ++i) {
    OnStream on(bufs[i].device(), streams[i]);
    scratch.push_back(empty({scratch_elems}, TensorOptions(bufs[i].dtype(), bufs[i].device())));
    scratch_ptrs.push_back(scratch.back().raw_data());
  }
  cuda::peer_all_reduce_sum(devices, ptrs, scratch_ptrs, count, bufs[0].dtype());
  for (size_t i = 0; i < bufs.size(); ++i) {
    OnStream on(bufs[i].device(), streams[i]);
    scratch[i] = Tensor();
  }
  // Every device's copy stream reads or writes every buffer: named there, a
  // free waits for them.
  for (size_t i = 0; i < bufs.size(); ++i) {
    const Device d = bufs[i].device();
    for (size_t j = 0; j < bufs.size(); ++j)
      backend(d).record_use(bufs[i].storage()->data(), d, bufs[j].device(), streams[j]);
    bufs[i].bump_version();
  }
  copy_engine_calls.fetch_add(1, std::memory_order_relaxed);
  return true;
}
#endif

}  // namespace

uint64_t copy_engine_all_reduce_calls() { return copy_engine_calls.load(std::memory_order_relaxed); }

namespace {
void check_all_reduce(const std::vector<Tensor>& bufs, const std::vector<Event>& ready, const char* op) {
  CHORUS_CHECK(!bufs.empty(), op, ": no buffers");
  (void)check_reduce(bufs, bufs[0], op);
  CHORUS_CHECK(ready.size() == bufs.size(), op, ": ", ready.size(), " events for ", bufs.size(), " buffers");
  for (size_t i = 0; i < bufs.size(); ++i)
    CHORUS_CHECK(ready[i].device() == bufs[i].device(), op, ": the event of buffer ", i, " is on ",
                 ready[i].device().str(), " but the buffer is on ", bufs[i].device().str());
}
}  // namespace

bool copy_engine_all_reduce_sum_after(const std::vector<Tensor>& bufs, const std::vector<Event>& ready) {
  check_all_reduce(bufs, ready, "copy_engine_all_reduce_sum_after");
  if (bufs.size() < 2 || bufs[0].numel() == 0) return true;  // nothing to sum
#ifdef CHORUS_WITH_CUDA
  return copy_engine_all_reduce_over(bufs, ready);
#else
  return false;
#endif
}

void all_reduce_sum_after(const std::vector<Tensor>& bufs, const std::vector<Event>& ready) {
  const char* op = "all_reduce_sum_after";
  check_all_reduce(bufs, ready, op);
  if (bufs.size() < 2 || bufs[0].numel() == 0) return;
#ifdef CHORUS_WITH_NCCL
  if (nccl_reduces(bufs, bufs[0])) {
    std::vector<int> devices;
    std::vector<void*> ptrs, events;
    for (size_t i = 0; i < bufs.size(); ++i) {
      devices.push_back(bufs[i].device().index);
      ptrs.push_back(bufs[i].raw_data());
      events.push_back(ready[i].handle());
    }
    cuda::nccl_all_reduce_sum_after(devices, ptrs, static_cast<size_t>(bufs[0].numel()), bufs[0].dtype(), events);
    // Named on the communication streams: a free waits for the collective.
    for (const Tensor& t : bufs) {
      backend(t.device()).record_use(t.storage()->data(), t.device(), t.device(),
                                     cuda::nccl_stream(t.device().index));
      t.bump_version();
    }
    return;
  }
#endif
  reduce_fallback(bufs, bufs[0], /*dst_is_first=*/true);
  for (size_t i = 1; i < bufs.size(); ++i) copy_(bufs[i], bufs[0]);
}

namespace {

// Whether t's elements fill [raw_data, raw_data + numel) exactly once in some
// order of its dimensions (contiguous, channels-last, ...).
bool dense(const Tensor& t) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of dims longer than 1
  for (int64_t d = 0; d < t.dim(); ++d)
    if (t.size(d) != 1) dims.emplace_back(t.stride(d), t.size(d));
  std::sort(dims.begin(), dims.end());
  int64_t expected = 1;
  for (const auto& [stride, size] : dims) {
    if (stride != expected) return false;
    expected *= size;
  }
  return true;
}

}  // namespace

void all_reduce_sum_each_after(const std::vector<std::vector<Tensor>>& bufs, const std::vector<Event>& ready) {
  const char* op = "all_reduce_sum_each_after";
  if (bufs.empty()) return;
  const size_t n = bufs[0].size();
  CHORUS_CHECK(n > 0, op, ": tensor 0 has no buffers");
  CHORUS_CHECK(ready.size() == n, op, ": ", ready.size(), " events for ", n, " devices");
  for (size_t t = 0; t < bufs.size(); ++t) {
    const std::vector<Tensor>& g = bufs[t];
    CHORUS_CHECK(g.size() == n, op, ": tensor ", t, " has ", g.size(), " buffers, tensor 0 has ", n);
    for (size_t i = 0; i < n; ++i) {
      CHORUS_CHECK(g[i].defined(), op, ": buffer ", i, " of tensor ", t, " is an undefined tensor");
      CHORUS_CHECK(g[i].device() == bufs[0][i].device(), op, ": buffer ", i, " of tensor ", t, " is on ",
                   g[i].device().str(), " but buffer ", i, " of tensor 0 is on ", bufs[0][i].device().str());
      CHORUS_CHECK(dense(g[i]), op, ": buffer ", i, " of tensor ", t, " (", g[i].describe(), ", strides ",
                   shape_str(g[i].strides()), ") is not dense");
      CHORUS_CHECK(g[i].sizes() == g[0].sizes() && g[i].strides() == g[0].strides() && g[i].dtype() == g[0].dtype(),
                   op, ": buffer ", i, " of tensor ", t, " is ", g[i].describe(), " with strides ",
                   shape_str(g[i].strides()), " but buffer 0 is ", g[0].describe(), " with strides ",
                   shape_str(g[0].strides()));
    }
    check_distinct(g, op);
  }
  for (size_t i = 0; i < n; ++i)
    CHORUS_CHECK(ready[i].device() == bufs[0][i].device(), op, ": the event of device ", i, " is on ",
                 ready[i].device().str(), " but the buffers are on ", bufs[0][i].device().str());
  if (n < 2) return;
#ifdef CHORUS_WITH_NCCL
  bool nccl = all_cuda(bufs[0]);
  for (const std::vector<Tensor>& g : bufs) nccl = nccl && cuda::nccl_can_reduce(g[0].dtype());
  if (nccl) {
    std::vector<int> devices;
    std::vector<void*> events;
    for (size_t i = 0; i < n; ++i) {
      devices.push_back(bufs[0][i].device().index);
      events.push_back(ready[i].handle());
    }
    std::vector<std::vector<void*>> ptrs;
    std::vector<size_t> counts;
    std::vector<DType> dtypes;
    for (const std::vector<Tensor>& g : bufs) {
      ptrs.emplace_back();
      for (const Tensor& b : g) ptrs.back().push_back(b.raw_data());
      counts.push_back(static_cast<size_t>(g[0].numel()));
      dtypes.push_back(g[0].dtype());
    }
    cuda::nccl_all_reduce_each_after(devices, ptrs, counts, dtypes, events);
    // Named on the communication streams: a free waits for the collective.
    for (const std::vector<Tensor>& g : bufs)
      for (const Tensor& t : g) {
        backend(t.device()).record_use(t.storage()->data(), t.device(), t.device(),
                                       cuda::nccl_stream(t.device().index));
        t.bump_version();
      }
    return;
  }
#endif
  // In order, one tensor at a time, as all_reduce_sum_after's fallback.
  for (const std::vector<Tensor>& g : bufs) {
    if (g[0].numel() == 0) continue;
    reduce_fallback(g, g[0], /*dst_is_first=*/true);
    for (size_t i = 1; i < g.size(); ++i) copy_(g[i], g[0]);
  }
}

void comm_join(const Device& device) {
#ifdef CHORUS_WITH_NCCL
  if (device.is_cuda()) cuda::nccl_join(device.index);
#endif
#ifdef CHORUS_WITH_CUDA
  if (device.is_cuda()) cuda::peer_join(device.index);
#else
  (void)device;
#endif
}

void reduce_sum(const std::vector<Tensor>& srcs, const Tensor& dst) {
  const char* op = "reduce_sum";
  const bool dst_is_first = check_reduce(srcs, dst, op);
  if (srcs[0].numel() == 0) return;
#ifdef CHORUS_WITH_NCCL
  if (nccl_reduces(srcs, dst)) {
    nccl_reduce(srcs, dst, nullptr);
    return;
  }
#endif
  reduce_fallback(srcs, dst, dst_is_first);
}

}  // namespace chorus::ops
