// The HTML rendering of a BenchReport: one standalone page, inline CSS and SVG, no script.
#include <algorithm>
#include <set>

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
    ChartSeries p50{i == 0 ? "p50" : "", kP50Color, {}, false, false, {}};
    ChartSeries p99{i == 0 ? "p99" : "", kP99Color, {}, false, false, {}};
    ChartSeries max{i == 0 ? "max" : "", "#aaaaaa", {}, true, false, {}};
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
    ChartSeries ok{i == 0 ? "ok" : "", "#1f77b4", {}, false, false, {}};
    ChartSeries errors{"", "#d62728", {}, false, false, {}};
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
                  false,
                  {}};
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
                : "Throughput against latency (one stage)";
  o.x_label = report.stages.size() > 1 ? "achieved decode requests/s"
                                       : "achieved decode requests/s (--sweep draws a curve)";
  o.y_label = "latency (ms)";
  if (report.sweep_max_latency_ms > 0) {
    o.threshold_y = report.sweep_max_latency_ms;
    o.threshold_label = absl::StrCat("threshold ", report.sweep_max_latency_ms, " ms");
  }
  ChartSeries p50{"p50", kP50Color, {}, false, true, {}};
  ChartSeries p90{"p90", kP90Color, {}, false, true, {}};
  ChartSeries p99{"p99", kP99Color, {}, false, true, {}};
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

// The servers' own figures per stage (GetStats over the measured window): latency by RPC,
// handler and batcher queues, backend time, and the phases of a step when the servers export
// them; each in microseconds per decode request or per call, as the header says.
std::string ServerTable(const BenchReport& report) {
  std::set<std::string> phases;
  bool any = false;
  for (const StageResult& r : report.stages) {
    any |= r.server.available;
    for (const auto& [phase, t] : r.server.delta.phases) phases.insert(phase);
  }
  std::string h = "<h2>Server-side breakdown</h2>\n";
  if (!any) {
    const std::string note = report.stages.empty() ? "" : report.stages.front().server.note;
    return h + absl::StrCat("<p class=\"sub\">No server figures: ", EscapeXml(note), "</p>\n");
  }
  h += "<div class=\"scroll\"><table>\n<tr><th>#</th><th>load</th><th>client p50 us</th>"
       "<th>client mean us</th><th>server latency (mean us by RPC)</th><th>handler queue us</th>"
       "<th>batcher queue us</th><th>backend us / request</th><th>backend mean us</th>"
       "<th>spans / selection</th>";
  for (const std::string& phase : phases)
    absl::StrAppend(&h, "<th>", EscapeXml(phase.empty() ? "(no phase)" : phase), " us</th>");
  h += "</tr>\n";
  for (size_t i = 0; i < report.stages.size(); ++i) {
    const StageResult& r = report.stages[i];
    const LatencyHistogram& l = r.decode().latency;
    absl::StrAppend(&h, "<tr>", Cell(absl::StrCat(i + 1), true), Cell(r.setup.label),
                    Cell(absl::StrFormat("%.1f", static_cast<double>(l.Percentile(0.5)) / 1e3),
                         true),
                    Cell(absl::StrFormat("%.1f", l.mean() / 1e3), true));
    if (!r.server.available) {
      absl::StrAppend(&h, "<td colspan=\"", 6 + phases.size(), "\">", EscapeXml(r.server.note),
                      "</td></tr>\n");
      continue;
    }
    const ServerCounters& d = r.server.delta;
    const int64_t requests = r.decode().ok + r.decode().errors;
    std::string rpcs;
    for (const auto& [rpc, t] : d.request_seconds) {
      absl::StrAppendFormat(&rpcs, "%s%s %.1f", rpcs.empty() ? "" : ", ", rpc, t.mean() * 1e6);
    }
    absl::StrAppend(
        &h, Cell(rpcs.empty() ? "-" : rpcs),
        Cell(absl::StrFormat("%.1f", d.queue_seconds.mean() * 1e6), true),
        Cell(d.batch_calls.count > 0 ? absl::StrFormat("%.1f", d.batch_queue_seconds.mean() * 1e6)
                                     : "-",
             true),
        Cell(absl::StrFormat("%.1f", requests > 0 ? d.select_seconds.sum * 1e6 /
                                                        static_cast<double>(requests)
                                                  : 0.0),
             true),
        Cell(absl::StrFormat("%.1f", d.select_seconds.mean() * 1e6), true),
        Cell(absl::StrFormat("%.2f", d.select_spans.mean()), true));
    for (const std::string& phase : phases) {
      const auto it = d.phases.find(phase);
      h += Cell(it == d.phases.end() ? "-"
                                     : absl::StrFormat("%.1f", PhaseUsPerRequest(r, it->second)),
                true);
    }
    h += "</tr>\n";
  }
  h += "</table></div>\n";
  absl::StrAppend(
      &h, "<p class=\"sub\">From the servers' GetStats at the end of the warm-up and of the "
          "stage. Backend: the selections' time (kernels with their copies on a GPU), per decode "
          "request and per selection.",
      phases.empty() ? " The servers export no step phases (indexer_step_phase_seconds)."
                     : " Phases (indexer_step_phase_seconds): microseconds per decode request.",
      "</p>\n");
  return h;
}

// The phases of the headline stage as bars, when the servers export them.
std::string PhaseChart(const StageResult& r) {
  std::vector<std::string> labels;
  std::vector<double> values;
  for (const auto& [phase, t] : r.server.delta.phases) {
    labels.push_back(phase.empty() ? "(none)" : phase);
    values.push_back(PhaseUsPerRequest(r, t));
  }
  ChartOptions o;
  o.title = "Server time per decode request, by phase";
  o.x_label = "phase";
  o.y_label = "us per request";
  // Room for every phase's name under its bar.
  size_t longest = 0;
  for (const std::string& l : labels) longest = std::max(longest, l.size());
  o.width = std::max(o.width, 90 + static_cast<int>(labels.size() * (longest * 6 + 10)));
  return BarChart(o, labels, values, "#72b7b2");
}

// Open-loop stages: how late requests left against their arrival times, and what was not sent;
// trace stages: how long arrivals waited for a free slot.
std::string LagTable(const BenchReport& report) {
  std::string h;
  bool open = false, trace = false;
  for (const StageResult& r : report.stages) {
    open |= r.setup.open_loop;
    trace |= !r.admission_wait.empty();
  }
  if (open) {
    h += "<h2>Open-loop send lag</h2>\n<div class=\"scroll\"><table>\n<tr><th>#</th>"
         "<th>load</th><th>target req/s</th><th>achieved req/s</th><th>lag p50 ms</th>"
         "<th>lag p90 ms</th><th>lag p99 ms</th><th>lag max ms</th><th>not sent</th></tr>\n";
    for (size_t i = 0; i < report.stages.size(); ++i) {
      const StageResult& r = report.stages[i];
      if (!r.setup.open_loop) continue;
      const LatencyHistogram& g = r.send_lag;
      absl::StrAppend(&h, "<tr>", Cell(absl::StrCat(i + 1), true), Cell(r.setup.label),
                      Cell(absl::StrFormat("%.1f", r.setup.target_rate), true),
                      Cell(absl::StrFormat("%.1f", r.throughput()), true));
      for (double q : {0.5, 0.9, 0.99}) {
        h += Cell(FormatMs(static_cast<double>(g.Percentile(q))), true);
      }
      absl::StrAppend(&h, Cell(FormatMs(static_cast<double>(g.max())), true),
                      Cell(absl::StrCat(r.not_sent), true), "</tr>\n");
    }
    h += "</table></div>\n<p class=\"sub\">Send lag: actual send - intended send (every worker "
         "was busy); it counts in the latency, so a server that falls behind shows as latency.</p>\n";
  }
  if (trace) {
    h += "<h2>Trace admission</h2>\n<table>\n<tr><th>#</th><th>sequences</th><th>wait p50 ms</th>"
         "<th>wait p99 ms</th><th>wait max ms</th></tr>\n";
    for (size_t i = 0; i < report.stages.size(); ++i) {
      const LatencyHistogram& a = report.stages[i].admission_wait;
      if (a.empty()) continue;
      absl::StrAppend(&h, "<tr>", Cell(absl::StrCat(i + 1), true),
                      Cell(absl::StrCat(a.count()), true),
                      Cell(FormatMs(static_cast<double>(a.Percentile(0.5))), true),
                      Cell(FormatMs(static_cast<double>(a.Percentile(0.99))), true),
                      Cell(FormatMs(static_cast<double>(a.max())), true), "</tr>\n");
    }
    h += "</table>\n<p class=\"sub\">A trace's sequence waits from its arrival until a worker "
         "has a free slot for it.</p>\n";
  }
  return h;
}

std::string StabilityCell(const StabilityVerdict& v) {
  if (!v.checked) return Cell("-");
  return Cell(absl::StrFormat("%s (±%.0f%% / ±%.0f%%)%s", v.stable ? "yes" : "NO",
                              v.throughput_spread * 100, v.p50_spread * 100,
                              v.extensions > 0 ? absl::StrCat(", +", v.extensions, " windows")
                                               : std::string()));
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
.warn { background: #fff4e5; border: 1px solid #f0b37e; border-radius: 4px; padding: 6px 10px;
        margin: 6px 0; font-size: 13px; }
.scroll { overflow-x: auto; max-width: 100%; }
code { white-space: pre-wrap; word-break: break-all; }
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

  for (const std::string& w : report.warnings) {
    absl::StrAppend(&h, "<div class=\"warn\">Warning: ", EscapeXml(w), "</div>\n");
  }
  if (!report.stop_reason.empty()) {
    absl::StrAppend(&h, "<div class=\"warn\">Stopped early: ", EscapeXml(report.stop_reason),
                    "</div>\n");
  }

  h += "<h2>Charts</h2>\n<div class=\"charts\">\n";
  h += LatencyOverTime(report);
  h += ThroughputOverTime(report);
  h += LatencyCdf(report);
  if (head != nullptr) {
    h += Histogram(*head, report.stages.size() > 1 ? head->setup.label : "");
  }
  h += ThroughputVsLatency(report);
  if (head != nullptr && !head->server.delta.phases.empty()) h += PhaseChart(*head);
  h += "</div>\n";

  h += "<h2>Stages</h2>\n<div class=\"scroll\"><table>\n<tr><th>#</th><th>load</th><th>mode</th>"
       "<th>req/s</th><th>selections/s</th>";
  for (const PercentileSpec& p : ReportedPercentiles())
    absl::StrAppend(&h, "<th>", p.label, " ms</th>");
  h += "<th>max ms</th><th>ok</th><th>errors</th><th>status codes</th><th>stable (throughput / "
       "p50)</th></tr>\n";
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
                    StabilityCell(r.stability), "</tr>\n");
  }
  h += "</table></div>\n";
  for (size_t i = 0; i < report.stages.size(); ++i) {
    const StageResult& r = report.stages[i];
    for (const std::string& e : r.first_errors) {
      absl::StrAppend(&h, "<p class=\"bad\">Stage ", i + 1, " error: ", EscapeXml(e), "</p>\n");
    }
    if (!r.stop_reason.empty()) {
      absl::StrAppend(&h, "<p class=\"bad\">Stage ", i + 1, " ended early: ",
                      EscapeXml(r.stop_reason), "</p>\n");
    }
  }
  h += ServerTable(report);
  h += LagTable(report);

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
