// What indexer-bench measures during one stage of a run, and the Recorder its workers write into.
//
// The headline figures are those of decode requests (one RPC each: a SelectBlocks in the unary
// style, a Batch call or BatchStream message in the others). Prefill appends, speculative
// truncations and releases are recorded as their own operations. A decode request whose
// intended start falls in the warm-up is counted apart and left out of every figure but the
// timeline (which marks warm-up intervals). Latency histograms hold successful requests only;
// failures are counted by gRPC status code.
//
// Threads: Recorder methods may be called from any thread (one mutex); StageResult is a value.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "client/bench/histogram.h"
#include "client/bench/pacer.h"
#include "client/bench/server_stats.h"
#include "client/bench/stability.h"

namespace indexer::bench {

enum class Op { kDecode = 0, kPrefill = 1, kTruncate = 2, kRelease = 3 };
inline constexpr int kNumOps = 4;
const char* OpName(Op op);

// The name of a gRPC status code number ("OK", "UNAVAILABLE", ...).
std::string CodeName(int code);

struct OpTotals {
  LatencyHistogram latency{8};   // successful calls, nanoseconds
  std::map<int, int64_t> codes;  // status code -> calls
  int64_t ok = 0;
  int64_t errors = 0;
  int64_t tokens = 0;  // prefill: tokens appended
};

// One interval of the timeline (decode requests by completion time).
struct TimelinePoint {
  double start_s = 0;  // since the stage's load began
  double seconds = 0;
  int64_t ok = 0;
  int64_t errors = 0;
  int64_t p50_ns = 0;
  int64_t p90_ns = 0;
  int64_t p99_ns = 0;
  int64_t max_ns = 0;
  bool warmup = false;  // the interval starts inside the warm-up
};

struct CheckTotals {
  int64_t responses = 0;           // answers (items) checked
  int64_t rows = 0;                // (token, head) rows compared
  int64_t tolerated = 0;           // rows accepted within tolerance
  int64_t mismatches = 0;          // answers that did not match
  std::vector<std::string> first;  // the first few mismatches, described
};

// How one stage was run.
struct StageSetup {
  std::string label;  // "concurrency 4", "rate 500/s"
  bool open_loop = false;
  int concurrency = 1;     // workers (closed loop: requests in flight; open loop: at most)
  double target_rate = 0;  // open loop, requests/s (replayed arrivals: their mean rate)
  Arrivals arrivals = Arrivals::kConstant;
  std::shared_ptr<const std::vector<double>> gaps_s;  // Arrivals::kReplay: the gaps, in order
  double duration_s = 0;  // 0: unbounded (count-limited)
  double warmup_s = 0;
  int64_t max_requests = 0;   // 0: unbounded
  int64_t max_sequences = 0;  // 0: unbounded
};

struct StageResult {
  StageSetup setup;
  double offset_s = 0;    // when the stage's load began, since the run began
  double measured_s = 0;  // the measured window: end of warm-up to the last measured completion
  double wall_s = 0;      // the whole stage, prefill and release included
  std::array<OpTotals, kNumOps> ops;
  int64_t warmup_requests = 0;
  int64_t items = 0;                  // Batch items (or unary calls) in measured requests
  std::map<int, int64_t> item_codes;  // their status codes
  int64_t selections = 0;             // (token, head) rows answered in measured requests
  int64_t decode_tokens = 0;          // tokens appended by measured decode requests
  int64_t sequences_started = 0;
  int64_t sequences_released = 0;
  LatencyHistogram send_lag{8};  // open loop: actual send - intended send, ns
  int64_t not_sent = 0;          // open loop: arrivals dropped at the end (backlog)
  LatencyHistogram admission_wait{8};  // trace: arrival to a free slot taking it, ns
  std::vector<std::string> first_errors;  // the first few distinct failure messages
  std::string stop_reason;  // why the stage ended before its limits ("" when it did not)
  StabilityVerdict stability;
  std::vector<TimelinePoint> timeline;
  CheckTotals check;
  bool checked = false;
  bool over_threshold = false;  // sweep: this stage crossed the latency threshold
  ServerStatsWindow server;     // the servers' own figures over the measured window (GetStats)

  const OpTotals& decode() const { return ops[static_cast<int>(Op::kDecode)]; }
  // Successful measured decode requests per second.
  double throughput() const;
  double error_rate() const;
};

// What a decode request did, for the Recorder.
struct DecodeRecord {
  Clock::time_point intended;  // latency is measured from here
  Clock::time_point sent;
  Clock::time_point done;
  bool measured = true;
  int code = 0;  // the request's status (first failed item's for batches)
  std::string message;  // its message, when it failed
  int64_t items = 0;
  std::map<int, int64_t> item_codes;
  int64_t selections = 0;
  int64_t tokens = 0;
  bool open_loop = false;
};

// A live view for the progress line.
struct ProgressSnapshot {
  bool prefilling = false;  // the first sequences are still being prefilled
  double elapsed_s = 0;
  bool warming_up = true;
  int64_t ok = 0;  // measured successful decode requests so far
  int64_t errors = 0;
  double recent_rate = 0;  // successful decode requests/s over the last interval
  int64_t p50_ns = 0;      // of the measured requests so far
  int64_t p99_ns = 0;
  int64_t checked = 0;
  int64_t mismatches = 0;
};

class Recorder {
 public:
  Recorder(double warmup_s, double interval_s);

  // Marks when the stage's load begins (after the first prefills): warm-up and intervals count
  // from there. Call once, before any RecordDecode.
  void Begin(Clock::time_point start);

  void RecordDecode(const DecodeRecord& r);
  void RecordOther(Op op, Clock::duration latency, int code, int64_t tokens = 0);
  void RecordCheck(int64_t rows, int64_t tolerated, const std::string& mismatch);
  // A trace's sequence waited this long between its arrival and a worker taking it.
  void RecordAdmission(int64_t wait_ns);
  void SequenceStarted();
  void SequenceReleased();
  void NotSent(int64_t n);

  Clock::time_point start() const;
  Clock::time_point warmup_end() const;

  ProgressSnapshot Snapshot() const;
  // Up to `count` consecutive windows of at most `window_s` (whole timeline intervals), the last
  // ending at the last interval complete at `until`, none reaching into the warm-up: fewer when
  // the measured time is shorter.
  std::vector<WindowFigures> Windows(int count, double window_s, Clock::time_point until) const;
  // When the latest measured decode request completed.
  Clock::time_point last_done() const;
  // The stage's figures; call once every worker has stopped.
  StageResult Finish(const StageSetup& setup, double offset_s, double wall_s, bool checked) const;

 private:
  struct Interval {
    LatencyHistogram latency{5};
    int64_t ok = 0;
    int64_t errors = 0;
  };

  const double warmup_s_;
  const double interval_s_;
  mutable std::mutex mu_;
  Clock::time_point start_;
  Clock::time_point warmup_end_;
  StageResult totals_;  // setup, offsets and timeline filled in by Finish
  std::vector<Interval> intervals_;
  Clock::time_point last_done_;
  bool any_measured_ = false;
};

}  // namespace indexer::bench
