#include "chorus/io/metrics.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>

#include "chorus/core/error.h"
#include "chorus/io/file_util.h"

namespace chorus::io {

namespace {

using ojson = nlohmann::ordered_json;

bool ends_with(const std::string& s, const std::string& suffix) {
  if (s.size() < suffix.size()) return false;
  return std::equal(suffix.rbegin(), suffix.rend(), s.rbegin(),
                    [](char want, char c) { return want == std::tolower(static_cast<unsigned char>(c)); });
}

std::string csv_quote(const std::string& s) {
  if (s.find_first_of(",\"\n\r") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) {
    if (c == '"') out += '"';
    out += c;
  }
  return out + "\"";
}

std::string csv_cell(const ojson& v) {
  if (v.is_null()) return "";
  if (v.is_string()) return csv_quote(v.get<std::string>());
  if (v.is_boolean()) return v.get<bool>() ? "true" : "false";
  if (v.is_number_float()) {
    // fmt's shortest round-trip form; "nan"/"inf" stay readable (JSON has no spelling for them).
    return fmt::format("{}", v.get<double>());
  }
  if (v.is_number()) return v.dump();
  return csv_quote(v.dump());  // nested object or array
}

// Splits `text` into CSV records at line ends outside quotes (RFC 4180: a
// quoted cell may hold a newline). Each record keeps its text as written,
// without the line end; a last record without a line end is kept too.
std::vector<std::string> split_csv_records(const std::string& text) {
  std::vector<std::string> records;
  std::string cur;
  bool quoted = false;
  for (char c : text) {
    if (c == '"') quoted = !quoted;  // "" inside quotes toggles twice: no change
    if (c == '\n' && !quoted) {
      if (!cur.empty() && cur.back() == '\r') cur.pop_back();
      records.push_back(std::move(cur));
      cur.clear();
    } else {
      cur += c;
    }
  }
  if (!cur.empty()) records.push_back(std::move(cur));
  return records;
}

// Splits one CSV record (RFC 4180 quoting) into cells.
std::vector<std::string> parse_csv_record(const std::string& line) {
  std::vector<std::string> cols(1);
  bool quoted = false;
  for (size_t i = 0; i < line.size(); ++i) {
    char c = line[i];
    if (quoted) {
      if (c == '"' && i + 1 < line.size() && line[i + 1] == '"') {
        cols.back() += '"';
        ++i;
      } else if (c == '"') {
        quoted = false;
      } else {
        cols.back() += c;
      }
    } else if (c == '"') {
      quoted = true;
    } else if (c == ',') {
      cols.emplace_back();
    } else if (c != '\r') {
      cols.back() += c;
    }
  }
  return cols;
}

std::string header_line(const std::vector<std::string>& columns) {
  std::string line;
  for (size_t i = 0; i < columns.size(); ++i) line += (i ? "," : "") + csv_quote(columns[i]);
  return line;
}

}  // namespace

MetricsWriter::MetricsWriter(const std::string& path, bool append) : path_(path), csv_(ends_with(path, ".csv")) {
  bool needs_newline = false;
  if (append) {
    std::error_code ec;
    if (std::filesystem::is_regular_file(path, ec)) {
      const std::string text = detail::read_file(path);
      // A run killed mid-write may leave a last line without its end.
      needs_newline = !text.empty() && text.back() != '\n';
      if (csv_) {
        std::vector<std::string> records = split_csv_records(text);
        if (!records.empty() && !records[0].empty()) columns_ = parse_csv_record(records[0]);
      }
    }
  }
  out_.open(path, append ? std::ios::app : std::ios::trunc);
  if (!out_) CHORUS_THROW(IOError, path, ": cannot open the metrics file for writing: ", std::strerror(errno));
  if (needs_newline) out_ << '\n';
}

void MetricsWriter::write(const ojson& record) {
  CHORUS_CHECK(record.is_object(), path_, ": a metrics record must be a JSON object, got ", record.type_name());
  if (csv_) {
    write_csv(record);
  } else {
    // error_handler replace: a stray invalid UTF-8 byte in a string must not kill training.
    out_ << record.dump(-1, ' ', false, ojson::error_handler_t::replace) << '\n';
  }
  flush_or_throw();
}

void MetricsWriter::write_csv(const ojson& record) {
  if (columns_.empty()) {
    for (const auto& [key, v] : record.items()) columns_.push_back(key);
    out_ << header_line(columns_) << '\n';
  }
  std::vector<std::string> added;
  for (const auto& [key, v] : record.items())
    if (std::find(columns_.begin(), columns_.end(), key) == columns_.end()) added.push_back(key);
  if (!added.empty()) add_columns(added);
  for (size_t i = 0; i < columns_.size(); ++i) {
    auto it = record.find(columns_[i]);
    out_ << (i ? "," : "") << (it == record.end() ? std::string() : csv_cell(*it));
  }
  out_ << '\n';
}

// New columns go at the end: the file is rewritten (atomically) with the
// longer header and an empty cell per new column in every earlier row, so
// every row has the header's column count.
void MetricsWriter::add_columns(const std::vector<std::string>& added) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path_, ec))
    CHORUS_THROW(ValueError, path_, ": record has key '", added[0],
                 "' which is not a column, and this CSV output is not a regular file that could be rewritten "
                 "with a longer header");
  flush_or_throw();
  out_.close();
  std::vector<std::string> records = split_csv_records(detail::read_file(path_));
  columns_.insert(columns_.end(), added.begin(), added.end());
  std::string text = header_line(columns_) + "\n";
  for (size_t i = 1; i < records.size(); ++i) {
    // Padded to the new width (a row cut short by a killed run included).
    const size_t cells = parse_csv_record(records[i]).size();
    text += records[i] + std::string(columns_.size() - std::min(cells, columns_.size()), ',') + "\n";
  }
  detail::write_file_atomically(path_, text);
  out_.open(path_, std::ios::app);
  if (!out_) CHORUS_THROW(IOError, path_, ": cannot reopen the metrics file for writing: ", std::strerror(errno));
}

void MetricsWriter::flush_or_throw() {
  out_.flush();
  if (!out_) CHORUS_THROW(IOError, path_, ": writing metrics failed: ", std::strerror(errno));
}

}  // namespace chorus::io
