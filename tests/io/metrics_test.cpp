// MetricsWriter: JSON lines and CSV, chosen by extension; records flushed at
// once; CSV columns from the first record, new keys adding columns; clear
// errors.
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
  }
  EXPECT_EQ(lines_of(path), (std::vector<std::string>{"step,loss,note", "1,0.25,\"warm, up\"", "2,nan,",
                                                      "3,1e-09,\"say \"\"hi\"\"\""}));
  // Appending continues under the existing header.
  MetricsWriter more(path, /*append=*/true);
  more.write({{"loss", 0.5}, {"step", 5}});
  EXPECT_EQ(lines_of(path).back(), "5,0.5,");
}

// Issue 15: `chorus train --metrics run.csv` failed at the first epoch end
// ("record has key 'test_loss' which is not a column"), and again on every
// --resume. The records a training run writes, in its order, across a resume.
TEST(MetricsWriter, CsvTakesEveryRecordATrainingRunWritesAcrossAResume) {
  ScratchDir dir;
  const std::string path = dir.file("run.csv");
  using J = nlohmann::ordered_json;
  {
    MetricsWriter w(path);
    w.write({{"step", 20}, {"epoch", 1}, {"loss", 0.5}, {"accuracy", 0.75}, {"lr", 0.05}, {"img_per_s", 900.0}});
    w.write({{"epoch", 1}, {"test_loss", 0.4}, {"test_accuracy", 0.8}});
  }
  // A killed run's last line may lack its end; a resumed run appends.
  write_bytes(path, read_bytes(path) + "40,2,0.3");
  {
    MetricsWriter w(path, /*append=*/true);
    w.write({{"step", 40}, {"epoch", 2}, {"loss", 0.25}, {"accuracy", 0.875}, {"lr", 0.01}, {"img_per_s", 950.0}});
    w.write({{"summary", J{{"model", "cnn"}, {"test_accuracy", 0.9}}}});
  }
  EXPECT_EQ(lines_of(path),
            (std::vector<std::string>{"step,epoch,loss,accuracy,lr,img_per_s,test_loss,test_accuracy,summary",
                                      "20,1,0.5,0.75,0.05,900,,,", ",1,,,,,0.4,0.8,", "40,2,0.3,,,,,,",
                                      "40,2,0.25,0.875,0.01,950,,,",
                                      ",,,,,,,,\"{\"\"model\"\":\"\"cnn\"\",\"\"test_accuracy\"\":0.9}\""}));
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
