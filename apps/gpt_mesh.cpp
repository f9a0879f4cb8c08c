#include "gpt_mesh.h"

#include <cstdio>

#include "chorus/core/error.h"
#include "chorus/core/rng.h"
#include "chorus/dist/hash_store.h"
#include "chorus/dist/launch_env.h"

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
  int tp = 1;
  for (const auto& a : axes) {
    CHORUS_CHECK(a.name != "pp" || a.size == 1, "--mesh pp=", a.size,
                 ": pipeline stages are not available with tensor parallelism for GPT models yet (use dp and tp)");
    if (a.name == "tp") tp = a.size;
  }
  CHORUS_CHECK(!s.sequence_parallel || tp > 1, "--sequence-parallel needs --mesh with tp > 1");
  tp::check_gpt_tp(cfg, tp);
  CHORUS_CHECK(!s.sequence_parallel || seq % tp == 0, "--sequence-parallel: --seq-len ", seq,
               " does not divide over tp=", tp);
  return axes;
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
  m.ctx.sharded_rng = std::make_shared<Generator>();
  manual_seed(s.seed);  // the tp=1 initialisation of the seed, sliced
  m.model = std::make_shared<tp::TensorParallelGPT>(cfg, m.ctx);
  m.model->to(m.device);
  tp::seed_parallel_rng(m.ctx, s.seed, m.dp_rank());  // Note [Dropout across the mesh]
  return m;
}

}  // namespace chorus::app
