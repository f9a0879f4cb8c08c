// ProcessGroupGloo: CPU tensors over Gloo's TCP transport. Operations run in
// order on one worker thread per group, so every call returns a Work at once
// and the caller's thread never blocks in the network (Note [Collective
// timeouts] in process_group.h for failures).
#include "chorus/distributed/gloo_group.h"

#ifdef CHORUS_WITH_GLOO

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "chorus/core/error.h"
#include "chorus/distributed/collective_watch.h"
#include "chorus/distributed/roll_call.h"
#include "chorus/distributed/store_barrier.h"
#include "chorus/ops/copy.h"
#include "chorus/ops/profile.h"

namespace chorus::dist {

namespace {

// Gloo's rendezvous through a Chorus store.
class GlooStore final : public ::gloo::rendezvous::Store {
 public:
  explicit GlooStore(StorePtr s) : s_(std::move(s)) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    s_->set(key, Bytes(data.begin(), data.end()));
  }
  std::vector<char> get(const std::string& key) override {
    Bytes b = s_->get(key);
    return std::vector<char>(b.begin(), b.end());
  }
  void wait(const std::vector<std::string>& keys) override { s_->wait(keys); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    s_->wait(keys, timeout);
  }

 private:
  StorePtr s_;
};

// Elementwise reductions Gloo calls as f(out, a, b, n).
template <typename T>
void reduce_fn(ReduceOp op, void* c, const void* a, const void* b, size_t n) {
  T* o = static_cast<T*>(c);
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
  for (size_t i = 0; i < n; ++i) {
    switch (op) {
      case ReduceOp::Sum: case ReduceOp::Avg: o[i] = x[i] + y[i]; break;
      case ReduceOp::Max: o[i] = x[i] > y[i] ? x[i] : y[i]; break;
      case ReduceOp::Min: o[i] = x[i] < y[i] ? x[i] : y[i]; break;
    }
  }
}

// bfloat16 is added in float and rounded once per step (as PyTorch's Gloo does).
void reduce_bf16(ReduceOp op, void* c, const void* a, const void* b, size_t n) {
  auto* o = static_cast<BFloat16*>(c);
  const auto* x = static_cast<const BFloat16*>(a);
  const auto* y = static_cast<const BFloat16*>(b);
  for (size_t i = 0; i < n; ++i) {
    const float fx = x[i], fy = y[i];
    float r = fx + fy;
    if (op == ReduceOp::Max) r = fx > fy ? fx : fy;
    if (op == ReduceOp::Min) r = fx < fy ? fx : fy;
    o[i] = BFloat16(r);
  }
}

std::function<void(void*, const void*, const void*, size_t)> reducer(DType d, ReduceOp op) {
  switch (d) {
    case kFloat32: return [op](void* c, const void* a, const void* b, size_t n) { reduce_fn<float>(op, c, a, b, n); };
    case kFloat64: return [op](void* c, const void* a, const void* b, size_t n) { reduce_fn<double>(op, c, a, b, n); };
    case kInt64: return [op](void* c, const void* a, const void* b, size_t n) { reduce_fn<int64_t>(op, c, a, b, n); };
    case kBFloat16: return [op](void* c, const void* a, const void* b, size_t n) { reduce_bf16(op, c, a, b, n); };
    default: CHORUS_THROW(ValueError, "gloo: no reduction for ", dtype_name(d));
  }
}

void divide(const Tensor& t, int64_t by) {
  const int64_t n = t.numel();
  switch (t.dtype()) {
    case kFloat32: { float* p = t.data<float>(); for (int64_t i = 0; i < n; ++i) p[i] /= static_cast<float>(by); break; }
    case kFloat64: { double* p = t.data<double>(); for (int64_t i = 0; i < n; ++i) p[i] /= static_cast<double>(by); break; }
    case kBFloat16: {
      auto* p = static_cast<BFloat16*>(t.raw_data());
      for (int64_t i = 0; i < n; ++i) p[i] = BFloat16(static_cast<float>(p[i]) / static_cast<float>(by));
      break;
    }
    default: CHORUS_THROW(ValueError, "all_reduce avg needs a floating tensor, got ", dtype_name(t.dtype()));
  }
}

// Point-to-point slots live apart from the collectives' (Gloo builds those
// from small prefixes and the tag).
uint64_t p2p_slot(int tag) { return (uint64_t{0xC4} << 56) | static_cast<uint32_t>(tag); }

// One operation: done once the worker has run it.
class GlooWork final : public Work {
 public:
  bool is_completed() override {
    std::lock_guard<std::mutex> lk(mu_);
    return done_;
  }
  void wait() override {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return done_; });
    if (error_) std::rethrow_exception(error_);
  }
  void finish(std::exception_ptr e) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      done_ = true;
      error_ = e;
    }
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
};

// Note [Connected before anyone returns]: Gloo's connectFullMesh returns on a
// rank once its own side of every pair is done, which can be before the peer
// has read the handshake. A rank that then exits at once (a job that only
// joins, or fails right after) closes the socket under a peer still
// connecting, and that peer fails with "Connection closed by peer" (seen in
// CI under load, about one job in 40). So nobody leaves the constructor until
// every rank has connected: a store_barrier (distributed/store_barrier.h), which
// names a rank that never connects and lets rank 0, the store's usual host,
// leave last.

}  // namespace

struct ProcessGroupGloo::Impl {
  std::shared_ptr<::gloo::rendezvous::Context> context;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::pair<std::function<void()>, std::shared_ptr<GlooWork>>> queue;
  bool stop = false;
  std::exception_ptr broken;  // the failure that ended the group, rethrown by later calls
  uint64_t seq = 0;           // operations issued so far
  std::unique_ptr<CollectiveWatch> watch;  // Note [Stuck collectives named early]
  std::string trace_track;                 // "gloo", or "gloo tp" for a mesh's tensor group (trace_track())
  std::thread worker;
};

ProcessGroupGloo::ProcessGroupGloo(int rank, int size, StorePtr store, ProcessGroupOptions options)
    : ProcessGroup(rank, size, std::move(store), options), impl_(std::make_unique<Impl>()) {
  ::gloo::transport::tcp::attr attr;
  // GLOO_SOCKET_IFNAME picks the interface (as in PyTorch); otherwise the
  // address this machine reaches the master from (options.local_addr).
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname) attr.iface = ifname;
  else attr.hostname = options.local_addr.empty() ? "127.0.0.1" : options.local_addr;
  std::shared_ptr<::gloo::transport::Device> device;
  try {
    device = ::gloo::transport::tcp::CreateDevice(attr);
    impl_->context = std::make_shared<::gloo::rendezvous::Context>(rank, size);
    impl_->context->setTimeout(options.timeout);
    GlooStore gs(store_);
    impl_->context->connectFullMesh(gs, device);
  } catch (const ::gloo::Exception& e) {
    CHORUS_THROW(DistError, "gloo: rank ", rank, " of ", size, " could not connect to the other ranks: ", e.what());
  }
  store_barrier(*store_, "gloo-connected/" + options.name, rank, size, options.timeout,
                detail::str_cat("gloo: rank ", rank, " of ", size, " (waiting for every rank to connect)"));
  impl_->watch = std::make_unique<CollectiveWatch>(store_, options.name, "gloo", rank, size, options.timeout);
  impl_->watch->set_job_ranks(options.job_ranks);
  impl_->trace_track = trace_track();
  impl_->worker = std::thread([this] { run(); });
}

ProcessGroupGloo::~ProcessGroupGloo() {
  {
    std::lock_guard<std::mutex> lk(impl_->mu);
    impl_->stop = true;
  }
  impl_->cv.notify_all();
  if (impl_->worker.joinable()) impl_->worker.join();
}

void ProcessGroupGloo::run() {
  for (;;) {
    std::pair<std::function<void()>, std::shared_ptr<GlooWork>> item;
    {
      std::unique_lock<std::mutex> lk(impl_->mu);
      impl_->cv.wait(lk, [&] { return impl_->stop || !impl_->queue.empty(); });
      if (impl_->queue.empty()) return;
      item = std::move(impl_->queue.front());
      impl_->queue.pop_front();
    }
    std::exception_ptr err;
    {
      std::lock_guard<std::mutex> lk(impl_->mu);
      err = impl_->broken;
    }
    if (!err) {
      try {
        item.first();
      } catch (...) {
        err = std::current_exception();
        std::lock_guard<std::mutex> lk(impl_->mu);
        impl_->broken = err;
        impl_->context.reset();  // closes every pair: peers still waiting on us fail at once
      }
    }
    item.second->finish(err);
  }
}

// Note [Collective signatures]: Gloo takes a collective's sizes on trust. When
// ranks bring different ones (other --steps, --log-every or data-set sizes,
// another --sizes-mb), a message of the wrong size reaches Gloo's own network
// thread, whose exception nobody can catch: the rank died by SIGABRT. So
// before each collective the ranks all-gather what they bring (a few int64s,
// the same size on every rank whatever they bring, under a tag of its own)
// and every rank compares: any difference is a DistError on every rank naming
// the collective, its sequence number and what each rank brought, and the
// collective itself never runs. The cost is one small all-gather per
// collective (tens of microseconds on one machine; Gloo is the CPU backend).
namespace {
enum SignatureField { kOp, kDType, kNumel, kRoot, kReduce, kFields };
const char* const kOpNames[] = {"?", "all_reduce", "broadcast", "all_gather", "barrier"};
std::vector<int64_t> signature(int op, const Tensor* t, int64_t root = -1, int64_t reduce = -1) {
  std::vector<int64_t> s(kFields, -1);
  s[kOp] = op;
  if (t) {
    s[kDType] = static_cast<int64_t>(t->dtype());
    s[kNumel] = t->numel();
  }
  s[kRoot] = root;
  s[kReduce] = reduce;
  return s;
}
std::string describe_signature(const int64_t* s) {
  std::string out = s[kOp] > 0 && s[kOp] < 5 ? kOpNames[s[kOp]] : "operation " + std::to_string(s[kOp]);
  if (s[kDType] >= 0) out += " of " + std::to_string(s[kNumel]) + " x " + dtype_name(static_cast<DType>(s[kDType]));
  if (s[kRoot] >= 0) out += " from root " + std::to_string(s[kRoot]);
  if (s[kReduce] >= 0) out += std::string(" (") + reduce_op_name(static_cast<ReduceOp>(s[kReduce])) + ")";
  return out;
}
// Tags of the signature all-gathers: apart from the collectives' (their sequence numbers).
uint32_t signature_tag(uint64_t seq) { return 0x80000000u | static_cast<uint32_t>(seq & 0x7fffffffu); }
}  // namespace

void ProcessGroupGloo::check_signature(const std::shared_ptr<::gloo::Context>& ctx, const char* op, uint64_t seq,
                                       const std::vector<int64_t>& mine) {
  const size_t k = mine.size();
  std::vector<int64_t> all(k * static_cast<size_t>(ctx->size));
  ::gloo::AllgatherOptions o(ctx);
  o.setInput(const_cast<int64_t*>(mine.data()), k);
  o.setOutput(all.data(), all.size());
  o.setTag(signature_tag(seq));
  o.setTimeout(options_.timeout);
  ::gloo::allgather(o);
  bool same = true;
  for (int r = 1; r < ctx->size && same; ++r) same = std::equal(all.begin(), all.begin() + k, all.begin() + r * k);
  if (same) return;
  std::string brought;
  const int shown = std::min(ctx->size, 8);
  for (int r = 0; r < shown; ++r) brought += (r ? "; rank " : "rank ") + std::to_string(r) + ": " + describe_signature(&all[r * k]);
  if (shown < ctx->size) brought += "; ... (" + std::to_string(ctx->size) + " ranks)";
  CHORUS_THROW(DistError, backend(), " ", op, " #", seq, " on rank ", rank_,
               ": the ranks brought different collectives (", brought,
               "); they were given different options or data (e.g. --steps, --log-every, a data set of another size, "
               "--sizes-mb) or took different code paths. Nothing was exchanged");
}

WorkPtr ProcessGroupGloo::enqueue(const char* op, int64_t bytes, std::vector<int64_t> sig,
                                  std::function<void(std::shared_ptr<::gloo::Context>, uint32_t)> body) {
  auto work = std::make_shared<GlooWork>();
  std::lock_guard<std::mutex> lk(impl_->mu);
  if (impl_->broken) std::rethrow_exception(impl_->broken);
  const uint64_t seq = ++impl_->seq;
  std::shared_ptr<::gloo::Context> ctx = impl_->context;
  impl_->queue.emplace_back(
      [this, op, seq, bytes, ctx, sig = std::move(sig), body = std::move(body)] {
        try {
          const auto begin = std::chrono::steady_clock::now();
          impl_->watch->begin(op, seq, bytes);
          if (!sig.empty() && ctx->size > 1) check_signature(ctx, op, seq, sig);
          body(ctx, static_cast<uint32_t>(seq));
          impl_->watch->end(seq);
          // Note [Step traces]: the worker's collectives as a track of their own.
          ops::trace_span(impl_->trace_track, op, "comm", begin, std::chrono::steady_clock::now());
        } catch (const ::gloo::Exception& e) {
          fail(op, seq, e.what());
        } catch (...) {
          impl_->watch->end(seq);  // over, if not done: no warning about it later
          throw;
        }
      },
      work);
  impl_->cv.notify_one();
  return work;
}

void ProcessGroupGloo::fail(const char* op, uint64_t seq, const std::string& why) {
  // What this rank was doing, in its log before the error ends the job.
  std::fprintf(stderr, "chorus: rank %d: gloo %s #%llu failed; the last collectives of group '%s' (sequence number, op, size, time):\n%s",
               job_rank(rank_), op, static_cast<unsigned long long>(seq), options_.name.c_str(), impl_->watch->recent().c_str());
  impl_->watch->end(seq);
  std::vector<int> missing =
      roll_call(*store_, options_.name, rank_, size_, seq, options_.timeout, job_store(), job_rank(rank_));
  throw_collective_failure(backend(), op, seq, rank_, missing, why, options_.timeout, job_store(), options_.job_ranks,
                           options_.job_ranks.empty() ? "" : options_.name);
}

WorkPtr ProcessGroupGloo::all_reduce(const Tensor& t, ReduceOp op) {
  check_tensor("all_reduce", t);
  CHORUS_CHECK(t.device().is_cpu(), "all_reduce: the gloo backend takes CPU tensors, got ", t.describe());
  CHORUS_CHECK(op != ReduceOp::Avg || is_floating(t.dtype()), "all_reduce: avg needs a floating tensor, got ",
               t.describe());
  const int size = size_;
  return enqueue("all_reduce", t.nbytes(), signature(1, &t, -1, static_cast<int64_t>(op)), [t, op, size, timeout = options_.timeout](std::shared_ptr<::gloo::Context> ctx,
                                                                         uint32_t tag) {
    if (t.numel() > 0 && size > 1) {
      ::gloo::AllreduceOptions o(ctx);
      const size_t n = static_cast<size_t>(t.numel());
      switch (t.dtype()) {  // the typed setters record the element size
        case kFloat32: o.setInput(t.data<float>(), n); o.setOutput(t.data<float>(), n); break;
        case kFloat64: o.setInput(t.data<double>(), n); o.setOutput(t.data<double>(), n); break;
        case kInt64: o.setInput(t.data<int64_t>(), n); o.setOutput(t.data<int64_t>(), n); break;
        default: {
          auto* p = static_cast<uint16_t*>(t.raw_data());
          o.setInput(p, n);
          o.setOutput(p, n);
        }
      }
      o.setReduceFunction(reducer(t.dtype(), op));
      o.setTag(tag);
      o.setTimeout(timeout);
      ::gloo::allreduce(o);
    }
    if (op == ReduceOp::Avg) divide(t, size);
  });
}

WorkPtr ProcessGroupGloo::broadcast(const Tensor& t, int root) {
  check_tensor("broadcast", t);
  CHORUS_CHECK(root >= 0 && root < size_, "broadcast: root ", root, " is not a rank of this group (", size_, " ranks)");
  return enqueue("broadcast", t.nbytes(), signature(2, &t, root), [t, root, timeout = options_.timeout](std::shared_ptr<::gloo::Context> ctx, uint32_t tag) {
    if (t.numel() == 0 || ctx->size == 1) return;
    ::gloo::BroadcastOptions o(ctx);
    const size_t bytes = t.numel() * dtype_size(t.dtype());
    auto* p = static_cast<uint8_t*>(t.raw_data());
    if (ctx->rank == root) o.setInput(p, bytes);
    o.setOutput(p, bytes);
    o.setRoot(root);
    o.setTag(tag);
    o.setTimeout(timeout);
    ::gloo::broadcast(o);
  });
}

WorkPtr ProcessGroupGloo::all_gather(const Tensor& in, const Tensor& out) {
  check_tensor("all_gather", in);
  check_tensor("all_gather", out);
  CHORUS_CHECK(out.dtype() == in.dtype() && out.numel() == in.numel() * size_, "all_gather: out must hold ", size_,
               " x ", in.numel(), " elements of ", dtype_name(in.dtype()), ", got ", out.describe());
  return enqueue("all_gather", out.nbytes(), signature(3, &in), [in, out, timeout = options_.timeout](std::shared_ptr<::gloo::Context> ctx, uint32_t tag) {
    const size_t bytes = in.numel() * dtype_size(in.dtype());
    if (bytes == 0) return;
    if (ctx->size == 1) {
      std::memcpy(out.raw_data(), in.raw_data(), bytes);
      return;
    }
    ::gloo::AllgatherOptions o(ctx);
    o.setInput(static_cast<uint8_t*>(in.raw_data()), bytes);
    o.setOutput(static_cast<uint8_t*>(out.raw_data()), bytes * static_cast<size_t>(ctx->size));
    o.setTag(tag);
    o.setTimeout(timeout);
    ::gloo::allgather(o);
  });
}

WorkPtr ProcessGroupGloo::reduce_scatter(const Tensor& in, const Tensor& out, ReduceOp op) {
  check_tensor("reduce_scatter", in);
  check_tensor("reduce_scatter", out);
  CHORUS_CHECK(out.dtype() == in.dtype() && in.numel() == out.numel() * size_, "reduce_scatter: in must hold ", size_,
               " x out.numel() elements, got in ", in.describe(), " and out ", out.describe());
  // All-reduce of a copy, then this rank's chunk: the CPU path favours
  // simplicity over the halving-doubling traffic saving.
  Tensor tmp = in.clone();
  WorkPtr w = all_reduce(tmp, op);
  const int rank = rank_;
  return enqueue("reduce_scatter", in.nbytes(), {}, [w, tmp, out, rank](std::shared_ptr<::gloo::Context>, uint32_t) {
    w->wait();
    const size_t bytes = out.numel() * dtype_size(out.dtype());
    std::memcpy(out.raw_data(), static_cast<const char*>(tmp.raw_data()) + bytes * rank, bytes);
  });
}

WorkPtr ProcessGroupGloo::barrier() {
  return enqueue("barrier", 0, signature(4, nullptr), [timeout = options_.timeout](std::shared_ptr<::gloo::Context> ctx, uint32_t tag) {
    if (ctx->size == 1) return;
    ::gloo::BarrierOptions o(ctx);
    o.setTag(tag);
    o.setTimeout(timeout);
    ::gloo::barrier(o);
  });
}

// Point to point: posted at once from the caller's thread, not queued behind
// the worker (a send completes only when its recv is posted: two ranks each
// sending before receiving would otherwise wait on each other's queues).
class ProcessGroupGloo::P2PWork final : public Work {
 public:
  P2PWork(ProcessGroupGloo* pg, const char* op, uint64_t seq, bool is_send, Tensor t,
          std::unique_ptr<::gloo::transport::UnboundBuffer> buf)
      : pg_(pg), op_(op), seq_(seq), is_send_(is_send), t_(std::move(t)), buf_(std::move(buf)) {}
  bool is_completed() override { return done_; }
  void wait() override {
    if (done_) return;
    bool ok = false;
    std::string why;
    const auto begin = std::chrono::steady_clock::now();
    try {
      ok = is_send_ ? buf_->waitSend(pg_->options_.timeout) : buf_->waitRecv(pg_->options_.timeout);
      if (!ok) why = std::string(op_) + " timed out";
    } catch (const ::gloo::Exception& e) {
      why = e.what();
    }
    done_ = true;
    if (!ok) pg_->fail(op_, seq_, why);
    // Note [Step traces]: the time the caller waited for the transfer (a
    // pipeline stage waiting for its neighbour), on the calling thread's host
    // track; the transfer itself has no worker thread to show it on.
    ops::trace_host_span(op_, "comm", begin, std::chrono::steady_clock::now());
  }

 private:
  ProcessGroupGloo* pg_;
  const char* op_;
  uint64_t seq_;
  bool is_send_;
  Tensor t_;  // keeps the memory alive while the transfer may touch it
  std::unique_ptr<::gloo::transport::UnboundBuffer> buf_;
  bool done_ = false;
};

WorkPtr ProcessGroupGloo::post(const char* op, const Tensor& t, int peer, int tag, bool is_send) {
  uint64_t seq = 0;
  std::string why;
  {
    std::lock_guard<std::mutex> lk(impl_->mu);
    if (impl_->broken) std::rethrow_exception(impl_->broken);
    // Collectives' sequence numbers are their gloo tags and must agree on every
    // rank; point-to-point operations differ between ranks (a middle pipeline
    // stage sends and receives twice as often), so they do not count. A failed
    // one is reported with the number of the collectives before it.
    seq = impl_->seq;
    try {
      auto buf = impl_->context->createUnboundBuffer(t.raw_data(), t.numel() * dtype_size(t.dtype()));
      if (is_send) buf->send(peer, p2p_slot(tag));
      else buf->recv(peer, p2p_slot(tag));
      return std::make_shared<P2PWork>(this, op, seq, is_send, t, std::move(buf));
    } catch (const ::gloo::Exception& e) {
      // The peer's connection closed before this was posted (it died while
      // this rank computed): reported as a failed wait is, naming the rank,
      // not as Gloo's bare "Connection closed by peer".
      why = e.what();
    }
  }
  fail(op, seq, why);  // outside the lock: its roll call waits for the other ranks
}

WorkPtr ProcessGroupGloo::send(const Tensor& t, int dst, int tag) {
  check_tensor("send", t);
  check_peer("send", dst, "destination");
  return post("send", t, dst, tag, true);
}

WorkPtr ProcessGroupGloo::recv(const Tensor& t, int src, int tag) {
  check_tensor("recv", t);
  check_peer("recv", src, "source");
  return post("recv", t, src, tag, false);
}

}  // namespace chorus::dist

#endif  // CHORUS_WITH_GLOO
