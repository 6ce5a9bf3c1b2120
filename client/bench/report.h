// indexer-bench's reports: the run as a value (BenchReport) and its renderings: the live
// progress line and the final summary for a terminal, JSON and CSV exports, and a self-contained
// HTML report with inline SVG charts (no script, no network: it opens from a file anywhere).
//
// Every function here is pure (BenchReport in, text out) except ProgressLine's printer and
// WriteTextFile; any thread may call them.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "client/bench/recorder.h"

namespace indexer::bench {

// One server as ServerInfo described it.
struct ServerSummary {
  std::string target;
  std::string version;
  std::string backend;
  std::string device;
  int head_dim = 0;
  int layers = 0;
  std::string key_storage;
  int64_t total_pages = 0;
  int64_t free_pages = 0;
};

struct BenchReport {
  std::string tool = "indexer-bench";
  std::string version;
  std::string started_at;  // UTC, ISO 8601
  std::string command_line;
  std::vector<ServerSummary> servers;
  // Settings for display, in order: (name, value).
  std::vector<std::pair<std::string, std::string>> workload;
  std::vector<std::pair<std::string, std::string>> load;
  std::string sweep_kind;  // "", "concurrency" or "rate"
  double sweep_max_latency_ms = 0;
  double sweep_percentile = 0.99;
  std::string stop_reason;
  bool check = false;
  bool exact_check = false;
  double interval_s = 1;
  std::vector<StageResult> stages;
  // Things a reader must know to trust the figures (unstable stages, identical stages that
  // disagree), one sentence each.
  std::vector<std::string> warnings;
};

// A server-side phase's share of a decode request: microseconds per decode request of the
// window (phase time / requests), for tables; 0 without requests.
double PhaseUsPerRequest(const StageResult& r, const HistogramTotals& phase);

// The percentiles every summary reports, in order, with their labels.
struct PercentileSpec {
  double q;
  const char* label;
};
const std::vector<PercentileSpec>& ReportedPercentiles();  // p50 p90 p95 p99 p99.9

// Milliseconds of a nanosecond count, with as many decimals as are meaningful ("0.412", "12.3").
std::string FormatMs(double ns);

// The live progress line (no newline), e.g.
//   "[stage 2/4 concurrency 4] 6.0s  1234 req/s  p50 1.20 ms  p99 3.40 ms  0 errors".
std::string ProgressLine(const StageSetup& setup, int stage, int stages,
                         const ProgressSnapshot& snapshot);

// The final summary for a terminal: setup, then per stage throughput, latency percentiles, a
// histogram, status codes, other operations and the correctness check; a sweep table last.
std::string TextSummary(const BenchReport& report);
// One line per stage: requests, throughput, p50/p99, errors and the check, e.g.
//   "concurrency 2: 2,323 ok, 0 errors in 8.00 s: 290 req/s, p50 5.587 ms, p99 14.97 ms".
std::string BriefSummary(const BenchReport& report);
// The whole report as JSON (one object; see docs/BENCH.md for the fields).
std::string JsonReport(const BenchReport& report);
// One CSV row per stage, with a header row.
std::string CsvReport(const BenchReport& report);
// A standalone HTML page: summary tables and charts (latency over time, throughput over time,
// latency CDF, histogram, throughput against latency across the stages).
std::string HtmlReport(const BenchReport& report);

// Writes `content` to `path` ("-" = stdout). INTERNAL with the path and errno text on failure.
absl::Status WriteTextFile(const std::string& path, const std::string& content);

}  // namespace indexer::bench
