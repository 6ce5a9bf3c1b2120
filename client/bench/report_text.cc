// The terminal renderings of a BenchReport (progress line, final summary) and WriteTextFile.
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/bench/report.h"

namespace indexer::bench {
namespace {

std::string Count(int64_t n) {
  // 1234567 -> "1,234,567"
  std::string digits = std::to_string(n < 0 ? -n : n);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return n < 0 ? "-" + out : out;
}

std::string Count(int64_t n);

std::string Rate(double per_s) {
  if (per_s >= 100) return Count(static_cast<int64_t>(std::llround(per_s)));
  if (per_s >= 10) return absl::StrFormat("%.1f", per_s);
  return absl::StrFormat("%.2f", per_s);
}

std::string Codes(const std::map<int, int64_t>& codes) {
  std::vector<std::string> parts;
  for (const auto& [code, n] : codes) parts.push_back(absl::StrCat(CodeName(code), " ", Count(n)));
  return parts.empty() ? "none" : absl::StrJoin(parts, ", ");
}

void AppendHistogram(const LatencyHistogram& h, std::string* out) {
  const std::vector<LatencyHistogram::Bucket> bins = h.DisplayBins(12);
  int64_t most = 0;
  for (const auto& b : bins) most = std::max(most, b.count);
  constexpr int kWidth = 40;
  for (const auto& b : bins) {
    const int bar = most > 0 ? static_cast<int>((b.count * kWidth + most - 1) / most) : 0;
    absl::StrAppendFormat(
        out, "    %9s - %-9s |%-*s| %9s %5.1f%%\n", FormatMs(static_cast<double>(b.low)),
        FormatMs(static_cast<double>(b.high)), kWidth, std::string(bar, '#'), Count(b.count),
        100.0 * static_cast<double>(b.count) /
            static_cast<double>(std::max<int64_t>(1, h.count())));
  }
}

// The phases of a step as the servers timed them, in microseconds per decode request.
std::string PhasesLine(const StageResult& r) {
  std::vector<std::string> parts;
  double total = 0;
  for (const auto& [phase, t] : r.server.delta.phases) {
    const double us = PhaseUsPerRequest(r, t);
    total += us;
    parts.push_back(absl::StrFormat("%s %.1f", phase.empty() ? "(none)" : phase, us));
  }
  return absl::StrFormat("  server phases    %s (us per request; %.1f in all)\n",
                         absl::StrJoin(parts, ", "), total);
}

}  // namespace

double PhaseUsPerRequest(const StageResult& r, const HistogramTotals& phase) {
  const int64_t requests = r.decode().ok + r.decode().errors;
  return requests > 0 ? phase.sum * 1e6 / static_cast<double>(requests) : 0.0;
}

const std::vector<PercentileSpec>& ReportedPercentiles() {
  static const std::vector<PercentileSpec> kPercentiles = {
      {0.50, "p50"}, {0.90, "p90"}, {0.95, "p95"}, {0.99, "p99"}, {0.999, "p99.9"}};
  return kPercentiles;
}

std::string FormatMs(double ns) {
  const double ms = ns / 1e6;
  if (ms < 10) return absl::StrFormat("%.3f", ms);
  if (ms < 100) return absl::StrFormat("%.2f", ms);
  if (ms < 1000) return absl::StrFormat("%.1f", ms);
  return absl::StrFormat("%.0f", ms);
}

std::string ProgressLine(const StageSetup& setup, int stage, int stages,
                         const ProgressSnapshot& s) {
  std::string where = stages > 1
                          ? absl::StrCat("[stage ", stage + 1, "/", stages, " ", setup.label, "] ")
                          : absl::StrCat("[", setup.label, "] ");
  if (s.prefilling) return absl::StrCat(where, "prefilling the first sequences...");
  std::string line = absl::StrFormat("%s%5.1fs%s  %s req/s  p50 %s ms  p99 %s ms  %s errors", where,
                                     s.elapsed_s, s.warming_up ? " (warm-up)" : "",
                                     Rate(s.recent_rate), FormatMs(static_cast<double>(s.p50_ns)),
                                     FormatMs(static_cast<double>(s.p99_ns)), Count(s.errors));
  if (s.checked > 0 || s.mismatches > 0) {
    absl::StrAppend(&line, "  checked ", Count(s.checked), " (", Count(s.mismatches), " wrong)");
  }
  return line;
}

std::string TextSummary(const BenchReport& report) {
  std::string out;
  absl::StrAppend(&out, report.tool, " ", report.version, ", ", report.started_at, "\n");
  for (const ServerSummary& s : report.servers) {
    absl::StrAppendFormat(&out,
                          "server %s: %s %s backend (%s), head_dim %d, %d layer(s), %s keys, "
                          "%d of %d pages free\n",
                          s.target, s.version, s.backend, s.device, s.head_dim, s.layers,
                          s.key_storage, s.free_pages, s.total_pages);
  }
  std::vector<std::string> parts;
  for (const auto& [k, v] : report.workload) parts.push_back(absl::StrCat(k, " ", v));
  absl::StrAppend(&out, "workload: ", absl::StrJoin(parts, ", "), "\n");
  parts.clear();
  for (const auto& [k, v] : report.load) parts.push_back(absl::StrCat(k, " ", v));
  absl::StrAppend(&out, "load: ", absl::StrJoin(parts, ", "), "\n");

  const int stages = static_cast<int>(report.stages.size());
  for (int i = 0; i < stages; ++i) {
    const StageResult& r = report.stages[i];
    const OpTotals& d = r.decode();
    absl::StrAppend(
        &out, "\n", stages > 1 ? absl::StrCat("stage ", i + 1, ": ") : "", r.setup.label,
        r.setup.open_loop
            ? absl::StrCat(" (open loop, ", ArrivalsName(r.setup.arrivals), " arrivals)")
            : " (closed loop)",
        r.over_threshold ? "  [over the sweep threshold]" : "", "\n");
    absl::StrAppendFormat(&out,
                          "  decode requests  %s ok, %s errors in %.2f s (+%s warm-up requests "
                          "excluded): %s req/s\n",
                          Count(d.ok), Count(d.errors), r.measured_s, Count(r.warmup_requests),
                          Rate(r.throughput()));
    if (r.measured_s > 0) {
      absl::StrAppendFormat(&out,
                            "  work             %s selections/s (token x head), %s tokens/s "
                            "appended by decode steps, %s items/request\n",
                            Rate(static_cast<double>(r.selections) / r.measured_s),
                            Rate(static_cast<double>(r.decode_tokens) / r.measured_s),
                            Rate(d.ok + d.errors > 0 ? static_cast<double>(r.items) /
                                                           static_cast<double>(d.ok + d.errors)
                                                     : 0));
    }
    if (!d.latency.empty()) {
      std::string line =
          absl::StrCat("  latency (ms)     min ", FormatMs(static_cast<double>(d.latency.min())),
                       "  mean ", FormatMs(d.latency.mean()));
      for (const PercentileSpec& p : ReportedPercentiles()) {
        absl::StrAppend(&line, "  ", p.label, " ",
                        FormatMs(static_cast<double>(d.latency.Percentile(p.q))));
      }
      absl::StrAppend(&line, "  max ", FormatMs(static_cast<double>(d.latency.max())), "\n");
      absl::StrAppend(&out, line);
      absl::StrAppend(&out, "  histogram (ms)\n");
      AppendHistogram(d.latency, &out);
    }
    absl::StrAppend(&out, "  status codes     ", Codes(d.codes), "\n");
    if (r.item_codes.size() > 1 || (r.item_codes.size() == 1 && r.item_codes.begin()->first != 0)) {
      absl::StrAppend(&out, "  batch items      ", Codes(r.item_codes), "\n");
    }
    if (r.setup.open_loop && !r.send_lag.empty()) {
      absl::StrAppendFormat(&out,
                            "  send lag (ms)    p50 %s  p99 %s  max %s (actual send - intended: "
                            "every worker was busy; it counts in the latency)\n",
                            FormatMs(static_cast<double>(r.send_lag.Percentile(0.5))),
                            FormatMs(static_cast<double>(r.send_lag.Percentile(0.99))),
                            FormatMs(static_cast<double>(r.send_lag.max())));
    }
    if (!r.admission_wait.empty()) {
      absl::StrAppendFormat(&out,
                            "  admission (ms)   p50 %s  p99 %s  max %s (trace arrival to a free "
                            "slot: the batch was full)\n",
                            FormatMs(static_cast<double>(r.admission_wait.Percentile(0.5))),
                            FormatMs(static_cast<double>(r.admission_wait.Percentile(0.99))),
                            FormatMs(static_cast<double>(r.admission_wait.max())));
    }
    if (r.not_sent > 0) {
      absl::StrAppend(&out, "  NOT SENT         ", Count(r.not_sent),
                      " arrivals still queued after the end (the load outran the workers: raise "
                      "--concurrency or lower --rate)\n");
    }
    for (Op op : {Op::kPrefill, Op::kTruncate, Op::kRelease}) {
      const OpTotals& o = r.ops[static_cast<int>(op)];
      if (o.ok + o.errors == 0) continue;
      std::string line = absl::StrFormat("  %-16s %s calls", OpName(op), Count(o.ok + o.errors));
      if (o.errors > 0) absl::StrAppend(&line, " (", Codes(o.codes), ")");
      if (op == Op::kPrefill && o.tokens > 0) {
        absl::StrAppend(&line, ", ", Count(o.tokens), " tokens");
      }
      if (!o.latency.empty()) {
        absl::StrAppend(&line, ", latency p50 ",
                        FormatMs(static_cast<double>(o.latency.Percentile(0.5))), " ms p99 ",
                        FormatMs(static_cast<double>(o.latency.Percentile(0.99))), " ms");
        if (op == Op::kPrefill && o.tokens > 0) {
          const double busy_s = o.latency.mean() * static_cast<double>(o.latency.count()) / 1e9;
          absl::StrAppend(&line, ", ", Rate(static_cast<double>(o.tokens) / busy_s),
                          " tokens/s per call");
        }
      }
      absl::StrAppend(&out, line, "\n");
    }
    if (r.server.available) {
      const ServerCounters& sd = r.server.delta;
      std::string line = absl::StrFormat(
          "  server           %s backend selections, mean %.1f us (%.1f spans each); handler "
          "queue mean %.1f us",
          Count(sd.select_seconds.count), sd.select_seconds.mean() * 1e6, sd.select_spans.mean(),
          sd.queue_seconds.mean() * 1e6);
      if (sd.batch_calls.count > 0) {
        absl::StrAppendFormat(&line, "; batcher %.1f calls per launch, queue mean %.1f us",
                              sd.batch_calls.mean(), sd.batch_queue_seconds.mean() * 1e6);
      }
      for (const auto& [rpc, t] : sd.request_seconds) {
        absl::StrAppendFormat(&line, "; %s %s calls, mean %.1f us", rpc, Count(t.count),
                              t.mean() * 1e6);
      }
      absl::StrAppend(&out, line, " (GetStats over the measured window)\n");
      if (!sd.phases.empty()) absl::StrAppend(&out, PhasesLine(r));
    }
    absl::StrAppendFormat(&out, "  sequences        %s started, %s released; stage took %.2f s\n",
                          Count(r.sequences_started), Count(r.sequences_released), r.wall_s);
    if (r.stability.checked) {
      absl::StrAppend(&out, "  stability        ", DescribeStability(r.stability), "\n");
    }
    for (const std::string& e : r.first_errors) absl::StrAppend(&out, "  error            ", e, "\n");
    if (!r.stop_reason.empty()) absl::StrAppend(&out, "  ended early      ", r.stop_reason, "\n");
    if (r.checked) {
      const CheckTotals& c = r.check;
      absl::StrAppend(&out, "  correctness      ", Count(c.responses), " answers (", Count(c.rows),
                      " rows) checked against the CPU reference",
                      report.exact_check ? " (exact)" : "", ": ", Count(c.mismatches),
                      " mismatches");
      if (c.tolerated > 0)
        absl::StrAppend(&out, ", ", Count(c.tolerated), " rows within tolerance");
      absl::StrAppend(&out, "\n");
      for (const std::string& m : c.first) absl::StrAppend(&out, "    MISMATCH ", m, "\n");
    }
  }

  if (stages > 1) {
    absl::StrAppendFormat(&out, "\n%-6s %-22s %10s", "stage", "load", "req/s");
    for (const PercentileSpec& p : ReportedPercentiles())
      absl::StrAppendFormat(&out, " %9s", p.label);
    absl::StrAppendFormat(&out, " %9s %8s\n", "max", "errors");
    for (int i = 0; i < stages; ++i) {
      const StageResult& r = report.stages[i];
      absl::StrAppendFormat(&out, "%-6d %-22s %10s", i + 1, r.setup.label, Rate(r.throughput()));
      for (const PercentileSpec& p : ReportedPercentiles()) {
        absl::StrAppendFormat(&out, " %9s",
                              FormatMs(static_cast<double>(r.decode().latency.Percentile(p.q))));
      }
      absl::StrAppendFormat(&out, " %9s %8s%s\n",
                            FormatMs(static_cast<double>(r.decode().latency.max())),
                            Count(r.decode().errors), r.over_threshold ? "  *" : "");
    }
    absl::StrAppend(&out, "(latencies in ms)\n");
  }
  if (!report.stop_reason.empty()) {
    absl::StrAppend(&out, stages > 1 || !report.sweep_kind.empty() ? "sweep stopped: "
                                                                    : "run stopped: ",
                    report.stop_reason, "\n");
  }
  for (const std::string& w : report.warnings) absl::StrAppend(&out, "warning: ", w, "\n");
  return out;
}

std::string BriefSummary(const BenchReport& report) {
  std::string out;
  for (const StageResult& r : report.stages) {
    const OpTotals& d = r.decode();
    absl::StrAppendFormat(
        &out,
        "%s: %s ok, %s errors in %.2f s: %s req/s, %s selections/s, p50 %s ms, "
        "p99 %s ms",
        r.setup.label, Count(d.ok), Count(d.errors), r.measured_s, Rate(r.throughput()),
        Rate(r.measured_s > 0 ? static_cast<double>(r.selections) / r.measured_s : 0),
        FormatMs(static_cast<double>(d.latency.Percentile(0.5))),
        FormatMs(static_cast<double>(d.latency.Percentile(0.99))));
    if (r.checked) {
      absl::StrAppend(
          &out, "; ", Count(r.check.responses), " answers checked against the CPU reference",
          report.exact_check ? " (exact)" : "", ": ", Count(r.check.mismatches), " mismatches");
    }
    if (!r.stability.stable) absl::StrAppend(&out, "; NOT STABLE");
    absl::StrAppend(&out, "\n");
  }
  if (!report.stop_reason.empty()) absl::StrAppend(&out, "stopped: ", report.stop_reason, "\n");
  for (const std::string& w : report.warnings) absl::StrAppend(&out, "warning: ", w, "\n");
  return out;
}

absl::Status WriteTextFile(const std::string& path, const std::string& content) {
  if (path == "-") {
    std::fwrite(content.data(), 1, content.size(), stdout);
    std::fflush(stdout);
    return absl::OkStatus();
  }
  FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) {
    return absl::InternalError(absl::StrCat("cannot write '", path, "': ", std::strerror(errno)));
  }
  const size_t written = std::fwrite(content.data(), 1, content.size(), f);
  const bool closed = std::fclose(f) == 0;
  if (written != content.size() || !closed) {
    return absl::InternalError(absl::StrCat("cannot write '", path, "': ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

}  // namespace indexer::bench
