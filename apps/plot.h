// `chorus plot METRICS_FILE... --out curves.svg|.png`: training curves from
// --metrics files without a server -- loss and validation loss, accuracy,
// throughput and peak memory against the step, several runs overlaid (one
// colour each, named in a legend by their file's name).
//
// Design note: the SVG is written directly (a few hundred lines of text, no
// plotting library); a .png goes through rsvg-convert (Debian's librsvg2-bin)
// when it is installed, and is otherwise refused with a line saying so.
// `chorus train --plot FILE` renders the same picture at each epoch end.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace CLI {
class App;
}

namespace chorus::app {

struct PlotRun {
  std::string name;                           // the legend's label
  std::vector<nlohmann::ordered_json> records;  // the metrics file's records, in order
};

// A --metrics file: JSON lines, or CSV (the header's columns as keys; numbers
// as numbers, empty cells left out). IOError naming the file when it cannot
// be read or holds no record.
PlotRun read_metrics_run(const std::string& path);

// The whole picture as SVG text.
std::string render_plot_svg(const std::vector<PlotRun>& runs);

// Writes `out` (.svg, or .png through rsvg-convert); ValueError for another
// extension or a .png without rsvg-convert.
void write_plot(const std::string& out, const std::vector<PlotRun>& runs);

struct PlotConfig {
  std::vector<std::string> files;
  std::string out = "curves.svg";
};
void add_plot_options(CLI::App* cmd, PlotConfig& c);
int run_plot(const PlotConfig& c);

}  // namespace chorus::app
