// MetricsWriter: JSON lines and CSV, chosen by extension; records flushed at
// once; CSV columns fixed by the first record; clear errors.
#include "chorus/io/metrics.h"

#include <gtest/gtest.h>

#include <cmath>
#include <sstream>

#include "chorus/core/error.h"
#include "io/io_test_util.h"

namespace chorus::io {
namespace {

using namespace testing;

std::vector<std::string> lines_of(const std::string& path) {
  std::istringstream in(read_bytes(path));
  std::vector<std::string> out;
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

TEST(MetricsWriter, JsonLinesOneObjectPerRecordFlushedAtOnce) {
  ScratchDir dir;
  const std::string path = dir.file("run.jsonl");
  MetricsWriter w(path);
  EXPECT_FALSE(w.is_csv());
  w.write({{"step", 1}, {"loss", 2.5}, {"phase", "train"}});
  // Readable before the writer is closed: flushed per record.
  ASSERT_EQ(lines_of(path).size(), 1u);
  w.write({{"step", 2}, {"loss", 0.1}, {"accuracy", 0.75}});
  auto lines = lines_of(path);
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0], R"({"step":1,"loss":2.5,"phase":"train"})") << "keys keep the caller's order";
  auto second = nlohmann::json::parse(lines[1]);
  EXPECT_EQ(second["step"], 2);
  EXPECT_DOUBLE_EQ(second["loss"].get<double>(), 0.1);
}

TEST(MetricsWriter, CsvHeaderFromTheFirstRecord) {
  ScratchDir dir;
  const std::string path = dir.file("run.CSV");
  {
    MetricsWriter w(path);
    EXPECT_TRUE(w.is_csv());
    w.write({{"step", 1}, {"loss", 0.25}, {"note", "warm, up"}});
    w.write({{"step", 2}, {"loss", std::nan("")}});  // missing column → empty cell
    w.write({{"step", 3}, {"note", "say \"hi\""}, {"loss", 1e-9}});
    expect_throw_with<ValueError>([&] { w.write({{"step", 4}, {"lr", 0.1}}); }, {"'lr'", "not a column"});
  }
  EXPECT_EQ(lines_of(path), (std::vector<std::string>{"step,loss,note", "1,0.25,\"warm, up\"", "2,nan,",
                                                      "3,1e-09,\"say \"\"hi\"\"\""}));
  // Appending continues under the existing header.
  MetricsWriter more(path, /*append=*/true);
  more.write({{"loss", 0.5}, {"step", 5}});
  EXPECT_EQ(lines_of(path).back(), "5,0.5,");
}

TEST(MetricsWriter, UnopenableFileIsAnIOErrorNamingIt) {
  ScratchDir dir;
  const std::string path = dir.file("missing-dir/metrics.jsonl");
  expect_throw_with<IOError>([&] { MetricsWriter w(path); }, {path, "cannot open"});
  MetricsWriter w(dir.file("m.jsonl"));
  expect_throw_with<ValueError>([&] { w.write(nlohmann::ordered_json::array({1, 2})); }, {"must be a JSON object"});
}

}  // namespace
}  // namespace chorus::io
