// chorus_sharded_probe: one rank of a ShardedDataParallel test job (started by
// tests/distributed/sharded.sh through chorus launch). Every rank trains two copies of
// one model on the same data: one under DistributedDataParallel (itself
// checked equal to one process on the global batch by tests/distributed/ddp.sh) and
// one under ShardedDataParallel at the stage given, both with AdamW (weight
// decay on matrices only, as GPTs) and clipping by the global norm, in
// float64; losses at every step and the weights after the last must agree to
// 1e-12 relative.
//
//   match MODEL STAGE [micro]   MODEL = mlp: uneven shards (no size divides
//                    by 2, 3 or 4; a 3-element bias leaves some ranks empty),
//                    a frozen bias, a weight tied between two layers, a
//                    parameter never used and a head used only on some steps
//                    and ranks; gpt: a 2-block GPT (tied embedding and head).
//                    Ranks other than 0 start from other weights.
//                    `micro`: each step 2 micro-batches, the first under
//                    no_sync(); `synced`: 2 micro-batches, both synced (the
//                    second backward adds to the pieces' gradients: Note
//                    [Sharded gradient shards]). PROBE_RESHARD=0: stage 3 keeps the weights
//                    from the forward to the backward. PROBE_BUCKET_BYTES:
//                    stages 1-2 bucket size. PROBE_REDUCE=bf16: gradients
//                    reduce-scattered in bfloat16, against DDP in float64
//                    (2e-2 relative: bfloat16 keeps 8 bits of each gradient).
//                    PROBE_PARAM_DTYPE=float32 (gpt): parameters gathered in
//                    float32 over float64 masters (1e-5 relative losses,
//                    1e-4 weights, against float64 DDP).
//                    PROBE_UNITS=named: the blocks named as units (gpt; the
//                    trainer's way: stage 3 shards them from construction,
//                    stages 1-2 wait for each one's gathers at its forward),
//                    or the mlp's layers (stages 1-2).
// Prints "rank R: ok ..." and exits 0, or FAIL lines and exits 1.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <chorus/chorus.h>
#include <chorus/ops/copy.h>
#include <chorus/data_parallel/ddp.h>
#include <chorus/distributed/init.h>
#include <chorus/data_parallel/sharded.h>
#include <chorus/models/gpt.h>
#include <chorus/optim/adamw.h>
#include <chorus/optim/clip_grad.h>

using namespace chorus;

namespace {

int failures = 0;
void expect(bool ok, const std::string& what) {
  if (!ok) {
    ++failures;
    std::fprintf(stderr, "FAIL: %s\n", what.c_str());
  }
}

std::string sci(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.3e", v);
  return b;
}

double rel_err(const Tensor& a, const Tensor& b) {
  const std::vector<double> u = a.to(kFloat64).contiguous().to_vector<double>();
  const std::vector<double> v = b.to(kFloat64).contiguous().to_vector<double>();
  double num = 0, den = 0;
  for (size_t i = 0; i < u.size(); ++i) {
    num += (u[i] - v[i]) * (u[i] - v[i]);
    den += v[i] * v[i];
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
}

// Sizes no world of 2-4 divides evenly; fc3 uses fc2's weight; fc1's bias is
// frozen; `aux` is used on some steps and ranks only; `never` never.
class Tangle : public nn::Module {
 public:
  Tangle() : Module("Tangle") {
    fc1 = register_module("fc1", std::make_shared<nn::Linear>(13, 11));
    fc2 = register_module("fc2", std::make_shared<nn::Linear>(11, 11));
    fc3 = register_module("fc3", std::make_shared<nn::Linear>(11, 11));
    head = register_module("head", std::make_shared<nn::Linear>(11, 3));
    aux = register_module("aux", std::make_shared<nn::Linear>(13, 3));
    never = register_module("never", std::make_shared<nn::Linear>(3, 3));
    for (auto& [n, t] : fc3->own_parameters())
      if (n == "weight") t = fc2->own_parameters()[0].second;  // tied
    fc1->own_parameters()[1].second.set_requires_grad(false);   // frozen bias
  }
  // Through the children (as Sequential does), so that stage 3's unit
  // wrappers run; PROBE_DIRECT=1 through the members (the wrappers bypassed).
  Tensor forward(const Tensor& x) override {
    auto call = [&](const char* name, const std::shared_ptr<nn::Linear>& member, const Tensor& in) {
      return direct ? member->forward(in) : nn::child_as<nn::Module>(*this, name)->forward(in);
    };
    Tensor h = relu(call("fc1", fc1, x));
    h = relu(call("fc2", fc2, h));
    h = tanh(call("fc3", fc3, h));
    Tensor out = call("head", head, h);
    return use_aux ? out + call("aux", aux, x) : out;
  }
  bool direct = std::getenv("PROBE_DIRECT") != nullptr;
  bool use_aux = false;
  std::shared_ptr<nn::Linear> fc1, fc2, fc3, head, aux, never;

 protected:
  std::shared_ptr<Module> make_empty() const override { return std::make_shared<Tangle>(); }
};

models::GPTConfig tiny_gpt() {
  models::GPTConfig c;
  c.layers = 2;
  c.heads = 2;
  c.width = 12;
  c.vocab = 29;
  c.padded_vocab = 31;
  c.context = 9;
  return c;
}

nn::ModulePtr build(const std::string& kind) {
  manual_seed(1234);
  nn::ModulePtr m;
  if (kind == "mlp") m = std::make_shared<Tangle>();
  else if (kind == "gpt") m = std::make_shared<models::GPT>(tiny_gpt());
  else throw ValueError("unknown model " + kind);
  m->to(kFloat64);
  return m;
}

// This rank's batch of step s (each rank its own rows, as DDP's sampler).
std::pair<Tensor, Tensor> batch(const std::string& kind, int rank, int step, int micro) {
  manual_seed(1000 + 97 * static_cast<uint64_t>(step) + 13 * static_cast<uint64_t>(rank) + micro);
  if (kind == "gpt") {
    Tensor ids = randint(0, 29, {3, 9});
    Tensor tg = randint(0, 29, {3, 9});
    return {ids, tg};
  }
  return {randn({5, 13}, {kFloat64}), randn({5, 3}, {kFloat64})};
}

Tensor loss_of(const std::string& kind, nn::Module& net, nn::Module& model, const Tensor& x, const Tensor& y) {
  if (kind == "gpt") return static_cast<models::GPT&>(model).loss_of_logits(net.forward(x), y);
  Tensor d = net.forward(x) - y;
  return (d * d).mean();
}

std::vector<double> decays(const std::vector<Tensor>& ps) {
  std::vector<double> out;
  for (const Tensor& p : ps) out.push_back(p.dim() >= 2 ? 0.1 : 0.0);
  return out;
}

void match(const dist::ProcessGroupPtr& pg, const std::string& kind, int stage, bool micro, bool synced) {
  const int rank = pg->rank();
  nn::ModulePtr ref_model = build(kind), sh_model = build(kind);
  // Ranks other than 0 start the sharded copy from other weights (frozen
  // ones too): the wrapper must take rank 0's.
  if (rank > 0) {
    NoGradGuard no_grad;
    manual_seed(77 + static_cast<uint64_t>(rank));
    for (Tensor p : sh_model->parameters()) ops::copy_(p, randn(p.sizes(), {kFloat64}));
  }
  dist::ShardOptions so;
  so.stage = stage;
  if (const char* b = std::getenv("PROBE_BUCKET_BYTES")) so.bucket_bytes = std::atoll(b);
  if (const char* r = std::getenv("PROBE_RESHARD")) so.reshard_after_forward = std::atoi(r) != 0;
  // PROBE_REDUCE=bf16: the reduce-scatter in bfloat16, against exact DDP.
  const bool bf16 = std::getenv("PROBE_REDUCE") && std::string(std::getenv("PROBE_REDUCE")) == "bf16";
  if (bf16) so.reduce_dtype = kBFloat16;
  // PROBE_UNITS=named (gpt): the blocks named as units, sharded from
  // construction (the trainer's way) instead of found in the first step.
  const bool named = std::getenv("PROBE_UNITS") && std::string(std::getenv("PROBE_UNITS")) == "named";
  if (named) {
    if (auto gpt = std::dynamic_pointer_cast<models::GPT>(sh_model)) {
      so.units = gpt->blocks();
    } else {
      // Stages 1-2 (Note [Gathers beside the forward]): every layer a unit --
      // fc2 and fc3 share a weight (the root's), aux runs on some steps and
      // ranks only, never not at all (their gathers end with the forward).
      expect(stage < 3, "PROBE_UNITS=named with the mlp is for stages 1-2 (stage 3 units must all run)");
      auto& t = static_cast<Tangle&>(*sh_model);
      so.units = {t.fc1, t.fc2, t.fc3, t.head, t.aux, t.never};
    }
  }
  // PROBE_PARAM_DTYPE=float32 (gpt): the parameters held in float32 while
  // gathered (ShardOptions::param_dtype) over float64 masters: the forward
  // and backward in float32, against float64 DDP.
  const bool low = std::getenv("PROBE_PARAM_DTYPE") && std::string(std::getenv("PROBE_PARAM_DTYPE")) == "float32";
  if (low) {
    expect(kind == "gpt", "PROBE_PARAM_DTYPE=float32 needs the gpt model (its only input is token ids)");
    so.param_dtype = kFloat32;
  }
  const double tol = bf16 ? 2e-2 : low ? 1e-5 : 1e-12;
  // Weights after 5 AdamW steps from float32 gradients: Adam's normalised
  // steps carry the gradients' relative rounding (1e-7) into every weight.
  const double tol_w = low ? 1e-4 : tol;
  auto ddp = std::make_shared<dist::DistributedDataParallel>(ref_model, pg);
  auto sdp = std::make_shared<dist::ShardedDataParallel>(sh_model, pg, so);
  if (low) {
    // Held in float32 now; the optimizer's pieces stay float64.
    for (const auto& [name, p] : sh_model->named_parameters())
      expect(p.dtype() == kFloat32, "param_dtype float32: '" + name + "' is " + dtype_name(p.dtype()));
    for (const Tensor& t : sdp->shard_parameters())
      expect(t.dtype() == kFloat64, "param_dtype float32: a master piece is " + std::string(dtype_name(t.dtype())));
  }
  if (named && stage == 3) {
    // Named units are sharded at once: only the root unit (embeddings, final
    // norm, the last bucket) is gathered before the first step, never the
    // blocks.
    const auto held = sdp->held_bytes();
    const auto& plan = sdp->buckets();
    const int64_t root = plan.padded_numel(plan.size() - 1, 0, pg->size()) *
                         static_cast<int64_t>(dtype_size(plan.buckets.back().layout.dtypes[0]));
    // The last block's bucket first: the backward finishes it first.
    const std::vector<std::string> order = sdp->unit_names();
    expect(order == std::vector<std::string>{"transformer.h.1", "transformer.h.0", ""},
           "named units: bucket order " + (order.size() == 3 ? order[0] + ", " + order[1] + ", " + order[2] : "?") +
           ", expected transformer.h.1, transformer.h.0, the root");
    expect(plan.size() == 3 && held.full_weights == root, "named units: " + std::to_string(held.full_weights) +
           " bytes gathered at construction, expected the root unit's " + std::to_string(root) + " only");
  }

  std::vector<Tensor> ref_params;
  for (const Tensor& p : ref_model->parameters())
    if (p.requires_grad()) ref_params.push_back(p);
  optim::AdamWOptions ao;
  ao.lr = 3e-2;
  // The GPT's key bias has a gradient of zero in exact arithmetic (softmax
  // does not see a shift of a row's scores): Adam would turn its float64
  // rounding noise into full steps of either sign, so eps keeps it small.
  ao.eps = kind == "gpt" ? 1e-6 : 1e-8;
  ao.param_weight_decay = decays(ref_params);
  optim::AdamW ref_opt(ref_params, ao);
  // The pieces' decay follows the parameter each is a piece of.
  std::vector<double> piece_decay;
  for (const auto& pc : sdp->pieces()) piece_decay.push_back(pc.shape.size() >= 2 ? 0.1 : 0.0);
  ao.param_weight_decay = piece_decay;
  optim::AdamW sh_opt(sdp->shard_parameters(), ao);

  double worst_loss = 0;
  for (int step = 0; step < 5; ++step) {
    const bool aux = kind == "mlp" && (step % 2 == 1) && (rank % 2 == 0);
    if (kind == "mlp") {
      static_cast<Tangle&>(*ref_model).use_aux = aux;
      static_cast<Tangle&>(*sh_model).use_aux = aux;
    }
    double l_ref = 0, l_sh = 0;
    const int n_micro = micro || synced ? 2 : 1;
    ref_opt.zero_grad();
    sh_opt.zero_grad();
    for (int m = 0; m < n_micro; ++m) {
      auto [x, y] = batch(kind, rank, step, m);
      const bool defer = micro && m + 1 < n_micro;
      {
        std::optional<dist::DistributedDataParallel::NoSync> q;
        if (defer) q.emplace(ddp->no_sync());
        Tensor l = loss_of(kind, *ddp, *ref_model, x, y).mul(1.0 / n_micro);
        l.backward();
        l_ref += l.item();
      }
      {
        std::optional<dist::ShardedDataParallel::NoSync> q;
        if (defer) q.emplace(sdp->no_sync());
        Tensor l = loss_of(kind, *sdp, *sh_model, x, y).mul(1.0 / n_micro);
        l.backward();
        l_sh += l.item();
      }
    }
    // Note [Sharded gradient shards]: after the backward the pieces'
    // gradients hold the shards -- at stage 1 inside the full buffers (their
    // own segments, reduced in place; float64 shards of float32 buffers over
    // the other ranks' segments where two of those lie beside this rank's),
    // otherwise tensors of their own.
    bool any_grad = false;
    for (const Tensor& t : sdp->shard_parameters()) any_grad = any_grad || t.grad().defined();
    const int64_t after_backward = sdp->held_bytes().shard_grads;
    const int world = pg->size();
    if (stage == 1 && !bf16 && (!low || rank >= 2 || rank <= world - 3))
      expect(after_backward == 0, "stage 1 holds " + std::to_string(after_backward) +
                                      " bytes of gradient shards beside its full buffers");
    else if (any_grad)
      expect(after_backward > 0, "stage " + std::to_string(stage) + ": no gradient shard held after the backward");
    const double n_ref = optim::clip_grad_norm_(ref_params, 0.5).item();
    ref_opt.step();
    // Odd steps as chorus train steps: the scale folded into AdamW's update
    // (clip_grad_norm_scale, step_scaled); even steps clipped in place.
    double n_sh = 0;
    if (step % 2) {
      ops::NormAndScale c = sdp->clip_grad_norm_scale(0.5);
      n_sh = c.norm.item();
      sh_opt.step_scaled(c.scale);
    } else {
      n_sh = sdp->clip_grad_norm(0.5).item();
      sh_opt.step();
    }
    // As the trainers do: the gradients go after the step, and with them the
    // shards -- nothing of them lives into the next forward.
    sh_opt.zero_grad();
    // Between steps only shards are held: stage 3 no gathered weight, stages
    // 2-3 no full-size gradient buffer, no stage a gradient shard.
    const auto held = sdp->held_bytes();
    expect(held.shard_grads == 0, "stage " + std::to_string(stage) + " holds " + std::to_string(held.shard_grads) +
                                      " bytes of gradient shards between steps");
    if (stage == 1)
      expect(held.full_grads > 0, "stage 1 holds no full gradient buffer between steps (they persist)");
    if (stage == 3) expect(held.full_weights == 0, "stage 3 holds " + std::to_string(held.full_weights) +
                                                     " bytes of gathered weights between steps");
    if (stage >= 2) expect(held.full_grads == 0, "stage " + std::to_string(stage) + " holds " +
                                                   std::to_string(held.full_grads) + " bytes of full gradients");
    // ... and during the backward about two buckets' full-size gradients at
    // once (the one reduce-scattered and the one before), never all of them.
    if (stage >= 2)
      expect(held.peak_full_grads <= 2 * held.largest_bucket_grads,
             "stage " + std::to_string(stage) + " held " + std::to_string(held.peak_full_grads) +
                 " bytes of full gradients at once, more than two buckets' " +
                 std::to_string(2 * held.largest_bucket_grads));
    const double e = std::abs(l_ref - l_sh) / std::max(std::abs(l_ref), 1e-30);
    worst_loss = std::max(worst_loss, e);
    expect(e <= tol, "step " + std::to_string(step) + ": loss " + sci(l_sh) + " vs DDP " + sci(l_ref));
    expect(std::abs(n_ref - n_sh) <= tol * std::max(1.0, n_ref),
           "step " + std::to_string(step) + ": gradient norm " + std::to_string(n_sh) + " vs DDP " +
               std::to_string(n_ref));
  }
  // The masters, whole (full_parameters()); in one dtype they must equal the
  // gathered weights exactly.
  const NamedTensors masters = sdp->full_parameters();
  sdp->gather_parameters();
  double worst_w = 0;
  const NamedTensors ref_state = ref_model->named_parameters();
  // Module order: the trainable ones from the masters, the frozen as held.
  NamedTensors sh_state;
  size_t m = 0;
  for (const auto& [name, p] : sh_model->named_parameters()) {
    if (p.requires_grad() && m < masters.size()) {
      const auto& [mname, mt] = masters[m++];
      expect(mname == name, "full_parameters() names '" + mname + "' where the module has '" + name + "'");
      if (!low) expect(rel_err(p, mt) == 0, "full_parameters() '" + name + "' differs from the gathered weight");
      sh_state.emplace_back(mname, mt);
    } else {
      sh_state.emplace_back(name, p);
    }
  }
  expect(ref_state.size() == sh_state.size(), "parameter count differs");
  for (size_t i = 0; i < std::min(ref_state.size(), sh_state.size()); ++i) {
    expect(ref_state[i].first == sh_state[i].first, "names differ: " + ref_state[i].first + " vs " + sh_state[i].first);
    const double e = rel_err(sh_state[i].second, ref_state[i].second);
    worst_w = std::max(worst_w, e);
    expect(e <= tol_w, "weight " + sh_state[i].first + " differs from DDP's by " + sci(e) + " relative");
  }
  if (bf16) expect(worst_w > 1e-9, "the bfloat16 reduction left the weights equal to float64 DDP's: was it applied?");
  size_t elems = 0;
  for (const Tensor& t : sdp->shard_parameters()) elems += static_cast<size_t>(t.numel());
  if (failures == 0)
    std::printf("rank %d: ok %s stage %d%s: 5 AdamW steps, losses %.1e and weights %.1e relative from DDP; "
                "%zu buckets, %zu pieces (%zu elements) here\n",
                rank, kind.c_str(), stage, micro ? " (no_sync micro-steps)" : synced ? " (synced micro-steps)" : "",
                worst_loss, worst_w,
                sdp->buckets().size(), sdp->shard_parameters().size(), elems);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "match";
  const std::string model = argc > 2 ? argv[2] : "mlp";
  const int stage = argc > 3 ? std::atoi(argv[3]) : 1;
  const bool micro = argc > 4 && std::string(argv[4]) == "micro";
  const bool synced = argc > 4 && std::string(argv[4]) == "synced";
  int rank = -1;
  try {
    dist::InitOptions o;
    if (const char* t = std::getenv("PROBE_TIMEOUT_MS")) o.timeout = std::chrono::milliseconds(std::atoi(t));
    auto pg = dist::init_process_group(o);
    rank = pg->rank();
    if (mode == "match") match(pg, model, stage, micro, synced);
    else {
      std::fprintf(stderr, "unknown mode %s\n", mode.c_str());
      return 2;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "FAIL: rank %d: %s\n", rank, e.what());
    return 1;
  }
  return failures == 0 ? 0 : 1;
}
