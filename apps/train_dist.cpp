#include "train_dist.h"

#include "chorus/core/backend.h"
#include "chorus/core/error.h"
#include "chorus/dist/init.h"
#include "chorus/ops/copy.h"
#include "chorus/ops/factory.h"

namespace chorus::app {

dist::LaunchEnv ddp_launch_env() {
  std::optional<dist::LaunchEnv> env = dist::read_launch_env();
  CHORUS_CHECK(env.has_value(),
               "--strategy ddp runs one process per device, started by a launcher, and none set this process up "
               "(no RANK/WORLD_SIZE, OMPI_COMM_WORLD_* or SLURM_* variables): run "
               "'chorus launch --nproc-per-node N -- chorus train --strategy ddp ...' (or torchrun, mpirun, srun)");
  return *env;
}

std::vector<Device> ddp_devices(const std::string& devices, const dist::LaunchEnv& env) {
  const bool gpus = cuda_is_available();
  if (devices == "cuda" || (devices.empty() && gpus)) {
    const int n = cuda_device_count();
    CHORUS_CHECK(n > 0, "--devices cuda: this machine has no GPU (use --devices cpu)");
    CHORUS_CHECK(env.local_rank < n, "rank ", env.rank, " (local rank ", env.local_rank, ") has no GPU of its own: this machine has ",
                 n, " GPU", n == 1 ? "" : "s", " and ", env.local_world_size, " processes were started on it (start at most ",
                 n, " per machine: chorus launch --nproc-per-node ", n, ")");
    return {cuda_device(env.local_rank)};
  }
  if (devices == "cpu" || devices.empty()) return {cpu_device(0)};
  return parse_devices(devices);
}

RankContext join_job(const dist::LaunchEnv& env, const Device& device, double timeout_s) {
  dist::InitOptions o;
  o.backend = device.is_cuda() ? "nccl" : "gloo";
  o.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  if (device.is_cuda()) set_device(device);
  return {env, dist::init_process_group(env, o)};
}

std::vector<double> sum_over_ranks(const RankContext& rc, const std::vector<double>& values) {
  if (rc.group->size() == 1) return values;
  Tensor t = ops::to_device(from_vector(values, {static_cast<int64_t>(values.size())}, {kFloat64}), rc.group->device());
  rc.group->all_reduce(t, dist::ReduceOp::Sum)->wait();
  return t.to_vector<double>();
}

std::string agree_on_checkpoint(const RankContext& rc, const std::optional<std::string>& leader_choice) {
  const std::string key = "chorus/train/resume_from";
  if (rc.leader()) rc.group->store()->set(key, std::string("=") + leader_choice.value_or(""));
  // The leading '=' keeps "no checkpoint" a non-empty value.
  const std::string v = rc.group->store()->get_string(key);
  return v.substr(1);
}

void rescale_position(io::TrainingState& st, int64_t global_batch, int64_t per_epoch) {
  auto it = st.extra.find("global_batch");
  if (it == st.extra.end() || !it->is_number_integer()) return;
  const int64_t saved = it->get<int64_t>();
  if (saved <= 0 || saved == global_batch) return;
  const int64_t seen = st.batch_in_epoch * saved;
  st.batch_in_epoch = std::min(seen / global_batch, per_epoch);
  st.step = st.epoch * per_epoch + st.batch_in_epoch;
  st.extra["global_batch"] = global_batch;
}

}  // namespace chorus::app
