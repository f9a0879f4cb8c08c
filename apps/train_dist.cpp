#include "train_dist.h"

#include <algorithm>

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

namespace {
// "--lr" for "lr"; the fingerprint's own fields in words.
std::string option_name(const std::string& key) {
  if (key == "devices_per_rank") return "the number of --devices";
  if (key == "train_data" || key == "test_data") return "the data set (" + key.substr(0, key.find('_')) + " split: size and checksum of its first and last examples)";
  std::string o = "--" + key;
  std::replace(o.begin(), o.end(), '_', '-');
  return o;
}
}  // namespace

void check_same_options(const RankContext& rc, const nlohmann::json& mine) {
  const int n = rc.group->size();
  if (n == 1) return;
  const dist::StorePtr& store = rc.group->store();
  const std::string base = "chorus/train/options/";
  store->set(base + std::to_string(rc.env.rank), mine.dump());
  const std::string verdict_key = base + "verdict";
  if (rc.leader()) {
    std::string verdict = "=";  // '=' and nothing after: every rank agrees
    for (int r = 1; r < n && verdict.size() == 1; ++r) {
      nlohmann::json theirs = nlohmann::json::parse(store->get_string(base + std::to_string(r)), nullptr, false);
      std::vector<std::string> keys;
      for (const auto& item : mine.items()) keys.push_back(item.key());
      for (const auto& item : theirs.items())
        if (!mine.contains(item.key())) keys.push_back(item.key());
      for (const std::string& k : keys) {
        const nlohmann::json a = mine.value(k, nlohmann::json()), b = theirs.is_object() ? theirs.value(k, nlohmann::json()) : nlohmann::json();
        if (a == b) continue;
        verdict = detail::str_cat("=rank ", r, " was given ", option_name(k), " ", b.dump(), " but rank 0 ", a.dump(),
                                  ": every rank of a job must train with the same options (ranks that differ drift "
                                  "apart); start them all with one command line");
        break;
      }
    }
    store->set(verdict_key, verdict);
  }
  const std::string verdict = store->get_string(verdict_key);
  CHORUS_CHECK(verdict.size() <= 1, verdict.substr(1));
}

bool StopAgreement::stop_after(int64_t step, bool signalled) {
  if (stop_at_ < 0) {
    const dist::StorePtr& store = rc_.group->store();
    const std::string key = "chorus/train/stop_at";
    std::string value;
    if (signalled && !proposed_) {
      proposed_ = true;
      const std::string mine = std::to_string(step + 2);
      const dist::Bytes got = store->compare_set(key, {}, dist::Bytes(mine.begin(), mine.end()));
      value.assign(got.begin(), got.end());
    } else if (store->check({key})) {
      value = store->get_string(key);
    }
    if (!value.empty()) stop_at_ = std::stoll(value);
  }
  return stop_at_ >= 0 && step >= stop_at_;
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
