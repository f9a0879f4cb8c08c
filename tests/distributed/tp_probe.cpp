// chorus_tp_probe: one rank of a tensor-parallel test job (started by
// tests/distributed/tensor_parallel.sh through chorus launch). Every rank also
// builds, alone, the tp=1 models::GPT from the same seed in float64 and runs
// it on the whole global batch -- the independent result the mesh must
// reproduce.
//
// SP is nosp, sp, or spK: sequence parallelism with its collectives in K
// chunks (TPContext::chunks; a K that does not divide a rank's tokens runs
// as 1), which must equal the reference just the same.
//
//   match MESH sp|nosp   (MESH as --mesh: dp=2,tp=2) the sharded model equals the
//                        reference: full logits, loss, every gradient (the
//                        shards gathered), and every weight after 3 AdamW steps
//                        with gradient clipping by the global norm (the norms
//                        compared too); <= 1e-12 relative in float64. dp > 1:
//                        DDP over the mesh's dp group, each dp rank on its rows.
//   dropout MESH sp|nosp with dropout 0.1 and the same rows on every data rank:
//                        the replicated parameters' gradients agree across the
//                        tensor ranks (their dropout masks agree), the losses
//                        differ across the data ranks (theirs differ), and a
//                        second run from the same seed repeats the first.
//   checkpoint MESH DIR  3 steps, then the gathered state written by rank 0 as
//                        DIR/model.safetensors; every rank checks that a
//                        models::GPT loading it equals the sharded model.
//   reload MESH DIR      that file loaded at another layout (each rank its
//                        slices) equals one process loading it.
//   pipeline MESH sp|nosp [interleaved]  (MESH with pp > 1) the model as a
//                        1F1B pipeline over the pp groups (interleaved: two
//                        stages per pipeline rank, one layer each), tensor
//                        parallel inside each stage: loss, the local stages'
//                        gradients, the global norm and weights after 3 AdamW
//                        steps equal the reference.
// Prints "rank R: ok ..." and exits 0, or FAIL lines and exits 1.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include <chorus/chorus.h>
#include <chorus/data_parallel/ddp.h>
#include <chorus/distributed/device_mesh.h>
#include <chorus/distributed/init.h>
#include <chorus/io/safetensors.h>
#include <chorus/models/gpt.h>
#include <chorus/optim/adamw.h>
#include <chorus/optim/clip_grad.h>
#include <chorus/parallel/pipeline.h>
#include <chorus/tensor_parallel/clip_grad.h>
#include <chorus/tensor_parallel/cross_entropy.h>
#include <chorus/tensor_parallel/gpt.h>
#include <chorus/tensor_parallel/gpt_layers.h>
#include <chorus/tensor_parallel/mappings.h>

using namespace chorus;

namespace {

int failures = 0;
double worst = 0;  // the largest relative difference seen in the comparisons
std::map<std::string, double> worst_of;  // ... per kind (the first word of what was compared)

void expect(bool ok, const std::string& what) {
  if (!ok) {
    ++failures;
    std::fprintf(stderr, "FAIL: %s\n", what.c_str());
  }
}

double rel_err(const Tensor& a, const Tensor& b) {
  const std::vector<double> u = a.to(cpu_device(0)).to(kFloat64).contiguous().to_vector<double>();
  const std::vector<double> v = b.to(cpu_device(0)).to(kFloat64).contiguous().to_vector<double>();
  if (u.size() != v.size()) return INFINITY;
  double num = 0, den = 0;
  for (size_t i = 0; i < u.size(); ++i) {
    num += (u[i] - v[i]) * (u[i] - v[i]);
    den += v[i] * v[i];
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-300);
}

void expect_close(const Tensor& got, const Tensor& want, const std::string& what, double tol = 1e-12) {
  const double e = rel_err(got, want);
  worst = std::max(worst, e);
  double& w = worst_of[what.substr(0, what.find(' '))];
  w = std::max(w, e);
  char line[64];
  std::snprintf(line, sizeof line, ": relative difference %.3g > %.3g", e, tol);
  expect(e <= tol, what + line + " (got " + got.describe() + ", want " + want.describe() + ")");
}

// Small enough for 2 cores, yet every path: 4 heads (tp=4 gives each rank
// one), a vocabulary with padding (100 -> 128 rows), two blocks.
models::GPTConfig config(double dropout) {
  models::GPTConfig c;
  c.layers = 2;
  c.heads = 4;
  c.width = 32;
  c.vocab = 100;
  c.padded_vocab = 128;
  c.context = 16;
  c.dropout = dropout;
  return c;
}

constexpr int64_t kBatch = 4, kSeq = 8;
constexpr uint64_t kSeed = 1234;

struct Batch {
  Tensor ids, targets;
};
Batch global_batch() {
  manual_seed(99);
  Tensor tokens = randint(0, 100, {kBatch, kSeq + 1});
  return {tokens.narrow(1, 0, kSeq).contiguous(), tokens.narrow(1, 1, kSeq).contiguous()};
}

std::map<std::string, Tensor> by_name(const NamedTensors& v) { return {v.begin(), v.end()}; }

optim::AdamWOptions adamw_options() {
  optim::AdamWOptions o;
  o.lr = 1e-2;  // large enough that three steps move every weight visibly
  o.weight_decay = 0.1;
  return o;
}
constexpr double kClip = 0.05;  // below the gradients' norm: clipping acts on every step

// Set by main from the SP argument.
int sp_chunks = 1;
std::string sp_label = "nosp";

struct Job {
  dist::ProcessGroupPtr world;
  std::shared_ptr<dist::DeviceMesh> mesh;
  bool sp = false;
};

Job join(const std::string& spec, bool sp) {
  Job j;
  dist::InitOptions io;
  io.timeout = std::chrono::milliseconds(std::atoi(std::getenv("PROBE_TIMEOUT_MS") ? std::getenv("PROBE_TIMEOUT_MS") : "60000"));
  j.world = dist::init_process_group(io);
  j.mesh = std::make_shared<dist::DeviceMesh>(j.world, dist::parse_mesh_spec(spec));
  if (j.world->rank() == 0) std::printf("%s\n", j.mesh->describe().c_str());
  j.sp = sp;
  return j;
}

tp::TPContext context(const Job& j) {
  tp::TPContext ctx;
  ctx.group = j.mesh->group("tp");
  ctx.sequence_parallel = j.sp;
  ctx.chunks = sp_chunks;
  ctx.sharded_rng = std::make_shared<Generator>();  // shared by the model's layers; seeded after the build
  return ctx;
}

// The reference and the sharded model from the same seed, in float64.
std::pair<std::shared_ptr<models::GPT>, std::shared_ptr<tp::TensorParallelGPT>> build(const Job& j, double dropout) {
  manual_seed(kSeed);
  auto ref = std::make_shared<models::GPT>(config(dropout));
  ref->to(kFloat64);
  manual_seed(kSeed);
  tp::TPContext ctx = context(j);
  auto model = std::make_shared<tp::TensorParallelGPT>(config(dropout), ctx);
  model->to(kFloat64);
  tp::seed_parallel_rng(ctx, kSeed + 1, j.mesh->coord("dp"));
  return {ref, model};
}

NamedTensors full_grads(tp::TensorParallelGPT& m, const dist::ProcessGroupPtr& g) {
  NamedTensors out;
  for (const auto& p : tp::sharded_parameters(m)) {
    Tensor grad = p.tensor.grad();
    out.emplace_back(p.name, grad.defined() ? tp::unshard(grad.contiguous(), p.spec, g) : Tensor());
  }
  return out;
}

int run_match(const std::string& spec, bool sp) {
  Job j = join(spec, sp);
  auto [ref, model] = build(j, 0.0);
  const auto tpg = j.mesh->group("tp");
  const int dp = j.mesh->size("dp"), dr = j.mesh->coord("dp");
  std::shared_ptr<dist::DistributedDataParallel> ddp;
  nn::ModulePtr net = model;
  if (dp > 1) net = ddp = std::make_shared<dist::DistributedDataParallel>(model, j.mesh->group("dp"));
  const Batch b = global_batch();
  const int64_t rows = kBatch / dp;
  Tensor ids = b.ids.narrow(0, dr * rows, rows).contiguous(), tg = b.targets.narrow(0, dr * rows, rows).contiguous();

  // Logits (no grad): the gathered slices equal the reference's rows.
  {
    NoGradGuard no_grad;
    Tensor want = ref->forward(b.ids).narrow(0, dr * rows, rows);
    expect_close(model->gather_logits(model->forward(ids)), want, "logits");
  }
  optim::AdamW ref_opt(ref->parameters(), adamw_options());
  std::vector<Tensor> params;
  const auto sharded = tp::sharded_parameters(*model);
  for (const auto& p : sharded) params.push_back(p.tensor);
  optim::AdamW opt(params, adamw_options());
  for (int step = 0; step < 3; ++step) {
    Tensor ref_loss = ref->loss(b.ids, b.targets);
    ref_loss.backward();
    Tensor loss = model->loss_of_logits(net->forward(ids), tg);
    loss.backward();
    // Each data rank's loss is the mean over its rows; their mean is the global one.
    Tensor mean_loss = loss.detach().clone().reshape({1});
    if (dp > 1) j.mesh->group("dp")->all_reduce(mean_loss, dist::ReduceOp::Avg)->wait();
    expect_close(mean_loss.reshape({}), ref_loss.detach(), "loss at step " + std::to_string(step));
    if (step == 0) {
      auto want = by_name(ref->named_parameters());
      for (const auto& [name, g] : full_grads(*model, tpg)) {
        expect(g.defined(), "no gradient for " + name);
        if (g.defined()) expect_close(g, want.at(name).grad(), "gradient of " + name);
      }
    }
    Tensor ref_norm = optim::clip_grad_norm_(ref->parameters(), kClip);
    Tensor norm = tp::clip_grad_norm_(sharded, kClip, tpg);
    expect_close(norm, ref_norm, "global gradient norm at step " + std::to_string(step));
    expect(ref_norm.item() > kClip, "the reference's gradient norm " + std::to_string(ref_norm.item()) +
                                        " does not exceed the clip: clipping untested");
    ref_opt.step();
    opt.step();
    ref->zero_grad();
    model->zero_grad();
  }
  auto want = by_name(ref->state_dict());
  for (const auto& [name, w] : tp::full_state_dict(*model, tpg)) expect_close(w, want.at(name), "weight " + name + " after 3 steps");
  if (failures) return 1;
  std::string kinds;
  for (const auto& [k, e] : worst_of) {
    char part[64];
    std::snprintf(part, sizeof part, "%s%s %.2g", kinds.empty() ? "" : ", ", k.c_str(), e);
    kinds += part;
  }
  std::printf("rank %d: ok match %s %s (max relative difference %.3g: %s)\n", j.world->rank(), spec.c_str(),
              sp_label.c_str(), worst, kinds.c_str());
  return 0;
}

int run_dropout(const std::string& spec, bool sp) {
  Job j = join(spec, sp);
  const auto tpg = j.mesh->group("tp");
  const Batch b = global_batch();
  std::vector<double> losses;
  NamedTensors first_grads;
  for (int run = 0; run < 2; ++run) {
    auto [ref, model] = build(j, 0.1);
    (void)ref;
    Tensor loss = model->loss(b.ids, b.targets);  // the same rows on every data rank
    loss.backward();
    losses.push_back(loss.item());
    NamedTensors grads = full_grads(*model, tpg);
    if (run == 0) first_grads = grads;
    else
      for (size_t i = 0; i < grads.size(); ++i)
        expect_close(grads[i].second, first_grads[i].second, "rerun from the seed: gradient of " + grads[i].first, 0.0);
    // Replicated parameters: every tensor rank must hold the same gradient.
    for (const auto& p : tp::sharded_parameters(*model)) {
      if (!p.spec.replicated() || !tp::is_parallel(tpg)) continue;
      Tensor mine = p.tensor.grad().contiguous();
      Tensor all = tp::all_gather_along(mine.unsqueeze(0).contiguous(), tpg, 0);
      for (int r = 1; r < tpg->size(); ++r)
        expect_close(all.select(0, r), all.select(0, 0), "tensor rank " + std::to_string(r) + "'s gradient of " + p.name, 0.0);
    }
  }
  expect(losses[0] == losses[1], "a second run from the same seed gave another loss");
  if (j.mesh->size("dp") > 1) {
    Tensor l = full({1}, losses[0], {kFloat64, cpu_device(0)});
    Tensor all = tp::all_gather_along(l, j.mesh->group("dp"), 0);
    expect(all.to_vector<double>()[0] != all.to_vector<double>()[1],
           "two data ranks drew the same dropout masks (equal losses on equal rows)");
  }
  if (failures) return 1;
  std::printf("rank %d: ok dropout %s %s (loss %.12f)\n", j.world->rank(), spec.c_str(), sp_label.c_str(), losses[0]);
  return 0;
}

int run_checkpoint(const std::string& spec, const std::string& dir) {
  Job j = join(spec, false);
  auto [ref, model] = build(j, 0.0);
  (void)ref;
  const Batch b = global_batch();
  std::vector<Tensor> params = model->parameters();
  optim::AdamW opt(params, adamw_options());
  for (int step = 0; step < 3; ++step) {
    model->loss(b.ids, b.targets).backward();
    opt.step();
    model->zero_grad();
  }
  NamedTensors full_state = tp::full_state_dict(*model, j.mesh->group("tp"));
  const std::string file = dir + "/model.safetensors";
  if (j.world->rank() == 0) io::save_safetensors(file, full_state);
  j.world->barrier()->wait();
  models::GPT one(config(0.0));
  one.to(kFloat64);
  one.load_state_dict(io::load_safetensors(file));
  NoGradGuard no_grad;
  expect_close(one.forward(b.ids), model->gather_logits(model->forward(b.ids)), "logits of the reloaded tp=1 model");
  if (failures) return 1;
  std::printf("rank %d: ok checkpoint %s (max relative difference %.3g)\n", j.world->rank(), spec.c_str(), worst);
  return 0;
}

// Tensor x pipeline (x data) parallel: the model's layers as a 1F1B (or
// interleaved) pipeline over the mesh's pp groups, 2 micro-batches; loss, the local stages'
// gradients (after the tied embedding's sync), the global norm and the local
// weights after 3 AdamW steps equal the reference's; evaluate() (forwards
// only) gives the reference's loss and no gradient.
int run_pipeline(const std::string& spec, bool sp, bool interleaved) {
  Job j = join(spec, sp);
  auto [ref, model] = build(j, 0.0);
  const auto tpg = j.mesh->group("tp"), ppg = j.mesh->group("pp");
  const int dp = j.mesh->size("dp"), dr = j.mesh->coord("dp"), pp = j.mesh->size("pp"), pr = j.mesh->coord("pp");
  parallel::PipelineOptions o;
  o.micro_batches = 2;
  o.schedule = interleaved ? parallel::Schedule::Interleaved : parallel::Schedule::OneFOneB;
  o.virtual_stages = interleaved ? 2 : 1;  // pp=2: embeddings, block 1 on rank 0; block 0, head on rank 1
  o.stage_group = ppg;  // data parallelism: tp::average_gradients below, as apps/gpt_mesh.cpp does
  parallel::Pipeline pipe(tp::pipeline_layers(*model), {}, {cpu_device(0)}, o);
  const std::vector<Tensor> mine = pipe.local_parameters();
  auto is_local = [&](const Tensor& t) {
    return std::any_of(mine.begin(), mine.end(), [&](const Tensor& m) { return m.is_same(t); });
  };
  std::vector<tp::ShardedParameter> local;
  for (const auto& p : tp::sharded_parameters(*model))
    if (is_local(p.tensor)) local.push_back(p);
  expect(!local.empty(), "no parameters on this rank");
  const bool uses_wte = is_local(tp::tied_embedding(*model));
  const std::vector<Tensor> elsewhere =
      pr > 0 && uses_wte ? std::vector<Tensor>{tp::tied_embedding(*model)} : std::vector<Tensor>{};
  optim::AdamW ref_opt(ref->parameters(), adamw_options());
  optim::AdamW opt(mine, adamw_options());
  const Batch b = global_batch();
  const int64_t rows = kBatch / dp;
  Tensor ids = b.ids.narrow(0, dr * rows, rows).contiguous(), tg = b.targets.narrow(0, dr * rows, rows).contiguous();
  const int64_t vocab = model->config().vocab;
  auto loss_fn = [&](const Tensor& out, const Tensor& t) { return tp::vocab_parallel_cross_entropy(out, t, vocab, tpg); };
  {
    // Validation's forwards-only pass: the same loss, no gradient anywhere.
    Tensor want;
    {
      NoGradGuard no_grad;
      want = ref->loss(b.ids, b.targets);
    }
    Tensor e = pipe.evaluate(ids, tg, loss_fn);
    expect(e.defined() == pipe.is_local(pipe.num_stages() - 1), "evaluate's loss defined off the last stage");
    if (e.defined()) {
      Tensor l = e.clone().reshape({1});
      if (dp > 1) j.mesh->group("dp")->all_reduce(l, dist::ReduceOp::Avg)->wait();
      expect_close(l.reshape({}), want, "evaluate's loss");
    }
    for (const Tensor& p : mine) expect(!p.grad().defined(), "evaluate left a gradient");
  }
  for (int step = 0; step < 3; ++step) {
    Tensor ref_loss = ref->loss(b.ids, b.targets);
    ref_loss.backward();
    opt.zero_grad();
    auto r = pipe.train_step(ids, tg, loss_fn);
    tp::average_gradients(mine, j.mesh->group("dp"));
    tp::sync_tied_embedding(*model, uses_wte, ppg);
    if (r.loss.defined()) {
      Tensor l = r.loss.detach().clone().reshape({1});
      if (dp > 1) j.mesh->group("dp")->all_reduce(l, dist::ReduceOp::Avg)->wait();
      expect_close(l.reshape({}), ref_loss.detach(), "loss at step " + std::to_string(step));
    }
    if (step == 0) {
      auto want = by_name(ref->named_parameters());
      for (const auto& p : local) {
        expect(p.tensor.grad().defined(), "no gradient for " + p.name);
        if (p.tensor.grad().defined())
          expect_close(tp::unshard(p.tensor.grad().contiguous(), p.spec, tpg), want.at(p.name).grad(), "gradient of " + p.name);
      }
    }
    Tensor ref_norm = optim::clip_grad_norm_(ref->parameters(), kClip);
    Tensor norm = tp::clip_grad_norm_(local, kClip, tpg, ppg, elsewhere);
    expect_close(norm, ref_norm, "global gradient norm at step " + std::to_string(step));
    ref_opt.step();
    opt.step();
    ref->zero_grad();
  }
  auto want = by_name(ref->state_dict());
  for (const auto& p : local)
    expect_close(tp::unshard(p.tensor.detach().contiguous(), p.spec, tpg), want.at(p.name), "weight " + p.name + " after 3 steps");
  j.world->barrier()->wait();
  if (failures) return 1;
  std::printf("rank %d: ok pipeline %s %s %s, rank %d of %d in the pipeline (%lld stages), %zu parameters (max relative "
              "difference %.3g)\n", j.world->rank(), spec.c_str(), sp_label.c_str(), interleaved ? "interleaved" : "1f1b",
              pr, pp, (long long)pipe.num_stages(), local.size(), worst);
  return 0;
}

// The checkpoint written by run_checkpoint, loaded at another layout: the
// sharded model's logits equal those of one process loading the same file.
int run_reload(const std::string& spec, const std::string& dir) {
  Job j = join(spec, false);
  auto [ref, model] = build(j, 0.0);
  (void)ref;
  const NamedTensors full_state = io::load_safetensors(dir + "/model.safetensors");
  tp::load_full_state_dict(*model, full_state, j.mesh->group("tp"));
  models::GPT one(config(0.0));
  one.to(kFloat64);
  one.load_state_dict(full_state);
  const Batch b = global_batch();
  NoGradGuard no_grad;
  expect_close(model->gather_logits(model->forward(b.ids)), one.forward(b.ids), "logits after loading at " + spec);
  if (failures) return 1;
  std::printf("rank %d: ok reload %s (max relative difference %.3g)\n", j.world->rank(), spec.c_str(), worst);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string mode = argc > 1 ? argv[1] : "";
    // argv[3], SP: nosp | sp | spK
    const std::string sp_arg = argc > 3 ? argv[3] : "";
    const bool sp = sp_arg.rfind("sp", 0) == 0;
    if (sp) {
      sp_label = sp_arg;
      sp_chunks = sp_arg.size() > 2 ? std::atoi(sp_arg.c_str() + 2) : 1;
      if (sp_chunks < 1) {
        std::fprintf(stderr, "FAIL: bad SP argument '%s' (expected nosp, sp or spK with K >= 1)\n", sp_arg.c_str());
        return 2;
      }
    }
    if (mode == "match" && argc == 4) return run_match(argv[2], sp);
    if (mode == "dropout" && argc == 4) return run_dropout(argv[2], sp);
    if (mode == "checkpoint" && argc == 4) return run_checkpoint(argv[2], argv[3]);
    if (mode == "reload" && argc == 4) return run_reload(argv[2], argv[3]);
    if (mode == "pipeline" && (argc == 4 || (argc == 5 && std::string(argv[4]) == "interleaved")))
      return run_pipeline(argv[2], sp, argc == 5);
    std::fprintf(stderr, "usage: chorus_tp_probe match|dropout MESH SP | pipeline MESH SP [interleaved] | "
                         "checkpoint|reload MESH DIR\n");
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "FAIL: %s\n", e.what());
    return 1;
  }
}
