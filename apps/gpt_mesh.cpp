#include "gpt_mesh.h"

#include <algorithm>
#include <cstdio>

#include "chorus/core/error.h"
#include "chorus/core/rng.h"
#include "chorus/distributed/hash_store.h"
#include "chorus/distributed/launch_env.h"
#include "chorus/parallel/pipeline_schedule.h"
#include "chorus/tensor_parallel/clip_grad.h"
#include "chorus/models/gpt_pipeline.h"
#include "chorus/parallel/placement.h"
#include "chorus/tensor_parallel/gpt_layers.h"

namespace chorus::app {

namespace {

// The job's ranks: the launcher's, or a world of one when the mesh has one
// rank and no launcher started this process.
RankContext join_mesh_job(int mesh_ranks, const Device& device, double timeout_s) {
  std::optional<dist::LaunchEnv> env = dist::read_launch_env();
  const int world = env ? env->world_size : 1;
  CHORUS_CHECK(world == mesh_ranks, "--mesh needs ", mesh_ranks, " processes, but the job has ", world,
               " (the axis sizes must multiply to the world size; start it with chorus launch --nproc-per-node ",
               mesh_ranks, " -- chorus ...)");
  if (env) return join_job(*env, device, timeout_s);
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  dist::ProcessGroupOptions o;
  o.timeout = timeout;
  return {dist::LaunchEnv{}, dist::make_process_group(device.is_cuda() ? "nccl" : "gloo", 0, 1,
                                                      std::make_shared<dist::HashStore>(timeout), o)};
}

}  // namespace

std::vector<dist::MeshAxis> check_mesh_gpt(const MeshSettings& s, const models::GPTConfig& cfg, int64_t seq) {
  const auto axes = dist::parse_mesh_spec(s.spec);
  const int tp = mesh_axis_size(axes, "tp"), pp = mesh_axis_size(axes, "pp");
  const int64_t layers = cfg.layers + 2;  // Note [GPT pipelines over the mesh]: embeddings, blocks, head
  CHORUS_CHECK(pp <= layers, "--mesh pp=", pp, ": ", cfg.layers, " blocks make ", layers,
               " pipeline layers (embeddings, blocks, head), fewer than the stages");
  CHORUS_CHECK(!s.sequence_parallel || tp > 1, "--sequence-parallel needs --mesh with tp > 1");
  CHORUS_CHECK(s.tp_chunks >= 1, "--tp-chunks must be at least 1, got ", s.tp_chunks);
  CHORUS_CHECK(s.tp_chunks == 1 || s.sequence_parallel, "--tp-chunks ", s.tp_chunks,
               " chunks the collectives of sequence parallelism: it needs --sequence-parallel");
  tp::check_gpt_tp(cfg, tp);
  CHORUS_CHECK(!s.sequence_parallel || seq % tp == 0, "--sequence-parallel: --seq-len ", seq,
               " does not divide over tp=", tp);
  return axes;
}

int mesh_axis_size(const std::vector<dist::MeshAxis>& axes, const std::string& name) {
  for (const auto& a : axes)
    if (a.name == name) return a.size;
  return 1;
}

void check_mesh_pipeline(const std::vector<dist::MeshAxis>& axes, const models::GPTConfig& cfg,
                         const MeshPipeSettings& p, int64_t batch) {
  const int pp = mesh_axis_size(axes, "pp");
  const parallel::Schedule sched = parallel::parse_schedule(p.schedule);
  CHORUS_CHECK(p.virtual_stages == 1 || sched == parallel::Schedule::Interleaved, "--virtual-stages ",
               p.virtual_stages, " goes with --schedule interleaved, not ", p.schedule);
  CHORUS_CHECK(p.virtual_stages >= 1, "--virtual-stages must be at least 1, got ", p.virtual_stages);
  const int64_t stages = p.stages(pp);
  CHORUS_CHECK(stages <= cfg.layers + 2, "--mesh pp=", pp, " x --virtual-stages ", p.virtual_stages, " makes ", stages,
               " pipeline stages, but ", cfg.layers, " blocks make only ", cfg.layers + 2,
               " pipeline layers (embeddings, blocks, head)");
  // The interleaved order needs no multiple of pp (Megatron-LM's does): with
  // others its warm-up is longer (Note [Schedules never deadlock]).
  CHORUS_CHECK(p.micro_batches >= pp, "--micro-batches ", p.micro_batches, " is fewer than the ", pp,
               " pipeline stages of --mesh pp=", pp, " (some stage would always idle): use at least ", pp);
  CHORUS_CHECK(p.micro_batches <= batch, "--micro-batches ", p.micro_batches, " is more than the batch of ", batch,
               " sequences");
  CHORUS_CHECK(batch % p.micro_batches == 0, "--batch-size ", batch, " does not divide into ", p.micro_batches,
               " micro-batches of equal size (--micro-batches)");
  if (!p.balance.empty()) {
    int64_t total = 0;
    for (int64_t b : p.balance) total += b;
    const std::string what = p.virtual_stages > 1 ? " with --virtual-stages " + std::to_string(p.virtual_stages) : "";
    CHORUS_CHECK(static_cast<int64_t>(p.balance.size()) == stages && total == cfg.layers + 2, "--balance gives ",
                 p.balance.size(), " stages of ", total, " layers; --mesh pp=", pp, what, " needs ", stages,
                 " counts adding up to ", cfg.layers + 2, " (the embeddings, ", cfg.layers, " blocks and the head)");
  }
}

MeshPipeline start_mesh_pipeline(MeshGpt& m, const MeshPipeSettings& p, int64_t seq) {
  MeshPipeline mp;
  parallel::PipelineOptions o;
  o.micro_batches = p.micro_batches;
  o.schedule = parallel::parse_schedule(p.schedule);
  o.virtual_stages = p.virtual_stages;
  o.stage_group = m.mesh->group("pp");
  o.keep_output = false;  // the loss is all the drivers read: no batch of logits kept and joined each step
  auto layers = tp::pipeline_layers(*m.model);
  // Note [Pipeline stages by cost] in models/gpt_pipeline.h: without
  // --balance the stages even out the layers' work, not their count.
  const std::vector<int64_t> balance =
      p.balance.empty() ? parallel::balance_ranks(models::pipeline_layer_costs(m.model->config(), seq), m.pp(), p.virtual_stages) : p.balance;
  mp.pipe = std::make_shared<parallel::Pipeline>(layers, balance, std::vector<Device>{m.device}, o);
  // After the pipeline moved this rank's stage: the tensors as they are now.
  const auto all = tp::sharded_parameters(*m.model);
  mp.owner.assign(all.size(), -1);
  int64_t first = 0;
  for (int64_t s = 0; s < mp.pipe->num_stages(); ++s) {
    const int64_t n = mp.pipe->balance()[static_cast<size_t>(s)];
    for (int64_t l = first; l < first + n; ++l)
      for (const Tensor& t : (*layers)[static_cast<size_t>(l)]->parameters())
        for (size_t i = 0; i < all.size(); ++i)
          if (mp.owner[i] < 0 && all[i].tensor.is_same(t)) mp.owner[i] = static_cast<int>(s % m.pp());
    first += n;
  }
  const int me = m.pp_rank();
  const Tensor& wte = tp::tied_embedding(*m.model);
  const std::vector<Tensor> local = mp.pipe->local_parameters();
  for (size_t i = 0; i < all.size(); ++i) {
    CHORUS_CHECK(mp.owner[i] >= 0, "--mesh pp: parameter ", all[i].name, " is in no pipeline stage");
    const bool here =
        std::any_of(local.begin(), local.end(), [&](const Tensor& t) { return t.is_same(all[i].tensor); });
    if (here) mp.local.push_back(all[i]);
    if (here && all[i].tensor.is_same(wte)) mp.uses_wte = true;
  }
  if (me > 0 && mp.uses_wte) mp.counted_elsewhere = {wte};
  mp.last_stage = me == m.pp() - 1;
  return mp;
}

void reduce_pipeline_gradients(MeshGpt& m, MeshPipeline& mp) {
  std::vector<Tensor> mine;
  for (const auto& p : mp.local) mine.push_back(p.tensor);
  if (m.dp() > 1) tp::average_gradients(mine, m.mesh->group("dp"));
  tp::sync_tied_embedding(*m.model, mp.uses_wte, m.mesh->group("pp"));
}

Tensor clip_mesh_gradients(MeshGpt& m, const MeshPipeline* mp, const std::vector<tp::ShardedParameter>& all,
                           double max_norm) {
  if (!mp) return tp::clip_grad_norm_(all, max_norm, m.ctx.group);
  return tp::clip_grad_norm_(mp->local, max_norm, m.ctx.group, m.mesh->group("pp"), mp->counted_elsewhere);
}

MeshGpt start_mesh_gpt(const MeshSettings& s, const models::GPTConfig& cfg, int64_t seq) {
  const auto axes = check_mesh_gpt(s, cfg, seq);
  int ranks = 1;
  for (const auto& a : axes) ranks *= a.size;
  MeshGpt m;
  std::optional<dist::LaunchEnv> env = dist::read_launch_env();
  std::vector<Device> devs = ddp_devices(s.devices, env ? *env : dist::LaunchEnv{});
  CHORUS_CHECK(devs.size() == 1, "--mesh takes one device per process, got --devices ", s.devices);
  m.device = devs[0];
  m.rc = join_mesh_job(ranks, m.device, s.timeout_s);
  dist::MeshOptions mo;
  mo.local_world_size = m.rc.env.local_world_size;
  mo.allow_tp_across_nodes = s.allow_tp_across_nodes;
  m.mesh = std::make_unique<dist::DeviceMesh>(m.rc.group, axes, mo);  // Note [Mesh rank order]
  if (m.rc.leader() && !s.quiet) std::fprintf(stderr, "%s\n", m.mesh->describe().c_str());
  m.ctx.group = m.mesh->group("tp");
  m.ctx.sequence_parallel = s.sequence_parallel;
  m.ctx.chunks = s.tp_chunks;
  m.ctx.sharded_rng = std::make_shared<Generator>();
  manual_seed(s.seed);  // the tp=1 initialisation of the seed, sliced
  m.model = std::make_shared<tp::TensorParallelGPT>(cfg, m.ctx);
  if (m.pp() == 1) m.model->to(m.device);  // else start_mesh_pipeline moves this rank's stage
  tp::seed_parallel_rng(m.ctx, s.seed, m.dp_rank());  // Note [Dropout across the mesh]
  return m;
}

}  // namespace chorus::app
