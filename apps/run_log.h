// RunLog: where `chorus train` sends the figures it reads at each log window
// and epoch end -- the --metrics file (JSON lines or CSV), TensorBoard event
// files (--tensorboard) and the --plot picture, refreshed at each epoch end.
//
// The records are the --metrics file's (docs/observability.md lists them);
// TensorBoard gets the same numbers under fixed tags (tensorboard_scalars), so
// a test can check every scalar against the JSON line it came from.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "chorus/io/metrics.h"
#include "chorus/io/tensorboard.h"

namespace chorus::app {

// The TensorBoard tags and values of one record: a step record (kind "step":
// train/loss, train/accuracy, train/lr, train/img_per_s, train/step_ms,
// train/grad_norm, memory/peak_bytes) or an epoch record (kind "epoch":
// val/loss, val/accuracy, memory/in_use_bytes, memory/peak_bytes/<device>).
std::vector<std::pair<std::string, double>> tensorboard_scalars(const nlohmann::ordered_json& record,
                                                                const std::string& kind);

struct RankContext;

// --tensorboard DIR: the job's run directory, DIR/<rank 0's start time>-<model>-<strategy>
// (TensorBoard lists each directory as a run), and with --tensorboard-all-ranks
// a rank<N> directory in it per rank. Every rank of a job calls it (the ranks
// agree on rank 0's time); unset root: none.
std::optional<std::string> tensorboard_run_dir(const std::optional<std::string>& root, const std::string& model,
                                               const std::string& strategy, const RankContext* ranks,
                                               bool all_ranks);

struct RunLogOptions {
  std::optional<std::string> metrics;      // --metrics FILE
  bool append = false;                     // --resume: extend the metrics file
  std::optional<std::string> tensorboard;  // the run directory for event files
  std::optional<std::string> plot;         // --plot FILE (.svg or .png)
  std::string run_name = "run";            // the plot's legend
};

class RunLog {
 public:
  explicit RunLog(RunLogOptions o);
  // A log window's record (it has "step").
  void step(const nlohmann::ordered_json& record);
  // An epoch end's record (it has "step"); refreshes the plot.
  void epoch(const nlohmann::ordered_json& record);
  // The closing summary (metrics file only); refreshes the plot.
  void summary(const nlohmann::ordered_json& summary);

  bool any() const { return metrics_ || tensorboard_ || opts_.plot; }
  const io::TensorBoardWriter* tensorboard() const { return tensorboard_.get(); }

 private:
  void refresh_plot();

  RunLogOptions opts_;
  std::unique_ptr<io::MetricsWriter> metrics_;
  std::unique_ptr<io::TensorBoardWriter> tensorboard_;
  std::vector<nlohmann::ordered_json> history_;  // for --plot without a JSON-lines metrics file
};

}  // namespace chorus::app
