// In-process NCCL collectives (Note [In-process NCCL] in nccl.h).
#include "chorus/cuda/runtime/nccl.h"

#include <cstdlib>

#include <cuda_runtime.h>
#ifdef CHORUS_WITH_NCCL
#include <nccl.h>

#include "chorus/cuda/runtime/nccl_check.h"
#endif

#include <map>
#include <mutex>
#include <string>

#include "chorus/core/error.h"
#include "chorus/cuda/runtime/context.h"

namespace chorus::cuda {

#ifdef CHORUS_WITH_NCCL

std::string nccl_error_message(ncclResult_t r, const char* call, ncclComm_t comm, const std::string& where) {
  std::string msg = detail::str_cat("NCCL error: ", ncclGetErrorString(r), " in ", call);
  if (!where.empty()) msg += " over " + where;
  if (comm) {
    const char* last = ncclGetLastError(comm);
    if (last && *last) msg += std::string(" (") + last + ")";
  }
  return msg;
}

namespace {

std::string device_list(const std::vector<int>& devices) {
  std::string s;
  for (int d : devices) s += (s.empty() ? "cuda:" : ", cuda:") + std::to_string(d);
  return s;
}

// The error of a failed set-up or collective: the devices, and NCCL's description of the
// failure, captured by the caller before anything else could replace it.
[[noreturn]] void throw_nccl_error_over(ncclResult_t r, const char* call, const std::vector<int>& devices,
                                        const char* detail_msg, const char* file, int line) {
  std::string where = device_list(devices);
  if (detail_msg && *detail_msg) where += std::string(" (") + detail_msg + ")";
  throw_nccl_error(r, call, nullptr, where, file, line);
}

// NCCL's description of its last failure ("" when it has none).
std::string last_error(ncclComm_t comm) {
  const char* m = ncclGetLastError(comm);
  return m ? m : "";
}

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::Float32: return ncclFloat32;
    case DType::Float16: return ncclFloat16;
#if NCCL_VERSION_CODE >= 21000
    case DType::BFloat16: return ncclBfloat16;
#endif
    case DType::Float64: return ncclFloat64;
    case DType::Int64: return ncclInt64;
    case DType::Int32: return ncclInt32;
    case DType::UInt8: return ncclUint8;
    default: break;
  }
  CHORUS_THROW(DeviceError, "NCCL cannot reduce ", dtype_name(t), " tensors");
}

// One device's communication stream and the two events that join it to a
// current stream. Raw cudaEvent_t, not chorus::Event: they live as long as the
// process in the leaked State below (never destroyed, so nothing to leak if a
// check throws) and are recorded on the raw communication stream, which is no
// chorus::Stream (reused: every call holds the mutex, and a wait captures the
// event's state when it is enqueued).
struct PerDevice {
  cudaStream_t stream = nullptr;
  cudaEvent_t ready = nullptr;  // current stream -> communication stream
  cudaEvent_t done = nullptr;   // communication stream -> current stream
};

struct State {
  std::mutex mu;
  std::map<std::vector<int>, std::vector<ncclComm_t>> comms;  // by ordered device list
  std::map<int, PerDevice> devices;
};

// Leaked on purpose: communicators and streams must outlive static destruction
// (a tensor freed at exit may still name a stream), and destroying them then
// could touch a CUDA runtime that is already unloading.
State& state() {
  static auto* s = new State;
  return *s;
}

PerDevice& per_device(State& st, int d) {
  PerDevice& pd = st.devices[d];
  if (!pd.stream) {
    CudaDeviceGuard guard(d);
    PerDevice made;
    CHORUS_CUDA_CHECK(cudaStreamCreateWithFlags(&made.stream, cudaStreamNonBlocking));
    CHORUS_CUDA_CHECK(cudaEventCreateWithFlags(&made.ready, cudaEventDisableTiming));
    CHORUS_CUDA_CHECK(cudaEventCreateWithFlags(&made.done, cudaEventDisableTiming));
    pd = made;
  }
  return pd;
}

std::vector<ncclComm_t>& comm_set(State& st, const std::vector<int>& devices) {
  auto it = st.comms.find(devices);
  if (it != st.comms.end()) return it->second;
  // Note [NCCL graph mixing]: one graph captured from several threads.
  ::setenv("NCCL_GRAPH_MIXING_SUPPORT", "0", /*overwrite=*/0);
  std::vector<ncclComm_t> comms(devices.size(), nullptr);
  int cur = 0;
  CHORUS_CUDA_CHECK(cudaGetDevice(&cur));
  CudaDeviceGuard restore(cur);  // ncclCommInitAll switches devices
  ncclResult_t r = ncclCommInitAll(comms.data(), static_cast<int>(devices.size()), devices.data());
  if (r != ncclSuccess)
    throw_nccl_error_over(r, "ncclCommInitAll", devices, last_error(nullptr).c_str(), __FILE__, __LINE__);
  return st.comms.emplace(devices, std::move(comms)).first->second;
}

// Aborts and forgets a set after a failure, so that a later call starts over
// instead of queueing behind a collective that can no longer complete.
void drop_comm_set(State& st, const std::vector<int>& devices) {
  auto it = st.comms.find(devices);
  if (it == st.comms.end()) return;
  for (ncclComm_t c : it->second)
    if (c) (void)ncclCommAbort(c);
  st.comms.erase(it);
}

// Issues issue(rank, comm, stream) for every rank inside one group, on the
// communication streams: joined to the current streams both ways, or, given
// `ready` (one cudaEvent_t per rank), after those events and joined to nothing
// (Note [Overlapped collectives]).
template <typename Issue>
void run_collective(const char* call, const std::vector<int>& devices, Issue&& issue,
                    const std::vector<void*>* ready = nullptr) {
  for (size_t i = 0; i < devices.size(); ++i)
    for (size_t j = 0; j < i; ++j)
      CHORUS_CHECK(devices[i] != devices[j], call, ": cuda:", devices[i], " appears twice in the device list");
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  std::vector<ncclComm_t>& comms = comm_set(st, devices);
  std::vector<PerDevice*> pds;
  std::vector<cudaStream_t> current;
  for (int d : devices) {
    PerDevice& pd = per_device(st, d);
    cudaStream_t cur = current_stream(d);
    CudaDeviceGuard guard(d);
    if (ready) {
      CHORUS_CUDA_CHECK(cudaStreamWaitEvent(pd.stream, static_cast<cudaEvent_t>((*ready)[pds.size()]), 0));
    } else {
      CHORUS_CUDA_CHECK(cudaEventRecord(pd.ready, cur));
      CHORUS_CUDA_CHECK(cudaStreamWaitEvent(pd.stream, pd.ready, 0));
    }
    pds.push_back(&pd);
    current.push_back(cur);
  }
  int cur_dev = 0;
  CHORUS_CUDA_CHECK(cudaGetDevice(&cur_dev));
  {
    CudaDeviceGuard restore(cur_dev);
    CHORUS_NCCL_CHECK(ncclGroupStart());
    ncclResult_t failed = ncclSuccess;
    std::string failed_msg;
    for (size_t i = 0; i < devices.size() && failed == ncclSuccess; ++i) {
      failed = issue(static_cast<int>(i), comms[i], pds[i]->stream);
      if (failed != ncclSuccess) failed_msg = last_error(comms[i]);
    }
    ncclResult_t end = ncclGroupEnd();
    if (failed != ncclSuccess || end != ncclSuccess) {
      const bool in_call = failed != ncclSuccess;
      if (!in_call) failed_msg = last_error(comms[0]);
      drop_comm_set(st, devices);
      throw_nccl_error_over(in_call ? failed : end, in_call ? call : "ncclGroupEnd", devices, failed_msg.c_str(),
                       __FILE__, __LINE__);
    }
  }
  if (ready) return;
  for (size_t i = 0; i < devices.size(); ++i) {
    CudaDeviceGuard guard(devices[i]);
    CHORUS_CUDA_CHECK(cudaEventRecord(pds[i]->done, pds[i]->stream));
    CHORUS_CUDA_CHECK(cudaStreamWaitEvent(current[i], pds[i]->done, 0));
  }
}

}  // namespace

bool nccl_available() { return true; }

bool nccl_can_reduce(DType dtype) {
  switch (dtype) {
    case DType::Float32:
    case DType::Float16:
    case DType::Float64:
    case DType::Int64:
    case DType::Int32:
    case DType::UInt8:
      return true;
    case DType::BFloat16:
      return NCCL_VERSION_CODE >= 21000;
    default:
      return false;
  }
}

void nccl_broadcast(const std::vector<int>& devices, const std::vector<void*>& bufs, size_t nbytes) {
  CHORUS_ASSERT(devices.size() == bufs.size());
  if (devices.size() < 2 || nbytes == 0) return;
  run_collective("ncclBroadcast", devices, [&](int rank, ncclComm_t comm, cudaStream_t stream) {
    // Bytes: a broadcast does no arithmetic, so every dtype is the same to it.
    // Rank 0 sends from its buffer; the others receive into theirs.
    void* buf = bufs[static_cast<size_t>(rank)];
    return ncclBroadcast(buf, buf, nbytes, ncclUint8, 0, comm, stream);
  });
}

namespace {
void reduce(const std::vector<int>& devices, const std::vector<const void*>& srcs, void* dst, size_t count,
            DType dtype, const std::vector<void*>* ready) {
  CHORUS_ASSERT(devices.size() == srcs.size() && !devices.empty());
  CHORUS_ASSERT(!ready || ready->size() == devices.size());
  if (count == 0) return;
  const ncclDataType_t type = nccl_type(dtype);
  run_collective(
      "ncclReduce", devices,
      [&](int rank, ncclComm_t comm, cudaStream_t stream) {
        // Only the root's receive buffer is used.
        return ncclReduce(srcs[static_cast<size_t>(rank)], rank == 0 ? dst : nullptr, count, type, ncclSum, 0,
                          comm, stream);
      },
      ready);
}
}  // namespace

void nccl_reduce_sum(const std::vector<int>& devices, const std::vector<const void*>& srcs, void* dst, size_t count,
                     DType dtype) {
  reduce(devices, srcs, dst, count, dtype, nullptr);
}

void nccl_reduce_sum_after(const std::vector<int>& devices, const std::vector<const void*>& srcs, void* dst,
                           size_t count, DType dtype, const std::vector<void*>& ready) {
  reduce(devices, srcs, dst, count, dtype, &ready);
}

void nccl_all_reduce_sum_after(const std::vector<int>& devices, const std::vector<void*>& bufs, size_t count,
                               DType dtype, const std::vector<void*>& ready) {
  CHORUS_ASSERT(devices.size() == bufs.size() && ready.size() == devices.size() && !devices.empty());
  if (count == 0) return;
  const ncclDataType_t type = nccl_type(dtype);
  run_collective(
      "ncclAllReduce", devices,
      [&](int rank, ncclComm_t comm, cudaStream_t stream) {
        void* buf = bufs[static_cast<size_t>(rank)];
        return ncclAllReduce(buf, buf, count, type, ncclSum, comm, stream);
      },
      &ready);
}

void nccl_all_reduce_each_after(const std::vector<int>& devices, const std::vector<std::vector<void*>>& bufs,
                                const std::vector<size_t>& counts, const std::vector<DType>& dtypes,
                                const std::vector<void*>& ready) {
  CHORUS_ASSERT(bufs.size() == counts.size() && dtypes.size() == counts.size());
  CHORUS_ASSERT(ready.size() == devices.size() && !devices.empty());
  size_t total = 0;
  for (size_t t = 0; t < bufs.size(); ++t) {
    CHORUS_ASSERT(bufs[t].size() == devices.size());
    total += counts[t];
  }
  if (total == 0) return;
  std::vector<ncclDataType_t> types;
  for (DType d : dtypes) types.push_back(nccl_type(d));
  run_collective(
      "ncclAllReduce", devices,
      [&](int rank, ncclComm_t comm, cudaStream_t stream) {
        for (size_t t = 0; t < bufs.size(); ++t) {
          if (counts[t] == 0) continue;
          void* buf = bufs[t][static_cast<size_t>(rank)];
          const ncclResult_t r = ncclAllReduce(buf, buf, counts[t], types[t], ncclSum, comm, stream);
          if (r != ncclSuccess) return r;
        }
        return ncclSuccess;
      },
      &ready);
}

void nccl_join(int device) {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  auto it = st.devices.find(device);
  if (it == st.devices.end()) return;
  const PerDevice& pd = it->second;
  cudaStream_t cur = current_stream(device);
  // A capture in which this device's collectives took no part (a step whose
  // gradients the copy engines summed, after an eager broadcast) has nothing
  // of theirs to wait for, and may not wait for work outside it.
  if (!same_capture(cur, pd.stream)) return;
  CudaDeviceGuard guard(device);
  // `done` may be re-recorded by the next call: the wait has captured it.
  CHORUS_CUDA_CHECK(cudaEventRecord(pd.done, pd.stream));
  CHORUS_CUDA_CHECK(cudaStreamWaitEvent(cur, pd.done, 0));
}

void* nccl_stream(int device) {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  return per_device(st, device).stream;
}

#else  // no NCCL in this build

bool nccl_available() { return false; }
bool nccl_can_reduce(DType) { return false; }

void nccl_broadcast(const std::vector<int>&, const std::vector<void*>&, size_t) {
  CHORUS_THROW(DeviceError, "ncclBroadcast: this build of Chorus has no NCCL");
}

void nccl_reduce_sum(const std::vector<int>&, const std::vector<const void*>&, void*, size_t, DType) {
  CHORUS_THROW(DeviceError, "ncclReduce: this build of Chorus has no NCCL");
}

void nccl_all_reduce_each_after(const std::vector<int>&, const std::vector<std::vector<void*>>&,
                                const std::vector<size_t>&, const std::vector<DType>&, const std::vector<void*>&) {
  CHORUS_THROW(DeviceError, "ncclAllReduce: this build of Chorus has no NCCL");
}
void nccl_reduce_sum_after(const std::vector<int>&, const std::vector<const void*>&, void*, size_t, DType,
                           const std::vector<void*>&) {
  CHORUS_THROW(DeviceError, "ncclReduce: this build of Chorus has no NCCL");
}
void nccl_all_reduce_sum_after(const std::vector<int>&, const std::vector<void*>&, size_t, DType,
                               const std::vector<void*>&) {
  CHORUS_THROW(DeviceError, "ncclAllReduce: this build of Chorus has no NCCL");
}
void nccl_join(int) {}
void* nccl_stream(int) { return nullptr; }

#endif

}  // namespace chorus::cuda
