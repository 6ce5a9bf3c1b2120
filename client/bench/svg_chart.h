// Small inline-SVG charts for indexer-bench's HTML report: line charts (linear or log axes,
// optional markers, shaded x ranges, vertical marks, a horizontal threshold) and bar charts.
// The output is an <svg> element with fixed pixel size and no script, fonts or external
// references, so the report renders offline in any browser.
//
// Pure functions; any thread.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace indexer::bench {

struct ChartSeries {
  std::string name;                               // legend text; empty = not in the legend
  std::string color;                              // CSS colour
  std::vector<std::pair<double, double>> points;  // (x, y); drawn in the given order
  bool dashed = false;
  bool markers = false;
  std::vector<std::string> point_labels;  // optional text beside each point (with markers)
};

struct ChartOptions {
  std::string title;
  std::string x_label;
  std::string y_label;
  int width = 560;
  int height = 320;
  bool log_x = false;
  bool log_y = false;
  std::optional<double> y_min;  // default: 0 on a linear axis, the data's min on a log axis
  std::optional<double> y_max;
  std::vector<std::pair<double, double>> shaded_x;      // x ranges drawn shaded
  std::string shaded_label;                             // legend text of the shading
  std::vector<std::pair<double, std::string>> x_marks;  // labelled vertical lines
  std::optional<double> threshold_y;                    // a horizontal dashed line
  std::string threshold_label;
};

// A line chart of the series. Shows "no data" when there is no point.
std::string LineChart(const ChartOptions& options, const std::vector<ChartSeries>& series);

// A bar chart: one bar per label (drawn left to right), heights `values`.
std::string BarChart(const ChartOptions& options, const std::vector<std::string>& labels,
                     const std::vector<double>& values, const std::string& color);

// "Nice" tick values covering [lo, hi] (about `count` of them, steps of 1, 2 or 5 x 10^k), and
// for log axes the powers of ten (with 2 and 5 between when the range is short).
std::vector<double> LinearTicks(double lo, double hi, int count);
std::vector<double> LogTicks(double lo, double hi);

// Text escaped for HTML and SVG (&, <, >, ").
std::string EscapeXml(const std::string& text);

}  // namespace indexer::bench
