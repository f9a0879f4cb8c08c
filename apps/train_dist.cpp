#include "train_dist.h"

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "chorus/core/backend.h"
#include "chorus/core/error.h"
#include "chorus/distributed/init.h"
#include "chorus/ops/copy.h"
#include "chorus/ops/factory.h"

namespace chorus::app {

dist::LaunchEnv ddp_launch_env(const std::string& strategy, const std::string& command) {
  std::optional<dist::LaunchEnv> env = dist::read_launch_env();
  CHORUS_CHECK(env.has_value(), "--strategy ", strategy,
               " runs one process per device, started by a launcher, and none set this process up "
               "(no RANK/WORLD_SIZE, OMPI_COMM_WORLD_* or SLURM_* variables): run "
               "'chorus launch --nproc-per-node N -- chorus ", command, " --strategy ", strategy,
               " ...' (or torchrun, mpirun, srun)");
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

void RankTimes::arrive() {
  // Seconds of the system clock (the same on every rank of a machine) less
  // a constant, so that sums of many keep sub-microsecond precision.
  constexpr double kClockBase = 1.7e9;
  arrivals_s_ += std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count() - kClockBase;
}

std::string RankTimes::report(const RankContext& rc, int64_t step, double wait_s) {
  const int world = rc.group->size();
  const double n = static_cast<double>(std::max<int64_t>(steps_, 1));
  constexpr size_t kFields = 4;
  std::vector<double> mine(kFields * static_cast<size_t>(world), 0.0);
  const size_t r = static_cast<size_t>(rc.env.rank);
  mine[kFields * r] = 1000.0 * std::max(0.0, step_s_ - (wait_s - wait_at_start_)) / n;  // busy ms per step
  mine[kFields * r + 1] = 1000.0 * data_s_ / n;
  mine[kFields * r + 2] = steps_ > 0 ? 1.0 : 0.0;
  mine[kFields * r + 3] = arrivals_s_;
  const std::vector<double> all = sum_over_ranks(rc, mine);
  *this = RankTimes();
  wait_at_start_ = wait_s;
  if (!rc.leader()) return "";
  std::vector<double> busy, data;
  double earliest = all[3];
  for (int k = 0; k < world; ++k) earliest = std::min(earliest, all[kFields * k + 3]);
  for (int k = 0; k < world; ++k) {
    if (all[kFields * k + 2] == 0) return "";  // a rank timed no step in this period
    // Note [Late arrivals]: its lateness behind the earliest rank, per step.
    busy.push_back(all[kFields * k] + 1000.0 * (all[kFields * k + 3] - earliest) / n);
    data.push_back(all[kFields * k + 1]);
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    const size_t m = v.size() / 2;
    return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
  };
  // The medians are over the other ranks: with two ranks, the slow one's
  // excess over the other (a median over both would halve it).
  const size_t slow = static_cast<size_t>(std::max_element(busy.begin(), busy.end()) - busy.begin());
  std::vector<double> compute(busy.size());
  for (size_t k = 0; k < busy.size(); ++k) compute[k] = busy[k] - data[k];
  auto others = [slow](const std::vector<double>& v) {
    std::vector<double> o;
    for (size_t k = 0; k < v.size(); ++k)
      if (k != slow) o.push_back(v[k]);
    return o;
  };
  const double med_busy = median(others(busy)), med_data = median(others(data)), med_compute = median(others(compute));
  const char* why = data[slow] - med_data > compute[slow] - med_compute ? "data loading" : "compute";
  char line[200];
  std::snprintf(line, sizeof line, "step %lld: %.1f ms median, slowest rank %zu at %.1f ms (%+.0f%%, %s)",
                static_cast<long long>(step), med_busy, slow, busy[slow],
                med_busy > 0 ? 100.0 * (busy[slow] - med_busy) / med_busy : 0.0, why);
  return line;
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

}  // namespace chorus::app
