#include "run_log.h"

#include <ctime>
#include <filesystem>

#include "plot.h"
#include "train_dist.h"

namespace chorus::app {

namespace {

using ojson = nlohmann::ordered_json;

void add_if_number(std::vector<std::pair<std::string, double>>& out, const ojson& record, const char* key,
                   const std::string& tag) {
  auto it = record.find(key);
  if (it != record.end() && it->is_number()) out.emplace_back(tag, it->get<double>());
}

}  // namespace

std::vector<std::pair<std::string, double>> tensorboard_scalars(const ojson& record, const std::string& kind) {
  std::vector<std::pair<std::string, double>> out;
  if (kind == "step") {
    add_if_number(out, record, "loss", "train/loss");
    add_if_number(out, record, "accuracy", "train/accuracy");
    add_if_number(out, record, "lr", "train/lr");
    add_if_number(out, record, "img_per_s", "train/img_per_s");
    add_if_number(out, record, "step_ms", "train/step_ms");
    add_if_number(out, record, "grad_norm", "train/grad_norm");
    add_if_number(out, record, "peak_mem_bytes", "memory/peak_bytes");
    // Language models (apps/train_gpt_loop.cpp): throughput in tokens, MFU, and the
    // validation loss of the windows that validate.
    add_if_number(out, record, "ppl", "train/ppl");
    add_if_number(out, record, "tok_per_s", "train/tok_per_s");
    add_if_number(out, record, "mfu", "train/mfu");
    add_if_number(out, record, "val_loss", "val/loss");
  } else {
    add_if_number(out, record, "test_loss", "val/loss");
    add_if_number(out, record, "test_accuracy", "val/accuracy");
    add_if_number(out, record, "mem_in_use_bytes", "memory/in_use_bytes");
    auto per = record.find("peak_mem_bytes_per_device");
    if (per != record.end() && per->is_object())
      for (auto it = per->begin(); it != per->end(); ++it)
        if (it.value().is_number()) out.emplace_back("memory/peak_bytes/" + it.key(), it.value().get<double>());
  }
  return out;
}

std::optional<std::string> tensorboard_run_dir(const std::optional<std::string>& root, const std::string& model,
                                               const std::string& strategy, const RankContext* ranks,
                                               bool all_ranks) {
  if (!root) return std::nullopt;  // also on ranks other than 0 without --tensorboard-all-ranks
  all_ranks = ranks && all_ranks;
  double now = static_cast<double>(std::time(nullptr));
  if (all_ranks) now = sum_over_ranks(*ranks, {ranks->leader() ? now : 0.0})[0];
  const std::time_t when = static_cast<std::time_t>(now);
  std::tm tm{};
  gmtime_r(&when, &tm);
  char stamp[32];
  std::strftime(stamp, sizeof(stamp), "%Y%m%d-%H%M%S", &tm);
  std::string dir = *root + "/" + stamp + "-" + model + "-" + strategy;
  if (all_ranks) dir += "/rank" + std::to_string(ranks->env.rank);
  return dir;
}

RunLog::RunLog(RunLogOptions o) : opts_(std::move(o)) {
  if (opts_.metrics) metrics_ = std::make_unique<io::MetricsWriter>(*opts_.metrics, opts_.append);
  if (opts_.tensorboard) tensorboard_ = std::make_unique<io::TensorBoardWriter>(*opts_.tensorboard);
  // Drawn at once (empty panels, or a resumed run's curves so far): a bad
  // --plot path fails before any training.
  if (opts_.plot) refresh_plot();
}

void RunLog::step(const ojson& record) {
  if (metrics_) metrics_->write(record);
  if (tensorboard_) tensorboard_->add_scalars(record.value("step", int64_t{0}), tensorboard_scalars(record, "step"));
  if (opts_.plot) history_.push_back(record);
}

void RunLog::epoch(const ojson& record) {
  if (metrics_) metrics_->write(record);
  if (tensorboard_) tensorboard_->add_scalars(record.value("step", int64_t{0}), tensorboard_scalars(record, "epoch"));
  if (opts_.plot) {
    history_.push_back(record);
    refresh_plot();
  }
}

void RunLog::summary(const ojson& summary) {
  if (metrics_) metrics_->write({{"summary", summary}});
  if (opts_.plot) refresh_plot();
}

// From the metrics file when there is one (a resumed run's file holds its
// earlier jobs' records too), else from the records of this job.
void RunLog::refresh_plot() {
  PlotRun run{opts_.run_name, history_};
  std::error_code ec;
  if (metrics_ && std::filesystem::file_size(metrics_->path(), ec) > 0 && !ec) {
    run = read_metrics_run(metrics_->path());
    run.name = opts_.run_name;
  }
  write_plot(*opts_.plot, {run});
}

}  // namespace chorus::app
