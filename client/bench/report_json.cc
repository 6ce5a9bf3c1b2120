// The JSON and CSV renderings of a BenchReport.
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/bench/json_writer.h"
#include "client/bench/report.h"

namespace indexer::bench {
namespace {

double Ms(int64_t ns) { return static_cast<double>(ns) / 1e6; }

// "p99.9" -> "p99_9": keys that every JSON consumer can address.
std::string PercentileKey(const char* label) {
  std::string key = label;
  for (char& c : key) {
    if (c == '.') c = '_';
  }
  return key;
}

void LatencyObject(JsonWriter& j, const LatencyHistogram& h) {
  j.BeginObject(true);
  j.Field("count", h.count());
  j.Field("min", Ms(h.min()));
  j.Field("mean", h.mean() / 1e6);
  j.Field("stddev", h.stddev() / 1e6);
  for (const PercentileSpec& p : ReportedPercentiles())
    j.Field(PercentileKey(p.label), Ms(h.Percentile(p.q)));
  j.Field("max", Ms(h.max()));
  j.EndObject();
}

void CodesObject(JsonWriter& j, const std::map<int, int64_t>& codes) {
  j.BeginObject(true);
  for (const auto& [code, n] : codes) j.Field(CodeName(code), n);
  j.EndObject();
}

// The servers' own figures over the measured window (GetStats), in microseconds.
void ServerStatsObject(JsonWriter& j, const StageResult& r) {
  const ServerStatsWindow& w = r.server;
  j.BeginObject();
  j.Field("available", w.available);
  if (!w.available) {
    j.Field("note", w.note);
    j.EndObject();
    return;
  }
  const ServerCounters& d = w.delta;
  const int64_t requests = r.decode().ok + r.decode().errors;
  j.Field("backend_selections", d.select_seconds.count);
  j.Field("backend_select_s", d.select_seconds.sum);
  j.Field("backend_select_mean_us", d.select_seconds.mean() * 1e6);
  j.Field("backend_select_us_per_request",
          requests > 0 ? d.select_seconds.sum * 1e6 / static_cast<double>(requests) : 0.0);
  j.Field("spans_per_selection", d.select_spans.mean());
  j.Field("queue_mean_us", d.queue_seconds.mean() * 1e6);
  j.Field("batch_items_mean", d.batch_items.mean());
  // The select batcher (servers with --batching; zero elsewhere).
  j.Field("calls_per_launch", d.batch_calls.mean());
  j.Field("batch_queue_mean_us", d.batch_queue_seconds.mean() * 1e6);
  j.Key("requests").BeginObject();
  for (const auto& [rpc, t] : d.request_seconds) {
    j.Key(rpc).BeginObject(true);
    j.Field("count", t.count);
    j.Field("mean_us", t.mean() * 1e6);
    j.EndObject();
  }
  j.EndObject();
  // indexer_step_phase_seconds by phase: mean of an observation and time per decode request.
  j.Field("phases_available", d.has_phases);
  j.Key("phases").BeginObject();
  for (const auto& [phase, t] : d.phases) {
    j.Key(phase).BeginObject(true);
    j.Field("count", t.count);
    j.Field("mean_us", t.mean() * 1e6);
    j.Field("us_per_request", PhaseUsPerRequest(r, t));
    j.EndObject();
  }
  j.EndObject();
  j.Key("backend_counts").BeginObject(true);
  for (const auto& [name, v] : d.backend_counts) j.Field(name, v);
  j.EndObject();
  j.EndObject();
}

void StabilityObject(JsonWriter& j, const StabilityVerdict& v) {
  j.BeginObject();
  j.Field("checked", v.checked);
  j.Field("stable", v.stable);
  j.Field("percent", v.percent);
  j.Field("throughput_spread_pct", v.throughput_spread * 100);
  j.Field("p50_spread_pct", v.p50_spread * 100);
  j.Field("extensions", v.extensions);
  j.Field("note", v.note);
  j.Key("windows").BeginArray();
  for (const WindowFigures& w : v.windows) {
    j.BeginObject(true);
    j.Field("t_s", w.start_s);
    j.Field("seconds", w.seconds);
    j.Field("ok", w.ok);
    j.Field("errors", w.errors);
    j.Field("rps", w.rps());
    j.Field("p50_ms", Ms(w.p50_ns));
    j.EndObject();
  }
  j.EndArray();
  j.EndObject();
}

void StageObject(JsonWriter& j, const StageResult& r) {
  const OpTotals& d = r.decode();
  j.BeginObject();
  j.Field("label", r.setup.label);
  j.Field("mode", r.setup.open_loop ? "open" : "closed");
  j.Field("concurrency", r.setup.concurrency);
  if (r.setup.open_loop) {
    j.Field("target_rate", r.setup.target_rate);
    j.Field("arrivals", ArrivalsName(r.setup.arrivals));
  }
  j.Field("duration_s", r.setup.duration_s);
  j.Field("warmup_s", r.setup.warmup_s);
  j.Field("max_requests", r.setup.max_requests);
  j.Field("max_sequences", r.setup.max_sequences);
  j.Field("offset_s", r.offset_s);
  j.Field("measured_s", r.measured_s);
  j.Field("wall_s", r.wall_s);
  j.Key("requests").BeginObject();
  j.Field("ok", d.ok);
  j.Field("errors", d.errors);
  j.Field("warmup_excluded", r.warmup_requests);
  j.Field("not_sent", r.not_sent);
  j.EndObject();
  j.Field("throughput_rps", r.throughput());
  j.Field("error_rate", r.error_rate());
  j.Field("selections_per_s",
          r.measured_s > 0 ? static_cast<double>(r.selections) / r.measured_s : 0.0);
  j.Field("decode_tokens_per_s",
          r.measured_s > 0 ? static_cast<double>(r.decode_tokens) / r.measured_s : 0.0);
  j.Field("items", r.items);
  j.Key("latency_ms");
  LatencyObject(j, d.latency);
  j.Key("histogram").BeginArray();
  for (const LatencyHistogram::Bucket& b : d.latency.DisplayBins(20)) {
    j.BeginObject(true)
        .Field("low_ms", Ms(b.low))
        .Field("high_ms", Ms(b.high))
        .Field("count", b.count)
        .EndObject();
  }
  j.EndArray();
  j.Key("buckets_ns").BeginArray();  // the full-resolution histogram: [low, high, count]
  for (const LatencyHistogram::Bucket& b : d.latency.Buckets()) {
    j.CompactInts({b.low, b.high, b.count});
  }
  j.EndArray();
  j.Key("status_codes");
  CodesObject(j, d.codes);
  j.Key("item_status_codes");
  CodesObject(j, r.item_codes);
  if (r.setup.open_loop) {
    j.Key("send_lag_ms");
    LatencyObject(j, r.send_lag);
  }
  if (!r.admission_wait.empty()) {
    j.Key("admission_wait_ms");
    LatencyObject(j, r.admission_wait);
  }
  j.Key("first_errors").BeginArray();
  for (const std::string& e : r.first_errors) j.Value(e);
  j.EndArray();
  j.Field("stop_reason", r.stop_reason);
  j.Key("stability");
  StabilityObject(j, r.stability);
  j.Key("operations").BeginObject();
  for (Op op : {Op::kPrefill, Op::kTruncate, Op::kRelease}) {
    const OpTotals& o = r.ops[static_cast<int>(op)];
    j.Key(OpName(op)).BeginObject();
    j.Field("ok", o.ok);
    j.Field("errors", o.errors);
    if (op == Op::kPrefill) j.Field("tokens", o.tokens);
    j.Key("latency_ms");
    LatencyObject(j, o.latency);
    j.Key("status_codes");
    CodesObject(j, o.codes);
    j.EndObject();
  }
  j.EndObject();
  j.Key("sequences").BeginObject();
  j.Field("started", r.sequences_started);
  j.Field("released", r.sequences_released);
  j.EndObject();
  j.Key("timeline").BeginArray();
  for (const TimelinePoint& p : r.timeline) {
    j.BeginObject(true);
    j.Field("t_s", p.start_s);
    j.Field("seconds", p.seconds);
    j.Field("ok", p.ok);
    j.Field("errors", p.errors);
    j.Field("rps", p.seconds > 0 ? static_cast<double>(p.ok) / p.seconds : 0.0);
    j.Field("p50_ms", Ms(p.p50_ns));
    j.Field("p90_ms", Ms(p.p90_ns));
    j.Field("p99_ms", Ms(p.p99_ns));
    j.Field("max_ms", Ms(p.max_ns));
    j.Field("warmup", p.warmup);
    j.EndObject();
  }
  j.EndArray();
  if (r.checked) {
    j.Key("correctness").BeginObject();
    j.Field("responses", r.check.responses);
    j.Field("rows", r.check.rows);
    j.Field("mismatches", r.check.mismatches);
    j.Field("tolerated_rows", r.check.tolerated);
    j.Key("first_mismatches").BeginArray();
    for (const std::string& m : r.check.first) j.Value(m);
    j.EndArray();
    j.EndObject();
  } else {
    j.Key("correctness").Null();
  }
  j.Field("over_threshold", r.over_threshold);
  j.Key("server_stats");
  ServerStatsObject(j, r);
  j.EndObject();
}

std::string CsvField(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) {
    if (c == '"') out += '"';
    out += c;
  }
  return out + "\"";
}

}  // namespace

std::string JsonReport(const BenchReport& report) {
  JsonWriter j;
  j.BeginObject();
  j.Field("tool", report.tool);
  j.Field("version", report.version);
  j.Field("started_at", report.started_at);
  j.Field("command_line", report.command_line);
  j.Key("servers").BeginArray();
  for (const ServerSummary& s : report.servers) {
    j.BeginObject();
    j.Field("target", s.target);
    j.Field("version", s.version);
    j.Field("backend", s.backend);
    j.Field("device", s.device);
    j.Field("head_dim", s.head_dim);
    j.Field("layers", s.layers);
    j.Field("key_storage", s.key_storage);
    j.Field("total_pages", s.total_pages);
    j.Field("free_pages", s.free_pages);
    j.EndObject();
  }
  j.EndArray();
  j.Key("workload").BeginObject();
  for (const auto& [k, v] : report.workload) j.Field(k, v);
  j.EndObject();
  j.Key("load").BeginObject();
  for (const auto& [k, v] : report.load) j.Field(k, v);
  j.EndObject();
  j.Key("sweep").BeginObject();
  j.Field("kind", report.sweep_kind);
  j.Field("max_latency_ms", report.sweep_max_latency_ms);
  j.Field("percentile", report.sweep_percentile);
  j.Field("stop_reason", report.stop_reason);
  j.EndObject();
  j.Field("check", report.check);
  j.Field("exact_check", report.exact_check);
  j.Field("interval_s", report.interval_s);
  j.Key("stages").BeginArray();
  for (const StageResult& r : report.stages) StageObject(j, r);
  j.EndArray();
  j.Key("warnings").BeginArray();
  for (const std::string& w : report.warnings) j.Value(w);
  j.EndArray();
  j.EndObject();
  return j.str() + "\n";
}

std::string CsvReport(const BenchReport& report) {
  std::vector<std::string> header = {
      "stage", "label",  "mode",           "concurrency",      "target_rate", "measured_s",
      "ok",    "errors", "throughput_rps", "selections_per_s", "mean_ms"};
  for (const PercentileSpec& p : ReportedPercentiles())
    header.push_back(PercentileKey(p.label) + "_ms");
  header.insert(header.end(), {"max_ms", "checked", "mismatches", "over_threshold"});
  std::string out = absl::StrJoin(header, ",") + "\n";
  for (size_t i = 0; i < report.stages.size(); ++i) {
    const StageResult& r = report.stages[i];
    const LatencyHistogram& h = r.decode().latency;
    std::vector<std::string> row = {
        absl::StrCat(i + 1),
        CsvField(r.setup.label),
        r.setup.open_loop ? "open" : "closed",
        absl::StrCat(r.setup.concurrency),
        absl::StrCat(r.setup.target_rate),
        absl::StrCat(r.measured_s),
        absl::StrCat(r.decode().ok),
        absl::StrCat(r.decode().errors),
        absl::StrCat(r.throughput()),
        absl::StrCat(r.measured_s > 0 ? static_cast<double>(r.selections) / r.measured_s : 0.0),
        absl::StrCat(h.mean() / 1e6)};
    for (const PercentileSpec& p : ReportedPercentiles())
      row.push_back(absl::StrCat(Ms(h.Percentile(p.q))));
    row.insert(row.end(), {absl::StrCat(Ms(h.max())), absl::StrCat(r.check.responses),
                           absl::StrCat(r.check.mismatches), r.over_threshold ? "1" : "0"});
    out += absl::StrJoin(row, ",") + "\n";
  }
  return out;
}

}  // namespace indexer::bench
