#include "client/bench/svg_chart.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace indexer::bench {
namespace {

constexpr int kLeft = 64;
constexpr int kRight = 18;
constexpr int kTop = 46;  // title and one legend row; each further legend row adds kLegendRow
constexpr int kLegendRow = 14;
constexpr int kBottom = 46;

std::string Num(double v) {
  // A tick label: few digits, no trailing zeros.
  if (v == 0) return "0";
  const double a = std::fabs(v);
  if (a >= 1e6 || a < 1e-3) return absl::StrFormat("%.0e", v);
  // One literal per call: absl checks format strings at compile time (clang enforces it).
  std::string s = a >= 100 ? absl::StrFormat("%.0f", v)
                           : (a >= 1 ? absl::StrFormat("%.2f", v) : absl::StrFormat("%.3f", v));
  if (s.find('.') != std::string::npos) {
    while (!s.empty() && s.back() == '0') s.pop_back();
    if (!s.empty() && s.back() == '.') s.pop_back();
  }
  return s;
}

std::string Px(double v) { return absl::StrFormat("%.1f", v); }

// A data axis mapped onto [p0, p1] pixels.
struct Axis {
  double lo = 0, hi = 1;
  bool log = false;
  double p0 = 0, p1 = 1;
  double Map(double v) const {
    double t;
    if (log) {
      v = std::max(v, lo);
      t = (std::log10(v) - std::log10(lo)) / (std::log10(hi) - std::log10(lo));
    } else {
      t = (v - lo) / (hi - lo);
    }
    return p0 + t * (p1 - p0);
  }
};

std::string Frame(const ChartOptions& o, std::string body, int top = kTop) {
  std::string svg = absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" class=\"chart\" width=\"%d\" height=\"%d\" "
      "viewBox=\"0 0 %d %d\" font-family=\"sans-serif\" font-size=\"11\">\n"
      "<rect x=\"0\" y=\"0\" width=\"%d\" height=\"%d\" fill=\"#ffffff\"/>\n"
      "<text x=\"%d\" y=\"18\" font-size=\"14\" font-weight=\"bold\" fill=\"#222\">%s</text>\n",
      o.width, o.height, o.width, o.height, o.width, o.height, kLeft, EscapeXml(o.title));
  svg += body;
  // Axis labels.
  absl::StrAppendFormat(&svg,
                        "<text x=\"%d\" y=\"%d\" text-anchor=\"middle\" fill=\"#333\">%s</text>\n",
                        kLeft + (o.width - kLeft - kRight) / 2, o.height - 8, EscapeXml(o.x_label));
  absl::StrAppendFormat(&svg,
                        "<text x=\"14\" y=\"%d\" text-anchor=\"middle\" fill=\"#333\" "
                        "transform=\"rotate(-90 14 %d)\">%s</text>\n",
                        top + (o.height - top - kBottom) / 2, top + (o.height - top - kBottom) / 2,
                        EscapeXml(o.y_label));
  svg += "</svg>\n";
  return svg;
}

std::string Grid(const Axis& x, const Axis& y, const std::vector<double>& xt,
                 const std::vector<double>& yt) {
  std::string s;
  for (double v : yt) {
    const double py = y.Map(v);
    absl::StrAppend(&s, "<line x1=\"", Px(x.p0), "\" y1=\"", Px(py), "\" x2=\"", Px(x.p1),
                    "\" y2=\"", Px(py), "\" stroke=\"#e4e4e4\"/>\n");
    absl::StrAppend(&s, "<text x=\"", Px(x.p0 - 6), "\" y=\"", Px(py + 4),
                    "\" text-anchor=\"end\" fill=\"#555\">", Num(v), "</text>\n");
  }
  for (double v : xt) {
    const double px = x.Map(v);
    absl::StrAppend(&s, "<line x1=\"", Px(px), "\" y1=\"", Px(y.p0), "\" x2=\"", Px(px), "\" y2=\"",
                    Px(y.p1), "\" stroke=\"#eeeeee\"/>\n");
    absl::StrAppend(&s, "<text x=\"", Px(px), "\" y=\"", Px(y.p0 + 16),
                    "\" text-anchor=\"middle\" fill=\"#555\">", Num(v), "</text>\n");
  }
  absl::StrAppend(&s, "<rect x=\"", Px(x.p0), "\" y=\"", Px(y.p1), "\" width=\"", Px(x.p1 - x.p0),
                  "\" height=\"", Px(y.p0 - y.p1), "\" fill=\"none\" stroke=\"#999\"/>\n");
  return s;
}

// Legend entries under the title, wrapped into rows of `width`.
double LegendWidth(const std::string& name) { return 34 + 6.5 * static_cast<double>(name.size()); }

int LegendRows(const std::vector<std::pair<std::string, std::string>>& entries, int width) {
  int rows = entries.empty() ? 0 : 1;
  double x = kLeft;
  for (const auto& e : entries) {
    if (x > kLeft && x + LegendWidth(e.first) > width) {
      ++rows;
      x = kLeft;
    }
    x += LegendWidth(e.first);
  }
  return rows;
}

std::string Legend(const std::vector<std::pair<std::string, std::string>>& entries, int width) {
  std::string s;
  double x = kLeft;
  double y = 34;
  for (const auto& [name, color] : entries) {
    if (x > kLeft && x + LegendWidth(name) > width) {
      x = kLeft;
      y += kLegendRow;
    }
    absl::StrAppend(&s, "<line x1=\"", Px(x), "\" y1=\"", Px(y - 4), "\" x2=\"", Px(x + 18),
                    "\" y2=\"", Px(y - 4), "\" stroke=\"", color, "\" stroke-width=\"3\"/>\n");
    absl::StrAppend(&s, "<text x=\"", Px(x + 22), "\" y=\"", Px(y), "\" fill=\"#333\">",
                    EscapeXml(name), "</text>\n");
    x += LegendWidth(name);
  }
  return s;
}

}  // namespace

std::string EscapeXml(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::vector<double> LinearTicks(double lo, double hi, int count) {
  if (!(hi > lo)) return {lo};
  const double raw = (hi - lo) / std::max(1, count);
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double step = mag;
  for (double m : {1.0, 2.0, 5.0, 10.0}) {
    if (m * mag >= raw) {
      step = m * mag;
      break;
    }
  }
  std::vector<double> ticks;
  for (double v = std::ceil(lo / step - 1e-9) * step; v <= hi + step * 1e-9; v += step) {
    ticks.push_back(std::fabs(v) < step * 1e-9 ? 0 : v);
    if (ticks.size() > 50) break;
  }
  return ticks;
}

std::vector<double> LogTicks(double lo, double hi) {
  std::vector<double> ticks;
  if (!(lo > 0) || !(hi > lo)) return {lo};
  const int e0 = static_cast<int>(std::floor(std::log10(lo)));
  const int e1 = static_cast<int>(std::ceil(std::log10(hi)));
  const bool fine = e1 - e0 <= 3;
  for (int e = e0; e <= e1; ++e) {
    for (double m : fine ? std::vector<double>{1, 2, 5} : std::vector<double>{1}) {
      const double v = m * std::pow(10.0, e);
      if (v >= lo * (1 - 1e-9) && v <= hi * (1 + 1e-9)) ticks.push_back(v);
    }
  }
  return ticks;
}

std::string LineChart(const ChartOptions& o, const std::vector<ChartSeries>& series) {
  double x_lo = std::numeric_limits<double>::infinity(), x_hi = -x_lo;
  double y_lo = x_lo, y_hi = -x_lo;
  for (const ChartSeries& s : series) {
    for (const auto& [x, y] : s.points) {
      if (!std::isfinite(x) || !std::isfinite(y)) continue;
      if (o.log_x && x <= 0) continue;
      if (o.log_y && y <= 0) continue;
      x_lo = std::min(x_lo, x);
      x_hi = std::max(x_hi, x);
      y_lo = std::min(y_lo, y);
      y_hi = std::max(y_hi, y);
    }
  }
  if (o.threshold_y) {
    y_hi = std::max(y_hi, *o.threshold_y);
    y_lo = std::min(y_lo, *o.threshold_y);
  }
  for (const auto& [a, b] : o.shaded_x) {
    if (std::isfinite(x_lo)) {
      x_lo = std::min(x_lo, a);
      x_hi = std::max(x_hi, b);
    }
  }
  if (!std::isfinite(x_lo)) {
    return Frame(o, absl::StrFormat("<text x=\"%d\" y=\"%d\" text-anchor=\"middle\" fill=\"#888\">"
                                    "no data</text>\n",
                                    o.width / 2, o.height / 2));
  }
  std::vector<std::pair<std::string, std::string>> legend;
  for (const ChartSeries& s : series) {
    if (!s.name.empty() && !s.points.empty()) legend.emplace_back(s.name, s.color);
  }
  if (!o.shaded_x.empty() && !o.shaded_label.empty())
    legend.emplace_back(o.shaded_label, "#e9dcb5");
  const int top = kTop + kLegendRow * std::max(0, LegendRows(legend, o.width) - 1);
  Axis x{x_lo, x_hi, o.log_x, kLeft, static_cast<double>(o.width - kRight)};
  Axis y{y_lo, y_hi, o.log_y, static_cast<double>(o.height - kBottom), static_cast<double>(top)};
  if (!o.log_y)
    y.lo = o.y_min.value_or(std::min(0.0, y_lo));
  else if (o.y_min)
    y.lo = *o.y_min;
  if (o.y_max) y.hi = *o.y_max;
  if (o.log_x) {
    x.lo = std::pow(10.0, std::floor(std::log10(x.lo) * 4) / 4);
    x.hi = std::pow(10.0, std::ceil(std::log10(x.hi) * 4) / 4);
  }
  if (o.log_y) {
    y.lo = std::pow(10.0, std::floor(std::log10(y.lo) * 4) / 4);
    y.hi = std::pow(10.0, std::ceil(std::log10(y.hi) * 4) / 4);
  }
  if (!(x.hi > x.lo)) {
    const double pad = x.lo == 0 ? 1 : std::fabs(x.lo) * 0.1;
    x.lo = o.log_x ? x.lo / 2 : x.lo - pad;
    x.hi = o.log_x ? x.hi * 2 : x.hi + pad;
  }
  if (!(y.hi > y.lo)) y.hi = o.log_y ? y.lo * 10 : y.lo + (y.lo == 0 ? 1 : std::fabs(y.lo));
  std::vector<double> yt = o.log_y ? LogTicks(y.lo, y.hi) : LinearTicks(y.lo, y.hi * 1.05, 5);
  if (!o.log_y && !yt.empty() && !o.y_max) y.hi = std::max(y.hi * 1.05, yt.back());
  std::vector<double> xt = o.log_x ? LogTicks(x.lo, x.hi) : LinearTicks(x.lo, x.hi, 6);
  if (!o.log_x) {
    xt.erase(std::remove_if(xt.begin(), xt.end(), [&](double v) { return v < x.lo || v > x.hi; }),
             xt.end());
  }

  std::string body;
  for (const auto& [a, b] : o.shaded_x) {
    const double pa = x.Map(std::max(a, x.lo)), pb = x.Map(std::min(b, x.hi));
    absl::StrAppend(&body, "<rect x=\"", Px(pa), "\" y=\"", Px(y.p1), "\" width=\"",
                    Px(std::max(0.0, pb - pa)), "\" height=\"", Px(y.p0 - y.p1),
                    "\" fill=\"#f3ecd9\"/>\n");
  }
  body += Grid(x, y, xt, yt);
  for (const auto& [mx, label] : o.x_marks) {
    const double px = x.Map(mx);
    absl::StrAppend(&body, "<line x1=\"", Px(px), "\" y1=\"", Px(y.p0), "\" x2=\"", Px(px),
                    "\" y2=\"", Px(y.p1), "\" stroke=\"#888\" stroke-dasharray=\"2 3\"/>\n");
    absl::StrAppend(&body, "<text x=\"", Px(px + 3), "\" y=\"", Px(y.p1 + 11),
                    "\" fill=\"#666\" font-size=\"10\">", EscapeXml(label), "</text>\n");
  }
  if (o.threshold_y) {
    const double py = y.Map(*o.threshold_y);
    absl::StrAppend(&body, "<line x1=\"", Px(x.p0), "\" y1=\"", Px(py), "\" x2=\"", Px(x.p1),
                    "\" y2=\"", Px(py), "\" stroke=\"#c0392b\" stroke-dasharray=\"6 4\"/>\n");
    absl::StrAppend(&body, "<text x=\"", Px(x.p1 - 4), "\" y=\"", Px(py - 4),
                    "\" text-anchor=\"end\" fill=\"#c0392b\">", EscapeXml(o.threshold_label),
                    "</text>\n");
  }
  for (const ChartSeries& s : series) {
    std::string path;
    for (const auto& [px, py] : s.points) {
      if (!std::isfinite(px) || !std::isfinite(py) || (o.log_x && px <= 0) ||
          (o.log_y && py <= 0)) {
        continue;
      }
      absl::StrAppend(&path, path.empty() ? "M" : " L", Px(x.Map(px)), ",",
                      Px(y.Map(std::clamp(py, y.lo, y.hi))));
    }
    if (path.empty()) continue;
    absl::StrAppend(&body, "<path class=\"series\" d=\"", path, "\" fill=\"none\" stroke=\"",
                    s.color, "\" stroke-width=\"2\"", s.dashed ? " stroke-dasharray=\"5 3\"" : "",
                    "/>\n");
    if (s.markers) {
      for (size_t i = 0; i < s.points.size(); ++i) {
        const auto& [px, py] = s.points[i];
        if (!std::isfinite(px) || !std::isfinite(py)) continue;
        const double cx = x.Map(px), cy = y.Map(std::clamp(py, y.lo, y.hi));
        absl::StrAppend(&body, "<circle cx=\"", Px(cx), "\" cy=\"", Px(cy), "\" r=\"3.5\" fill=\"",
                        s.color, "\"/>\n");
        if (i < s.point_labels.size() && !s.point_labels[i].empty()) {
          const bool right_edge = cx > x.p1 - 40;  // keep the label inside the plot
          absl::StrAppend(&body, "<text x=\"", Px(right_edge ? cx - 5 : cx + 5), "\" y=\"",
                          Px(cy - 5), "\" fill=\"#444\" font-size=\"10\"",
                          right_edge ? " text-anchor=\"end\"" : "", ">",
                          EscapeXml(s.point_labels[i]), "</text>\n");
        }
      }
    }
  }
  body += Legend(legend, o.width);
  return Frame(o, body, top);
}

std::string BarChart(const ChartOptions& o, const std::vector<std::string>& labels,
                     const std::vector<double>& values, const std::string& color) {
  if (values.empty()) {
    return Frame(o, absl::StrFormat("<text x=\"%d\" y=\"%d\" text-anchor=\"middle\" fill=\"#888\">"
                                    "no data</text>\n",
                                    o.width / 2, o.height / 2));
  }
  const double top = *std::max_element(values.begin(), values.end());
  Axis y{0, top > 0 ? top : 1, false, static_cast<double>(o.height - kBottom), kTop};
  const std::vector<double> yt = LinearTicks(0, y.hi * 1.05, 5);
  y.hi = std::max(y.hi, yt.back());
  Axis x{0, static_cast<double>(values.size()), false, kLeft,
         static_cast<double>(o.width - kRight)};
  std::string body = Grid(x, y, {}, yt);
  const double slot = (x.p1 - x.p0) / static_cast<double>(values.size());
  const size_t label_every = std::max<size_t>(1, values.size() / 8);
  for (size_t i = 0; i < values.size(); ++i) {
    const double px = x.p0 + slot * static_cast<double>(i);
    const double py = y.Map(values[i]);
    absl::StrAppend(&body, "<rect class=\"bar\" x=\"", Px(px + 1), "\" y=\"", Px(py), "\" width=\"",
                    Px(std::max(1.0, slot - 2)), "\" height=\"", Px(y.p0 - py), "\" fill=\"", color,
                    "\"><title>", EscapeXml(labels[i]), ": ", Num(values[i]), "</title></rect>\n");
    if (i % label_every == 0) {
      absl::StrAppend(&body, "<text x=\"", Px(px + slot / 2), "\" y=\"", Px(y.p0 + 16),
                      "\" text-anchor=\"middle\" fill=\"#555\" font-size=\"10\">",
                      EscapeXml(labels[i]), "</text>\n");
    }
  }
  return Frame(o, body);
}

}  // namespace indexer::bench
