#include "plot.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include "chorus/core/error.h"
#include "chorus/io/file_util.h"
#include "cli_options.h"

namespace chorus::app {

namespace {

using ojson = nlohmann::ordered_json;
namespace fs = std::filesystem;

// --- reading ----------------------------------------------------------------

std::vector<std::string> split_csv_line(const std::string& line) {
  std::vector<std::string> cells(1);
  bool quoted = false;
  for (size_t i = 0; i < line.size(); ++i) {
    const char c = line[i];
    if (c == '"') {
      if (quoted && i + 1 < line.size() && line[i + 1] == '"') {
        cells.back() += '"';
        ++i;
      } else {
        quoted = !quoted;
      }
    } else if (c == ',' && !quoted) {
      cells.emplace_back();
    } else if (c != '\r') {
      cells.back() += c;
    }
  }
  return cells;
}

ojson csv_value(const std::string& cell) {
  char* end = nullptr;
  const double v = std::strtod(cell.c_str(), &end);
  if (!cell.empty() && end == cell.c_str() + cell.size()) return v;
  return cell;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// --- drawing ----------------------------------------------------------------

std::string xml_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '<') out += "&lt;";
    else if (c == '>') out += "&gt;";
    else if (c == '&') out += "&amp;";
    else if (c == '"') out += "&quot;";
    else out += c;
  }
  return out;
}

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f", v);
  return buf;
}

// Tick labels: 1, 2.5, 1500, 12k, 3.5M.
std::string tick_label(double v) {
  char buf[32];
  const double a = std::fabs(v);
  if (a >= 1e9) std::snprintf(buf, sizeof(buf), "%gG", v / 1e9);
  else if (a >= 1e6) std::snprintf(buf, sizeof(buf), "%gM", v / 1e6);
  else if (a >= 1e4) std::snprintf(buf, sizeof(buf), "%gk", v / 1e3);
  else std::snprintf(buf, sizeof(buf), "%g", v);
  return buf;
}

// Ticks at 1, 2 or 5 times a power of ten, about `n` of them over [lo, hi].
std::vector<double> nice_ticks(double& lo, double& hi, int n) {
  if (!(hi > lo)) {
    const double pad = lo == 0 ? 1 : std::fabs(lo) * 0.1;
    lo -= pad;
    hi += pad;
  }
  const double raw = (hi - lo) / n;
  const double p = std::pow(10, std::floor(std::log10(raw)));
  const double step = raw / p < 1.5 ? p : raw / p < 3.5 ? 2 * p : raw / p < 7.5 ? 5 * p : 10 * p;
  lo = std::floor(lo / step) * step;
  hi = std::ceil(hi / step) * step;
  std::vector<double> t;
  for (double v = lo; v <= hi + step * 1e-6; v += step) t.push_back(std::fabs(v) < step * 1e-9 ? 0 : v);
  return t;
}

// A curve: (step, value) points of one run, drawn solid or dashed.
struct Series {
  int run = 0;
  bool dashed = false;
  std::vector<std::pair<double, double>> points;
};

struct Panel {
  std::string title;
  std::vector<Series> series;
  double scale = 1;        // values are divided by it (bytes -> MiB)
  bool from_zero = false;  // the y axis starts at 0
};

const char* kColours[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"};

Series series_of(const PlotRun& run, int index, const char* key, bool epoch_records, bool dashed) {
  Series s{index, dashed, {}};
  for (const ojson& r : run.records) {
    if (!r.is_object() || r.contains("summary")) continue;
    // Step records carry the training loss; epoch records the test set's.
    const bool is_epoch = r.contains("test_loss") || r.contains("test_accuracy");
    if (is_epoch != epoch_records) continue;
    auto step = r.find("step");
    auto v = r.find(key);
    if (step == r.end() || v == r.end() || !step->is_number() || !v->is_number()) continue;
    const double y = v->get<double>();
    if (std::isfinite(y)) s.points.emplace_back(step->get<double>(), y);
  }
  return s;
}

void draw_panel(std::ostringstream& svg, const Panel& p, double x0, double y0, double w, double h, double xlo,
                double xhi) {
  const double left = 62, right = 24, top = 26, bottom = 34;
  const double px = x0 + left, py = y0 + top, pw = w - left - right, ph = h - top - bottom;
  double ylo = std::numeric_limits<double>::infinity(), yhi = -ylo;
  for (const Series& s : p.series)
    for (auto [x, y] : s.points) {
      ylo = std::min(ylo, y / p.scale);
      yhi = std::max(yhi, y / p.scale);
    }
  svg << "<text x=\"" << num(x0 + w / 2) << "\" y=\"" << num(y0 + 17)
      << "\" text-anchor=\"middle\" font-size=\"14\" font-weight=\"bold\">" << xml_escape(p.title) << "</text>\n";
  svg << "<rect x=\"" << num(px) << "\" y=\"" << num(py) << "\" width=\"" << num(pw) << "\" height=\"" << num(ph)
      << "\" fill=\"white\" stroke=\"#888\"/>\n";
  if (!std::isfinite(ylo)) {
    svg << "<text x=\"" << num(px + pw / 2) << "\" y=\"" << num(py + ph / 2)
        << "\" text-anchor=\"middle\" font-size=\"12\" fill=\"#888\">no data</text>\n";
    return;
  }
  if (p.from_zero) ylo = std::min(ylo, 0.0);
  const double margin = (yhi - ylo) * 0.05;
  // The margin below the lowest point stops at zero for a series that never
  // goes below it (a perplexity's axis from -20 reads wrong).
  if (!p.from_zero || ylo < 0) ylo = ylo >= 0 ? std::max(0.0, ylo - margin) : ylo - margin;
  yhi += margin;
  const std::vector<double> yt = nice_ticks(ylo, yhi, 5);
  const std::vector<double> xt = nice_ticks(xlo, xhi, 6);
  auto X = [&](double x) { return px + (x - xlo) / (xhi - xlo) * pw; };
  auto Y = [&](double y) { return py + ph - (y - ylo) / (yhi - ylo) * ph; };
  for (double t : yt) {
    svg << "<line x1=\"" << num(px) << "\" x2=\"" << num(px + pw) << "\" y1=\"" << num(Y(t)) << "\" y2=\""
        << num(Y(t)) << "\" stroke=\"#e4e4e4\"/>\n";
    svg << "<text x=\"" << num(px - 5) << "\" y=\"" << num(Y(t) + 4) << "\" text-anchor=\"end\" font-size=\"11\">"
        << tick_label(t) << "</text>\n";
  }
  for (double t : xt) {
    svg << "<line x1=\"" << num(X(t)) << "\" x2=\"" << num(X(t)) << "\" y1=\"" << num(py) << "\" y2=\""
        << num(py + ph) << "\" stroke=\"#e4e4e4\"/>\n";
    svg << "<text x=\"" << num(X(t)) << "\" y=\"" << num(py + ph + 15) << "\" text-anchor=\"middle\" font-size=\"11\">"
        << tick_label(t) << "</text>\n";
  }
  svg << "<text x=\"" << num(px + pw / 2) << "\" y=\"" << num(py + ph + 29)
      << "\" text-anchor=\"middle\" font-size=\"11\" fill=\"#444\">step</text>\n";
  for (const Series& s : p.series) {
    if (s.points.empty()) continue;
    const char* colour = kColours[s.run % (sizeof(kColours) / sizeof(kColours[0]))];
    std::ostringstream pts;
    for (auto [x, y] : s.points) pts << num(X(x)) << "," << num(Y(y / p.scale)) << " ";
    svg << "<polyline fill=\"none\" stroke=\"" << colour << "\" stroke-width=\"" << (s.dashed ? "2" : "1.6") << "\""
        << (s.dashed ? " stroke-dasharray=\"6,4\"" : "") << " points=\"" << pts.str() << "\"/>\n";
    if (s.dashed || s.points.size() == 1)  // epoch points are few: mark each
      for (auto [x, y] : s.points)
        svg << "<circle cx=\"" << num(X(x)) << "\" cy=\"" << num(Y(y / p.scale)) << "\" r=\"3.5\" fill=\"" << colour
            << "\"/>\n";
  }
}

}  // namespace

PlotRun read_metrics_run(const std::string& path) {
  const std::string text = io::detail::read_file(path);
  PlotRun run;
  run.name = fs::path(path).stem().string();
  std::istringstream in(text);
  std::string line;
  std::vector<std::string> header;
  int64_t line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    if (line[line.find_first_not_of(" \t")] == '{') {
      try {
        run.records.push_back(ojson::parse(line));
      } catch (const std::exception& e) {
        CHORUS_THROW(IOError, path, ": line ", line_no, " is not JSON: ", e.what());
      }
      continue;
    }
    std::vector<std::string> cells = split_csv_line(line);
    if (header.empty()) {
      header = cells;
      continue;
    }
    ojson r = ojson::object();
    for (size_t i = 0; i < cells.size() && i < header.size(); ++i)
      if (!cells[i].empty()) r[header[i]] = csv_value(cells[i]);
    run.records.push_back(std::move(r));
  }
  CHORUS_CHECK_T(IOError, !run.records.empty(), path, ": no metrics records (expected the JSON lines or CSV that chorus train --metrics writes)");
  return run;
}

std::string render_plot_svg(const std::vector<PlotRun>& runs) {
  std::vector<Panel> panels(4);
  panels[0].title = "Loss";
  // Language models (chorus train --model gpt2...) log perplexity and tokens/s
  // instead of accuracy and images/s: those panels show whichever the runs have.
  bool lm = false;
  for (const PlotRun& r : runs)
    for (const auto& rec : r.records) lm = lm || rec.contains("tok_per_s");
  panels[1].title = lm ? "Perplexity" : "Accuracy";
  panels[2].title = lm ? "Throughput (tok/s)" : "Throughput (img/s)";
  panels[2].from_zero = true;
  panels[3].title = "Peak memory (MiB)";
  panels[3].from_zero = true;
  panels[3].scale = 1 << 20;
  double xlo = std::numeric_limits<double>::infinity(), xhi = -xlo;
  for (size_t i = 0; i < runs.size(); ++i) {
    const int k = static_cast<int>(i);
    panels[0].series.push_back(series_of(runs[i], k, "loss", false, false));
    panels[0].series.push_back(series_of(runs[i], k, "test_loss", true, true));
    panels[1].series.push_back(series_of(runs[i], k, lm ? "ppl" : "accuracy", false, false));
    if (!lm) panels[1].series.push_back(series_of(runs[i], k, "test_accuracy", true, true));
    panels[2].series.push_back(series_of(runs[i], k, lm ? "tok_per_s" : "img_per_s", false, false));
    panels[3].series.push_back(series_of(runs[i], k, "peak_mem_bytes", false, false));
  }
  for (const Panel& p : panels)
    for (const Series& s : p.series)
      for (auto [x, y] : s.points) {
        xlo = std::min(xlo, x);
        xhi = std::max(xhi, x);
      }
  if (!std::isfinite(xlo)) xlo = 0, xhi = 1;
  if (xlo > 0 && xlo <= (xhi - xlo)) xlo = 0;  // a run from its start: the axis from step 0
  const double W = 960, H = 660, legend_h = 30 + 18 * std::ceil(runs.size() / 3.0);
  std::ostringstream svg;
  svg << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << num(H + legend_h)
      << "\" viewBox=\"0 0 " << W << " " << num(H + legend_h) << "\" font-family=\"DejaVu Sans, Arial, sans-serif\">\n"
      << "<rect width=\"100%\" height=\"100%\" fill=\"#fafafa\"/>\n";
  // Legend: a colour per run, then what solid and dashed mean.
  for (size_t i = 0; i < runs.size(); ++i) {
    const double lx = 20 + 310 * static_cast<double>(i % 3), ly = 18 + 18 * static_cast<double>(i / 3);
    svg << "<line x1=\"" << num(lx) << "\" x2=\"" << num(lx + 26) << "\" y1=\"" << num(ly - 4) << "\" y2=\""
        << num(ly - 4) << "\" stroke=\"" << kColours[i % 8] << "\" stroke-width=\"3\"/>\n"
        << "<text x=\"" << num(lx + 32) << "\" y=\"" << num(ly) << "\" font-size=\"12\">"
        << xml_escape(runs[i].name) << "</text>\n";
  }
  svg << "<text x=\"20\" y=\"" << num(legend_h - 6)
      << "\" font-size=\"11\" fill=\"#444\">solid: training (per log window) · dashed with dots: validation (per epoch)"
      << "</text>\n";
  const double pw = W / 2, ph = H / 2;
  for (int i = 0; i < 4; ++i)
    draw_panel(svg, panels[i], pw * (i % 2), legend_h + ph * (i / 2), pw, ph, xlo, xhi);
  svg << "</svg>\n";
  return svg.str();
}

void write_plot(const std::string& out, const std::vector<PlotRun>& runs) {
  const bool png = ends_with(out, ".png"), svg = ends_with(out, ".svg");
  CHORUS_CHECK(png || svg, "the plot's file must end in .svg or .png, got '", out, "'");
  const std::string text = render_plot_svg(runs);
  if (svg) {
    io::detail::write_file_atomically(out, text);
    return;
  }
  CHORUS_CHECK(std::system("command -v rsvg-convert >/dev/null 2>&1") == 0, "writing ", out,
               " needs rsvg-convert (apt-get install librsvg2-bin); or name a .svg file");
  const std::string tmp = out + ".tmp-" + io::detail::unique_suffix() + ".svg";
  io::detail::write_file_atomically(tmp, text);
  auto quote = [](const std::string& s) {
    std::string q = "'";
    for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
    return q + "'";
  };
  const int rc = std::system(("rsvg-convert -o " + quote(out) + " " + quote(tmp)).c_str());
  std::error_code ec;
  fs::remove(tmp, ec);
  CHORUS_CHECK_T(IOError, rc == 0, out, ": rsvg-convert failed (exit status ", rc, ")");
}

void add_plot_options(CLI::App* cmd, PlotConfig& c) {
  cmd->add_option("files", c.files, "Metrics files (chorus train --metrics: JSON lines or CSV)")->required();
  cmd->add_option("--out", c.out, "The picture: .svg, or .png (through rsvg-convert)")->capture_default_str();
}

int run_plot(const PlotConfig& c) {
  std::vector<PlotRun> runs;
  for (const std::string& f : c.files) runs.push_back(read_metrics_run(f));
  // Two files of the same name in different folders: their paths tell them apart.
  for (size_t i = 0; i < runs.size(); ++i)
    for (size_t j = 0; j < runs.size(); ++j)
      if (i != j && runs[i].name == runs[j].name) runs[i].name = c.files[i];
  write_plot(c.out, runs);
  std::printf("%s: %zu run%s\n", c.out.c_str(), runs.size(), runs.size() == 1 ? "" : "s");
  return 0;
}

}  // namespace chorus::app
