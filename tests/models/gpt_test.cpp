// models::GPT: the configurations, the gradient of the whole model against
// central differences in float64, Hugging Face's names and layout both ways,
// and the logits against a GPT-2 written in PyTorch (gpt2_reference.py, run
// with Debian's python3-torch) reading the same safetensors file.
#include <gtest/gtest.h>

#include <chorus/models/gpt_pipeline.h>
#include <chorus/optim/adamw.h>
#include <chorus/parallel/pipeline.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>

#include <chorus/chorus.h>

#include "io/io_test_util.h"
#include "testing/devices.h"
#include "testing/expect_error.h"

namespace chorus {
namespace {

using models::GPT;
using models::GPTConfig;

GPTConfig tiny(int64_t layers = 2, int64_t heads = 2, int64_t width = 8, int64_t vocab = 11, int64_t context = 6) {
  GPTConfig c;
  c.layers = layers;
  c.heads = heads;
  c.width = width;
  c.vocab = vocab;
  c.padded_vocab = vocab + 5;  // padding rows, as 50257 -> 50304
  c.context = context;
  return c;
}

// Every parameter drawn at random (biases and norms too, which GPT-2's
// initialisation leaves at 0 and 1), the padding rows of the embedding 0.
void randomize(GPT& m, uint64_t seed) {
  manual_seed(seed);
  NoGradGuard g;
  for (auto& [name, p] : m.named_parameters()) p.copy_(randn(p.sizes(), {p.dtype()}).mul(0.3));
  const auto& c = m.config();
  m.wte().narrow(0, c.vocab, c.padded_vocab - c.vocab).zero_();
}

Tensor random_ids(const Shape& s, int64_t vocab, uint64_t seed) {
  manual_seed(seed);
  return randint(0, vocab, s);
}

TEST(GPTModel, KnownConfigurationsAndParameterCounts) {
  GPTConfig g = GPTConfig::named("gpt2");
  EXPECT_EQ(g.layers, 12);
  EXPECT_EQ(g.padded_vocab, 50304);
  // llm.c's count for gpt2 with the padded vocabulary: 124,475,904.
  EXPECT_EQ(g.num_parameters(), 124475904);
  EXPECT_EQ(GPTConfig::named("gpt2-xl").width, 1600);
  GPTConfig d84 = GPTConfig::named("d84");
  EXPECT_NEAR(static_cast<double>(d84.num_parameters()), 9.7e9, 0.1e9);
  // The count agrees with the built model's.
  GPT m(tiny());
  EXPECT_EQ(m.num_parameters(), tiny().num_parameters());
  EXPECT_TRUE(test::throws_naming([] { GPTConfig::named("gpt5"); }, {"gpt5", "gpt2-xl", "d84"}));
  GPTConfig bad = tiny(1, 3, 8);
  EXPECT_TRUE(test::throws_naming([&] { GPT m2(bad); }, {"3 heads", "width 8"}));
}

TEST(GPTModel, InitialisationFollowsGpt2) {
  manual_seed(1);
  GPTConfig c = tiny(4, 2, 64, 11, 6);
  GPT m(c);
  for (auto& [name, p] : m.named_parameters()) {
    auto v = p.to(kFloat64).to_vector<double>();
    if (name.find(".bias") != std::string::npos) {
      for (double x : v) EXPECT_EQ(x, 0.0) << name;
    }
  }
  // c_proj weights have std 0.02 / sqrt(2 * layers); the others 0.02.
  auto std_of = [](const Tensor& t) {
    auto v = t.to(kFloat64).to_vector<double>();
    double s = 0;
    for (double x : v) s += x * x;
    return std::sqrt(s / static_cast<double>(v.size()));
  };
  for (auto& [name, p] : m.named_parameters()) {
    if (name.find("mlp.c_proj.weight") != std::string::npos) EXPECT_NEAR(std_of(p), 0.02 / std::sqrt(8.0), 0.0015) << name;
    if (name.find("mlp.c_fc.weight") != std::string::npos) EXPECT_NEAR(std_of(p), 0.02, 0.0015) << name;
  }
  EXPECT_EQ(m.state_dict().front().first, "transformer.wte.weight");
  // Tied: one tensor, listed once.
  int wte = 0;
  for (auto& [name, p] : m.named_parameters()) wte += name.find("wte") != std::string::npos;
  EXPECT_EQ(wte, 1);
}

// The whole model's loss gradient against central differences in float64,
// for a few elements of every parameter.
TEST(GPTModel, LossGradientMatchesFiniteDifferences) {
  GPT m(tiny());
  m.to(kFloat64);
  randomize(m, 3);
  Tensor ids = random_ids({2, 5}, 11, 4), tg = random_ids({2, 5}, 11, 5);
  m.zero_grad();
  m.loss(ids, tg).backward();
  std::mt19937 gen(7);
  for (auto& [name, p] : m.named_parameters()) {
    Tensor grad = p.grad();
    ASSERT_TRUE(grad.defined()) << name;
    auto g = grad.to_vector<double>();
    double* data = p.data<double>();
    for (int k = 0; k < 3; ++k) {
      int64_t j = static_cast<int64_t>(gen() % static_cast<uint32_t>(p.numel()));
      if (name == "transformer.wte.weight") j %= 11 * 8;  // a real row (padding rows get no gradient)
      const double keep = data[j], eps = 1e-6;
      double lp, lm;
      {
        NoGradGuard ng;
        data[j] = keep + eps;
        lp = m.loss(ids, tg).item();
        data[j] = keep - eps;
        lm = m.loss(ids, tg).item();
        data[j] = keep;
      }
      const double numeric = (lp - lm) / (2 * eps);
      EXPECT_NEAR(g[j], numeric, 1e-7 + 1e-6 * std::abs(numeric)) << name << " element " << j;
    }
  }
}

// DataParallel over two logical CPU devices (--strategy dp's layout: the
// logits gathered on the first device, the loss taken there) against one
// device, in float64: the loss and every parameter's gradient, the tied
// embedding's included.
TEST(GPTModel, DataParallelEqualsOneDeviceInFloat64) {
  GPT one(tiny());
  one.to(kFloat64);
  randomize(one, 31);
  auto copy = std::dynamic_pointer_cast<GPT>(one.clone());
  ASSERT_TRUE(copy);
  parallel::DataParallel dp(copy, test::cpus(2));
  Tensor ids = random_ids({4, 5}, 11, 32), tg = random_ids({4, 5}, 11, 33);
  Tensor l1 = one.loss(ids, tg);
  Tensor l2 = copy->loss_of_logits(dp.forward(ids), tg);
  EXPECT_NEAR(l1.item(), l2.item(), 1e-13);
  l1.backward();
  l2.backward();
  auto a = one.named_parameters(), b = copy->named_parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    auto x = a[i].second.grad().to_vector<double>(), y = b[i].second.grad().to(cpu_device(0)).to_vector<double>();
    ASSERT_EQ(x.size(), y.size());
    double worst = 0;
    for (size_t j = 0; j < x.size(); ++j) worst = std::max(worst, std::abs(x[j] - y[j]));
    EXPECT_LT(worst, 1e-12) << a[i].first;
  }
}

// The GPT's loss written out as separate adds and layer norms: each block
// h = x + attn(ln_1(x)), out = h + mlp(ln_2(h)), then ln_f -- what the model
// computes with each add fused into the norm after it (Note [Pending
// residual] in models/gpt.h).
Tensor unfused_loss(GPT& m, const Tensor& ids, const Tensor& tg) {
  auto trunk = nn::child_as<nn::Module>(m, "transformer");
  auto norm = [](nn::Module& parent, const char* name, const Tensor& x) {
    auto ln = nn::child_as<nn::Module>(parent, name);
    return nn::functional::layer_norm(x, ln->named_parameters()[0].second, ln->named_parameters()[1].second, 1e-5);
  };
  Tensor positions;
  Tensor x = models::gpt_embed(*nn::child_as<nn::Embedding>(*trunk, "wte"), *nn::child_as<nn::Module>(*trunk, "wpe"),
                               positions, ids, m.config().dropout, m.is_training());
  for (const nn::ModulePtr& b : m.blocks()) {
    x = chorus::add(x, nn::child_as<nn::Module>(*b, "attn")->forward(norm(*b, "ln_1", x)));
    x = chorus::add(x, nn::child_as<nn::Module>(*b, "mlp")->forward(norm(*b, "ln_2", x)));
  }
  Tensor logits = nn::functional::linear(norm(*trunk, "ln_f", x), m.wte(), Tensor());
  return m.loss_of_logits(logits, tg);
}

// In float64 the model (every residual add fused with the norm after it)
// and the composition of separate adds and norms give the same loss and
// gradients, with residual dropout off and on (the same masks drawn in the
// same order).
TEST(GPTModel, FusedResidualNormsEqualTheComposition) {
  for (double p : {0.0, 0.2}) {
    SCOPED_TRACE(::testing::Message() << "dropout " << p);
    GPTConfig c = tiny(3, 2, 8, 11, 6);
    c.dropout = p;
    GPT a(c), b(c);
    a.to(kFloat64);
    b.to(kFloat64);
    randomize(a, 51);
    randomize(b, 51);
    Tensor ids = random_ids({2, 6}, 11, 52), tg = random_ids({2, 6}, 11, 53);
    manual_seed(54);
    Tensor la = a.loss(ids, tg);
    la.backward();
    manual_seed(54);
    Tensor lb = unfused_loss(b, ids, tg);
    lb.backward();
    EXPECT_GT(la.item(), 0.5);
    EXPECT_LE(std::abs(la.item() - lb.item()), 1e-12 * std::abs(lb.item()));
    auto pa = a.named_parameters(), pb = b.named_parameters();
    ASSERT_EQ(pa.size(), pb.size());
    for (size_t i = 0; i < pa.size(); ++i) {
      ASSERT_TRUE(pa[i].second.grad().defined() && pb[i].second.grad().defined()) << pa[i].first;
      auto x = pa[i].second.grad().to_vector<double>(), y = pb[i].second.grad().to_vector<double>();
      double worst = 0, scale = 0;
      for (size_t j = 0; j < x.size(); ++j) {
        worst = std::max(worst, std::abs(x[j] - y[j]));
        scale = std::max(scale, std::abs(y[j]));
      }
      EXPECT_LE(worst, 1e-12 * scale) << pa[i].first;
    }
  }
}

// One step of `plain` and of `again` (the same weights, the same dropout
// seed): equal losses and gradients in float64.
void expect_recomputed_like_plain(const GPTConfig& plain, const GPTConfig& again) {
  GPT a(plain), b(again);
  a.to(kFloat64);
  b.to(kFloat64);
  randomize(a, 41);
  randomize(b, 41);
  Tensor ids = random_ids({2, 6}, 11, 42), tg = random_ids({2, 6}, 11, 43);
  manual_seed(44);
  Tensor la = a.loss(ids, tg);
  la.backward();
  manual_seed(44);
  Tensor lb = b.loss(ids, tg);
  lb.backward();
  EXPECT_EQ(la.item(), lb.item());
  EXPECT_GT(la.item(), 0.5);  // a real loss: about log(11) for random weights
  auto pa = a.named_parameters(), pb = b.named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    ASSERT_TRUE(pb[i].second.grad().defined()) << pb[i].first;
    auto x = pa[i].second.grad().to_vector<double>(), y = pb[i].second.grad().to_vector<double>();
    double worst = 0;
    for (size_t j = 0; j < x.size(); ++j) worst = std::max(worst, std::abs(x[j] - y[j]));
    EXPECT_LT(worst, 1e-13) << pa[i].first;
  }
}

// --recompute: every block (or the first k: Note [Recomputing some blocks])
// keeps its input only and runs again in the backward (nn::checkpoint). In
// float64 the loss and every gradient equal an ordinary step's, with dropout
// on (the recomputed forward draws the same masks), and under DataParallel
// over two CPU devices.
TEST(GPTModel, RecomputedBlocksGiveTheSameGradients) {
  for (int64_t k : {3, 1, 2}) {
    GPTConfig plain = tiny(3, 2, 8, 11, 6), again = plain;
    plain.dropout = again.dropout = 0.2;
    again.recompute_blocks = k;
    SCOPED_TRACE("recomputed blocks: " + std::to_string(k));
    expect_recomputed_like_plain(plain, again);
  }
  // --recompute-gelu (Note [GELU recomputed in the backward]): alone and
  // beside recomputed blocks.
  for (int64_t k : {0, 2}) {
    GPTConfig plain = tiny(3, 2, 8, 11, 6), again = plain;
    plain.dropout = again.dropout = 0.2;
    again.recompute_blocks = k;
    again.recompute_gelu = true;
    SCOPED_TRACE("GELU recomputed, recomputed blocks: " + std::to_string(k));
    expect_recomputed_like_plain(plain, again);
  }
  // Without grad mode (evaluation) nothing is recorded or recomputed.
  {
    GPTConfig every = tiny(3, 2, 8, 11, 6);
    every.recompute_blocks = every.layers;
    GPT b(every);
    Tensor ids = random_ids({2, 6}, 11, 42), tg = random_ids({2, 6}, 11, 43);
    NoGradGuard ng;
    EXPECT_FALSE(b.loss(ids, tg).requires_grad());
  }
  // DataParallel replicas of a recomputing model (no dropout: the replicas
  // draw their own masks) against one ordinary device.
  GPTConfig p0 = tiny(3, 2, 8, 11, 6), r0 = p0;
  r0.recompute_blocks = r0.layers;
  GPT one(p0);
  one.to(kFloat64);
  randomize(one, 45);
  auto rc = std::make_shared<GPT>(r0);
  rc->to(kFloat64);
  randomize(*rc, 45);
  parallel::DataParallel dp(rc, test::cpus(2));
  Tensor ids2 = random_ids({4, 6}, 11, 46), tg2 = random_ids({4, 6}, 11, 47);
  Tensor l1 = one.loss(ids2, tg2), l2 = rc->loss_of_logits(dp.forward(ids2), tg2);
  EXPECT_NEAR(l1.item(), l2.item(), 1e-13);
  l1.backward();
  l2.backward();
  auto o = one.named_parameters(), r = rc->named_parameters();
  for (size_t i = 0; i < o.size(); ++i) {
    auto x = o[i].second.grad().to_vector<double>(), y = r[i].second.grad().to(cpu_device(0)).to_vector<double>();
    double worst = 0;
    for (size_t j = 0; j < x.size(); ++j) worst = std::max(worst, std::abs(x[j] - y[j]));
    EXPECT_LT(worst, 1e-12) << o[i].first;
  }
}

// A GPT as pipeline stages over two CPU devices (the embeddings and the
// head on different stages, the head holding a copy of the tied embedding),
// 1F1B over 3 micro-batches, in float64: the loss and every gradient equal one
// device's once the tied gradients are merged, and after an AdamW step and
// sync_tied_weights() the head's copy equals the embedding again.
TEST(GPTModel, PipelineStagesEqualOneDeviceInFloat64) {
  GPTConfig c = tiny(3, 2, 8, 11, 6);
  auto one = std::make_shared<GPT>(c), piped = std::make_shared<GPT>(c);
  one->to(kFloat64);
  piped->to(kFloat64);
  randomize(*one, 51);
  randomize(*piped, 51);
  models::GPTPipelineLayers tied(piped);
  ASSERT_EQ(tied.layers()->size(), 5u);  // embeddings, 3 blocks, head
  parallel::PipelineOptions po;
  po.micro_batches = 3;
  parallel::Pipeline pipe(tied.layers(), {2, 3}, test::cpus(2), po);
  Tensor ids = random_ids({6, 6}, 11, 52), tg = random_ids({6, 6}, 11, 53);
  Tensor l1 = one->loss(ids, tg);
  l1.backward();
  Tensor l2 = pipe.train_step(ids, tg, [&](const Tensor& out, const Tensor& t) { return piped->loss_of_logits(out, t); })
                  .loss;
  tied.merge_tied_gradients();
  EXPECT_NEAR(l1.item(), l2.item(), 1e-13);
  auto a = one->named_parameters(), b = piped->named_parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_TRUE(b[i].second.grad().defined()) << b[i].first;
    auto x = a[i].second.grad().to_vector<double>(), y = b[i].second.grad().to(cpu_device(0)).to_vector<double>();
    double worst = 0;
    for (size_t j = 0; j < x.size(); ++j) worst = std::max(worst, std::abs(x[j] - y[j]));
    EXPECT_LT(worst, 1e-12) << a[i].first;
  }
  // One AdamW step on the model's own parameters, then the head's copy follows.
  std::vector<Tensor> params;
  for (auto& [n, p] : piped->named_parameters()) params.push_back(p);
  optim::AdamW opt(params, optim::AdamWOptions{1e-2, 0.9, 0.95, 1e-8, 0.0});
  opt.step();
  tied.sync_tied_weights();
  auto head = std::dynamic_pointer_cast<models::GPTHeadStage>(tied.layers()->named_children().back().second);
  ASSERT_TRUE(head);
  auto w = piped->wte().to(cpu_device(0)).to_vector<double>(), h = head->weight().to(cpu_device(0)).to_vector<double>();
  EXPECT_EQ(w, h);
}

TEST(GPTModel, RejectsASequenceLongerThanTheContext) {
  GPT m(tiny());
  Tensor ids = random_ids({1, 7}, 11, 1);
  EXPECT_TRUE(test::throws_naming([&] { m.forward(ids); }, {"7 tokens", "context of 6"}));
}

TEST(GPTModel, HuggingFaceLayoutRoundTrips) {
  GPTConfig c = tiny();
  GPT m(c);
  randomize(m, 8);
  NamedTensors hf = models::gpt_to_hf(m.state_dict(), c);
  for (auto& [name, t] : hf) {
    if (name == "transformer.h.0.attn.c_attn.weight") EXPECT_EQ(t.sizes(), (Shape{8, 24}));  // Conv1D: [in, out]
    if (name == "transformer.wte.weight") EXPECT_EQ(t.sizes(), (Shape{11, 8}));               // vocabulary cut
  }
  GPT back(c);
  back.load_state_dict(models::gpt_from_hf(hf, c));
  auto a = m.state_dict(), b = back.state_dict();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].first, b[i].first);
    EXPECT_EQ(a[i].second.to_vector<float>(), b[i].second.to_vector<float>()) << a[i].first;
  }
  // A tensor of another shape is named.
  hf[3].second = zeros({3, 3});
  EXPECT_TRUE(test::throws_naming([&] { models::gpt_from_hf(hf, c); }, {hf[3].first}));
}

TEST(GPTModel, LogitsEqualAPyTorchGpt2ReadingTheSameFile) {
  // Debian's python3 (python3-torch), which a python3 earlier on PATH (pyenv, a venv) may hide.
  std::string python;
  for (const char* p : {"/usr/bin/python3", "python3"}) {
    if (std::system((std::string(p) + " -c 'import torch' >/dev/null 2>&1").c_str()) == 0) {
      python = p;
      break;
    }
  }
  if (python.empty()) GTEST_SKIP() << "python3-torch is not installed (scripts/setup.sh installs it)";
  GPTConfig c = tiny(2, 4, 32, 300, 16);
  c.padded_vocab = 384;
  GPT m(c);
  randomize(m, 9);
  io::testing::ScratchDir dir;
  io::save_safetensors(dir.file("model.safetensors"), models::gpt_to_hf(m.state_dict(), c));
  Tensor ids = random_ids({2, 16}, 300, 10);
  {
    std::ofstream f(dir.file("ids.txt"));
    auto v = ids.to_vector<int64_t>();
    for (int64_t b = 0; b < 2; ++b) {
      for (int64_t t = 0; t < 16; ++t) f << v[b * 16 + t] << (t + 1 < 16 ? " " : "\n");
    }
  }
  const std::string cmd = python + " " + CHORUS_TESTS_DIR + "/models/gpt2_reference.py " +
                          dir.file("model.safetensors") + " " + dir.file("ids.txt") + " 4 " + dir.file("ref.bin");
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::string raw = io::testing::read_bytes(dir.file("ref.bin"));
  ASSERT_EQ(raw.size(), sizeof(double) * 2 * 16 * 300);
  const double* ref = reinterpret_cast<const double*>(raw.data());
  auto got = m.forward(ids).to_vector<float>();  // [2, 16, 384]
  double worst = 0;
  for (int64_t r = 0; r < 32; ++r)
    for (int64_t v = 0; v < 300; ++v) worst = std::max(worst, std::abs(got[r * 384 + v] - ref[r * 300 + v]));
  EXPECT_LT(worst, 1e-5) << "largest difference from PyTorch's logits";
  // The loss of the same logits, against PyTorch's cross entropy over the
  // real vocabulary (computed here from its logits in double).
  Tensor tg = random_ids({2, 16}, 300, 11);
  auto t = tg.to_vector<int64_t>();
  double want = 0;
  for (int64_t r = 0; r < 32; ++r) {
    double mx = -1e300, s = 0;
    for (int64_t v = 0; v < 300; ++v) mx = std::max(mx, ref[r * 300 + v]);
    for (int64_t v = 0; v < 300; ++v) s += std::exp(ref[r * 300 + v] - mx);
    want += mx + std::log(s) - ref[r * 300 + t[r]];
  }
  EXPECT_NEAR(m.loss(ids, tg).item(), want / 32, 1e-5);
}

TEST(GPTModel, ForwardOnGpuMatchesCpu_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  GPTConfig c = tiny(2, 2, 128, 300, 70);
  GPT cpu_model(c);
  randomize(cpu_model, 12);
  auto gpu_model = std::dynamic_pointer_cast<GPT>(cpu_model.clone(Device("cuda:0")));
  ASSERT_TRUE(gpu_model);
  Tensor ids = random_ids({3, 70}, 300, 13), tg = random_ids({3, 70}, 300, 14);
  Tensor lc = cpu_model.loss(ids, tg);
  Tensor lg = gpu_model->loss(ids.to(Device("cuda:0")), tg.to(Device("cuda:0")));
  EXPECT_NEAR(lc.item(), lg.item(), 1e-4);
  lc.backward();
  lg.backward();
  auto a = cpu_model.named_parameters(), b = gpu_model->named_parameters();
  for (size_t i = 0; i < a.size(); ++i) {
    auto x = a[i].second.grad().to_vector<float>(), y = b[i].second.grad().to(kFloat32).to(cpu_device(0)).to_vector<float>();
    double worst = 0, scale = 1e-6;
    for (size_t j = 0; j < x.size(); ++j) {
      worst = std::max(worst, double(std::abs(x[j] - y[j])));
      scale = std::max(scale, double(std::abs(x[j])));
    }
    EXPECT_LT(worst, 1e-3 * scale + 1e-6) << a[i].first;
  }
  // bf16 autocast: the loss within bf16's precision of float32's.
  AutocastGuard cast(kBFloat16);
  Tensor lb = gpu_model->loss(ids.to(Device("cuda:0")), tg.to(Device("cuda:0")));
  EXPECT_NEAR(lb.item(), lc.item(), 0.05);
}

}  // namespace
}  // namespace chorus
