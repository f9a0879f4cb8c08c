#include "chorus/io/metrics.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>

#include "chorus/core/error.h"

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

// Splits one CSV header line (RFC 4180 quoting) into column names.
std::vector<std::string> parse_csv_header(const std::string& line) {
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

}  // namespace

MetricsWriter::MetricsWriter(const std::string& path, bool append) : path_(path), csv_(ends_with(path, ".csv")) {
  if (csv_ && append) {
    std::ifstream in(path);
    std::string header;
    if (in && std::getline(in, header) && !header.empty()) columns_ = parse_csv_header(header);
  }
  out_.open(path, append ? std::ios::app : std::ios::trunc);
  if (!out_) CHORUS_THROW(IOError, path, ": cannot open the metrics file for writing: ", std::strerror(errno));
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
    for (size_t i = 0; i < columns_.size(); ++i) out_ << (i ? "," : "") << csv_quote(columns_[i]);
    out_ << '\n';
  }
  for (const auto& [key, v] : record.items())
    CHORUS_CHECK(std::find(columns_.begin(), columns_.end(), key) != columns_.end(), path_, ": record has key '",
                 key, "' which is not a column of this CSV file (the first record fixes the columns)");
  for (size_t i = 0; i < columns_.size(); ++i) {
    auto it = record.find(columns_[i]);
    out_ << (i ? "," : "") << (it == record.end() ? std::string() : csv_cell(*it));
  }
  out_ << '\n';
}

void MetricsWriter::flush_or_throw() {
  out_.flush();
  if (!out_) CHORUS_THROW(IOError, path_, ": writing metrics failed: ", std::strerror(errno));
}

}  // namespace chorus::io
