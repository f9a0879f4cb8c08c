#include "sharded_checkpoints.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <map>

#include "chorus/autograd/grad_mode.h"
#include "chorus/core/error.h"
#include "chorus/ops/factory.h"
#include "chorus/io/safetensors.h"
#include "chorus/io/sharded_checkpoint.h"
#include "chorus/io/sharded_reader.h"
#include "chorus/ops/copy.h"

namespace chorus::app {

namespace fs = std::filesystem;

// Note [Checkpoints at any layout]: a run's checkpoint directory may hold
// both kinds (a DDP run resumed as zero, or the reverse); the newest step
// wins, whatever the kind. A zero rank reads only its ranges of a sharded
// checkpoint (the index says which files hold them), but must read a
// one-process checkpoint whole; a whole-model run reads the sharded one whole.
std::optional<FoundCheckpoint> find_newest_checkpoint(const std::string& dir) {
  auto step_of = [](const std::string& path) -> int64_t {
    const std::string name = fs::path(path).filename().string();
    try {
      return static_cast<int64_t>(std::stoll(name.substr(name.find('-') + 1)));
    } catch (...) {
      return int64_t{-1};
    }
  };
  std::optional<FoundCheckpoint> best;
  if (auto one = io::find_latest_checkpoint(dir)) best = FoundCheckpoint{*one, false};
  if (auto sh = io::find_latest_sharded_checkpoint(dir))
    if (!best || step_of(*sh) > step_of(best->path)) best = FoundCheckpoint{*sh, true};
  return best;
}

namespace {

// The job's store as io/'s CommitStore.
class JobCommitStore final : public io::CommitStore {
 public:
  explicit JobCommitStore(dist::StorePtr store) : store_(std::move(store)) {}
  void set(const std::string& key, const std::string& value) override { store_->set(key, value); }
  std::string get(const std::string& key) override { return store_->get_string(key); }
  int64_t add(const std::string& key, int64_t delta) override { return store_->add(key, delta); }
  bool check(const std::vector<std::string>& keys) override { return store_->check(keys); }
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    store_->wait(keys, timeout);
  }

 private:
  dist::StorePtr store_;
};

}  // namespace

ShardedCheckpointer::ShardedCheckpointer(std::string dir, std::shared_ptr<dist::ShardedDataParallel> sdp,
                                         optim::Optimizer& opt, const RankContext& ranks, int keep_last)
    : sdp_(std::move(sdp)),
      opt_(opt),
      writer_(std::move(dir), [&] {
        io::ShardedSaveOptions o;
        o.rank = ranks.env.rank;
        o.world = ranks.env.world_size;
        o.store = std::make_shared<JobCommitStore>(ranks.group->store());
        o.keep_last = keep_last;
        return o;
      }()) {}

double ShardedCheckpointer::save(const io::TrainingState& state) {
  // Note [Stall by phase] (io/sharded_writer.h): the assembly's phases open
  // the stall's.
  io::StallPhases phases;
  io::PhaseClock clock(phases);
  io::ShardedSave s = assemble(state, clock);
  return writer_.save(s, phases);
}

double ShardedCheckpointer::set_aside() {
  io::StallPhases phases;
  io::PhaseClock clock(phases);
  return writer_.set_aside(assemble(io::TrainingState{}, clock));
}

io::ShardedSave ShardedCheckpointer::assemble(const io::TrainingState& state, io::PhaseClock& clock) {
  const auto& pieces = sdp_->pieces();
  const auto& values = sdp_->shard_parameters();
  // The live moments: the writer's snapshot freezes them (state() would
  // copy them once more on the device).
  const NamedTensors opt_state = opt_.live_state();
  std::map<std::string, Tensor> by_name(opt_state.begin(), opt_state.end());
  clock.lap("live state");
  io::ShardedSave s;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const auto& pc = pieces[i];
    s.model.push_back({pc.name, pc.shape, pc.dtype, pc.begin, pc.end, values[i]});
    const std::string prefix = "param." + std::to_string(i) + ".";
    if (!by_name.count(prefix + "step")) continue;  // never updated
    io::OptimizerPiece op{pc.name, pc.shape, pc.begin, pc.end, by_name[prefix + "step"].to_vector<int64_t>()[0], {}};
    for (const char* b : {"exp_avg", "exp_avg_sq", "momentum_buffer"})
      if (by_name.count(prefix + b)) op.buffers.emplace_back(b, by_name[prefix + b]);
    s.optimizer.push_back(std::move(op));
  }
  clock.lap("pieces");
  // The replicated part (rank 0's is written): frozen parameters, buffers,
  // the optimizer's scalars.
  std::vector<std::string> trainable = sdp_->parameter_names();
  for (auto& [name, p] : sdp_->module()->named_parameters())
    if (!p.requires_grad()) s.replicated_model.emplace_back(name, p);
  for (auto& [name, b] : sdp_->module()->named_buffers()) s.replicated_model.emplace_back(name, b);
  s.replicated_optimizer = {{"step", by_name["step"]}, {"lr", by_name["lr"]}};
  clock.lap("replicated");
  for (auto& [name, p] : sdp_->module()->named_parameters()) s.param_order.push_back(name);
  s.optimizer_name = opt_.name();
  s.state = state;
  s.layout = {{"strategy", "zero"}, {"stage", sdp_->options().stage}, {"ranks", sdp_->process_group()->size()}};
  clock.lap("metadata");
  return s;
}

std::string ShardedCheckpointer::wait() { return writer_.wait(); }

std::string snapshot_where(const std::vector<Device>& devices) {
  if (devices.empty()) return "shards copied to host memory; written in the background";
  std::string on;
  for (const Device& d : devices) on += (on.empty() ? "" : ", ") + d.str();
  return "shards snapshotted on " + on + "; copied to host and written in the background";
}

std::string stall_summary(const io::ShardedCheckpointWriter::Totals& t, double step_ms) {
  const double n = static_cast<double>(std::max<int64_t>(t.saves, 1));
  const double host = t.stall_ms / n, device = t.device_ms / n;
  char line[320];
  std::snprintf(line, sizeof line,
                "checkpoints: %lld save%s, stall per save %.1f ms on the host + %.1f ms of device copies",
                static_cast<long long>(t.saves), t.saves == 1 ? "" : "s", host, device);
  std::string s = line;
  if (step_ms > 0) {
    std::snprintf(line, sizeof line, " (%.1f%% of a step)", 100 * (host + device) / step_ms);
    s += line;
  }
  if (t.saves > 1) {
    // The first save also allocates the snapshot's memory; the pool keeps
    // it for the later ones, which are the steady cost.
    const double later = (t.stall_ms - t.first_stall_ms) / static_cast<double>(t.saves - 1);
    std::snprintf(line, sizeof line, "; the first %.1f ms on the host, the later ones %.1f ms", t.first_stall_ms, later);
    s += line;
    if (step_ms > 0) {
      std::snprintf(line, sizeof line, " (%.1f%% of a step with the device copies)", 100 * (later + device) / step_ms);
      s += line;
    }
  }
  if (t.wait_ms > 0) {
    std::snprintf(line, sizeof line, "; and %.1f s in all waiting for earlier saves still being written (checkpoint less often)",
                  t.wait_ms / 1000);
    s += line;
  }
  return s;
}

namespace {

// "live state 0.1, pieces 2.0, ... ms (sum 9.5 ms)", each phase divided by `n`.
std::string phases_str(const io::StallPhases& p, double n) {
  std::string s;
  char v[96];
  for (const auto& [name, ms] : p.ms) {
    std::snprintf(v, sizeof v, "%s%s %.2f", s.empty() ? "" : ", ", name.c_str(), ms / n);
    s += v;
  }
  std::snprintf(v, sizeof v, " ms (sum %.2f ms)", p.total() / n);
  return s + v;
}

}  // namespace

std::string stall_phases_summary(const io::ShardedCheckpointWriter::Totals& t) {
  if (t.saves == 0) return "";
  // Whether the device still ran earlier work as a save began (none: nothing
  // outside host memory).
  std::string s = "checkpoints: the first save's stall by phase";
  if (t.first_device_busy >= 0) s += t.first_device_busy ? " (the device busy as it began)" : " (the device idle as it began)";
  s += ": " + phases_str(t.first_phases, 1);
  if (t.saves > 1) {
    s += "; the later ones' (mean of " + std::to_string(t.saves - 1);
    if (t.later_on_device > 0)
      s += "; the device busy as " + std::to_string(t.later_device_busy) + " of them began";
    s += "): " + phases_str(t.later_phases, static_cast<double>(t.saves - 1));
  }
  return s;
}

nlohmann::ordered_json stall_phases_json(const io::ShardedCheckpointWriter::Totals& t) {
  auto obj = [](const io::StallPhases& p, double n) {
    nlohmann::ordered_json o = nlohmann::ordered_json::object();
    for (const auto& [name, ms] : p.ms) o[name] = ms / n;
    return o;
  };
  nlohmann::ordered_json out = {{"first", obj(t.first_phases, 1)}};
  if (t.saves > 1) out["later"] = obj(t.later_phases, static_cast<double>(t.saves - 1));
  if (t.first_device_busy >= 0) out["first_device_busy"] = t.first_device_busy == 1;
  if (t.later_on_device > 0) out["later_device_busy"] = t.later_device_busy;  // of the later saves
  return out;
}

namespace {

// The per-parameter buffers a checkpoint may hold: AdamW's moments, SGD's
// momentum (the image models' optimizer).
constexpr const char* kOptimizerBuffers[] = {"exp_avg", "exp_avg_sq", "momentum_buffer"};

// Where a zero rank's ranges come from: a range of a model tensor, of an
// optimizer buffer of a parameter (undefined when the checkpoint has no such
// buffer: another optimizer's, or SGD without momentum), and a parameter
// range's step count (nullopt: never updated).
struct RangeSource {
  std::function<Tensor(const std::string&, int64_t, int64_t)> model;
  std::function<Tensor(const std::string&, const std::string&, int64_t, int64_t)> buffer;
  std::function<std::optional<int64_t>(const std::string&, int64_t, int64_t)> step;
  NamedTensors scalars;  // "step", "lr"
  NamedTensors replicated;  // frozen parameters and buffers, whole
};

void load_ranges(const RangeSource& src, dist::ShardedDataParallel& sdp, optim::Optimizer& opt) {
  sdp.load_shards([&](const dist::ShardedDataParallel::Piece& pc) { return src.model(pc.name, pc.begin, pc.end); });
  NamedTensors st = src.scalars;
  const auto& pieces = sdp.pieces();
  for (size_t i = 0; i < pieces.size(); ++i) {
    const auto& pc = pieces[i];
    const std::optional<int64_t> step = src.step(pc.name, pc.begin, pc.end);
    if (!step) continue;
    const std::string prefix = "param." + std::to_string(i) + ".";
    st.emplace_back(prefix + "step", from_vector(std::vector<int64_t>{*step}, {}));
    for (const char* b : kOptimizerBuffers)
      if (Tensor t = src.buffer(pc.name, b, pc.begin, pc.end); t.defined()) st.emplace_back(prefix + b, t);
  }
  opt.load_state(st);
  // Frozen parameters and buffers: whole, into the module.
  std::map<std::string, Tensor> rep(src.replicated.begin(), src.replicated.end());
  NoGradGuard no_grad;
  for (auto& [name, p] : sdp.module()->named_parameters())
    if (!p.requires_grad() && rep.count(name)) ops::copy_(p, ops::to_device(rep[name].reshape(p.sizes()), p.device()));
  for (auto& [name, b] : sdp.module()->named_buffers())
    if (rep.count(name)) ops::copy_(b, ops::to_device(rep[name].reshape(b.sizes()), b.device()));
}

}  // namespace

io::TrainingState load_into_shards(const FoundCheckpoint& found, dist::ShardedDataParallel& sdp, optim::Optimizer& opt,
                                   const CheckpointCheck& check) {
  RangeSource src;
  io::TrainingState state;
  if (found.sharded) {
    auto ck = std::make_shared<io::ShardedCheckpoint>(io::ShardedCheckpoint::open(found.path));
    state = ck->state();
    if (check) check(state, found.path + "/index.json");
    src.model = [ck](const std::string& n, int64_t b, int64_t e) { return ck->read(n, b, e); };
    auto holds = [ck](const std::string& name) {
      const auto names = ck->names();
      return std::find(names.begin(), names.end(), name) != names.end();
    };
    src.buffer = [ck, holds](const std::string& p, const std::string& buf, int64_t b, int64_t e) {
      const std::string name = "optimizer/" + p + "." + buf;
      return holds(name) ? ck->read(name, b, e) : Tensor();
    };
    // The step count is recorded with each buffer's pieces: the first buffer's.
    src.step = [ck, holds](const std::string& p, int64_t b, int64_t e) -> std::optional<int64_t> {
      for (const char* buf : kOptimizerBuffers)
        if (const std::string name = "optimizer/" + p + "." + buf; holds(name)) return ck->read_step(name, b, e);
      return std::nullopt;
    };
    for (const char* s : {"step", "lr"}) src.scalars.emplace_back(s, ck->read_full(std::string("optimizer/") + s));
    const auto names = ck->names();
    for (auto& [name, p] : sdp.module()->named_parameters())
      if (!p.requires_grad() && std::find(names.begin(), names.end(), name) != names.end())
        src.replicated.emplace_back(name, ck->read_full(name));
    for (auto& [name, b] : sdp.module()->named_buffers())
      if (std::find(names.begin(), names.end(), name) != names.end()) src.replicated.emplace_back(name, ck->read_full(name));
  } else {
    state = io::read_training_state(found.path + "/state.json");
    if (check) check(state, found.path + "/state.json");
    auto model = std::make_shared<std::map<std::string, Tensor>>();
    for (auto& [n, t] : io::load_safetensors(found.path + "/model.safetensors")) (*model)[n] = t;
    auto optst = std::make_shared<std::map<std::string, Tensor>>();
    for (auto& [n, t] : io::load_safetensors(found.path + "/optimizer.safetensors")) (*optst)[n] = t;
    // Optimizer::state()'s index of each parameter: its place among all of them.
    auto index = std::make_shared<std::map<std::string, size_t>>();
    size_t i = 0;
    for (auto& [name, p] : sdp.module()->named_parameters()) (*index)[name] = i++;
    auto need = [path = found.path](const std::map<std::string, Tensor>& m, const std::string& n) {
      auto it = m.find(n);
      CHORUS_CHECK(it != m.end(), "checkpoint ", path, " holds no '", n, "'");
      return it->second;
    };
    src.model = [model, need](const std::string& n, int64_t b, int64_t e) {
      Tensor t = need(*model, n);
      return t.reshape({t.numel()}).narrow(0, b, e - b);
    };
    src.buffer = [optst, index](const std::string& p, const std::string& buf, int64_t b, int64_t e) {
      auto it = optst->find("param." + std::to_string(index->at(p)) + "." + buf);
      if (it == optst->end()) return Tensor();
      return it->second.reshape({it->second.numel()}).narrow(0, b, e - b);
    };
    src.step = [optst, index](const std::string& p, int64_t, int64_t) -> std::optional<int64_t> {
      auto it = optst->find("param." + std::to_string(index->at(p)) + ".step");
      if (it == optst->end()) return std::nullopt;
      return it->second.to_vector<int64_t>()[0];
    };
    for (const char* s : {"step", "lr"}) src.scalars.emplace_back(s, need(*optst, s));
    for (auto& [name, p] : sdp.module()->named_parameters())
      if (!p.requires_grad()) src.replicated.emplace_back(name, need(*model, name));
    for (auto& [name, b] : sdp.module()->named_buffers()) src.replicated.emplace_back(name, need(*model, name));
  }
  load_ranges(src, sdp, opt);
  return state;
}

namespace {
bool is_sharded_checkpoint(const std::string& ckpt) { return fs::exists(fs::path(ckpt) / "index.json"); }
}  // namespace

std::string state_file_of(const std::string& ckpt) {
  return ckpt + (is_sharded_checkpoint(ckpt) ? "/index.json" : "/state.json");
}

io::Resumed resume_at_any_layout(const std::string& dir, nn::Module& model, optim::Optimizer& opt,
                                 dist::ShardedDataParallel* sdp, bool start_fresh, const CheckpointCheck& check) {
  const std::optional<FoundCheckpoint> found = find_newest_checkpoint(dir);
  // A zero module's own parameters are not the weights (stage 3 frees them):
  // only its pieces are loaded.
  if (!sdp && !(found && found->sharded)) return io::resume_checkpoint(dir, model, opt, start_fresh, check);
  io::Resumed res;
  if (!found) return res;
  res.state = sdp ? load_into_shards(*found, *sdp, opt, check) : load_sharded_into_full(found->path, model, opt, check);
  res.path = found->path;
  return res;
}

io::TrainingState load_at_any_layout(const std::string& ckpt, nn::Module& model, optim::Optimizer& opt,
                                     const CheckpointCheck& check) {
  return is_sharded_checkpoint(ckpt) ? load_sharded_into_full(ckpt, model, opt, check)
                                     : io::load_checkpoint(ckpt, model, opt, check);
}

io::TrainingState load_sharded_into_full(const std::string& ckpt, nn::Module& model, optim::Optimizer& opt,
                                         const CheckpointCheck& check) {
  io::ShardedCheckpoint ck = io::ShardedCheckpoint::open(ckpt);
  if (check) check(ck.state(), ckpt + "/index.json");
  model.load_state_dict(io::load_full_model_state(ck));
  opt.load_state(io::load_full_optimizer_state(ck));
  return ck.state();
}

}  // namespace chorus::app
