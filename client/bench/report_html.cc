// The HTML rendering of a BenchReport: one standalone page, inline CSS and SVG, no script.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/bench/report.h"
#include "client/bench/svg_chart.h"

namespace indexer::bench {
namespace {

const char* const kPalette[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728",
                                "#9467bd", "#8c564b", "#e377c2", "#17becf"};
constexpr const char* kP50Color = "#1f77b4";
constexpr const char* kP90Color = "#2ca02c";
constexpr const char* kP99Color = "#d62728";

double Ms(int64_t ns) { return static_cast<double>(ns) / 1e6; }

std::string Cell(const std::string& text, bool number = false) {
  return absl::StrCat(number ? "<td class=\"n\">" : "<td>", EscapeXml(text), "</td>");
}

std::string KeyValueTable(const std::vector<std::pair<std::string, std::string>>& rows) {
  std::string s = "<table class=\"kv\">\n";
  for (const auto& [k, v] : rows)
    absl::StrAppend(&s, "<tr><th>", EscapeXml(k), "</th>", Cell(v), "</tr>\n");
  return s + "</table>\n";
}

std::string CodesText(const std::map<int, int64_t>& codes) {
  std::string s;
  for (const auto& [code, n] : codes)
    absl::StrAppend(&s, s.empty() ? "" : ", ", CodeName(code), " ", n);
  return s.empty() ? "none" : s;
}

// Latency (p50, p99) per interval over the whole run, stages one after another.
std::string LatencyOverTime(const BenchReport& report) {
  ChartOptions o;
  o.title = "Latency over time (decode requests)";
  o.x_label = "time since start (s)";
  o.y_label = "latency (ms)";
  o.shaded_label = "warm-up";
  std::vector<ChartSeries> series;
  for (size_t i = 0; i < report.stages.size(); ++i) {
    const StageResult& r = report.stages[i];
    ChartSeries p50{i == 0 ? "p50" : "", kP50Color, {}, false, false};
    ChartSeries p99{i == 0 ? "p99" : "", kP99Color, {}, false, false};
    ChartSeries max{i == 0 ? "max" : "", "#aaaaaa", {}, true, false};
    double warm_end = -1;
    for (const TimelinePoint& p : r.timeline) {
      const double t = r.offset_s + p.start_s + p.seconds / 2;
      if (p.warmup) warm_end = r.offset_s + p.start_s + p.seconds;
      if (p.ok == 0) continue;
      p50.points.emplace_back(t, Ms(p.p50_ns));
      p99.points.emplace_back(t, Ms(p.p99_ns));
      max.points.emplace_back(t, Ms(p.max_ns));
    }
    if (r.setup.warmup_s > 0 && warm_end > 0) {
      o.shaded_x.emplace_back(r.offset_s, r.offset_s + r.setup.warmup_s);
    }
    if (report.stages.size() > 1) o.x_marks.emplace_back(r.offset_s, absl::StrCat("stage ", i + 1));
    series.push_back(std::move(max));
    series.push_back(std::move(p99));
    series.push_back(std::move(p50));
  }
  return LineChart(o, series);
}

std::string ThroughputOverTime(const BenchReport& report) {
  ChartOptions o;
  o.title = "Throughput over time";
  o.x_label = "time since start (s)";
  o.y_label = "decode requests/s";
  o.shaded_label = "warm-up";
  std::vector<ChartSeries> series;
  for (size_t i = 0; i < report.stages.size(); ++i) {
    const StageResult& r = report.stages[i];
    ChartSeries ok{i == 0 ? "ok" : "", "#1f77b4", {}, false, false};
    ChartSeries errors{"", "#d62728", {}, false, false};
    bool any_errors = false;
    for (const TimelinePoint& p : r.timeline) {
      const double t = r.offset_s + p.start_s + p.seconds / 2;
      ok.points.emplace_back(t, p.seconds > 0 ? static_cast<double>(p.ok) / p.seconds : 0);
      errors.points.emplace_back(t, p.seconds > 0 ? static_cast<double>(p.errors) / p.seconds : 0);
      any_errors |= p.errors > 0;
    }
    if (r.setup.warmup_s > 0) o.shaded_x.emplace_back(r.offset_s, r.offset_s + r.setup.warmup_s);
    if (report.stages.size() > 1) o.x_marks.emplace_back(r.offset_s, absl::StrCat("stage ", i + 1));
    series.push_back(std::move(ok));
    if (any_errors) {
      errors.name = "errors";
      series.push_back(std::move(errors));
    }
  }
  return LineChart(o, series);
}

std::string LatencyCdf(const BenchReport& report) {
  ChartOptions o;
  o.title = "Latency CDF (decode requests)";
  o.x_label = "latency (ms, log scale)";
  o.y_label = "fraction of requests at or below";
  o.log_x = true;
  o.y_min = 0;
  o.y_max = 1;
  std::vector<ChartSeries> series;
  for (size_t i = 0; i < report.stages.size(); ++i) {
    const StageResult& r = report.stages[i];
    const LatencyHistogram& h = r.decode().latency;
    if (h.empty()) continue;
    ChartSeries s{report.stages.size() > 1 ? absl::StrCat(i + 1, ": ", r.setup.label) : "all",
                  kPalette[i % 8],
                  {},
                  false,
                  false};
    s.points.emplace_back(Ms(h.min()), 0.0);
    int64_t seen = 0;
    for (const LatencyHistogram::Bucket& b : h.Buckets()) {
      seen += b.count;
      const double x = std::min(Ms(b.high), Ms(h.max()));
      s.points.emplace_back(std::max(x, Ms(h.min())),
                            static_cast<double>(seen) / static_cast<double>(h.count()));
    }
    series.push_back(std::move(s));
  }
  return LineChart(o, series);
}

std::string Histogram(const StageResult& r, const std::string& which) {
  ChartOptions o;
  o.title = absl::StrCat("Latency histogram", which.empty() ? "" : " (" + which + ")");
  o.x_label = "latency (ms, log-spaced bins)";
  o.y_label = "requests";
  std::vector<std::string> labels;
  std::vector<double> values;
  for (const LatencyHistogram::Bucket& b : r.decode().latency.DisplayBins(24)) {
    labels.push_back(FormatMs(static_cast<double>(b.low)));
    values.push_back(static_cast<double>(b.count));
  }
  return BarChart(o, labels, values, "#4c78a8");
}

std::string ThroughputVsLatency(const BenchReport& report) {
  ChartOptions o;
  o.title = report.stages.size() > 1
                ? "Throughput against latency across the sweep"
                : "Throughput against latency (one stage; --sweep draws a curve)";
  o.x_label = "achieved decode requests/s";
  o.y_label = "latency (ms)";
  if (report.sweep_max_latency_ms > 0) {
    o.threshold_y = report.sweep_max_latency_ms;
    o.threshold_label = absl::StrCat("threshold ", report.sweep_max_latency_ms, " ms");
  }
  ChartSeries p50{"p50", kP50Color, {}, false, true};
  ChartSeries p90{"p90", kP90Color, {}, false, true};
  ChartSeries p99{"p99", kP99Color, {}, false, true};
  for (size_t i = 0; i < report.stages.size(); ++i) {
    const StageResult& r = report.stages[i];
    if (r.decode().latency.empty()) continue;
    if (report.stages.size() > 1) {
      p99.point_labels.push_back(r.setup.open_loop ? absl::StrFormat("%g/s", r.setup.target_rate)
                                                   : absl::StrCat("c=", r.setup.concurrency));
    }
    p50.points.emplace_back(r.throughput(), Ms(r.decode().latency.Percentile(0.5)));
    p90.points.emplace_back(r.throughput(), Ms(r.decode().latency.Percentile(0.9)));
    p99.points.emplace_back(r.throughput(), Ms(r.decode().latency.Percentile(0.99)));
  }
  return LineChart(o, {p99, p90, p50});
}

constexpr char kStyle[] = R"(
body { font-family: sans-serif; margin: 24px; color: #222; background: #fafafa; }
h1 { font-size: 22px; margin: 0 0 4px 0; }
h3 { font-size: 14px; margin: 14px 0 4px 0; }
h2 { font-size: 17px; margin: 26px 0 8px 0; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
.sub { color: #666; font-size: 12px; }
code { background: #eee; padding: 1px 4px; border-radius: 3px; font-size: 12px; }
.cards { display: flex; flex-wrap: wrap; gap: 10px; margin: 14px 0; }
.card { background: #fff; border: 1px solid #ddd; border-radius: 6px; padding: 8px 14px; min-width: 110px; }
.card .v { font-size: 20px; font-weight: bold; }
.card .l { font-size: 11px; color: #666; }
.card.bad .v { color: #c0392b; }
table { border-collapse: collapse; background: #fff; font-size: 12px; margin: 6px 0; }
td, th { border: 1px solid #ddd; padding: 3px 8px; text-align: left; }
th { background: #f0f0f0; }
td.n { text-align: right; font-variant-numeric: tabular-nums; }
tr.over td { background: #fdecea; }
.charts { display: flex; flex-wrap: wrap; gap: 12px; }
.charts svg { border: 1px solid #ddd; border-radius: 4px; }
.bad { color: #c0392b; }
)";

}  // namespace

std::string HtmlReport(const BenchReport& report) {
  std::string h;
  absl::StrAppend(&h, "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n",
                  "<title>indexer-bench report ", EscapeXml(report.started_at), "</title>\n<style>",
                  kStyle, "</style>\n</head>\n<body>\n");
  absl::StrAppend(&h, "<h1>indexer-bench report</h1>\n<div class=\"sub\">", EscapeXml(report.tool),
                  " ", EscapeXml(report.version), ", started ", EscapeXml(report.started_at),
                  "</div>\n<div class=\"sub\">command: <code>", EscapeXml(report.command_line),
                  "</code></div>\n");

  // Headline cards: the single stage, or the best stage under the threshold of a sweep.
  const StageResult* head = nullptr;
  for (const StageResult& r : report.stages) {
    if (r.over_threshold && head != nullptr) continue;
    if (head == nullptr || r.throughput() > head->throughput()) head = &r;
  }
  if (head != nullptr) {
    const LatencyHistogram& l = head->decode().latency;
    const auto card = [&](const std::string& value, const std::string& label, bool bad = false) {
      absl::StrAppend(&h, "<div class=\"card", bad ? " bad" : "", "\"><div class=\"v\">",
                      EscapeXml(value), "</div><div class=\"l\">", EscapeXml(label),
                      "</div></div>\n");
    };
    h += "<div class=\"cards\">\n";
    card(absl::StrFormat("%.1f", head->throughput()),
         report.stages.size() > 1 ? absl::StrCat("req/s (best: ", head->setup.label, ")")
                                  : "decode req/s");
    card(absl::StrFormat("%.0f", head->measured_s > 0
                                     ? static_cast<double>(head->selections) / head->measured_s
                                     : 0),
         "selections/s");
    card(FormatMs(static_cast<double>(l.Percentile(0.5))) + " ms", "p50");
    card(FormatMs(static_cast<double>(l.Percentile(0.99))) + " ms", "p99");
    card(FormatMs(static_cast<double>(l.Percentile(0.999))) + " ms", "p99.9");
    card(absl::StrCat(head->decode().errors), "errors", head->decode().errors > 0);
    if (report.check) {
      int64_t mismatches = 0;
      for (const StageResult& r : report.stages) mismatches += r.check.mismatches;
      card(absl::StrCat(mismatches), "mismatches vs CPU reference", mismatches > 0);
    }
    h += "</div>\n";
  }

  h += "<h2>Charts</h2>\n<div class=\"charts\">\n";
  h += LatencyOverTime(report);
  h += ThroughputOverTime(report);
  h += LatencyCdf(report);
  if (head != nullptr) {
    h += Histogram(*head, report.stages.size() > 1 ? head->setup.label : "");
  }
  h += ThroughputVsLatency(report);
  h += "</div>\n";

  h += "<h2>Stages</h2>\n<table>\n<tr><th>#</th><th>load</th><th>mode</th><th>req/s</"
       "th><th>selections/s</th>";
  for (const PercentileSpec& p : ReportedPercentiles())
    absl::StrAppend(&h, "<th>", p.label, " ms</th>");
  h += "<th>max ms</th><th>ok</th><th>errors</th><th>status codes</th></tr>\n";
  for (size_t i = 0; i < report.stages.size(); ++i) {
    const StageResult& r = report.stages[i];
    const LatencyHistogram& l = r.decode().latency;
    absl::StrAppend(
        &h, r.over_threshold ? "<tr class=\"over\">" : "<tr>", Cell(absl::StrCat(i + 1), true),
        Cell(r.setup.label),
        Cell(r.setup.open_loop ? absl::StrCat("open, ", ArrivalsName(r.setup.arrivals)) : "closed"),
        Cell(absl::StrFormat("%.1f", r.throughput()), true),
        Cell(absl::StrFormat(
                 "%.0f", r.measured_s > 0 ? static_cast<double>(r.selections) / r.measured_s : 0),
             true));
    for (const PercentileSpec& p : ReportedPercentiles()) {
      h += Cell(FormatMs(static_cast<double>(l.Percentile(p.q))), true);
    }
    absl::StrAppend(&h, Cell(FormatMs(static_cast<double>(l.max())), true),
                    Cell(absl::StrCat(r.decode().ok), true),
                    Cell(absl::StrCat(r.decode().errors), true), Cell(CodesText(r.decode().codes)),
                    "</tr>\n");
  }
  h += "</table>\n";
  if (!report.stop_reason.empty()) {
    absl::StrAppend(&h, "<p>Sweep stopped: ", EscapeXml(report.stop_reason), "</p>\n");
  }

  h += "<h2>Other "
       "operations</h2>\n<table>\n<tr><th>#</th><th>operation</th><th>calls</th><th>errors</th>"
       "<th>p50 ms</th><th>p99 ms</th><th>status codes</th></tr>\n";
  for (size_t i = 0; i < report.stages.size(); ++i) {
    for (Op op : {Op::kPrefill, Op::kTruncate, Op::kRelease}) {
      const OpTotals& o = report.stages[i].ops[static_cast<int>(op)];
      if (o.ok + o.errors == 0) continue;
      absl::StrAppend(&h, "<tr>", Cell(absl::StrCat(i + 1), true), Cell(OpName(op)),
                      Cell(absl::StrCat(o.ok + o.errors), true), Cell(absl::StrCat(o.errors), true),
                      Cell(FormatMs(static_cast<double>(o.latency.Percentile(0.5))), true),
                      Cell(FormatMs(static_cast<double>(o.latency.Percentile(0.99))), true),
                      Cell(CodesText(o.codes)), "</tr>\n");
    }
  }
  h += "</table>\n";

  if (report.check) {
    h += "<h2>Correctness</h2>\n<table>\n<tr><th>#</th><th>answers checked</th><th>rows</th>"
         "<th>mismatches</th><th>rows within tolerance</th></tr>\n";
    for (size_t i = 0; i < report.stages.size(); ++i) {
      const CheckTotals& c = report.stages[i].check;
      absl::StrAppend(&h, "<tr>", Cell(absl::StrCat(i + 1), true),
                      Cell(absl::StrCat(c.responses), true), Cell(absl::StrCat(c.rows), true),
                      Cell(absl::StrCat(c.mismatches), true), Cell(absl::StrCat(c.tolerated), true),
                      "</tr>\n");
    }
    h += "</table>\n";
    absl::StrAppend(&h,
                    "<p class=\"sub\">Every answer was recomputed in the tester with the CPU "
                    "reference selector",
                    report.exact_check ? " and compared exactly (integer-valued keys and queries)"
                                       : " and compared within tolerance",
                    ".</p>\n");
    for (const StageResult& r : report.stages) {
      for (const std::string& m : r.check.first)
        absl::StrAppend(&h, "<p class=\"bad\">", EscapeXml(m), "</p>\n");
    }
  }

  h += "<h2>Setup</h2>\n";
  std::vector<std::pair<std::string, std::string>> servers;
  for (const ServerSummary& s : report.servers) {
    servers.emplace_back(
        s.target,
        absl::StrFormat("%s %s (%s), head_dim %d, %d layer(s), %s keys, %d of %d pages free",
                        s.version, s.backend, s.device, s.head_dim, s.layers, s.key_storage,
                        s.free_pages, s.total_pages));
  }
  h += "<h3>Servers</h3>\n" + KeyValueTable(servers);
  h += "<h3>Workload</h3>\n" + KeyValueTable(report.workload);
  h += "<h3>Load</h3>\n" + KeyValueTable(report.load);
  absl::StrAppend(
      &h,
      "<p class=\"sub\">Latency is measured per decode request (one RPC), from its "
      "intended start (open loop: its scheduled arrival time, so queueing in the tester "
      "counts) to its answer; only successful requests enter the percentiles. Requests "
      "started during the warm-up are left out.</p>\n</body>\n</html>\n");
  return h;
}

}  // namespace indexer::bench
