#include "client/bench/recorder.h"

#include <algorithm>
#include <cmath>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace indexer::bench {
namespace {

constexpr size_t kMismatchesKept = 5;
constexpr size_t kErrorsKept = 5;

}  // namespace

const char* OpName(Op op) {
  switch (op) {
    case Op::kDecode:
      return "decode";
    case Op::kPrefill:
      return "prefill";
    case Op::kTruncate:
      return "truncate";
    case Op::kRelease:
      return "release";
  }
  return "?";
}

std::string CodeName(int code) {
  if (code < 0 || code > 16) return "CODE_" + std::to_string(code);
  return absl::StatusCodeToString(static_cast<absl::StatusCode>(code));
}

double StageResult::throughput() const {
  return measured_s > 0 ? static_cast<double>(decode().ok) / measured_s : 0;
}

double StageResult::error_rate() const {
  const int64_t all = decode().ok + decode().errors;
  return all > 0 ? static_cast<double>(decode().errors) / static_cast<double>(all) : 0;
}

Recorder::Recorder(double warmup_s, double interval_s)
    : warmup_s_(std::max(0.0, warmup_s)), interval_s_(interval_s > 0 ? interval_s : 1.0) {
  Begin(Clock::now());
}

void Recorder::Begin(Clock::time_point start) {
  std::lock_guard<std::mutex> lock(mu_);
  start_ = start;
  warmup_end_ =
      start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(warmup_s_));
  last_done_ = start;
}

Clock::time_point Recorder::start() const {
  std::lock_guard<std::mutex> lock(mu_);
  return start_;
}

Clock::time_point Recorder::warmup_end() const {
  std::lock_guard<std::mutex> lock(mu_);
  return warmup_end_;
}

void Recorder::RecordDecode(const DecodeRecord& r) {
  const int64_t latency = Nanos(r.done - r.intended);
  std::lock_guard<std::mutex> lock(mu_);
  const double at = Seconds(r.done - start_);
  const size_t interval = at <= 0 ? 0 : static_cast<size_t>(at / interval_s_);
  if (interval >= intervals_.size()) intervals_.resize(interval + 1);
  Interval& iv = intervals_[interval];
  if (r.code == 0) {
    ++iv.ok;
    iv.latency.Record(latency);
  } else {
    ++iv.errors;
  }
  if (!r.measured) {
    ++totals_.warmup_requests;
    return;
  }
  OpTotals& d = totals_.ops[static_cast<int>(Op::kDecode)];
  ++d.codes[r.code];
  if (r.code == 0) {
    ++d.ok;
    d.latency.Record(latency);
  } else {
    ++d.errors;
    const std::string what = absl::StrCat(CodeName(r.code), ": ", r.message);
    std::vector<std::string>& first = totals_.first_errors;
    if (first.size() < kErrorsKept && std::find(first.begin(), first.end(), what) == first.end()) {
      first.push_back(what);
    }
  }
  totals_.items += r.items;
  for (const auto& [code, n] : r.item_codes) totals_.item_codes[code] += n;
  totals_.selections += r.selections;
  totals_.decode_tokens += r.tokens;
  if (r.open_loop) totals_.send_lag.Record(Nanos(r.sent - r.intended));
  if (!any_measured_ || r.done > last_done_) last_done_ = r.done;
  any_measured_ = true;
}

void Recorder::RecordOther(Op op, Clock::duration latency, int code, int64_t tokens) {
  std::lock_guard<std::mutex> lock(mu_);
  OpTotals& o = totals_.ops[static_cast<int>(op)];
  ++o.codes[code];
  if (code == 0) {
    ++o.ok;
    o.latency.Record(Nanos(latency));
    o.tokens += tokens;
  } else {
    ++o.errors;
  }
}

void Recorder::RecordCheck(int64_t rows, int64_t tolerated, const std::string& mismatch) {
  std::lock_guard<std::mutex> lock(mu_);
  CheckTotals& c = totals_.check;
  ++c.responses;
  c.rows += rows;
  c.tolerated += tolerated;
  if (!mismatch.empty()) {
    ++c.mismatches;
    if (c.first.size() < kMismatchesKept) c.first.push_back(mismatch);
  }
}

void Recorder::RecordAdmission(int64_t wait_ns) {
  std::lock_guard<std::mutex> lock(mu_);
  totals_.admission_wait.Record(wait_ns);
}

Clock::time_point Recorder::last_done() const {
  std::lock_guard<std::mutex> lock(mu_);
  return last_done_;
}

std::vector<WindowFigures> Recorder::Windows(int count, double window_s,
                                             Clock::time_point until) const {
  std::lock_guard<std::mutex> lock(mu_);
  // Whole intervals, rounded down so that `count` windows fit in the time they were meant for.
  const int64_t per_window =
      std::max<int64_t>(1, static_cast<int64_t>(std::floor(window_s / interval_s_ + 1e-6)));
  // Intervals [first, end) are wholly measured and complete.
  // (The slack absorbs the clock's nanosecond rounding.)
  const int64_t first = static_cast<int64_t>(std::ceil(warmup_s_ / interval_s_ - 1e-6));
  const int64_t end =
      static_cast<int64_t>(std::floor(Seconds(until - start_) / interval_s_ + 1e-6));
  const int64_t n = std::clamp<int64_t>((end - first) / per_window, 0, count);
  std::vector<WindowFigures> windows;
  for (int64_t w = 0; w < n; ++w) {
    const int64_t from = end - (n - w) * per_window;
    LatencyHistogram latency{5};
    WindowFigures f;
    f.start_s = static_cast<double>(from) * interval_s_;
    f.seconds = static_cast<double>(per_window) * interval_s_;
    for (int64_t i = from; i < from + per_window; ++i) {
      if (i < 0 || static_cast<size_t>(i) >= intervals_.size()) continue;
      const Interval& iv = intervals_[static_cast<size_t>(i)];
      f.ok += iv.ok;
      f.errors += iv.errors;
      latency.Merge(iv.latency);
    }
    f.p50_ns = latency.Percentile(0.5);
    windows.push_back(f);
  }
  return windows;
}

void Recorder::SequenceStarted() {
  std::lock_guard<std::mutex> lock(mu_);
  ++totals_.sequences_started;
}

void Recorder::SequenceReleased() {
  std::lock_guard<std::mutex> lock(mu_);
  ++totals_.sequences_released;
}

void Recorder::NotSent(int64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  totals_.not_sent += n;
}

ProgressSnapshot Recorder::Snapshot() const {
  const Clock::time_point now = Clock::now();
  ProgressSnapshot s;
  std::lock_guard<std::mutex> lock(mu_);
  s.elapsed_s = Seconds(now - start_);
  s.warming_up = now < warmup_end_;
  const OpTotals& d = totals_.ops[static_cast<int>(Op::kDecode)];
  s.ok = d.ok;
  s.errors = d.errors;
  s.p50_ns = d.latency.Percentile(0.50);
  s.p99_ns = d.latency.Percentile(0.99);
  s.checked = totals_.check.responses;
  s.mismatches = totals_.check.mismatches;
  // The last complete interval.
  const int64_t current = static_cast<int64_t>(std::max(0.0, s.elapsed_s) / interval_s_);
  if (current >= 1 && static_cast<size_t>(current - 1) < intervals_.size()) {
    s.recent_rate = static_cast<double>(intervals_[current - 1].ok) / interval_s_;
  } else if (s.elapsed_s > 0 && !intervals_.empty()) {
    s.recent_rate = static_cast<double>(intervals_[0].ok) / s.elapsed_s;
  }
  return s;
}

StageResult Recorder::Finish(const StageSetup& setup, double offset_s, double wall_s,
                             bool checked) const {
  std::lock_guard<std::mutex> lock(mu_);
  StageResult r = totals_;
  r.setup = setup;
  r.offset_s = offset_s;
  r.wall_s = wall_s;
  r.checked = checked;
  r.measured_s = any_measured_ ? std::max(0.0, Seconds(last_done_ - warmup_end_)) : 0;
  const double warmup_s = Seconds(warmup_end_ - start_);
  // The last interval is usually cut short by the end of the stage: shorter than half an
  // interval, it joins the one before (a few requests over a sliver of time would read as a
  // spike of throughput).
  std::vector<Interval> intervals = intervals_;
  std::vector<double> seconds(intervals.size(), interval_s_);
  if (!intervals.empty() && any_measured_) {
    const double tail =
        Seconds(last_done_ - start_) - interval_s_ * static_cast<double>(intervals.size() - 1);
    seconds.back() = std::clamp(tail, 1e-3, interval_s_);
    if (intervals.size() >= 2 && seconds.back() < interval_s_ / 2) {
      Interval& prev = intervals[intervals.size() - 2];
      prev.latency.Merge(intervals.back().latency);
      prev.ok += intervals.back().ok;
      prev.errors += intervals.back().errors;
      seconds[seconds.size() - 2] += seconds.back();
      intervals.pop_back();
      seconds.pop_back();
    }
  }
  for (size_t i = 0; i < intervals.size(); ++i) {
    const Interval& iv = intervals[i];
    TimelinePoint p;
    p.start_s = static_cast<double>(i) * interval_s_;
    p.seconds = seconds[i];
    p.ok = iv.ok;
    p.errors = iv.errors;
    p.p50_ns = iv.latency.Percentile(0.50);
    p.p90_ns = iv.latency.Percentile(0.90);
    p.p99_ns = iv.latency.Percentile(0.99);
    p.max_ns = iv.latency.max();
    p.warmup = p.start_s < warmup_s;
    r.timeline.push_back(p);
  }
  return r;
}

}  // namespace indexer::bench
