// MetricsWriter: training metrics as JSON lines or CSV, one record per call.
//
// Design note: the format follows the file name (".csv" → CSV, anything else
// → JSON lines), so `--metrics run.csv` and `--metrics run.jsonl` both do what
// they say. Every record is flushed at once: a crashed or killed run keeps
// every line it logged, and `tail -f` shows progress live. Records are
// ordered_json so that CSV columns and JSON keys keep the caller's order
// ("step" first) rather than nlohmann's alphabetical one.
//
// CSV: the first record's keys become the header; later records may leave
// columns out (empty cells), and a record with a new key adds a column at
// the end: the file is rewritten atomically with the longer header and an
// empty cell in every earlier row (so a training run's step, epoch and
// summary records share one file; `tail -f` must then reopen it).
// Strings are quoted when needed (RFC 4180), nested values are written as
// JSON text, numbers in shortest round-trip form.
#pragma once

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace chorus::io {

class MetricsWriter {
 public:
  // Opens (truncates, or with `append` extends) `path`; IOError if it cannot.
  // Appending to a non-empty CSV reuses its header line as the columns.
  explicit MetricsWriter(const std::string& path, bool append = false);

  // Writes one record (a JSON object) and flushes.
  void write(const nlohmann::ordered_json& record);

  bool is_csv() const { return csv_; }
  const std::string& path() const { return path_; }

 private:
  void write_csv(const nlohmann::ordered_json& record);
  void add_columns(const std::vector<std::string>& added);
  void flush_or_throw();

  std::string path_;
  bool csv_ = false;
  std::ofstream out_;
  std::vector<std::string> columns_;  // CSV only; empty until the header is known
};

}  // namespace chorus::io
