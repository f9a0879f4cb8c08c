#include "chorus/autograd/side_work.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "chorus/core/backend.h"
#include "chorus/core/device.h"
#include "chorus/core/env_switches.h"

namespace chorus::autograd {

namespace {

thread_local bool t_allowed = false;

std::atomic<int>& enabled_flag() {
  static std::atomic<int> flag{[] {
    const char* e = chorus::env::get("CHORUS_WGRAD_STREAM");
    return e && *e && std::strcmp(e, "0") == 0 ? 0 : 1;
  }()};
  return flag;
}

// One device's side stream and its pending work (Note [Weight gradients
// beside the data gradient]). The stream and events live as long as the
// process (leaked with the table: backward may run from threads that outlive
// static destruction).
struct SideState {
  std::mutex mu;
  StreamHandle side = nullptr;
  EventHandle fork = nullptr, done = nullptr;
  bool pending = false;
  StreamHandle main = nullptr;  // the stream that forked the pending work
  TensorList hold;
  std::vector<const TensorImpl*> results;
  std::vector<const void*> read_storages;  // of hold
};

std::mutex table_mu;
std::vector<std::unique_ptr<SideState>>* table = new std::vector<std::unique_ptr<SideState>>();
std::atomic<int> pending_count{0};
std::atomic<int64_t> runs{0};

SideState& state_of(const Device& d) {
  std::lock_guard<std::mutex> lk(table_mu);
  if (table->size() <= static_cast<size_t>(d.index)) table->resize(static_cast<size_t>(d.index) + 1);
  std::unique_ptr<SideState>& s = (*table)[static_cast<size_t>(d.index)];
  if (!s) s = std::make_unique<SideState>();
  return *s;
}

// Under s.mu: the forking stream waits for the pending work; what it read is
// let go (freed on the current stream, now ordered after it).
void join_locked(const Device& d, SideState& s) {
  if (!s.pending) return;
  backend(d).stream_wait_event(d, s.main, s.done);
  s.pending = false;
  pending_count.fetch_sub(1);
  s.hold.clear();
  s.results.clear();
  s.read_storages.clear();
}

}  // namespace

bool beside_allowed(const Device& d) {
  return t_allowed && d.is_cuda() && enabled_flag().load(std::memory_order_relaxed) != 0;
}

void set_beside_enabled(bool on) { enabled_flag().store(on ? 1 : 0); }

TensorList run_beside(const Device& d, TensorList hold, const std::function<void()>& on_main,
                      const std::function<TensorList()>& beside) {
  SideState& s = state_of(d);
  std::lock_guard<std::mutex> lk(s.mu);
  DeviceBackend& be = backend(d);
  if (!s.side) {
    s.side = be.create_stream(d);
    s.fork = be.create_event(d, false);
    s.done = be.create_event(d, false);
  }
  const StreamHandle main = be.current_stream(d);
  be.record_event(d, s.fork, main);  // everything beside() reads is issued by now
  on_main();
  // The previous work beside ran alongside this node's main-stream work; it
  // is joined after it, before what follows.
  join_locked(d, s);
  be.stream_wait_event(d, s.side, s.fork);
  TensorList out;
  {
    be.set_current_stream(d, s.side);
    struct Restore {
      DeviceBackend& be;
      Device d;
      StreamHandle main;
      ~Restore() { be.set_current_stream(d, main); }
    } restore{be, d, main};
    out = beside();
  }
  be.record_event(d, s.done, s.side);
  s.pending = true;
  pending_count.fetch_add(1);
  runs.fetch_add(1);
  s.main = main;
  s.hold = std::move(hold);
  for (const Tensor& t : s.hold)
    if (t.defined()) s.read_storages.push_back(t.storage().get());
  for (const Tensor& t : out)
    if (t.defined()) s.results.push_back(t.impl());
  return out;
}

int64_t beside_runs() { return runs.load(); }

void join_beside(const Device& d) {
  if (pending_count.load() == 0 || !d.is_cuda()) return;
  SideState& s = state_of(d);
  std::lock_guard<std::mutex> lk(s.mu);
  join_locked(d, s);
}

void join_beside_for(const Tensor& g) {
  if (pending_count.load() == 0 || !g.defined() || !g.device().is_cuda()) return;
  SideState& s = state_of(g.device());
  std::lock_guard<std::mutex> lk(s.mu);
  if (!s.pending) return;
  for (const TensorImpl* r : s.results)
    if (r == g.impl()) {
      join_locked(g.device(), s);
      return;
    }
}

void join_beside_before_write(const Tensor& g) {
  if (pending_count.load() == 0 || !g.defined() || !g.device().is_cuda()) return;
  SideState& s = state_of(g.device());
  std::lock_guard<std::mutex> lk(s.mu);
  if (!s.pending) return;
  bool hit = false;
  for (const TensorImpl* r : s.results) hit = hit || r == g.impl();
  for (const void* st : s.read_storages) hit = hit || st == g.storage().get();
  if (hit) join_locked(g.device(), s);
}

void join_all_beside() {
  if (pending_count.load() == 0) return;
  std::vector<SideState*> states;
  {
    std::lock_guard<std::mutex> lk(table_mu);
    for (auto& s : *table) states.push_back(s.get());
  }
  for (size_t i = 0; i < states.size(); ++i) {
    if (!states[i]) continue;
    std::lock_guard<std::mutex> lk(states[i]->mu);
    join_locked(Device(DeviceType::CUDA, static_cast<int>(i)), *states[i]);
  }
}

std::optional<Stream> beside_merge(const Device& d) {
  if (pending_count.load() == 0 || !d.is_cuda()) return std::nullopt;
  SideState& s = state_of(d);
  std::lock_guard<std::mutex> lk(s.mu);
  if (!s.pending) return std::nullopt;
  DeviceBackend& be = backend(d);
  const StreamHandle cur = be.current_stream(d);
  be.record_event(d, s.fork, cur);
  be.stream_wait_event(d, s.side, s.fork);
  // A handle on the side stream (not owned): Stream::current of it.
  be.set_current_stream(d, s.side);
  Stream side = Stream::current(d);
  be.set_current_stream(d, cur);
  return side;
}

BesideScope::BesideScope(std::optional<Device> only) : prev_(t_allowed), only_(only) { t_allowed = true; }

BesideScope::~BesideScope() {
  t_allowed = prev_;
  try {
    if (only_) join_beside(*only_);
    else join_all_beside();
  } catch (...) {
    // A failed join leaves the device in error; the backward's own error (if
    // any) is the one to report.
  }
}

}  // namespace chorus::autograd
