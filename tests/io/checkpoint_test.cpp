// Checkpoints: a save/load round trip continues training identically; crashed
// saves (a leftover .tmp dir, a checkpoint dir without state.json, a broken
// `latest`) are ignored by find_latest_checkpoint; keep-K pruning; corrupted
// files are refused naming the file.
#include "chorus/io/checkpoint.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <functional>
#include <map>

#include "chorus/core/error.h"
#include "chorus/core/rng.h"
#include "chorus/io/file_util.h"
#include "chorus/io/safetensors.h"
#include "chorus/ops/factory.h"
#include "chorus/optim/adamw.h"
#include "chorus/optim/sgd.h"
#include "io/io_test_util.h"

namespace chorus::io {
namespace {

using namespace testing;

// weight, bias, a buffer, and a child: names "weight", "bias", "running",
// "head.weight" as in a state dict.
class Head : public nn::Module {
 public:
  Head() : Module("Head") { register_parameter("weight", randn({2, 4})); }

 protected:
  std::shared_ptr<Module> make_empty() const override { return std::make_shared<Head>(); }
};

class TinyNet : public nn::Module {
 public:
  TinyNet() : Module("TinyNet") {
    register_parameter("weight", randn({4, 3}));
    register_parameter("bias", randn({4}));
    register_buffer("running", randn({4}));
    register_module("head", std::make_shared<Head>());
  }

 protected:
  std::shared_ptr<Module> make_empty() const override { return std::make_shared<TinyNet>(); }
};

std::vector<uint8_t> raw(const Tensor& t) {
  Tensor c = t.contiguous();
  auto* b = static_cast<const uint8_t*>(c.raw_data());
  return std::vector<uint8_t>(b, b + c.nbytes());
}

// One optimizer step with gradients drawn from the default generator.
void train_step(nn::Module& m, optim::Optimizer& opt) {
  opt.zero_grad();
  for (auto& p : m.parameters()) p.set_grad(randn(p.sizes()));
  opt.step();
}

TrainingState some_state(int64_t step) {
  TrainingState s;
  s.epoch = 2;
  s.step = step;
  s.batch_in_epoch = 17;
  s.rng = default_generator().state();
  s.config = {{"model", "tiny"}, {"lr", 0.1}, {"devices", {"cpu:0", "cpu:1"}}};
  s.extra = {{"best_accuracy", 0.875}};
  return s;
}

optim::SGDOptions sgd_opts() { return {.lr = 0.1, .momentum = 0.9, .weight_decay = 1e-4, .nesterov = true}; }

TEST(Checkpoint, RoundTripContinuesTrainingIdentically) {
  ScratchDir dir;
  manual_seed(42);
  TinyNet a;
  optim::SGD opt_a(a.parameters(), sgd_opts());
  for (int i = 0; i < 3; ++i) train_step(a, opt_a);
  const TrainingState saved = some_state(3);
  const std::string path = save_checkpoint(dir.path().string(), a, opt_a, saved);
  EXPECT_EQ(fs::path(path).filename(), "ckpt-00000003");
  EXPECT_EQ(read_bytes(dir.file("latest")), "ckpt-00000003\n");

  TinyNet b;  // different initial weights
  optim::SGD opt_b(b.parameters(), sgd_opts());
  auto found = find_latest_checkpoint(dir.path().string());
  ASSERT_TRUE(found);
  EXPECT_EQ(*found, path);
  TrainingState got = load_checkpoint(*found, b, opt_b);
  EXPECT_EQ(got.epoch, 2);
  EXPECT_EQ(got.step, 3);
  EXPECT_EQ(got.batch_in_epoch, 17);
  EXPECT_EQ(got.rng.seed, saved.rng.seed);
  EXPECT_EQ(got.rng.offset, saved.rng.offset);
  EXPECT_EQ(got.config, saved.config);
  EXPECT_EQ(got.extra, saved.extra);
  EXPECT_EQ(opt_b.step_count(), 3);

  auto sa = a.state_dict(), sb = b.state_dict();
  ASSERT_EQ(sa.size(), sb.size());
  for (size_t i = 0; i < sa.size(); ++i) EXPECT_EQ(raw(sa[i].second), raw(sb[i].second)) << sa[i].first;

  // Same gradients from the restored generator: identical next steps.
  default_generator().set_state(got.rng);
  train_step(a, opt_a);
  default_generator().set_state(got.rng);
  train_step(b, opt_b);
  sa = a.state_dict(), sb = b.state_dict();
  for (size_t i = 0; i < sa.size(); ++i) EXPECT_EQ(raw(sa[i].second), raw(sb[i].second)) << sa[i].first;
}

TEST(Checkpoint, ModelFileIsPlainSafetensorsWithStateDictNames) {
  ScratchDir dir;
  TinyNet m;
  optim::AdamW opt(m.parameters(), {});
  train_step(m, opt);
  const std::string path = save_checkpoint(dir.path().string(), m, opt, some_state(1));
  std::map<std::string, std::string> meta;
  nn::NamedTensors w = load_safetensors(path + "/model.safetensors", &meta);
  std::vector<std::string> names;
  for (auto& [n, t] : w) names.push_back(n);
  EXPECT_EQ(names, (std::vector<std::string>{"weight", "bias", "head.weight", "running"}));
  EXPECT_EQ(meta.at("format"), "pt");
  std::map<std::string, std::string> opt_meta;
  load_safetensors(path + "/optimizer.safetensors", &opt_meta);
  EXPECT_EQ(opt_meta.at("optimizer"), "AdamW");
  auto state = nlohmann::json::parse(read_bytes(path + "/state.json"));
  EXPECT_EQ(state["format_version"], kCheckpointFormatVersion);
  EXPECT_EQ(state["step"], 1);
  EXPECT_TRUE(state["rng"].contains("seed") && state["rng"].contains("offset"));
}

// Steps first..last, each trained and saved as step * 100.
void train_and_save(const ScratchDir& dir, TinyNet& m, optim::SGD& opt, int64_t first, int64_t last, int keep_last) {
  for (int64_t step = first; step <= last; ++step) {
    train_step(m, opt);
    save_checkpoint(dir.path().string(), m, opt, some_state(step * 100), keep_last);
  }
}

TEST(Checkpoint, KeepsTheNewestK) {
  ScratchDir dir;
  TinyNet m;
  optim::SGD opt(m.parameters(), sgd_opts());
  train_and_save(dir, m, opt, 1, 5, /*keep_last=*/3);
  std::vector<std::string> left;
  for (auto& e : fs::directory_iterator(dir.path())) left.push_back(e.path().filename().string());
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{"ckpt-00000300", "ckpt-00000400", "ckpt-00000500", "latest"}));
  EXPECT_EQ(*find_latest_checkpoint(dir.path().string()), dir.file("ckpt-00000500"));
  // Re-saving an existing step replaces it in place.
  save_checkpoint(dir.path().string(), m, opt, some_state(500), 3);
  EXPECT_TRUE(is_complete_checkpoint(dir.file("ckpt-00000500")));
  // keep_last 0 keeps everything.
  save_checkpoint(dir.path().string(), m, opt, some_state(600), 0);
  EXPECT_TRUE(is_complete_checkpoint(dir.file("ckpt-00000300")));
}

// Note [Checkpoints removed whole] (io/file_util.h): an old checkpoint is
// moved aside in one rename before its files go, so a prune killed half-way
// leaves debris under a .tmp- name, which the next save sweeps, never a
// ckpt-* that has lost files.
TEST(Checkpoint, PrunedCheckpointsGoWholeNeverHalfRemoved) {
  ScratchDir dir;
  TinyNet m;
  optim::SGD opt(m.parameters(), sgd_opts());
  train_and_save(dir, m, opt, 1, 2, /*keep_last=*/0);
  const std::string old = dir.file("ckpt-00000100");
  EXPECT_EQ(detail::remove_directory_atomically(old, ".tmp-"), "");
  EXPECT_FALSE(fs::exists(old));
  // What a prune killed after its rename leaves: the moved-aside directory, some of its files gone.
  const fs::path killed = dir.path() / ".tmp-ckpt-00000200-killed";
  fs::create_directories(killed);
  std::ofstream(killed / "optimizer.safetensors") << "partial";
  EXPECT_EQ(*find_latest_checkpoint(dir.path().string()), dir.file("ckpt-00000200"));
  train_step(m, opt);
  save_checkpoint(dir.path().string(), m, opt, some_state(300), /*keep_last=*/1);
  std::vector<std::string> left;
  for (auto& e : fs::directory_iterator(dir.path())) left.push_back(e.path().filename().string());
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{"ckpt-00000300", "latest"}));
  // A path that cannot be moved: the error names it.
  EXPECT_NE(detail::remove_directory_atomically(dir.file("no-such-checkpoint"), ".tmp-").find("no-such-checkpoint"),
            std::string::npos);
}

TEST(Checkpoint, CrashedSavesAreIgnored) {
  ScratchDir dir;
  const std::string root = dir.path().string();
  EXPECT_FALSE(find_latest_checkpoint(root));
  EXPECT_FALSE(find_latest_checkpoint(dir.file("does-not-exist")));
  TinyNet m;
  optim::SGD opt(m.parameters(), sgd_opts());
  train_step(m, opt);
  save_checkpoint(root, m, opt, some_state(10));

  // A save that died while writing its temporary directory...
  fs::create_directories(dir.file(".tmp-ckpt-00000020-999-0"));
  write_bytes(dir.file(".tmp-ckpt-00000020-999-0/model.safetensors"), "partial");
  // ...and a checkpoint directory without state.json (not written by Chorus' protocol, but seen in the wild).
  fs::create_directories(dir.file("ckpt-00000030"));
  fs::copy_file(dir.file("ckpt-00000010/model.safetensors"), dir.file("ckpt-00000030/model.safetensors"));
  fs::copy_file(dir.file("ckpt-00000010/optimizer.safetensors"), dir.file("ckpt-00000030/optimizer.safetensors"));
  EXPECT_EQ(*find_latest_checkpoint(root), dir.file("ckpt-00000010"));

  // `latest` pointing at the broken one, at nothing, outside, or missing: fall back.
  for (std::string pointer : {"ckpt-00000030\n", "ckpt-00000099\n", "../ckpt-00000010\n", "garbage"}) {
    write_bytes(dir.file("latest"), pointer);
    EXPECT_EQ(*find_latest_checkpoint(root), dir.file("ckpt-00000010")) << pointer;
  }
  fs::remove(dir.file("latest"));
  EXPECT_EQ(*find_latest_checkpoint(root), dir.file("ckpt-00000010"));

  // Without a `latest`, the newest complete checkpoint by step number wins.
  save_checkpoint(root, m, opt, some_state(12), 0);
  fs::remove(dir.file("latest"));
  EXPECT_EQ(*find_latest_checkpoint(root), dir.file("ckpt-00000012"));
  // And `latest` wins when it names a complete checkpoint, even an older one.
  write_bytes(dir.file("latest"), "ckpt-00000010\n");
  EXPECT_EQ(*find_latest_checkpoint(root), dir.file("ckpt-00000010"));

  // The next save clears the debris.
  save_checkpoint(root, m, opt, some_state(40));
  EXPECT_FALSE(fs::exists(dir.file(".tmp-ckpt-00000020-999-0")));
  // ...but never a checkpoint that could not be read (issue 15: the next save
  // after a resume from scratch deleted one): it stays for the user.
  EXPECT_TRUE(fs::exists(dir.file("ckpt-00000030/model.safetensors")));
}

// Issue 15: with the newest checkpoint's model.safetensors missing, a
// directory, a FIFO, a dangling link or unreadable, --resume quietly started
// from scratch and the first save pruned that checkpoint. Now resume falls
// back to the newest good one, says which it skipped and why, and the
// skipped one survives every later save.
TEST(Checkpoint, ResumeSkipsUnreadableCheckpointsAndNeverDeletesThem) {
  const std::map<std::string, std::function<void(const fs::path&)>> damage = {
      {"missing", [](const fs::path& f) { fs::remove(f); }},
      {"a directory", [](const fs::path& f) { fs::remove(f); fs::create_directory(f); }},
      {"a FIFO", [](const fs::path& f) { fs::remove(f); ASSERT_EQ(::mkfifo(f.c_str(), 0600), 0); }},
      {"a dangling symbolic link", [](const fs::path& f) { fs::remove(f); fs::create_symlink("nowhere", f); }},
      {"not valid JSON", [](const fs::path& f) { write_bytes(f.parent_path() / "state.json", "{\"epoch\": "); }},
      {"too short", [](const fs::path& f) { write_bytes(f.string(), "abc"); }},
  };
  for (const auto& [why, harm] : damage) {
    SCOPED_TRACE(why);
    ScratchDir dir;
    const std::string root = dir.path().string();
    TinyNet m;
    optim::SGD opt(m.parameters(), sgd_opts());
    train_step(m, opt);
    save_checkpoint(root, m, opt, some_state(10));
    const auto good = raw(m.parameters()[0]);
    train_step(m, opt);
    const std::string newest = save_checkpoint(root, m, opt, some_state(20));
    harm(fs::path(newest) / "model.safetensors");

    TinyNet fresh;
    optim::SGD fresh_opt(fresh.parameters(), sgd_opts());
    Resumed r = resume_checkpoint(root, fresh, fresh_opt);
    ASSERT_TRUE(r.path);
    EXPECT_EQ(*r.path, dir.file("ckpt-00000010"));
    EXPECT_EQ(raw(fresh.parameters()[0]), good);
    ASSERT_EQ(r.skipped.size(), 1u);
    EXPECT_EQ(r.skipped[0].path, newest);
    EXPECT_NE(r.skipped[0].reason.find(why), std::string::npos) << r.skipped[0].reason;
    EXPECT_EQ(r.skipped[0].kept_as, newest + ".unreadable");
    // Training goes on: saves past and at its step, with pruning, keep it.
    for (int64_t step : {15, 20, 30, 40, 50}) save_checkpoint(root, fresh, fresh_opt, some_state(step), 2);
    EXPECT_TRUE(fs::exists(dir.file("ckpt-00000020.unreadable/state.json")));
    EXPECT_TRUE(fs::exists(dir.file("ckpt-00000020.unreadable/optimizer.safetensors")));
  }
}

TEST(Checkpoint, ResumeWithNoReadableCheckpointIsAnErrorUnlessAFreshStartIsAllowed) {
  ScratchDir dir;
  const std::string root = dir.path().string();
  TinyNet m;
  optim::SGD opt(m.parameters(), sgd_opts());
  // No checkpoint at all: nothing to resume, nothing skipped.
  Resumed none = resume_checkpoint(root, m, opt);
  EXPECT_FALSE(none.path);
  EXPECT_TRUE(none.skipped.empty());
  EXPECT_FALSE(resume_checkpoint(dir.file("not-there"), m, opt).path);

  train_step(m, opt);
  const std::string only = save_checkpoint(root, m, opt, some_state(10));
  fs::remove(fs::path(only) / "optimizer.safetensors");
  expect_throw_with<IOError>([&] { resume_checkpoint(root, m, opt); },
                             {"no checkpoint could be read", only + "/optimizer.safetensors: missing"});
  EXPECT_TRUE(fs::exists(only)) << "a refused resume changes nothing";
  Resumed fresh = resume_checkpoint(root, m, opt, /*allow_fresh_start=*/true);
  EXPECT_FALSE(fresh.path);
  ASSERT_EQ(fresh.skipped.size(), 1u);
  EXPECT_EQ(fresh.skipped[0].kept_as, only + ".unreadable");
  EXPECT_TRUE(fs::exists(only + ".unreadable/model.safetensors"));
}

// The caller's check sees the state before any tensor is read; what it
// throws is fatal, an IOError included (it is not an unreadable file).
TEST(Checkpoint, ResumeCheckRunsFirstAndItsErrorsAreFatal) {
  ScratchDir dir;
  const std::string root = dir.path().string();
  TinyNet m;
  optim::SGD opt(m.parameters(), sgd_opts());
  save_checkpoint(root, m, opt, some_state(10));
  save_checkpoint(root, m, opt, some_state(20));
  Head other;  // would not fit: the check must name the problem first
  optim::SGD other_opt(other.parameters(), sgd_opts());
  int calls = 0;
  expect_throw_with<IOError>([&] {
    resume_checkpoint(root, other, other_opt, false, [&](const TrainingState& st, const std::string& path) {
      ++calls;
      CHORUS_THROW(IOError, path, ": config says step ", st.step);
    });
  }, {dir.file("ckpt-00000020/state.json"), "config says step 20"});
  EXPECT_EQ(calls, 1);
  EXPECT_TRUE(fs::exists(dir.file("ckpt-00000020/model.safetensors"))) << "nothing set aside";
}

// Permission bits do not stop root; this case runs as an ordinary user.
TEST(Checkpoint, ResumeSkipsAModelFileItCannotOpen) {
  if (::geteuid() == 0) GTEST_SKIP() << "running as root: permission bits do not apply";
  ScratchDir dir;
  const std::string root = dir.path().string();
  TinyNet m;
  optim::SGD opt(m.parameters(), sgd_opts());
  save_checkpoint(root, m, opt, some_state(10));
  const std::string newest = save_checkpoint(root, m, opt, some_state(20));
  fs::permissions(fs::path(newest) / "model.safetensors", fs::perms::none);
  Resumed r = resume_checkpoint(root, m, opt);
  ASSERT_TRUE(r.path);
  EXPECT_EQ(*r.path, dir.file("ckpt-00000010"));
  ASSERT_EQ(r.skipped.size(), 1u);
  EXPECT_NE(r.skipped[0].reason.find("Permission denied"), std::string::npos) << r.skipped[0].reason;
}

TEST(Checkpoint, CorruptedFilesAreRefusedNamingTheFile) {
  ScratchDir dir;
  TinyNet m;
  optim::SGD opt(m.parameters(), sgd_opts());
  train_step(m, opt);
  const std::string ckpt = save_checkpoint(dir.path().string(), m, opt, some_state(5));
  for (const char* file : {"model.safetensors", "optimizer.safetensors"}) {
    const std::string path = ckpt + "/" + file;
    const std::string good = read_bytes(path);
    write_bytes(path, good.substr(0, good.size() - 3));
    expect_throw_with<IOError>([&] { load_checkpoint(ckpt, m, opt); }, {path});
    write_bytes(path, good);
  }
  const std::string state_path = ckpt + "/state.json";
  const std::string good_state = read_bytes(state_path);
  write_bytes(state_path, good_state.substr(0, good_state.size() / 2));
  expect_throw_with<IOError>([&] { load_checkpoint(ckpt, m, opt); }, {state_path, "not valid JSON"});
  write_bytes(state_path, R"({"format_version": 1, "epoch": 1, "step": -4, "batch_in_epoch": 0, "rng": {"seed": 1, "offset": 2}})");
  expect_throw_with<IOError>([&] { load_checkpoint(ckpt, m, opt); }, {state_path, "\"step\" is -4"});
  write_bytes(state_path, R"({"format_version": 9})");
  expect_throw_with<IOError>([&] { load_checkpoint(ckpt, m, opt); }, {state_path, "format version 9"});
  fs::remove(state_path);
  expect_throw_with<IOError>([&] { load_checkpoint(ckpt, m, opt); }, {state_path, "missing"});
}

TEST(Checkpoint, MismatchedModelOrOptimizerIsAValueErrorNamingTheFile) {
  ScratchDir dir;
  TinyNet m;
  optim::SGD opt(m.parameters(), sgd_opts());
  train_step(m, opt);
  const std::string ckpt = save_checkpoint(dir.path().string(), m, opt, some_state(5));
  optim::AdamW adam(m.parameters(), {});
  expect_throw_with<ValueError>([&] { load_checkpoint(ckpt, m, adam); },
                                {ckpt + "/optimizer.safetensors", "holds SGD state but the optimizer is AdamW"});
  Head other;
  optim::SGD opt_other(other.parameters(), sgd_opts());
  expect_throw_with<ValueError>([&] { load_checkpoint(ckpt, other, opt_other); }, {ckpt + "/model.safetensors"});
}

// Issue 15: a state.json nesting 100,000 levels deep in "epoch", "rng" or
// "config" killed --resume with SIGSEGV. Depth is bounded while parsing.
TEST(Checkpoint, DeeplyNestedStateJsonIsRefusedNotACrash) {
  ScratchDir dir;
  TinyNet m;
  optim::SGD opt(m.parameters(), sgd_opts());
  train_step(m, opt);
  const std::string ckpt = save_checkpoint(dir.path().string(), m, opt, some_state(5));
  const std::string state_path = ckpt + "/state.json";
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  const std::string rest = R"("format_version": 1, "batch_in_epoch": 0, "step": 5)";
  for (const std::string& text :
       {"{" + rest + R"(, "epoch": )" + deep + R"(, "rng": {"seed": 1, "offset": 2}})",
        "{" + rest + R"(, "epoch": 1, "rng": )" + deep + "}",
        "{" + rest + R"(, "epoch": 1, "rng": {"seed": 1, "offset": 2}, "config": {"a": )" + deep + "}}"}) {
    write_bytes(state_path, text);
    expect_throw_with<IOError>([&] { load_checkpoint(ckpt, m, opt); }, {state_path, "nests deeper than"});
  }
  // A value of the wrong type is named without dumping it whole.
  write_bytes(state_path, "{" + rest + R"(, "epoch": [")" + std::string(100000, '7') + R"("], "rng": {"seed": 1, "offset": 2}})");
  const std::string msg = expect_throw_with<IOError>([&] { load_checkpoint(ckpt, m, opt); }, {state_path, "\"epoch\" is [\"777"});
  EXPECT_LT(msg.size(), 1000u);
  // A number too large for any integer type is not valid JSON for us (it
  // escaped as nlohmann's out_of_range before).
  write_bytes(state_path, "{" + rest + R"(, "epoch": )" + std::string(400, '7') + R"(, "rng": {"seed": 1, "offset": 2}})");
  expect_throw_with<IOError>([&] { load_checkpoint(ckpt, m, opt); }, {state_path, "not valid JSON"});
}

}  // namespace
}  // namespace chorus::io
