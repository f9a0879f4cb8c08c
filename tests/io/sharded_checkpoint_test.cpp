// Sharded checkpoints: three ranks (threads sharing a HashStore) write
// uneven pieces, and readers at 1, 2 and 4 ranks and the full tensors get
// the bytes back exactly; the full model and optimizer load into a fresh
// model that then trains identically; consolidate and shard round-trip; a
// crashed save is never taken for a checkpoint; missing shards and
// overlapping pieces are named; the background writer stalls only for its
// snapshot, which keeps the values at save time on either path (on the
// device, or the synchronous host copy it falls back to).
#include "chorus/io/sharded_checkpoint.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <thread>

#include "chorus/core/error.h"
#include "chorus/core/rng.h"
#include "chorus/distributed/hash_store.h"
#include "chorus/io/safetensors.h"
#include "chorus/io/sharded_index.h"
#include "chorus/io/sharded_reader.h"
#include "chorus/io/sharded_writer.h"
#include "chorus/nn/layers.h"
#include "chorus/ops/factory.h"
#include "chorus/ops/copy.h"
#include "chorus/optim/adamw.h"
#include "io/io_test_util.h"

namespace {
// An in-memory store every thread of a test shares, as io/'s CommitStore.
class HashCommitStore final : public chorus::io::CommitStore {
 public:
  void set(const std::string& key, const std::string& value) override { store_.set(key, value); }
  std::string get(const std::string& key) override { return store_.get_string(key); }
  int64_t add(const std::string& key, int64_t delta) override { return store_.add(key, delta); }
  bool check(const std::vector<std::string>& keys) override { return store_.check(keys); }
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    store_.wait(keys, timeout);
  }

 private:
  chorus::dist::HashStore store_;
};
std::shared_ptr<chorus::io::CommitStore> hash_commit_store() { return std::make_shared<HashCommitStore>(); }
}  // namespace

namespace chorus::io::sharded_checkpoint_test {
namespace {

using namespace chorus::io::testing;
using Ranges = std::function<std::pair<int64_t, int64_t>(int64_t numel, int rank)>;

// Parameters of 35 (not a multiple of 3), 2 (one rank of 3 gets nothing) and
// 24 elements, a buffer, a child.
class Net : public nn::Module {
 public:
  Net() : Module("Net") {
    register_parameter("weight", randn({5, 7}));
    register_parameter("bias", randn({2}));
    register_buffer("running", randn({3}));
    register_module("head", std::make_shared<nn::Linear>(4, 6));
  }

 protected:
  std::shared_ptr<Module> make_empty() const override { return std::make_shared<Net>(); }
};

std::vector<uint8_t> raw(const Tensor& t) {
  Tensor c = t.contiguous();
  auto* b = static_cast<const uint8_t*>(c.raw_data());
  return std::vector<uint8_t>(b, b + c.nbytes());
}

Tensor flat(const Tensor& t) { return t.detach().contiguous().reshape({t.numel()}); }

void train_step(nn::Module& m, optim::Optimizer& opt) {
  opt.zero_grad();
  for (auto& p : m.parameters()) p.set_grad(randn(p.sizes()));
  opt.step();
}

std::vector<std::string> param_names(const nn::Module& m) {
  std::vector<std::string> out;
  for (const auto& [name, t] : m.named_parameters()) out.push_back(name);
  return out;
}

TrainingState state_at(int64_t step) {
  TrainingState s;
  s.epoch = 1;
  s.step = step;
  s.batch_in_epoch = 9;
  s.rng = default_generator().state();
  s.config = {{"model", "net"}, {"lr", 0.001}};
  s.extra = {{"note", "sharded"}};
  return s;
}

// What a ZeRO rank holds: its range of every parameter and of its AdamW
// moments, the buffers and the optimizer's scalars (kept by rank 0 only).
ShardedSave rank_save(const nn::Module& m, const optim::Optimizer& opt, int rank, const Ranges& ranges, int64_t step) {
  ShardedSave s;
  s.param_order = param_names(m);
  s.optimizer_name = opt.name();
  s.state = state_at(step);
  s.layout = {{"strategy", "zero"}, {"stage", 3}};
  const nn::NamedTensors full_opt = opt.state();
  auto find = [&](const std::string& name) {
    for (const auto& [n, t] : full_opt)
      if (n == name) return t;
    return Tensor();
  };
  const nn::NamedTensors params = m.named_parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& [name, p] = params[i];
    const auto [b, e] = ranges(p.numel(), rank);
    s.model.push_back({name, p.sizes(), p.dtype(), b, e, flat(p).narrow(0, b, e - b)});
    OptimizerPiece o{name, p.sizes(), b, e, static_cast<int64_t>(find("param." + std::to_string(i) + ".step").item()), {}};
    for (const char* buf : {"exp_avg", "exp_avg_sq"})
      o.buffers.emplace_back(buf, flat(find("param." + std::to_string(i) + "." + buf)).narrow(0, b, e - b));
    s.optimizer.push_back(std::move(o));
  }
  s.replicated_model = m.named_buffers();
  for (const char* name : {"step", "lr"}) s.replicated_optimizer.emplace_back(name, find(name));
  return s;
}

// Rank 0 takes the first 5/8 of each tensor, rank 1 nothing, rank 2 the rest.
std::pair<int64_t, int64_t> lopsided(int64_t numel, int rank) {
  const int64_t cut = numel * 5 / 8;
  if (rank == 0) return {0, cut};
  if (rank == 1) return {cut, cut};
  return {cut, numel};
}

// World `world`'s saves, each rank on its own thread, through one store.
std::vector<std::string> save_in_threads(const std::string& dir, const std::vector<ShardedSave>& saves,
                                         std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  auto store = hash_commit_store();
  const int world = static_cast<int>(saves.size());
  std::vector<std::string> paths(world);
  std::vector<std::exception_ptr> errors(world);
  std::vector<std::thread> ranks;
  for (int r = 0; r < world; ++r)
    ranks.emplace_back([&, r] {
      try {
        ShardedSaveOptions o;
        o.rank = r;
        o.world = world;
        o.store = store;
        o.timeout = timeout;
        paths[r] = save_sharded_checkpoint(dir, saves[r], o);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  for (auto& t : ranks) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  return paths;
}

struct Trained {
  Net net;
  optim::AdamW opt{net.parameters(), {}};
  Trained() {
    for (int i = 0; i < 3; ++i) train_step(net, opt);
  }
};

TEST(ShardedCheckpoint, ThreeUnevenRanksReadBackAtAnyWorldBitExactly) {
  ScratchDir dir;
  manual_seed(7);
  Trained t;
  std::vector<ShardedSave> saves;
  for (int r = 0; r < 3; ++r) saves.push_back(rank_save(t.net, t.opt, r, lopsided, 3));
  const std::vector<std::string> paths = save_in_threads(dir.path().string(), saves);
  for (const std::string& p : paths) EXPECT_EQ(p, dir.file("ckpt-00000003"));
  EXPECT_EQ(read_bytes(dir.file("latest")), "ckpt-00000003\n");
  EXPECT_TRUE(fs::exists(dir.file("ckpt-00000003/shard-00001-of-00003.safetensors")));

  const ShardedCheckpoint ckpt = ShardedCheckpoint::open(dir.path().string());
  EXPECT_EQ(ckpt.world(), 3);
  EXPECT_EQ(ckpt.layout()["stage"], 3);
  EXPECT_EQ(ckpt.state().step, 3);
  EXPECT_EQ(ckpt.state().config, saves[0].state.config);
  EXPECT_EQ(ckpt.state().extra, saves[0].state.extra);
  EXPECT_EQ(ckpt.state().rng.offset, saves[0].state.rng.offset);

  const nn::NamedTensors full_opt = t.opt.state();
  std::vector<std::pair<std::string, Tensor>> expected;  // every tensor, by checkpoint name
  for (const auto& [name, v] : t.net.state_dict()) expected.emplace_back(name, v);
  const nn::NamedTensors params = t.net.named_parameters();
  for (size_t i = 0; i < params.size(); ++i)
    for (const char* buf : {"exp_avg", "exp_avg_sq"})
      for (const auto& [n, v] : full_opt)
        if (n == "param." + std::to_string(i) + "." + buf) expected.emplace_back("optimizer/" + params[i].first + "." + buf, v);
  for (const auto& [n, v] : full_opt)
    if (n == "step" || n == "lr") expected.emplace_back("optimizer/" + n, v);
  ASSERT_EQ(ckpt.names().size(), expected.size());

  for (const auto& [name, v] : expected) {
    EXPECT_EQ(raw(ckpt.read_full(name)), raw(v)) << name;
    EXPECT_EQ(ckpt.read_full(name).sizes(), v.sizes()) << name;
    for (int world : {1, 2, 4})
      for (int r = 0; r < world; ++r) {
        const auto [b, e] = even_range(v.numel(), r, world);
        EXPECT_EQ(raw(ckpt.read(name, b, e)), raw(flat(v).narrow(0, b, e - b))) << name << " rank " << r << "/" << world;
      }
  }
  EXPECT_EQ(ckpt.read_step("optimizer/weight.exp_avg", 0, 35), 3);
  EXPECT_THROW(ckpt.read("weight", 30, 36), ValueError);
  EXPECT_THROW(ckpt.info("nope"), ValueError);
}

TEST(ShardedCheckpoint, FullStateLoadsIntoOneProcessAndTrainsIdentically) {
  ScratchDir dir;
  manual_seed(11);
  Trained a;
  std::vector<ShardedSave> saves;
  for (int r = 0; r < 3; ++r)
    saves.push_back(rank_save(a.net, a.opt, r, [](int64_t n, int r) { return even_range(n, r, 3); }, 3));
  save_in_threads(dir.path().string(), saves);

  Net b;  // other weights
  optim::AdamW opt_b(b.parameters(), {});
  const ShardedCheckpoint ckpt = ShardedCheckpoint::open(dir.file("ckpt-00000003"));
  b.load_state_dict(load_full_model_state(ckpt));
  opt_b.load_state(load_full_optimizer_state(ckpt));
  EXPECT_EQ(opt_b.step_count(), 3);
  const RngState rng = default_generator().state();
  train_step(a.net, a.opt);
  default_generator().set_state(rng);
  train_step(b, opt_b);
  auto sa = a.net.state_dict(), sb = b.state_dict();
  ASSERT_EQ(sa.size(), sb.size());
  for (size_t i = 0; i < sa.size(); ++i) EXPECT_EQ(raw(sa[i].second), raw(sb[i].second)) << sa[i].first;
}

TEST(ShardedCheckpoint, ConsolidateThenShardRoundTripsBitExactly) {
  ScratchDir dir;
  manual_seed(3);
  Trained t;
  std::vector<ShardedSave> saves;
  for (int r = 0; r < 3; ++r) saves.push_back(rank_save(t.net, t.opt, r, lopsided, 5));
  save_in_threads(dir.file("run"), saves);
  // consolidate: one full file
  const nn::NamedTensors full = load_full_model_state(ShardedCheckpoint::open(dir.file("run")));
  save_safetensors(dir.file("full.safetensors"), full);
  // shard it again at another world size
  const nn::NamedTensors loaded = load_safetensors(dir.file("full.safetensors"));
  std::vector<ShardedSave> again;
  for (int r = 0; r < 4; ++r) {
    again.push_back(shard_full_state(loaded, t.opt.state(), param_names(t.net), r, 4));
    again.back().state.step = 6;
  }
  save_sharded_checkpoint_from_one_process(dir.file("again"), again);
  const ShardedCheckpoint back = ShardedCheckpoint::open(dir.file("again"));
  EXPECT_EQ(back.world(), 4);
  const nn::NamedTensors round = load_full_model_state(back);
  const nn::NamedTensors want = t.net.state_dict();
  ASSERT_EQ(round.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(round[i].first, want[i].first);
    EXPECT_EQ(raw(round[i].second), raw(want[i].second)) << want[i].first;
  }
  const nn::NamedTensors opt_round = load_full_optimizer_state(back), opt_want = t.opt.state();
  ASSERT_EQ(opt_round.size(), opt_want.size());
  for (const auto& [name, v] : opt_want) {
    bool found = false;
    for (const auto& [n, w] : opt_round)
      if (n == name) {
        found = true;
        EXPECT_EQ(raw(w), raw(v)) << name;
      }
    EXPECT_TRUE(found) << name;
  }
}

TEST(ShardedCheckpoint, CrashedSaveIsNeverTakenForACheckpoint) {
  ScratchDir dir;
  manual_seed(5);
  Trained t;
  std::vector<ShardedSave> saves;
  for (int r = 0; r < 3; ++r) saves.push_back(rank_save(t.net, t.opt, r, lopsided, 10));
  save_in_threads(dir.path().string(), saves);
  const std::string good = dir.file("ckpt-00000010");

  // A crash after the shards and before index.json: the hidden temp dir.
  fs::create_directory(dir.file(".tmp-ckpt-00000020-1-0"));
  for (const char* f : {"shard-00000-of-00003.safetensors", "replicated.safetensors"})
    fs::copy_file(good + "/" + f, dir.file(std::string(".tmp-ckpt-00000020-1-0/") + f));
  // A later directory with shards but no index (damage), and `latest` naming it.
  fs::create_directory(dir.file("ckpt-00000030"));
  fs::copy_file(good + "/shard-00000-of-00003.safetensors", dir.file("ckpt-00000030/shard-00000-of-00003.safetensors"));
  write_bytes(dir.file("latest"), "ckpt-00000030\n");

  EXPECT_FALSE(is_complete_sharded_checkpoint(dir.file("ckpt-00000030")));
  EXPECT_EQ(find_latest_sharded_checkpoint(dir.path().string()).value_or(""), good);
  const ShardedCheckpoint ckpt = ShardedCheckpoint::open(dir.path().string());
  EXPECT_EQ(ckpt.path(), good);
  EXPECT_EQ(raw(ckpt.read_full("weight")), raw(t.net.named_parameters()[0].second));

  // A rank that never reports: rank 0 names it, leaves no debris, and the
  // previous checkpoint is still the one found.
  auto store = hash_commit_store();
  ShardedSaveOptions o;
  o.world = 2;
  o.store = store;
  o.timeout = std::chrono::milliseconds(200);
  ShardedSave lone = rank_save(t.net, t.opt, 0, [](int64_t n, int r) { return even_range(n, r, 2); }, 40);
  expect_throw_with<IOError>([&] { save_sharded_checkpoint(dir.path().string(), lone, o); },
                             {"rank(s) 1", "ckpt-00000040", "timed out"});
  EXPECT_FALSE(fs::exists(dir.file("ckpt-00000040")));
  EXPECT_EQ(find_latest_sharded_checkpoint(dir.path().string()).value_or(""), good);

  // The next save clears the crash debris and keeps the damaged directory.
  for (auto& s : saves) s.state.step = 50;
  save_in_threads(dir.path().string(), saves);
  EXPECT_FALSE(fs::exists(dir.file(".tmp-ckpt-00000020-1-0")));
  EXPECT_TRUE(fs::exists(dir.file("ckpt-00000030")));
  EXPECT_EQ(find_latest_sharded_checkpoint(dir.path().string()).value_or(""), dir.file("ckpt-00000050"));
}

TEST(ShardedCheckpoint, ARankThatFailsIsNamedAndNothingIsCommitted) {
  ScratchDir dir;
  manual_seed(21);
  Trained t;
  std::vector<ShardedSave> saves;
  for (int r = 0; r < 3; ++r) saves.push_back(rank_save(t.net, t.opt, r, lopsided, 12));
  saves[2].model[1].end -= 1;  // values no longer fit the range
  expect_throw_with<IOError>([&] { save_in_threads(dir.path().string(), saves); },
                             {"rank 2 could not write its shard of ckpt-00000012", "'bias'"});
  EXPECT_FALSE(find_latest_sharded_checkpoint(dir.path().string()).has_value());
  EXPECT_TRUE(fs::is_empty(dir.path())) << "no temp directory left behind";

  // A rank whose rank 0 never comes says so.
  ShardedSaveOptions o;
  o.rank = 1;
  o.world = 2;
  o.store = hash_commit_store();
  o.timeout = std::chrono::milliseconds(100);
  expect_throw_with<IOError>([&] { save_sharded_checkpoint(dir.path().string(), saves[1], o); },
                             {"rank 1: rank 0 did not start saving ckpt-00000012"});
}

TEST(ShardedCheckpoint, MissingShardAndBadPiecesAreNamed) {
  ScratchDir dir;
  manual_seed(9);
  Trained t;
  std::vector<ShardedSave> saves;
  for (int r = 0; r < 3; ++r) saves.push_back(rank_save(t.net, t.opt, r, lopsided, 1));
  const std::string ckpt = save_in_threads(dir.path().string(), saves)[0];
  const std::string index_text = read_bytes(ckpt + "/index.json");

  // Overlap: rank 2's piece of "weight" starts inside rank 0's.
  nlohmann::json j = nlohmann::json::parse(index_text);
  for (auto& tensor : j["tensors"])
    if (tensor["name"] == "weight")
      for (auto& p : tensor["pieces"])
        if (p["file"] == "shard-00002-of-00003.safetensors") p["begin"] = 20;
  write_bytes(ckpt + "/index.json", j.dump());
  expect_throw_with<IOError>([&] { ShardedCheckpoint::open(ckpt); }, {"index.json", "'weight'", "overlap", "[20, 35)"});
  EXPECT_FALSE(is_complete_sharded_checkpoint(ckpt));

  // Gap: rank 2's piece of "bias" dropped.
  j = nlohmann::json::parse(index_text);
  for (auto& tensor : j["tensors"])
    if (tensor["name"] == "bias") tensor["pieces"].erase(2);
  write_bytes(ckpt + "/index.json", j.dump());
  expect_throw_with<IOError>([&] { ShardedCheckpoint::open(ckpt); }, {"'bias'", "elements [1, 2) of 2", "no piece"});

  // Not JSON at all.
  write_bytes(ckpt + "/index.json", "{\"format\": ");
  expect_throw_with<IOError>([&] { ShardedCheckpoint::open(ckpt); }, {"index.json", "not valid JSON"});

  // A missing shard file.
  write_bytes(ckpt + "/index.json", index_text);
  fs::remove(ckpt + "/shard-00002-of-00003.safetensors");
  expect_throw_with<IOError>([&] { ShardedCheckpoint::open(ckpt); }, {"shard-00002-of-00003.safetensors", "missing"});
  EXPECT_FALSE(find_latest_sharded_checkpoint(dir.path().string()).has_value());
  expect_throw_with<IOError>([&] { ShardedCheckpoint::open(dir.path().string()); }, {"not a sharded checkpoint"});
  expect_throw_with<IOError>([&] { ShardedCheckpoint::open(dir.file("nowhere")); }, {"nowhere", "no such directory"});

  // Ranges that do not tile a tensor are refused at save time.
  std::vector<ShardedSave> holes = saves;
  holes[2].model[0].begin += 1;
  holes[2].model[0].values = holes[2].model[0].values.narrow(0, 1, holes[2].model[0].end - holes[2].model[0].begin);
  EXPECT_THROW(save_sharded_checkpoint_from_one_process(dir.file("holes"), holes), ValueError);
  EXPECT_FALSE(fs::exists(dir.file("holes/ckpt-00000001")));
}

TEST(ShardedCheckpoint, BackgroundWriterStallsOnlyForTheHostCopy) {
  ScratchDir dir;
  manual_seed(13);
  Trained t;
  auto store = hash_commit_store();
  auto options = [&](int rank) {
    ShardedSaveOptions o;
    o.rank = rank;
    o.world = 2;
    o.store = store;
    o.timeout = std::chrono::seconds(60);
    return o;
  };
  ShardedCheckpointWriter w0(dir.path().string(), options(0)), w1(dir.path().string(), options(1));
  auto half = [](int64_t n, int r) { return even_range(n, r, 2); };
  // state_dict() shares the parameters' storage: keep the bytes.
  std::vector<std::vector<uint8_t>> want;
  for (const auto& [n, v] : t.net.state_dict()) want.push_back(raw(v));

  const double stall = w0.save(rank_save(t.net, t.opt, 0, half, 4));
  EXPECT_GE(stall, 0.0);
  EXPECT_EQ(w0.last_stall_ms(), stall);
  // Rank 0's commit waits for rank 1, which has not saved: the write goes on
  // after save() returned.
  EXPECT_TRUE(w0.busy());
  // Training changes the weights in place; the checkpoint keeps the snapshot.
  train_step(t.net, t.opt);
  w1.save(rank_save(t.net, t.opt, 1, half, 4));
  EXPECT_NE(raw(t.net.named_parameters()[0].second), want[0]);
  EXPECT_EQ(w0.wait(), dir.file("ckpt-00000004"));
  EXPECT_EQ(w1.wait(), dir.file("ckpt-00000004"));
  EXPECT_FALSE(w0.busy());
  EXPECT_GT(w0.last_write_ms(), 0.0);
  std::printf("rank 0: stall %.3f ms (host copy), background write and commit %.3f ms\n", w0.last_stall_ms(),
              w0.last_write_ms());
  const ShardedCheckpoint ckpt = ShardedCheckpoint::open(dir.path().string());
  const Tensor weight = ckpt.read_full("weight");
  const auto [b, e] = even_range(35, 0, 2);
  EXPECT_EQ(raw(weight.reshape({35}).narrow(0, b, e - b)),
            std::vector<uint8_t>(want[0].begin() + b * 4, want[0].begin() + e * 4));

  // A failure in the background reaches wait(), once.
  ShardedSaveOptions lonely = options(0);
  lonely.store = hash_commit_store();
  lonely.timeout = std::chrono::milliseconds(100);
  ShardedCheckpointWriter w(dir.path().string(), lonely);
  w.save(rank_save(t.net, t.opt, 0, half, 8));
  expect_throw_with<IOError>([&] { w.wait(); }, {"rank(s) 1", "ckpt-00000008"});
  EXPECT_EQ(w.wait(), "");
}

// Every tensor of a save, in order.
std::vector<Tensor*> tensors_of(ShardedSave& s) {
  std::vector<Tensor*> out;
  for (auto& p : s.model) out.push_back(&p.values);
  for (auto& p : s.optimizer)
    for (auto& [n, t] : p.buffers) out.push_back(&t);
  for (auto& [n, t] : s.replicated_model) out.push_back(&t);
  for (auto& [n, t] : s.replicated_optimizer) out.push_back(&t);
  return out;
}

// Every tensor's bytes as the checkpoint holds them, in tensors_of's order.
std::vector<std::vector<uint8_t>> read_back(const ShardedCheckpoint& ck, const ShardedSave& s) {
  std::vector<std::vector<uint8_t>> out;
  for (const auto& p : s.model) out.push_back(raw(ck.read_full(p.name)));
  for (const auto& p : s.optimizer)
    for (const auto& [n, t] : p.buffers) out.push_back(raw(ck.read_full("optimizer/" + p.param + "." + n)));
  for (const auto& [n, t] : s.replicated_model) out.push_back(raw(ck.read_full(n)));
  for (const auto& [n, t] : s.replicated_optimizer) out.push_back(raw(ck.read_full("optimizer/" + n)));
  return out;
}

// Note [Background checkpoint writes]: save() freezes the pieces, and the
// caller changes them in place as soon as it returns. With the pieces on
// `device` (outside host memory, as a GPU's are) the device snapshot is
// taken -- clones there, copied to cpu:0 by the background thread -- and
// with a snapshot limit of 0 the synchronous host copy instead; either way
// the checkpoint holds the values at save() time, bit for bit.
void check_snapshot_keeps_values(const Device& device, bool fallback) {
  SCOPED_TRACE(device.str() + (fallback ? ": host copy (snapshot limit 0)" : ": device snapshot"));
  ScratchDir dir;
  manual_seed(fallback ? 23 : 29);
  Trained t;
  ShardedSave s = rank_save(t.net, t.opt, 0, [](int64_t n, int) { return std::pair<int64_t, int64_t>(0, n); }, 5);
  // Replicated tensors of other dtypes and odd sizes: the device snapshot
  // packs every (device, dtype) into one buffer at 128-byte-aligned offsets
  // (Note [One buffer per snapshot]), so neighbours must not overlap.
  s.replicated_model.emplace_back("extra.f64", randn({7, 3}, TensorOptions(kFloat64)));
  s.replicated_model.emplace_back("extra.bf16", ops::to_dtype(randn({5}), kBFloat16));
  s.replicated_model.emplace_back("extra.f32", randn({33}));
  s.replicated_model.emplace_back("extra.large", randn({300, 1000}));  // over 1 MiB: copied on its own
  // The weights and moments on the device; the optimizer's scalars stay on
  // the host, as Optimizer::state() gives them.
  // (CUDA kernels take no float64: that one stays in host memory there.)
  for (Tensor* x : tensors_of(s))
    if (is_floating(x->dtype()) && !(x->dtype() == kFloat64 && device.is_cuda())) *x = x->to(device);
  // Views of one storage: cloned as the span they cover, gap included (Note
  // [One buffer per snapshot]); a small view of a large buffer, alone.
  const Tensor flat = randn({1000}).to(device);
  s.replicated_model.emplace_back("span.a", flat.narrow(0, 0, 300));
  s.replicated_model.emplace_back("span.b", flat.narrow(0, 320, 380));
  s.replicated_model.emplace_back("lone.small", randn({100000}).to(device).narrow(0, 5, 10));
  std::vector<std::vector<uint8_t>> want;
  for (Tensor* x : tensors_of(s)) want.push_back(raw(x->to(cpu_device(0))));

  ShardedWriterOptions wo;
  if (fallback) wo.snapshot_limit_bytes = 0;
  ShardedCheckpointWriter w(dir.path().string(), ShardedSaveOptions{}, wo);
  const double stall = w.save(s);
  // Training goes on at once: new random values, in place.
  for (Tensor* x : tensors_of(s)) ops::copy_(*x, randn(x->sizes()) * 100.0 + 1000.0);
  EXPECT_NE(raw(s.model[0].values.to(cpu_device(0))), want[0]);
  EXPECT_EQ(w.wait(), dir.file(checkpoint_name(5)));

  EXPECT_EQ(w.last_snapshot_devices(), fallback ? std::vector<Device>{} : std::vector<Device>{device});
  for (const double ms : {stall, w.last_stall_ms(), w.last_snapshot_device_ms(), w.last_write_ms()}) {
    EXPECT_TRUE(std::isfinite(ms)) << ms;
    EXPECT_GE(ms, 0.0);
  }
  if (fallback) EXPECT_EQ(w.last_snapshot_device_ms(), 0.0);
  const ShardedCheckpointWriter::Totals totals = w.totals();
  EXPECT_EQ(totals.saves, 1);
  EXPECT_EQ(totals.stall_ms, stall);
  EXPECT_EQ(totals.device_ms, w.last_snapshot_device_ms());
  // Note [Stall by phase]: the path's phases, in order, adding up to the stall.
  std::vector<std::string> names;
  for (const auto& [name, ms] : totals.first_phases.ms) {
    names.push_back(name);
    EXPECT_GE(ms, 0.0) << name;
  }
  const std::vector<std::string> want_names =
      fallback ? std::vector<std::string>{"placement", "copy to host", "start"}
               : std::vector<std::string>{"placement", "plan", "allocate", "views", "events", "copies", "host copies",
                                          "start"};
  EXPECT_EQ(names, want_names);
  EXPECT_NEAR(totals.first_phases.total(), stall, 1e-9 * std::max(1.0, stall));
  EXPECT_EQ(totals.first_stall_ms, totals.stall_ms);
  EXPECT_TRUE(totals.later_phases.ms.empty());
  // Pieces on a device: whether it was busy as the save began was asked (a
  // logical CPU device runs its work as it is issued: never busy).
  if (device.is_cuda()) EXPECT_GE(totals.first_device_busy, 0);
  else EXPECT_EQ(totals.first_device_busy, 0);
  std::printf("%s, %s: stall %.3f ms on the host + %.3f ms of device copies, background %.3f ms\n",
              device.str().c_str(), fallback ? "host copy" : "device snapshot", stall, w.last_snapshot_device_ms(),
              w.last_write_ms());

  const std::vector<std::vector<uint8_t>> got = read_back(ShardedCheckpoint::open(dir.path().string()), s);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(got[i], want[i]) << "tensor " << i;
}

// A save made while the previous one is still written waits for it; the
// totals keep that wait apart from the stall of the saves themselves, and
// the two add up to what save() returned.
TEST(ShardedCheckpoint, WaitsForEarlierWritesAddUpApart) {
  ScratchDir dir;
  manual_seed(31);
  Trained t;
  ShardedSave s = rank_save(t.net, t.opt, 0, [](int64_t n, int) { return std::pair<int64_t, int64_t>(0, n); }, 3);
  ShardedCheckpointWriter w(dir.path().string(), ShardedSaveOptions{});
  double returned = 0;
  for (int64_t step : {3, 4, 5}) {
    s.state.step = step;
    returned += w.save(s, 0.25);  // 0.25 ms of (pretended) assembly, counted in the stall
  }
  EXPECT_EQ(w.wait(), dir.file(checkpoint_name(5)));
  const ShardedCheckpointWriter::Totals totals = w.totals();
  EXPECT_EQ(totals.saves, 3);
  EXPECT_GE(totals.wait_ms, 0.0);
  EXPECT_GE(totals.stall_ms, 3 * 0.25);
  EXPECT_GE(totals.first_stall_ms, 0.25);
  EXPECT_LE(totals.first_stall_ms, totals.stall_ms);
  EXPECT_NEAR(totals.stall_ms + totals.wait_ms, returned, 1e-9 * std::max(1.0, returned));
  // Note [Stall by phase]: the caller's assembly opens each save's phases;
  // the later saves also join the previous one's thread. The first save's
  // phases add up to its stall, the later ones' to the rest.
  ASSERT_FALSE(totals.first_phases.ms.empty());
  EXPECT_EQ(totals.first_phases.ms.front(), (std::pair<std::string, double>("assemble", 0.25)));
  ASSERT_GE(totals.later_phases.ms.size(), 2u);
  EXPECT_EQ(totals.later_phases.ms[0], (std::pair<std::string, double>("assemble", 0.5)));
  EXPECT_EQ(totals.later_phases.ms[1].first, "join");
  // Everything in host memory: no device to ask.
  EXPECT_EQ(totals.first_device_busy, -1);
  EXPECT_EQ(totals.later_on_device, 0);
  EXPECT_NEAR(totals.first_phases.total(), totals.first_stall_ms, 1e-9 * std::max(1.0, totals.stall_ms));
  EXPECT_NEAR(totals.later_phases.total(), totals.stall_ms - totals.first_stall_ms,
              1e-9 * std::max(1.0, totals.stall_ms));
}

// StallPhases keeps the order phases first ran in and adds up a phase named
// again, and PhaseClock's laps add up to the time they span.
TEST(ShardedCheckpoint, StallPhasesAddUpInOrder) {
  StallPhases p;
  p.add("b", 1.5);
  p.add("a", 2.0);
  p.add("b", 0.25);
  StallPhases q;
  q.add("c", 3.0);
  q.add("a", 1.0);
  p.add(q);
  EXPECT_EQ(p.ms, (std::vector<std::pair<std::string, double>>{{"b", 1.75}, {"a", 3.0}, {"c", 3.0}}));
  EXPECT_DOUBLE_EQ(p.total(), 7.75);

  StallPhases laps;
  const auto t0 = std::chrono::steady_clock::now();
  PhaseClock clock(laps, t0);
  std::this_thread::sleep_for(std::chrono::milliseconds(2));
  const double first = clock.lap("x");
  const double skipped = clock.skip();
  clock.lap("y");
  clock.lap("x");
  const double span = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_EQ(laps.ms.size(), 2u);
  EXPECT_EQ(laps.ms[0].first, "x");
  EXPECT_GE(first, 2.0);
  EXPECT_GE(laps.ms[0].second, first);
  EXPECT_LE(laps.total() + skipped, span);
  EXPECT_GE(laps.total() + skipped, first);
}

TEST(ShardedCheckpoint, SnapshotKeepsTheValuesAtSaveTime) {
  for (const bool fallback : {false, true}) check_snapshot_keeps_values(cpu_device(1), fallback);
}

TEST(ShardedCheckpoint, GpuSnapshotKeepsTheValuesAtSaveTime_CUDA) {
  if (!cuda_is_available()) GTEST_SKIP() << "no CUDA device";
  for (const bool fallback : {false, true}) check_snapshot_keeps_values(cuda_device(0), fallback);
}

// Note [The snapshot's memory set aside]: set_aside() allocates the device
// snapshot's buffers and frees them into the allocator, which keeps them (on
// a logical CPU device, the host block cache: cached_bytes); the save after it
// writes the values as ever; nothing is set aside when the snapshot would
// not be taken on the device (a snapshot limit of 0) or once a save is made.
TEST(ShardedCheckpoint, SetAsideKeepsTheSnapshotsMemoryForTheFirstSave) {
  const Device dev = cpu_device(1);
  for (const bool limited : {false, true}) {
    SCOPED_TRACE(limited ? "snapshot limit 0" : "device snapshot");
    ScratchDir dir;
    manual_seed(31);
    Trained t;
    ShardedSave s = rank_save(t.net, t.opt, 0, [](int64_t n, int) { return std::pair<int64_t, int64_t>(0, n); }, 4);
    s.replicated_model.emplace_back("extra.large", randn({600, 1000}));  // 2.4 MB: a block the cache keeps
    for (Tensor* x : tensors_of(s))
      if (is_floating(x->dtype())) *x = x->to(dev);
    std::vector<std::vector<uint8_t>> want;
    for (Tensor* x : tensors_of(s)) want.push_back(raw(x->to(cpu_device(0))));
    ShardedWriterOptions wo;
    if (limited) wo.snapshot_limit_bytes = 0;
    ShardedCheckpointWriter w(dir.path().string(), ShardedSaveOptions{}, wo);
    backend(dev).empty_cache(dev);
    const size_t cached = backend(dev).cached_bytes(dev);
    ASSERT_EQ(cached, 0u);
    const double ms = w.set_aside(s);
    if (limited) {
      EXPECT_EQ(ms, -1.0);
      EXPECT_EQ(backend(dev).cached_bytes(dev), cached);
    } else {
      EXPECT_GE(ms, 0.0);
      EXPECT_GE(backend(dev).cached_bytes(dev), cached + 600 * 1000 * sizeof(float)) << "the buffers kept for the save";
    }
    w.save(s);
    EXPECT_EQ(w.wait(), dir.file(checkpoint_name(4)));
    EXPECT_EQ(w.set_aside(s), -1.0) << "after a save there is nothing to set aside";
    const ShardedCheckpoint ckpt = ShardedCheckpoint::open(dir.path().string());
    EXPECT_EQ(raw(ckpt.read_full("head.weight")), raw(t.net.state_dict()[2].second.to(cpu_device(0))));
    EXPECT_EQ(raw(s.model[0].values.to(cpu_device(0))), want[0]);
  }
}

TEST(ShardedCheckpoint, OneProcessWithoutAStore) {
  ScratchDir dir;
  manual_seed(17);
  Trained t;
  ShardedSave s = rank_save(t.net, t.opt, 0, [](int64_t n, int) { return std::pair<int64_t, int64_t>(0, n); }, 2);
  for (int64_t step : {2, 4, 6, 8}) {
    s.state.step = step;
    ShardedSaveOptions o;
    o.keep_last = 2;
    EXPECT_EQ(save_sharded_checkpoint(dir.path().string(), s, o), dir.file(checkpoint_name(step)));
  }
  EXPECT_FALSE(fs::exists(dir.file("ckpt-00000004")));
  EXPECT_TRUE(fs::exists(dir.file("ckpt-00000006")));
  const ShardedCheckpoint ckpt = ShardedCheckpoint::open(dir.path().string());
  EXPECT_EQ(ckpt.world(), 1);
  EXPECT_EQ(ckpt.state().step, 8);
  EXPECT_EQ(raw(ckpt.read_full("head.weight")), raw(t.net.state_dict()[2].second));

  // A piece whose values do not match its range is the caller's error.
  s.model[0].end -= 1;
  expect_throw_with<ValueError>([&] { save_sharded_checkpoint(dir.path().string(), s, {}); }, {"rank 0", "'weight'"});
}

}  // namespace
}  // namespace chorus::io::sharded_checkpoint_test
