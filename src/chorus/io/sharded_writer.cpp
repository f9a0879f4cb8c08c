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

void StallPhases::add(const std::string& phase, double v) {
  for (auto& [name, m] : ms)
    if (name == phase) {
      m += v;
      return;
    }
  ms.emplace_back(phase, v);
}

void StallPhases::add(const StallPhases& other) {
  for (const auto& [name, m] : other.ms) add(name, m);
}

double StallPhases::total() const {
  double t = 0;
  for (const auto& [name, m] : ms) t += m;
  return t;
}

double PhaseClock::skip() {
  const auto now = std::chrono::steady_clock::now();
  const double ms = std::chrono::duration<double, std::milli>(now - last_).count();
  last_ = now;
  return ms;
}

double PhaseClock::lap(const std::string& phase) {
  const double ms = skip();
  out_.add(phase, ms);
  return ms;
}

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
// one allocation and one copy each made the host's calls most of the stall,
// and the clones' device time too: the GPU copied faster than the host could
// hand it the next copy. So
//  - the clones are views of one buffer per (device, dtype), each region
//    starting on a 128-byte boundary (as aligned as a fresh tensor, so the
//    multi-tensor copy runs in 16-byte vectors);
//  - contiguous pieces that view one storage (ZeRO's shards of a flat
//    bucket; an optimizer's moments when it keeps them in one buffer) are
//    cloned as the one span of that storage they cover, with one copy, when
//    that span is at most twice their elements (a small piece of a large
//    buffer is cloned alone);
//  - spans and pieces of 1 MiB and more are copied one by one (the driver's
//    device-to-device memcpy, which reads and writes closer to the memory's
//    bandwidth than the multi-tensor kernel), the rest together in
//    multi-tensor launches (Note [Multi-tensor copy]).
class SnapshotPlan {
 public:
  // First pass: every tensor outside host memory, in order.
  void add(const Tensor& t) {
    Entry e;
    if (t.is_contiguous() && t.storage()) {
      auto [it, fresh] = spans_.try_emplace(t.storage()->data());
      Span& sp = it->second;
      if (fresh) {
        sp.base = t;
        sp.lo = t.storage_offset();
        sp.hi = t.storage_offset() + t.numel();
      }
      sp.ok = sp.ok && t.dtype() == sp.base.dtype() && t.device() == sp.base.device();
      sp.lo = std::min(sp.lo, t.storage_offset());
      sp.hi = std::max(sp.hi, t.storage_offset() + t.numel());
      sp.pieces += t.numel();
      e.span = &sp;
    }
    e.source = t.detach();
    entries_.push_back(std::move(e));
  }
  // Places the spans and lone pieces in the buffers and allocates them.
  void allocate() {
    for (auto& [key, sp] : spans_) {
      sp.ok = sp.ok && sp.hi - sp.lo <= 2 * sp.pieces;
      if (sp.ok) sp.offset = reserve(sp.base.device(), sp.base.dtype(), sp.hi - sp.lo);
    }
    for (Entry& e : entries_)
      if (!e.span || !e.span->ok) {
        e.span = nullptr;
        e.offset = reserve(e.source.device(), e.source.dtype(), e.source.numel());
      }
    for (auto& [key, g] : buffers_) g.flat = empty({std::max<int64_t>(g.numel, 1)}, TensorOptions(key.second, key.first));
  }
  // Second pass, in the order of add(): the clone of each tensor.
  Tensor clone_of(const Tensor& t) {
    const Entry& e = entries_[next_++];
    const Tensor& flat = buffers_.at({t.device(), t.dtype()}).flat;
    const int64_t at = e.span ? e.span->offset + (e.source.storage_offset() - e.span->lo) : e.offset;
    return chorus::detail::make_view(flat, t.sizes(), contiguous_strides(t.sizes()), at);
  }
  // Issues the copies on the current streams.
  void copy() {
    TensorList small_srcs, small_dsts;
    auto one = [&](const Tensor& src, const Tensor& dst) {
      if (src.nbytes() >= kLargePiece && src.is_contiguous()) {
        ops::copy_(dst, src);
      } else {
        small_srcs.push_back(src);
        small_dsts.push_back(dst);
      }
    };
    for (auto& [key, sp] : spans_)
      if (sp.ok) {
        const Tensor& flat = buffers_.at({sp.base.device(), sp.base.dtype()}).flat;
        one(chorus::detail::make_view(sp.base, {sp.hi - sp.lo}, {1}, sp.lo),
            chorus::detail::make_view(flat, {sp.hi - sp.lo}, {1}, sp.offset));
      }
    for (size_t i = 0; i < entries_.size(); ++i)
      if (!entries_[i].span) one(entries_[i].source, clones_[i]);
    ops::copy_multi(small_srcs, small_dsts);
  }
  void keep_clone(const Tensor& c) { clones_.push_back(c); }

 private:
  static constexpr int64_t kAlignBytes = 128;
  struct Span {
    Tensor base;  // one of its pieces: the storage, dtype and device
    int64_t lo = 0, hi = 0, pieces = 0, offset = 0;
    bool ok = true;  // cloned as one span
  };
  struct Entry {
    Tensor source;
    Span* span = nullptr;  // null: cloned alone, at offset
    int64_t offset = 0;
  };
  struct Buffer {
    int64_t numel = 0;
    Tensor flat;
  };
  int64_t reserve(const Device& d, DType dt, int64_t numel) {
    Buffer& b = buffers_[{d, dt}];
    const int64_t align = std::max<int64_t>(1, kAlignBytes / static_cast<int64_t>(dtype_size(dt)));
    b.numel = (b.numel + align - 1) / align * align;
    const int64_t at = b.numel;
    b.numel += numel;
    return at;
  }
  std::map<const void*, Span> spans_;  // by storage
  std::vector<Entry> entries_;
  std::vector<Tensor> clones_;
  std::map<std::pair<Device, DType>, Buffer> buffers_;
  size_t next_ = 0;
};

// Clones the tensors outside host memory on their own devices, on the
// caller's current streams (after the work that produced them), and the
// rest on the host. Returns at once; the events say when the clones are done.
// `clock` times its phases (Note [Stall by phase]).
ShardedSnapshot snapshot_on_devices(const ShardedSave& save, const std::map<Device, size_t>& bytes,
                                    PhaseClock& clock) {
  ShardedSnapshot snap{save, {}};
  SnapshotPlan plan;
  for_each_tensor(snap.save, [&](Tensor& t) {
    if (t.defined() && !in_host_memory(t)) plan.add(t);
  });
  clock.lap("plan");
  plan.allocate();
  clock.lap("allocate");
  HostCopier host;
  for_each_tensor(snap.save, [&](Tensor& t) {
    if (!t.defined()) return;
    if (in_host_memory(t)) {
      t = host(t);
      return;
    }
    t = plan.clone_of(t);
    plan.keep_clone(t);
  });
  clock.lap("views");
  // The events bracket the copies alone: the planning and allocation above
  // are host time, counted in save()'s stall.
  for (const auto& [d, n] : bytes)
    snap.devices.emplace(d, ShardedSnapshot::Marks{Event(d), Event(d)}).first->second.start.record();
  clock.lap("events");
  plan.copy();
  for (auto& [d, m] : snap.devices) m.end.record();
  clock.lap("copies");
  host.finish();
  clock.lap("host copies");
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

double ShardedCheckpointWriter::set_aside(const ShardedSave& save) {
  if (saves_ > 0) return -1;
  const auto t0 = std::chrono::steady_clock::now();
  const std::map<Device, size_t> bytes = device_bytes(save);
  if (bytes.empty() || !why_not_on_device(bytes).empty()) return -1;  // the save says why, if it must
  try {
    SnapshotPlan plan;
    for_each_tensor(save, [&](const Tensor& t) {
      if (t.defined() && !in_host_memory(t)) plan.add(t);
    });
    plan.allocate();
  } catch (const OutOfMemoryError&) {
    return -1;  // the first save decides again (and falls back if it must)
  }
  // The plan's buffers are freed here, on the current streams, into the
  // allocator, which keeps them: the placement rule counts them as the
  // previous snapshot's.
  reserved_ = bytes;
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

double ShardedCheckpointWriter::save(const ShardedSave& save, double gather_ms) {
  StallPhases gather;
  if (gather_ms > 0) gather.add("assemble", gather_ms);
  return this->save(save, gather);
}

double ShardedCheckpointWriter::save(const ShardedSave& save, const StallPhases& gather) {
  // The stall counts the wait for a previous save still being written: with
  // saves closer together than the disk writes them, that wait is the stall.
  // Note [Stall by phase]: every other moment of it is one phase's.
  StallPhases phases = gather;
  PhaseClock clock(phases);
  const bool was_busy = busy();
  join_and_rethrow();
  const double wait_ms = was_busy ? clock.skip() : 0.0;
  if (was_busy)
    warn_once("sharded-checkpoint-wait",
              "sharded checkpoint: the previous checkpoint was still being written after " +
                  std::to_string(static_cast<int64_t>(last_write_ms())) + " ms; training waited " +
                  std::to_string(static_cast<int64_t>(wait_ms)) +
                  " ms for it (checkpoint less often to keep saves in the background)");
  if (saves_ > 0) clock.lap("join");
  const std::map<Device, size_t> bytes = device_bytes(save);
  // Note [Stall by phase]: whether a device still runs earlier work (its
  // current stream has not reached an event recorded now).
  bool device_busy = false;
  for (const auto& [d, n] : bytes) {
    Event e(d, /*timing=*/false);
    e.record();
    device_busy = !e.query() || device_busy;
  }
  std::optional<ShardedSnapshot> snap;
  if (!bytes.empty()) {
    std::string why = why_not_on_device(bytes);
    clock.lap("placement");
    if (why.empty()) {
      try {
        snap = snapshot_on_devices(save, bytes, clock);
      } catch (const OutOfMemoryError& e) {
        why = std::string("the device ran out of memory: ") + e.what();
        clock.lap("allocate");  // the failed attempt
      }
    }
    if (!why.empty())
      warn_once("sharded-checkpoint-snapshot",
                "sharded checkpoint: not snapshotting on the device (" + why +
                    "); copying to host memory before training goes on instead, a longer stall");
  } else {
    clock.lap("placement");
  }
  if (!snap) {
    snap = ShardedSnapshot{copy_to_host(save), {}};
    clock.lap("copy to host");
  }
  last_devices_.clear();
  for (const auto& [d, m] : snap->devices) last_devices_.push_back(d);
  if (!last_devices_.empty()) reserved_ = bytes;
  ShardedSaveOptions o = options_;
  o.key_prefix += "/save-" + std::to_string(saves_++);
  {
    std::lock_guard<std::mutex> lock(mu_);
    running_ = true;
    last_snapshot_device_ms_ = 0;
  }
  worker_ = std::thread([this, s = std::move(*snap), o = std::move(o)]() mutable {
    write_in_background(std::move(s), std::move(o));
  });
  clock.lap("start");
  // The stall: the phases, and the wait for a previous save (counted apart).
  const double stall = phases.total();
  last_stall_ms_ = stall + wait_ms;
  std::lock_guard<std::mutex> lock(mu_);
  totals_.saves += 1;
  totals_.stall_ms += stall;
  if (totals_.saves == 1) {
    totals_.first_stall_ms = stall;
    totals_.first_phases = phases;
    if (!bytes.empty()) totals_.first_device_busy = device_busy ? 1 : 0;
  } else {
    totals_.later_phases.add(phases);
    if (!bytes.empty()) {
      totals_.later_on_device += 1;
      totals_.later_device_busy += device_busy ? 1 : 0;
    }
  }
  totals_.wait_ms += wait_ms;
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
