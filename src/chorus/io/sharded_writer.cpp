#include "chorus/io/sharded_writer.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <set>
#include <vector>

#include "chorus/core/backend.h"
#include "chorus/core/error.h"
#include "chorus/core/stream.h"
#include "chorus/core/warn.h"
#include "chorus/ops/copy.h"
#include "chorus/ops/factory.h"

namespace chorus::io {

namespace {

constexpr size_t kSnapshotMargin = size_t{1} << 30;  // left free beside a device snapshot
constexpr size_t kLargePiece = size_t{1} << 20;      // snapshot pieces copied one by one

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

std::string size_str(size_t bytes) {
  char s[32];
  const double b = static_cast<double>(bytes);
  if (bytes >= (size_t{1} << 30)) std::snprintf(s, sizeof s, "%.2f GiB", b / static_cast<double>(size_t{1} << 30));
  else if (bytes >= (size_t{1} << 20)) std::snprintf(s, sizeof s, "%.1f MiB", b / static_cast<double>(size_t{1} << 20));
  else std::snprintf(s, sizeof s, "%zu bytes", bytes);
  return s;
}

// Every tensor of a save: the pieces, the optimizer's buffers, the
// replicated tensors. `S` is ShardedSave or const ShardedSave.
template <class S, class F>
void for_each_tensor(S& save, F&& f) {
  for (auto& p : save.model) f(p.values);
  for (auto& p : save.optimizer)
    for (auto& [name, t] : p.buffers) f(t);
  for (auto& [name, t] : save.replicated_model) f(t);
  for (auto& [name, t] : save.replicated_optimizer) f(t);
}

bool in_host_memory(const Tensor& t) { return t.device() == cpu_device(0); }

// Bytes per device of the tensors held outside host memory: what a device
// snapshot clones.
std::map<Device, size_t> device_bytes(const ShardedSave& save) {
  std::map<Device, size_t> out;
  for_each_tensor(save, [&](const Tensor& t) {
    if (t.defined() && !in_host_memory(t)) out[t.device()] += t.nbytes();
  });
  return out;
}

// Copies are issued for every tensor first and waited for once per device
// at the end, so a GPU's copies run back to back.
class HostCopier {
 public:
  Tensor operator()(const Tensor& t) {
    if (!t.defined()) return t;
    const Tensor src = t.detach();
    // Contiguous on its own device (stream-ordered), so that nothing reads
    // the host copy before finish() waited for it.
    const Tensor d = src.contiguous();
    devices_.insert(d.device());
    Tensor h = d.to(cpu_device(0));
    // to() and contiguous() hand back the tensor itself when there is
    // nothing to do: the snapshot needs storage of its own.
    return h.storage() == src.storage() ? h.clone() : h;
  }
  void finish() {
    devices_.insert(cpu_device(0));
    for (const Device& d : devices_) synchronize(d);
  }

 private:
  std::set<Device> devices_;
};

}  // namespace

ShardedSave copy_to_host(const ShardedSave& save) {
  HostCopier copy;
  ShardedSave out = save;
  for_each_tensor(out, [&](Tensor& t) { t = copy(t); });
  copy.finish();
  return out;
}

// A save whose tensors are frozen: in host memory, or cloned on their
// devices with events around the clones (Note [Background checkpoint writes]).
struct ShardedSnapshot {
  struct Marks {
    Event start, end;  // on the stream the clones were issued to
  };
  ShardedSave save;
  std::map<Device, Marks> devices;  // empty: everything is in host memory
};

namespace {

// Note [One buffer per snapshot]: a ZeRO rank's save holds thousands of
// pieces (a shard of every parameter, and each one's moments). Cloning them
// one allocation each made the allocator's host time most of the stall, and
// the clones' device time too: the GPU copied faster than the host could
// hand it the next allocation. So the clones are views of one buffer per
// (device, dtype), each view starting on a 128-byte boundary (as aligned as
// a fresh tensor, so the multi-tensor copy runs in 16-byte vectors).
class CloneArena {
 public:
  // Reserves a contiguous place for a clone of `t`.
  void reserve(const Tensor& t) {
    Group& g = groups_[{t.device(), t.dtype()}];
    const int64_t align = std::max<int64_t>(1, kAlignBytes / static_cast<int64_t>(dtype_size(t.dtype())));
    g.numel = (g.numel + align - 1) / align * align;
    offsets_.push_back(g.numel);
    g.numel += t.numel();
  }
  // Allocates the buffers; then clone_of() hands out the views in the order
  // of reserve().
  void allocate() {
    for (auto& [key, g] : groups_) g.flat = empty({std::max<int64_t>(g.numel, 1)}, TensorOptions(key.second, key.first));
  }
  Tensor clone_of(const Tensor& t) {
    const Tensor& flat = groups_.at({t.device(), t.dtype()}).flat;
    return chorus::detail::make_view(flat, t.sizes(), contiguous_strides(t.sizes()), offsets_[next_++]);
  }

 private:
  static constexpr int64_t kAlignBytes = 128;
  struct Group {
    int64_t numel = 0;
    Tensor flat;
  };
  std::map<std::pair<Device, DType>, Group> groups_;
  std::vector<int64_t> offsets_;
  size_t next_ = 0;
};

// Clones the tensors outside host memory on their own devices, on the
// caller's current streams (after the work that produced them), and the
// rest on the host. Returns at once; the events say when the clones are done.
ShardedSnapshot snapshot_on_devices(const ShardedSave& save, const std::map<Device, size_t>& bytes) {
  ShardedSnapshot snap{save, {}};
  for (const auto& [d, n] : bytes) {
    auto& m = snap.devices.emplace(d, ShardedSnapshot::Marks{Event(d), Event(d)}).first->second;
    m.start.record();
  }
  CloneArena arena;
  for_each_tensor(snap.save, [&](Tensor& t) {
    if (t.defined() && !in_host_memory(t)) arena.reserve(t);
  });
  arena.allocate();
  HostCopier host;
  TensorList srcs, dsts;
  for_each_tensor(snap.save, [&](Tensor& t) {
    if (!t.defined()) return;
    if (in_host_memory(t)) {
      t = host(t);
      return;
    }
    srcs.push_back(t.detach());
    dsts.push_back(arena.clone_of(t));
    t = dsts.back();
  });
  // The small pieces in one launch per few dozen (Note [Multi-tensor copy]):
  // a ZeRO rank holds thousands of them, and each launch is host time. The
  // large ones, most of the bytes, one copy each: a contiguous copy is the
  // driver's device-to-device memcpy, which reads and writes closer to the
  // memory's bandwidth than the multi-tensor kernel does.
  TensorList small_srcs, small_dsts;
  for (size_t i = 0; i < srcs.size(); ++i) {
    if (srcs[i].nbytes() >= kLargePiece && srcs[i].is_contiguous()) {
      ops::copy_(dsts[i], srcs[i]);
    } else {
      small_srcs.push_back(srcs[i]);
      small_dsts.push_back(dsts[i]);
    }
  }
  ops::copy_multi(small_srcs, small_dsts);
  for (auto& [d, m] : snap.devices) m.end.record();
  host.finish();
  return snap;
}

// Waits for the clones and copies them to host memory on a stream of this
// thread's own per device; each device buffer is freed once its last view
// is copied (Note [One buffer per snapshot]).
// Returns the clones' device time (the slowest device).
double snapshot_to_host(ShardedSnapshot& snap) {
  double device_ms = 0;
  std::vector<Stream> streams;
  std::vector<std::unique_ptr<StreamGuard>> guards;
  for (auto& [d, m] : snap.devices) {
    m.end.synchronize();
    device_ms = std::max(device_ms, static_cast<double>(m.start.elapsed(m.end)));
    streams.push_back(Stream::create(d));
    guards.push_back(std::make_unique<StreamGuard>(streams.back()));
  }
  std::set<const void*> recorded;
  for_each_tensor(snap.save, [&](Tensor& t) {
    if (!t.defined() || in_host_memory(t)) return;
    // The clone's home is the training stream; this stream reads it, so a
    // free on any other stream must wait for the copy (Note [Stream-ordered
    // memory]). The copy into host memory waits for its stream.
    if (recorded.insert(t.storage()->data()).second)
      backend(t.device()).record_use(t.storage()->data(), t.device(), t.device(), Stream::current(t.device()).handle());
    t = t.to(cpu_device(0));
  });
  return device_ms;
}

}  // namespace

ShardedCheckpointWriter::ShardedCheckpointWriter(std::string dir, ShardedSaveOptions options,
                                                 ShardedWriterOptions writer)
    : dir_(std::move(dir)), options_(std::move(options)), writer_options_(writer) {}

ShardedCheckpointWriter::~ShardedCheckpointWriter() {
  try {
    wait();
  } catch (const std::exception& e) {
    warn(std::string("sharded checkpoint: the last background save failed: ") + e.what());
  }
}

void ShardedCheckpointWriter::join_and_rethrow() {
  if (worker_.joinable()) worker_.join();
  std::exception_ptr e;
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::swap(e, error_);
  }
  if (e) std::rethrow_exception(e);
}

std::string ShardedCheckpointWriter::wait() {
  join_and_rethrow();
  std::lock_guard<std::mutex> lock(mu_);
  return last_path_;
}

bool ShardedCheckpointWriter::busy() const {
  std::lock_guard<std::mutex> lock(mu_);
  return running_;
}

double ShardedCheckpointWriter::last_write_ms() const {
  std::lock_guard<std::mutex> lock(mu_);
  return last_write_ms_;
}

double ShardedCheckpointWriter::last_snapshot_device_ms() const {
  std::lock_guard<std::mutex> lock(mu_);
  return last_snapshot_device_ms_;
}

ShardedCheckpointWriter::Totals ShardedCheckpointWriter::totals() const {
  std::lock_guard<std::mutex> lock(mu_);
  return totals_;
}

std::string ShardedCheckpointWriter::why_not_on_device(const std::map<Device, size_t>& bytes) const {
  size_t total = 0;
  for (const auto& [d, n] : bytes) total += n;
  if (const auto& limit = writer_options_.snapshot_limit_bytes)
    return total <= *limit ? "" : "its " + size_str(total) + " exceed the snapshot limit of " + size_str(*limit);
  for (const auto& [d, n] : bytes) {
    const auto info = backend(d).memory_info(d);
    if (!info) continue;  // unknown: try, and fall back on OutOfMemoryError
    // The previous snapshot's memory went back to the pool, which keeps it
    // reserved (so the driver no longer counts it free) for this one.
    const auto it = reserved_.find(d);
    const size_t avail = info->free + (it == reserved_.end() ? 0 : it->second);
    if (n + kSnapshotMargin > avail)
      return "its " + size_str(n) + " on " + d.str() + " do not fit in " + size_str(avail) + " free less a margin of " +
             size_str(kSnapshotMargin);
  }
  return "";
}

double ShardedCheckpointWriter::save(const ShardedSave& save, double gather_ms) {
  // The stall counts the wait for a previous save still being written: with
  // saves closer together than the disk writes them, that wait is the stall.
  const auto t0 = std::chrono::steady_clock::now();
  const bool was_busy = busy();
  join_and_rethrow();
  const double wait_ms = was_busy ? ms_since(t0) : 0.0;
  if (was_busy)
    warn_once("sharded-checkpoint-wait",
              "sharded checkpoint: the previous checkpoint was still being written after " +
                  std::to_string(static_cast<int64_t>(last_write_ms())) + " ms; training waited " +
                  std::to_string(static_cast<int64_t>(ms_since(t0))) +
                  " ms for it (checkpoint less often to keep saves in the background)");
  const std::map<Device, size_t> bytes = device_bytes(save);
  std::optional<ShardedSnapshot> snap;
  if (!bytes.empty()) {
    std::string why = why_not_on_device(bytes);
    if (why.empty()) {
      try {
        snap = snapshot_on_devices(save, bytes);
      } catch (const OutOfMemoryError& e) {
        why = std::string("the device ran out of memory: ") + e.what();
      }
    }
    if (!why.empty())
      warn_once("sharded-checkpoint-snapshot",
                "sharded checkpoint: not snapshotting on the device (" + why +
                    "); copying to host memory before training goes on instead, a longer stall");
  }
  if (!snap) snap = ShardedSnapshot{copy_to_host(save), {}};
  last_devices_.clear();
  for (const auto& [d, m] : snap->devices) last_devices_.push_back(d);
  if (!last_devices_.empty()) reserved_ = bytes;
  last_stall_ms_ = gather_ms + ms_since(t0);
  ShardedSaveOptions o = options_;
  o.key_prefix += "/save-" + std::to_string(saves_++);
  {
    std::lock_guard<std::mutex> lock(mu_);
    running_ = true;
    last_snapshot_device_ms_ = 0;
    totals_.saves += 1;
    totals_.stall_ms += last_stall_ms_ - wait_ms;
    totals_.wait_ms += wait_ms;
  }
  worker_ = std::thread([this, s = std::move(*snap), o = std::move(o)]() mutable {
    write_in_background(std::move(s), std::move(o));
  });
  return last_stall_ms_;
}

void ShardedCheckpointWriter::write_in_background(ShardedSnapshot snap, ShardedSaveOptions o) {
  const auto start = std::chrono::steady_clock::now();
  std::string path;
  std::exception_ptr error;
  double device_ms = 0;
  try {
    device_ms = snapshot_to_host(snap);
    path = save_sharded_checkpoint(dir_, snap.save, o);
  } catch (...) {
    error = std::current_exception();
  }
  std::lock_guard<std::mutex> lock(mu_);
  running_ = false;
  last_write_ms_ = ms_since(start);
  last_snapshot_device_ms_ = device_ms;
  totals_.device_ms += device_ms;
  if (error) error_ = error;
  else last_path_ = path;
}

}  // namespace chorus::io
