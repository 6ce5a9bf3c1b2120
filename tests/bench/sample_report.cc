#include "tests/bench/sample_report.h"

#include <cmath>
#include <random>

#include "absl/strings/str_cat.h"

namespace indexer::bench {

BenchReport SampleReport(int stages) {
  BenchReport r;
  r.version = "test";
  r.started_at = "2025-01-01T00:00:00Z";
  r.command_line = "indexer-bench --sweep=concurrency:1,2,4 --check \"quoted\" <tag>";
  r.servers.push_back(
      ServerSummary{"127.0.0.1:50051", "0.1.0", "cpu", "2 threads", 128, 1, "bf16", 8192, 8000});
  r.workload = {{"prefill", "fixed:4096"}, {"heads", "4"}, {"call style", "batch"}};
  r.load = {{"mode", "sweep over concurrency"}, {"duration", "5s after 1s warm-up"}};
  r.sweep_kind = stages > 1 ? "concurrency" : "";
  r.sweep_max_latency_ms = stages > 1 ? 8 : 0;
  r.check = true;
  r.exact_check = true;
  r.interval_s = 0.5;
  std::mt19937_64 rng(2024);
  double offset = 0;
  for (int s = 0; s < stages; ++s) {
    StageResult st;
    st.setup.label = absl::StrCat("concurrency ", 1 << s);
    st.setup.concurrency = 1 << s;
    st.setup.duration_s = 5;
    st.setup.warmup_s = 1;
    st.offset_s = offset;
    st.measured_s = 5;
    st.wall_s = 6.5;
    std::lognormal_distribution<double> ln(std::log(1.5e6 * (1 + s)), 0.35 + 0.1 * s);
    OpTotals& d = st.ops[static_cast<int>(Op::kDecode)];
    const int n = 2000 * (s + 1);
    for (int i = 0; i < n; ++i) d.latency.Record(static_cast<int64_t>(ln(rng)));
    d.ok = n;
    d.errors = s == stages - 1 ? 7 : 0;
    d.codes[0] = n;
    if (d.errors > 0) {
      d.codes[4] = 5;   // DEADLINE_EXCEEDED
      d.codes[14] = 2;  // UNAVAILABLE
    }
    st.warmup_requests = 300;
    st.items = n * 8;
    st.item_codes[0] = n * 8;
    st.selections = n * 32;
    st.decode_tokens = n * 8;
    OpTotals& prefill = st.ops[static_cast<int>(Op::kPrefill)];
    prefill.ok = 32;
    prefill.tokens = 32 * 2048;
    prefill.codes[0] = 32;
    for (int i = 0; i < 32; ++i) prefill.latency.Record(3'000'000 + i * 10'000);
    st.sequences_started = 16;
    st.sequences_released = 16;
    for (int t = 0; t < 12; ++t) {
      TimelinePoint p;
      p.start_s = t * 0.5;
      p.seconds = 0.5;
      p.ok = n / 12;
      p.errors = (s == stages - 1 && t == 7) ? 7 : 0;
      p.p50_ns = static_cast<int64_t>(1.5e6 * (1 + s) * (1 + 0.05 * std::sin(t)));
      p.p90_ns = p.p50_ns * 3 / 2;
      p.p99_ns = p.p50_ns * 2;
      p.max_ns = p.p50_ns * 3;
      p.warmup = p.start_s < 1;
      st.timeline.push_back(p);
    }
    st.checked = true;
    st.check.responses = n * 8;
    st.check.rows = n * 32;
    st.over_threshold = stages > 1 && s == stages - 1;
    // The servers' figures, with the phases of a step.
    st.server.available = true;
    ServerCounters& sc = st.server.delta;
    sc.has_backend = true;
    sc.select_seconds = HistogramTotals{n, n * 400e-6};
    sc.select_spans = HistogramTotals{n, n * 8.0};
    sc.queue_seconds = HistogramTotals{n, n * 20e-6};
    sc.request_seconds["Batch"] = HistogramTotals{n, n * 1.1e-3};
    sc.has_phases = true;
    sc.phases["parse"] = HistogramTotals{n, n * 30e-6};
    sc.phases["queue"] = HistogramTotals{n, n * 20e-6};
    sc.phases["device"] = HistogramTotals{n, n * 400e-6};
    sc.phases["respond"] = HistogramTotals{n, n * 15e-6};
    // Three windows of the measured time; the last stage's disagree.
    std::vector<WindowFigures> windows;
    for (int w = 0; w < 3; ++w) {
      WindowFigures f;
      f.start_s = 1 + w * 5.0 / 3;
      f.seconds = 5.0 / 3;
      f.ok = n / 3 + (s == stages - 1 && w == 2 ? n / 3 : 0);
      f.p50_ns = static_cast<int64_t>(1.5e6 * (1 + s));
      windows.push_back(f);
    }
    st.stability = JudgeStability(windows, 10, 3);
    if (d.errors > 0) st.first_errors = {"UNAVAILABLE: 127.0.0.1:50051: connection refused"};
    offset += st.wall_s;
    r.stages.push_back(std::move(st));
  }
  if (stages > 1) r.stop_reason = "stage 3: p99 9 ms > 8 ms";
  for (const StageResult& st : r.stages) {
    if (st.stability.checked && !st.stability.stable) {
      r.warnings.push_back(absl::StrCat("the stage (", st.setup.label, ") did not settle"));
    }
  }
  return r;
}

}  // namespace indexer::bench
