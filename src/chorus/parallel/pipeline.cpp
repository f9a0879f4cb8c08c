#include "chorus/parallel/pipeline.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <set>

#include "chorus/autograd/grad_mode.h"
#include "chorus/core/backend.h"
#include "chorus/core/error.h"
#include "chorus/core/graph_capture.h"
#include "chorus/core/rng.h"
#include "chorus/core/stream.h"
#include "chorus/ops/factory.h"
#include "chorus/autograd/functions.h"
#include "chorus/parallel/device_threads.h"
#include "chorus/parallel/pipeline_messages.h"
#include "chorus/parallel/placement.h"

namespace chorus::parallel {

Checkpoint parse_checkpoint(const std::string& name) {
  if (name == "never") return Checkpoint::Never;
  if (name == "except_last") return Checkpoint::ExceptLast;
  if (name == "always") return Checkpoint::Always;
  CHORUS_THROW(ValueError, "unknown recomputation (checkpoint) mode '", name, "' (known: never, except_last, always)");
}

std::string checkpoint_name(Checkpoint c) {
  switch (c) {
    case Checkpoint::Never: return "never";
    case Checkpoint::ExceptLast: return "except_last";
    case Checkpoint::Always: return "always";
  }
  return "?";
}

namespace {

std::vector<int64_t> even_split(int64_t n, int64_t parts) {
  std::vector<int64_t> out(static_cast<size_t>(parts), n / parts);
  for (int64_t i = 0; i < n % parts; ++i) ++out[static_cast<size_t>(i)];
  return out;
}

uint64_t mix(uint64_t x) {  // splitmix64's finaliser
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Thrown by a task that stops waiting because another task failed: not the
// cause, so never reported.
struct Aborted {};

using Clock = std::chrono::steady_clock;

}  // namespace

// One step's shared state: per (stage, micro-batch) slot i = s * M + m.
struct Pipeline::Run {
  bool train = true;  // forward and backward by the schedule; false: forwards only, graph kept (forward())
  bool backward = true;  // train: false for evaluate()'s forwards only (no grad, the loss alone kept)
  int S = 0, M = 0;
  std::vector<int64_t> sizes;
  int64_t batch = 0;
  std::vector<std::vector<PipeTask>> lists;  // per local device
  std::vector<Device> local_devices;
  const LossFn* loss_fn = nullptr;
  std::vector<Tensor> targets;  // per micro-batch, on the last stage's device

  std::vector<Tensor> in, out, grad_out, loss;
  std::vector<std::optional<Event>> in_ready, grad_ready;
  std::vector<char> in_flag, grad_flag;
  std::vector<std::unique_ptr<Generator>> gens;
  std::vector<RngState> gen_start;
  std::vector<char> ckpt;  // per micro-batch
  std::vector<Tensor> outputs, losses;
  std::vector<int> forwards_done, backwards_done;  // per stage

  std::mutex mu;
  std::condition_variable cv;
  std::exception_ptr error;
  bool failed = false;

  std::vector<dist::WorkPtr> sends;  // cross-process sends, waited for at the end
  std::mutex sends_mu;

  // The copy streams this step issued to (under mu): inside a CUDA graph
  // capture they joined it, and the step joins them back at its end.
  std::vector<std::pair<Device, const Stream*>> copies_used;

  // measure
  std::vector<double> host_busy_ms;                            // per local device (CPU)
  std::vector<std::vector<std::pair<Event, Event>>> gpu_spans;  // per local device (GPU)

  size_t slot(int s, int m) const { return static_cast<size_t>(s) * static_cast<size_t>(M) + static_cast<size_t>(m); }
};

Pipeline::Pipeline(std::shared_ptr<nn::Sequential> layers, std::vector<int64_t> balance, std::vector<Device> devices,
                   PipelineOptions options)
    : Module("Pipeline"), seq_(std::move(layers)), balance_(std::move(balance)), devices_(std::move(devices)),
      opts_(std::move(options)) {
  CHORUS_CHECK(seq_ != nullptr, "Pipeline: the Sequential is null");
  const int64_t n = static_cast<int64_t>(seq_->size());
  CHORUS_CHECK(n >= 1, "Pipeline: the Sequential has no layers");
  CHORUS_CHECK(!devices_.empty(), "Pipeline: no devices given");
  for (size_t i = 0; i < devices_.size(); ++i)
    for (size_t j = 0; j < i; ++j)
      CHORUS_CHECK(!(devices_[i] == devices_[j]), "Pipeline: device ", devices_[i].str(),
                   " is listed twice (several stages on one device: use the interleaved schedule's virtual stages)");
  CHORUS_CHECK(opts_.micro_batches >= 1, "Pipeline: micro-batches must be at least 1, got ", opts_.micro_batches);
  CHORUS_CHECK(opts_.virtual_stages >= 0, "Pipeline: virtual stages must be >= 0, got ", opts_.virtual_stages);
  const dist::ProcessGroupPtr& pg = opts_.stage_group;
  if (pg) {
    CHORUS_CHECK(devices_.size() == 1, "Pipeline: with a stage group each process runs its stages on one device, got ",
                 devices_.size(), " devices");
  }
  const int64_t places = pg ? pg->size() : static_cast<int64_t>(devices_.size());
  if (balance_.empty()) {
    const int64_t v = opts_.virtual_stages > 0 ? opts_.virtual_stages
                                               : (opts_.schedule == Schedule::Interleaved ? 2 : 1);
    CHORUS_CHECK(places * v <= n, "Pipeline: ", places * v, " stages (", places, pg ? " processes" : " devices",
                 v > 1 ? " x " + std::to_string(v) + " virtual stages" : std::string(), ") but the model has only ", n,
                 " layers");
    balance_ = even_split(n, places * v);
  }
  const int64_t S = static_cast<int64_t>(balance_.size());
  CHORUS_CHECK(S <= n, "Pipeline: ", S, " stages but the model has only ", n, " layers");
  CHORUS_CHECK(S % places == 0, "Pipeline: ", S, " stages cannot be spread evenly over ", places,
               pg ? " processes" : " devices", " (balance ", balance_str(balance_), ")");
  // Validates the schedule's shape (1F1B: one stage per device) before anything moves.
  (void)make_schedule(opts_.schedule, static_cast<int>(places), static_cast<int>(S), 1);

  if (opts_.deferred_batch_norm) (void)defer_batch_norm(*seq_);
  // Stage s on devices[s % D]; over processes, the stages of other ranks stay where they are.
  std::vector<Device> stage_devices;
  for (int64_t s = 0; s < S; ++s) stage_devices.push_back(pg ? devices_[0] : devices_[static_cast<size_t>(s % places)]);
  if (pg)
    check_process_stages(n);
  else
    place(*seq_, balance_, stage_devices);
  int64_t next = 0;
  for (int64_t s = 0; s < S; ++s) {
    Stage st{stage_devices[static_cast<size_t>(s)], next, next + balance_[static_cast<size_t>(s)], {}, {}};
    for (int64_t l = st.first; l < st.last; ++l) {
      st.layers.push_back((*seq_)[static_cast<size_t>(l)]);
      if (pg && is_local(s)) st.layers.back()->to(st.device);
      for (const nn::ModulePtr& m : st.layers.back()->modules())
        if (auto d = std::dynamic_pointer_cast<DeferredBatchNorm>(m)) st.deferred.push_back(d);
    }
    next = st.last;
    stages_.push_back(std::move(st));
  }
  for (const Stage& st : stages_) {
    bool known = false;
    for (const auto& c : copy_streams_) known = known || c.first == st.device;
    if (st.device.is_cuda() && !known)
      copy_streams_.emplace_back(st.device, std::array<std::optional<Stream>, 2>{Stream::create(st.device),
                                                                                  Stream::create(st.device)});
  }
  make_groups(places);
  register_child("", seq_);  // Note [State dict names]
}

namespace {
std::shared_ptr<nn::Sequential> join_stages(const std::vector<std::shared_ptr<nn::Sequential>>& stages) {
  CHORUS_CHECK(!stages.empty(), "Pipeline: no stages given");
  auto seq = std::make_shared<nn::Sequential>();
  for (size_t s = 0; s < stages.size(); ++s) {
    CHORUS_CHECK(stages[s] != nullptr && stages[s]->size() > 0, "Pipeline: stage ", s, " is ",
                 stages[s] ? "empty" : "null", "; every stage needs at least one layer");
    for (size_t l = 0; l < stages[s]->size(); ++l) seq->push_back((*stages[s])[l]);
  }
  return seq;
}
std::vector<int64_t> stage_sizes(const std::vector<std::shared_ptr<nn::Sequential>>& stages) {
  std::vector<int64_t> out;
  for (const auto& s : stages) out.push_back(s ? static_cast<int64_t>(s->size()) : 0);
  return out;
}
}  // namespace

Pipeline::Pipeline(const std::vector<std::shared_ptr<nn::Sequential>>& stages, std::vector<Device> devices,
                   PipelineOptions options)
    : Pipeline(join_stages(stages), stage_sizes(stages), std::move(devices), std::move(options)) {}

bool Pipeline::is_local(int64_t stage) const {
  return !opts_.stage_group || stage % opts_.stage_group->size() == opts_.stage_group->rank();
}

std::vector<Tensor> Pipeline::local_parameters() const {
  std::vector<Tensor> out;
  for (size_t s = 0; s < stages_.size(); ++s) {
    if (!is_local(static_cast<int64_t>(s))) continue;
    for (const nn::ModulePtr& l : stages_[s].layers)
      for (const Tensor& p : l->parameters()) out.push_back(p);
  }
  return out;
}

std::string Pipeline::extra_repr() const {
  std::string devs;
  for (const Device& d : devices_) devs += (devs.empty() ? "" : ",") + d.str();
  return "balance=" + balance_str(balance_) + ", devices=" + devs + ", micro_batches=" + std::to_string(opts_.micro_batches) +
         ", schedule=" + schedule_name(opts_.schedule) + ", checkpoint=" + checkpoint_name(opts_.checkpoint) +
         (opts_.deferred_batch_norm ? ", deferred_batch_norm" : "") +
         (opts_.stage_group ? ", processes=" + std::to_string(opts_.stage_group->size()) : "");
}

std::shared_ptr<nn::Module> Pipeline::make_empty() const {
  CHORUS_THROW(ValueError, "Pipeline: cannot be cloned (clone the Sequential and build a new Pipeline)");
}

Tensor Pipeline::run_stage(size_t s, const Tensor& x) const {
  Tensor h = x;
  for (const nn::ModulePtr& l : stages_[s].layers) h = l->forward(h);
  return h;
}

namespace {

// Note [Pipeline transfers]: `t` (detached) on `dst`, copied on `copy_stream`
// when a GPU is involved; `ready` marks the copy's end for the receiver.
Tensor transfer(const Tensor& t, const Device& dst, const std::optional<Stream>& copy_stream,
                std::optional<Event>* ready) {
  if (t.device() == dst) return t;
  // Inside a CUDA graph capture too: the copy stream joins the capture by the
  // event it waits on (the sender's capture stream) and leaves it by the event
  // the receiver's capture stream waits on, so the graph keeps the copy on a
  // branch of its own. (Issued on the capture streams themselves, each copy
  // sat between two kernels of a stage and held it: graphed 1F1B ran 22%
  // slower than eager at batch 4096, session 14.)
  if (!copy_stream || !(t.device().is_cuda() || dst.is_cuda())) return t.to(dst);
  Tensor out;
  {
    StreamGuard g(*copy_stream);
    out = t.to(dst);
  }
  ready->emplace(dst, false);
  (*ready)->record(*copy_stream);
  return out;
}

}  // namespace

// Remembers (once) that this step issued to the copy stream of `dst`, direction `dir` (run.mu held).
void Pipeline::note_copy(Run& run, const Device& dst, int dir) const {
  const std::optional<Stream>& st = copy_stream(dst, dir);
  if (!st) return;
  for (const auto& [d, used] : run.copies_used)
    if (used == &*st) return;
  run.copies_used.emplace_back(dst, &*st);
}

void Pipeline::run_task(Run& run, const PipeTask& t, size_t d) {
  // Busy time: from when the task's inputs are there to its end (waiting is the bubble).
  // On a GPU the task is issued behind a gate that holds the stream until the
  // whole task is issued (DeviceBackend::hold_stream): its events then time
  // the device's work alone, not the host's issue gaps between kernels, which
  // a replayed graph does not have either (Note [Timing behind a gate]).
  std::optional<Event> start;
  std::shared_ptr<void> hold;
  Clock::time_point t0;
  auto begin_busy = [&] {
    if (!opts_.measure) return;
    t0 = Clock::now();
    const Device& dev = run.local_devices[d];
    if (dev.is_cuda()) {
      // Not over processes: a send stages its header from the host on the
      // held stream and would wait for the gate to give up.
      if (!opts_.stage_group) hold = backend(dev).hold_stream(dev);
      start.emplace(dev, true);
      start->record();
    }
  };
  auto end_busy = [&] {
    if (!opts_.measure) return;
    if (start) {
      Event end(run.local_devices[d], true);
      end.record();
      hold.reset();  // the task runs now
      run.gpu_spans[d].emplace_back(*start, end);
    } else {
      run.host_busy_ms[d] += std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    }
  };
  const int s = t.stage, m = t.micro;
  const size_t i = run.slot(s, m);
  const bool last = s == run.S - 1;
  const Stage& st = stages_[static_cast<size_t>(s)];
  const dist::ProcessGroupPtr& pg = opts_.stage_group;
  auto tag = [&](int dir, int stage, int part) { return ((dir * run.S + stage) * run.M + m) * 2 + part; };
  auto rank_of = [&](int stage) { return stage % pg->size(); };

  // Waits for flag `f` of slot i, or for another task's failure.
  auto wait_flag = [&](std::vector<char>& flags) {
    std::unique_lock<std::mutex> lk(run.mu);
    run.cv.wait(lk, [&] { return flags[i] || run.failed; });
    if (!flags[i]) throw Aborted{};
  };
  // Note [Pipeline messages] (pipeline_messages.h).
  auto send = [&](const Tensor& v, int to_stage, int dir) {
    // Note [Pipeline links]: stage s's neighbours are on the next and previous ranks.
    const dist::ProcessGroupPtr& link = links_.out[static_cast<size_t>(dir)];
    CHORUS_ASSERT(link && rank_of(to_stage) == (pg->rank() + (dir == 0 ? 1 : pg->size() - 1)) % pg->size());
    send_message(link, v, tag(dir, to_stage, 0), tag(dir, to_stage, 1), run.sends, run.sends_mu);
  };
  auto recv = [&](int from_stage, int dir) {
    const dist::ProcessGroupPtr& link = links_.in[static_cast<size_t>(dir)];
    CHORUS_ASSERT(link && rank_of(from_stage) == (pg->rank() + (dir == 0 ? pg->size() - 1 : 1)) % pg->size());
    return recv_message(link, tag(dir, s, 0), tag(dir, s, 1), st.device, copy_stream(st.device, dir),
                        rank_of(from_stage));
  };

  if (t.kind == PipeTask::Forward) {
    Tensor x;
    if (s == 0) {
      x = run.in[i];
    } else if (is_local(s - 1)) {
      wait_flag(run.in_flag);
      x = run.in[i];
      wait_arrival(x, run.in_ready[i]);
    } else {
      x = recv(s - 1, 0);
      if (run.train && run.backward && is_floating(x.dtype())) x.set_requires_grad(true);
      run.in[i] = x;
    }
    begin_busy();
    const bool ck = run.train && run.ckpt[static_cast<size_t>(m)];
    Tensor y, loss;
    {
      GeneratorGuard gg(*run.gens[i]);
      std::optional<NoGradGuard> ng;
      if (ck) ng.emplace();
      y = run_stage(static_cast<size_t>(s), x);
      if (last && run.train) {
        loss = (*run.loss_fn)(y, run.targets[static_cast<size_t>(m)]);
        CHORUS_CHECK(loss.numel() == 1, "Pipeline: the loss function must return one value, got ", loss.describe());
        loss = loss.mul(static_cast<double>(run.sizes[static_cast<size_t>(m)]) / static_cast<double>(run.batch));
      }
    }
    if (!last) {
      if (!run.train) {
        // forward(): the graph runs through the stages (a differentiable copy).
        std::lock_guard<std::mutex> lk(run.mu);
        run.in[run.slot(s + 1, m)] = y.to(stages_[static_cast<size_t>(s + 1)].device);
        run.in_flag[run.slot(s + 1, m)] = 1;
        run.cv.notify_all();
      } else if (is_local(s + 1)) {
        const Device dst = stages_[static_cast<size_t>(s + 1)].device;
        std::optional<Event> ready;
        Tensor nx = transfer(y.detach(), dst, copy_stream(dst, 0), &ready);
        if (run.backward && is_floating(nx.dtype())) nx.set_requires_grad(true);
        std::lock_guard<std::mutex> lk(run.mu);
        note_copy(run, dst, 0);
        run.in[run.slot(s + 1, m)] = nx;
        run.in_ready[run.slot(s + 1, m)] = std::move(ready);
        run.in_flag[run.slot(s + 1, m)] = 1;
        run.cv.notify_all();
      } else {
        send(y.detach(), s + 1, 0);
      }
      if (run.train && run.backward && !ck) run.out[i] = y;
      if (!run.backward) run.in[i] = Tensor();
    } else {
      if (run.backward && (!run.train || opts_.keep_output)) run.outputs[static_cast<size_t>(m)] = run.train ? y.detach() : y;
      if (run.train) {
        run.losses[static_cast<size_t>(m)] = loss.detach();
        if (!ck && run.backward) run.loss[i] = loss;
      }
      if (!run.backward) run.in[i] = Tensor();
    }
    if (++run.forwards_done[static_cast<size_t>(s)] == run.M && is_training() && run.backward)
      for (const auto& bn : st.deferred) bn->commit();
    end_busy();
    return;
  }

  // Backward.
  Tensor g;
  if (!last) {
    if (is_local(s + 1)) {
      wait_flag(run.grad_flag);
      g = run.grad_out[i];
      wait_arrival(g, run.grad_ready[i]);
    } else {
      g = recv(s + 1, 1);
    }
  }
  begin_busy();
  Tensor root;
  if (run.ckpt[static_cast<size_t>(m)]) {
    RecomputeGuard rg;
    run.gens[i]->set_state(run.gen_start[i]);  // the same dropout masks as the first forward
    GeneratorGuard gg(*run.gens[i]);
    Tensor y = run_stage(static_cast<size_t>(s), run.in[i]);
    if (last) {
      root = (*run.loss_fn)(y, run.targets[static_cast<size_t>(m)])
                 .mul(static_cast<double>(run.sizes[static_cast<size_t>(m)]) / static_cast<double>(run.batch));
    } else {
      root = y;
    }
  } else {
    root = last ? run.loss[i] : run.out[i];
  }
  if (root.requires_grad()) root.backward(last ? Tensor() : g);
  if (s > 0) {
    Tensor gi = run.in[i].grad();
    if (!gi.defined()) gi = zeros(run.in[i].sizes(), {run.in[i].dtype(), run.in[i].device()});
    if (is_local(s - 1)) {
      const Device dst = stages_[static_cast<size_t>(s - 1)].device;
      std::optional<Event> ready;
      Tensor moved = transfer(gi, dst, copy_stream(dst, 1), &ready);
      std::lock_guard<std::mutex> lk(run.mu);
      note_copy(run, dst, 1);
      run.grad_out[run.slot(s - 1, m)] = moved;
      run.grad_ready[run.slot(s - 1, m)] = std::move(ready);
      run.grad_flag[run.slot(s - 1, m)] = 1;
      run.cv.notify_all();
    } else {
      send(gi, s - 1, 1);
    }
  }
  // This micro-batch's activations on this stage are done with.
  run.in[i] = Tensor();
  run.out[i] = Tensor();
  run.loss[i] = Tensor();
  run.grad_out[i] = Tensor();
  if (++run.backwards_done[static_cast<size_t>(s)] == run.M && !stage_data_groups_.empty())
    reduce_stage_gradients(static_cast<size_t>(s));
  end_busy();
}

const std::optional<Stream>& Pipeline::copy_stream(const Device& dst, int dir) const {
  for (const auto& [d, streams] : copy_streams_)
    if (d == dst) return streams[static_cast<size_t>(dir)];
  static const std::optional<Stream> none;
  return none;
}

void Pipeline::execute(Run& run) {
  const size_t D = run.local_devices.size();
  std::vector<std::function<void()>> tasks;
  run.host_busy_ms.assign(D, 0.0);
  run.gpu_spans.assign(D, {});
  for (size_t d = 0; d < D; ++d) {
    tasks.push_back([this, &run, d] {
      for (const PipeTask& t : run.lists[d]) {
        {
          std::lock_guard<std::mutex> lk(run.mu);
          if (run.failed) return;
        }
        try {
          run_task(run, t, d);
        } catch (const Aborted&) {
          return;
        } catch (...) {
          const Stage& st = stages_[static_cast<size_t>(t.stage)];
          std::string what;
          try {
            throw;
          } catch (const Error& e) {
            what = e.message();
          } catch (const std::exception& e) {
            what = e.what();
          }
          std::lock_guard<std::mutex> lk(run.mu);
          if (!run.failed) {
            run.failed = true;
            run.error = std::make_exception_ptr(
                Error("pipeline stage " + std::to_string(t.stage) + " (layers " + std::to_string(st.first) + "-" +
                      std::to_string(st.last - 1) + ", " + st.device.str() + "), micro-batch " +
                      std::to_string(t.micro) + (t.kind == PipeTask::Forward ? " forward" : " backward") + ": " +
                      what));
          }
          run.cv.notify_all();
          return;
        }
      }
    });
  }
  DeviceThreads(run.local_devices).run(tasks);
  {
    std::lock_guard<std::mutex> g(run.sends_mu);
    for (const dist::WorkPtr& w : run.sends) w->wait();
    run.sends.clear();
  }
  // Inside a capture every copy stream the step used joined it; a copy whose
  // receiver never ran (a stage failed, e.g. a CaptureError) would leave its
  // stream unjoined and the capture could not even end cleanly. Joining each
  // one back into its device's capture stream keeps the capture well formed
  // whatever happened (on success the receivers already waited for them).
  if (capture_in_progress()) {
    for (const auto& [dev, stream] : run.copies_used) {
      Event done(dev, false);
      done.record(*stream);
      Stream::current(dev).wait(done);
    }
  }
  if (run.error) std::rethrow_exception(run.error);
}

// The micro-batches' inputs to the first stage's device and targets to the
// last's, where this process holds them.
void Pipeline::feed(Run& run, const Tensor& x, const Tensor& target) const {
  int64_t at = 0;
  for (int m = 0; m < run.M; ++m) {
    const int64_t len = run.sizes[static_cast<size_t>(m)];
    if (is_local(0)) run.in[run.slot(0, m)] = x.narrow(0, at, len).to(stages_[0].device);
    if (is_local(run.S - 1)) run.targets.push_back(target.narrow(0, at, len).to(stages_.back().device));
    at += len;
  }
}

// Every device's list in one process; over processes this rank's, after
// checking that each link's messages are sent in the order they are received.
void Pipeline::set_lists(Run& run, std::vector<std::vector<PipeTask>> lists, bool forwards_only) const {
  const dist::ProcessGroupPtr& pg = opts_.stage_group;
  if (!pg) {
    run.lists = std::move(lists);
    return;
  }
  check_link_order(lists, run.S, run.M, forwards_only);
  run.lists = {std::move(lists[static_cast<size_t>(pg->rank())])};
}

void Pipeline::init_run(Run& run, int64_t batch, int micro_batches) const {
  run.S = static_cast<int>(stages_.size());
  run.batch = batch;
  run.M = micro_batches;
  run.sizes = even_split(batch, micro_batches);
  run.local_devices = devices_;
  const size_t n = static_cast<size_t>(run.S) * static_cast<size_t>(run.M);
  run.in.assign(n, {});
  run.out.assign(n, {});
  run.grad_out.assign(n, {});
  run.loss.assign(n, {});
  run.in_ready.resize(n);
  run.grad_ready.resize(n);
  run.in_flag.assign(n, 0);
  run.grad_flag.assign(n, 0);
  run.ckpt.assign(static_cast<size_t>(run.M), 0);
  run.outputs.assign(static_cast<size_t>(run.M), {});
  run.losses.assign(static_cast<size_t>(run.M), {});
  run.forwards_done.assign(static_cast<size_t>(run.S), 0);
  run.backwards_done.assign(static_cast<size_t>(run.S), 0);
  // One generator per (stage, micro-batch), derived from the process's
  // stream: the same numbers whatever order the threads run in, and again
  // when a checkpointed forward is recomputed.
  // A replayed step does not run this host code: inside a capture the
  // process's stream is advanced once per replay instead, as an eager step
  // advances it (else every later draw of the program -- the next batch --
  // differs from an eager run's).
  RngState base;
  if (capture_in_progress()) {
    base = default_generator().state();
    on_each_replay([] { (void)default_generator().reserve(4); });
  } else {
    base = default_generator().reserve(4);
  }
  for (size_t i = 0; i < n; ++i) {
    run.gens.push_back(std::make_unique<Generator>(mix(base.seed ^ mix(base.offset) ^ mix(i + 1))));
    run.gen_start.push_back(run.gens.back()->state());
  }
}

Tensor Pipeline::forward(const Tensor& x) {
  CHORUS_CHECK(!opts_.stage_group, "Pipeline: forward() runs in one process; over processes use train_step");
  CHORUS_CHECK(x.defined() && x.dim() >= 1, "Pipeline: forward needs a batch, got ",
               x.defined() ? x.describe() : std::string("an undefined tensor"));
  CHORUS_CHECK(x.size(0) >= 1, "Pipeline: the batch is empty");
  Run run;
  run.train = false;
  init_run(run, x.size(0), static_cast<int>(std::min<int64_t>(opts_.micro_batches, x.size(0))));
  const int D = static_cast<int>(devices_.size());
  run.lists.assign(static_cast<size_t>(D), {});
  for (int m = 0; m < run.M; ++m)
    for (int s = 0; s < run.S; ++s) run.lists[static_cast<size_t>(s % D)].push_back({PipeTask::Forward, s, m});
  int64_t at = 0;
  for (int m = 0; m < run.M; ++m) {
    run.in[run.slot(0, m)] = x.narrow(0, at, run.sizes[static_cast<size_t>(m)]).to(stages_[0].device);
    at += run.sizes[static_cast<size_t>(m)];
  }
  execute(run);
  return run.M == 1 ? run.outputs[0] : chorus::cat(run.outputs, 0);
}

Tensor Pipeline::evaluate(const Tensor& x, const Tensor& target, const LossFn& loss_fn) {
  CHORUS_CHECK(x.defined() && x.dim() >= 1 && x.size(0) >= 1, "Pipeline: evaluate needs a batch, got ",
               x.defined() ? x.describe() : std::string("an undefined tensor"));
  CHORUS_CHECK(target.defined() && target.dim() >= 1 && target.size(0) == x.size(0), "Pipeline: ",
               target.defined() ? target.describe() : std::string("an undefined target"), " for a batch of ", x.size(0));
  CHORUS_CHECK(loss_fn != nullptr, "Pipeline: evaluate needs a loss function");
  NoGradGuard no_grad;  // the stages' threads run under the caller's grad mode (DeviceThreads)
  Run run;
  run.train = true;  // the loss on the last stage, activations sent on over processes
  run.backward = false;
  init_run(run, x.size(0), static_cast<int>(std::min<int64_t>(opts_.micro_batches, x.size(0))));
  run.loss_fn = &loss_fn;
  const dist::ProcessGroupPtr& pg = opts_.stage_group;
  const int places = pg ? pg->size() : static_cast<int>(devices_.size());
  // Forwards in micro-batch order: every stage's list waits only on the one before it.
  set_lists(run, forward_lists(places, run.S, run.M), /*forwards_only=*/true);
  feed(run, x, target);
  execute(run);
  if (!is_local(run.S - 1)) return Tensor();
  Tensor loss = run.losses[0];
  for (int m = 1; m < run.M; ++m) loss = loss.add(run.losses[static_cast<size_t>(m)]);
  return loss;
}

Pipeline::StepResult Pipeline::train_step(const Tensor& x, const Tensor& target, const LossFn& loss_fn) {
  CHORUS_CHECK(x.defined() && x.dim() >= 1, "Pipeline: train_step needs a batch, got ",
               x.defined() ? x.describe() : std::string("an undefined tensor"));
  CHORUS_CHECK(target.defined() && target.dim() >= 1 && target.size(0) == x.size(0), "Pipeline: ",
               target.defined() ? target.describe() : std::string("an undefined target"), " for a batch of ", x.size(0));
  CHORUS_CHECK(loss_fn != nullptr, "Pipeline: train_step needs a loss function");
  const auto t0 = Clock::now();
  const dist::ProcessGroupPtr& pg = opts_.stage_group;
  CHORUS_CHECK(opts_.micro_batches <= x.size(0), "Pipeline: ", opts_.micro_batches,
               " micro-batches are more than the batch of ", x.size(0), " (each micro-batch needs a sample)");
  Run run;
  run.train = true;
  init_run(run, x.size(0), static_cast<int>(opts_.micro_batches));
  run.loss_fn = &loss_fn;
  const int places = pg ? pg->size() : static_cast<int>(devices_.size());
  set_lists(run, make_schedule(opts_.schedule, places, run.S, run.M), /*forwards_only=*/false);
  for (int m = 0; m < run.M; ++m)
    run.ckpt[static_cast<size_t>(m)] = opts_.checkpoint == Checkpoint::Always ||
                                       (opts_.checkpoint == Checkpoint::ExceptLast && m != run.M - 1);
  feed(run, x, target);
  execute(run);

  StepResult r;
  if (is_local(run.S - 1)) {
    Tensor loss = run.losses[0];
    for (int m = 1; m < run.M; ++m) loss = loss.add(run.losses[static_cast<size_t>(m)]);
    r.loss = loss;
    if (opts_.keep_output) r.output = run.M == 1 ? run.outputs[0] : chorus::cat(run.outputs, 0);
  }
  stats_ = PipelineStats{};
  if (opts_.measure) {
    for (const Device& d : run.local_devices) synchronize(d);
    stats_.busy_ms = run.host_busy_ms;
    for (size_t d = 0; d < run.gpu_spans.size(); ++d)
      for (auto& [a, b] : run.gpu_spans[d]) stats_.busy_ms[d] += a.elapsed(b);
  }
  stats_.step_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  if (opts_.measure && stats_.step_ms > 0) {
    double busy = 0;
    for (double b : stats_.busy_ms) busy += b;
    stats_.bubble = std::max(0.0, 1.0 - busy / (static_cast<double>(stats_.busy_ms.size()) * stats_.step_ms));
  }
  return r;
}

}  // namespace chorus::parallel
