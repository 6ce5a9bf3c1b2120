#include "client/bench/runner.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "client/bench/backoff.h"
#include "client/bench/pacer.h"
#include "client/bench/scheduler.h"
#include "client/bench/server_stats.h"

namespace indexer::bench {
namespace {

std::atomic<bool> stop_requested{false};

bool StopRequestedHere() { return stop_requested.load(std::memory_order_relaxed); }

Clock::duration FromSeconds(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

// Holds workers until all have prefilled their first sequences, then starts the load together.
class StartGate {
 public:
  StartGate(int workers, std::function<void(Clock::time_point)> on_open)
      : waiting_(workers), on_open_(std::move(on_open)) {}

  Clock::time_point ArriveAndWait() {
    std::unique_lock<std::mutex> lock(mu_);
    if (--waiting_ == 0) {
      start_ = Clock::now();
      on_open_(start_);
      open_ = true;
      cv_.notify_all();
    }
    cv_.wait(lock, [this] { return open_; });
    return start_;
  }
  bool open() {
    std::lock_guard<std::mutex> lock(mu_);
    return open_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int waiting_;
  bool open_ = false;
  Clock::time_point start_;
  std::function<void(Clock::time_point)> on_open_;
};

// The end of a stage's load, read by every worker: set when the load begins, pushed back window
// by window while the stage is not yet stable (when it may be extended), or brought forward by
// Stop (the servers are unreachable).
class StageControl {
 public:
  explicit StageControl(bool extendable) : final_(!extendable) {}

  void SetEnd(Clock::time_point end) {
    std::lock_guard<std::mutex> lock(mu_);
    end_ = end;
    has_end_ = true;
  }
  Clock::time_point end() const {
    std::lock_guard<std::mutex> lock(mu_);
    return has_end_ ? end_ : Clock::time_point::max();
  }
  bool has_end() const {
    std::lock_guard<std::mutex> lock(mu_);
    return has_end_;
  }
  // Whether the load is over for a request meant to start at `t`. At the end of an extendable
  // stage it waits for the controller to decide.
  bool Over(Clock::time_point t) {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      if (stopped_) return true;
      if (!has_end_ || t < end_) return false;
      if (final_) return true;
      cv_.wait(lock);
    }
  }
  bool final() const {
    std::lock_guard<std::mutex> lock(mu_);
    return final_;
  }
  void Extend(Clock::duration by) {
    std::lock_guard<std::mutex> lock(mu_);
    end_ += by;
    ++extensions_;
    cv_.notify_all();
  }
  void Finalize() {
    std::lock_guard<std::mutex> lock(mu_);
    final_ = true;
    cv_.notify_all();
  }
  void Stop(const std::string& reason) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stopped_) reason_ = reason;
    stopped_ = true;
    final_ = true;
    cv_.notify_all();
  }
  bool stopped() const {
    std::lock_guard<std::mutex> lock(mu_);
    return stopped_;
  }
  std::string reason() const {
    std::lock_guard<std::mutex> lock(mu_);
    return reason_;
  }
  int extensions() const {
    std::lock_guard<std::mutex> lock(mu_);
    return extensions_;
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  Clock::time_point end_;
  bool has_end_ = false;
  bool final_;
  bool stopped_ = false;
  std::string reason_;
  int extensions_ = 0;
};

// Sleeps until `until`, waking early when the run or the stage is stopped.
void Nap(Clock::time_point until, const StageControl& control) {
  while (!StopRequestedHere() && !control.stopped()) {
    const Clock::time_point now = Clock::now();
    if (now >= until) return;
    std::this_thread::sleep_for(std::min<Clock::duration>(until - now, std::chrono::milliseconds(50)));
  }
}

constexpr int kUnavailable = static_cast<int>(absl::StatusCode::kUnavailable);

}  // namespace

void RequestStop() { stop_requested.store(true, std::memory_order_relaxed); }
bool StopRequested() { return StopRequestedHere(); }

absl::StatusOr<StageResult> RunStage(const StageSetup& setup, const WorkloadSpec& spec,
                                     const ServerShape& shape, const ValuePool& pool,
                                     const std::vector<client::ShardedClient*>& connections,
                                     const LoadOptions& options, double offset_s,
                                     const ProgressFn& progress, int stage, int stages) {
  if (setup.concurrency < 1) return absl::InvalidArgumentError("concurrency must be >= 1");
  if (connections.empty()) return absl::InvalidArgumentError("no connections");
  if (setup.duration_s <= 0 && setup.max_requests <= 0 && setup.max_sequences <= 0 &&
      spec.trace == nullptr) {
    return absl::InvalidArgumentError(
        "a stage needs a limit: a duration, a request count, a sequence count or a trace");
  }
  if (setup.open_loop && !(setup.target_rate > 0)) {
    return absl::InvalidArgumentError("an open-loop stage needs a rate > 0");
  }
  const Clock::time_point stage_begin = Clock::now();
  Recorder recorder(setup.warmup_s, options.interval_s);
  SequenceSource source(spec, setup.max_sequences);
  std::atomic<int64_t> attention_pages{0};
  SchedulerContext ctx;
  ctx.spec = &spec;
  ctx.shape = &shape;
  ctx.pool = &pool;
  ctx.recorder = &recorder;
  ctx.source = &source;
  ctx.call = client::CallOptions::Timeout(options.timeout);
  ctx.check = options.check;
  ctx.check_params.select = EffectiveParams(spec, shape);
  ctx.check_params.page_table = shape.page_table;
  ctx.check_params.exact = spec.values == ValueKind::kInteger;
  ctx.check_params.tolerance = options.tolerance;
  ctx.attention_pages = &attention_pages;

  const bool timed = setup.duration_s > 0;
  const double window_s =
      timed ? setup.duration_s / std::max(1, options.stability_windows) : 0.0;
  const bool extendable = timed && options.stability_percent > 0 &&
                          options.max_duration_s > setup.duration_s && window_s > 0;
  StageControl control(extendable);
  OutageMonitor outage;
  std::unique_ptr<ArrivalPacer> pacer;
  StartGate gate(setup.concurrency, [&](Clock::time_point start) {
    recorder.Begin(start);
    source.Begin(start);
    if (timed) control.SetEnd(start + FromSeconds(setup.warmup_s + setup.duration_s));
    if (setup.open_loop && setup.arrivals == Arrivals::kReplay) {
      pacer = std::make_unique<ArrivalPacer>(setup.gaps_s, start);
    } else if (setup.open_loop) {
      pacer = std::make_unique<ArrivalPacer>(setup.target_rate, setup.arrivals, start,
                                             options.seed * 7919 + static_cast<uint64_t>(stage));
    }
  });
  std::atomic<int64_t> claimed{0};
  std::mutex done_mu;
  std::condition_variable done_cv;
  int running = setup.concurrency;
  // Open loop: arrivals still waiting this long after the end are dropped and counted.
  const Clock::duration backlog = FromSeconds(std::max(1.0, 0.1 * setup.duration_s));

  const auto worker = [&](int w) {
    SimulatedScheduler scheduler(
        ctx, *connections[static_cast<size_t>(w) % connections.size()],
        options.seed * 1000003 + static_cast<uint64_t>(w) * 7919 + static_cast<uint64_t>(stage));
    SimulatedScheduler::RefillState state = scheduler.Refill();
    const Clock::time_point start = gate.ArriveAndWait();
    const Clock::time_point warmup_end = start + FromSeconds(setup.warmup_s);
    if (state.live == 0) state = scheduler.Refill();  // a trace's arrivals count from the start
    Backoff backoff;
    bool stage_over = false;  // ended by a limit, not by running out of sequences
    while (!stage_over) {
      if (StopRequested() || control.stopped()) {
        stage_over = true;
        break;
      }
      if (state.live == 0) {
        if (state.source_done) break;
        // The next arrival of a trace, or a prefill the servers refused: wait, then try again.
        const Clock::time_point wake =
            state.next_arrival ? *state.next_arrival : Clock::now() + backoff.Next();
        if (control.Over(wake)) {
          stage_over = true;
          break;
        }
        Nap(wake, control);
        state = scheduler.Refill();
        continue;
      }
      Clock::time_point intended;
      if (setup.open_loop) {
        intended = pacer->Next();
        if (control.Over(intended)) {
          stage_over = true;
          break;
        }
        if (control.has_end() && Clock::now() > control.end() + backlog) {
          recorder.NotSent(1);
          continue;
        }
      } else {
        intended = Clock::now();
        if (control.Over(intended)) {
          stage_over = true;
          break;
        }
      }
      const bool measured = intended >= warmup_end;
      if (measured && setup.max_requests > 0 && claimed.fetch_add(1) >= setup.max_requests) {
        stage_over = true;
        break;
      }
      if (setup.open_loop) SleepUntil(intended);
      if (!scheduler.Decode(intended, measured, setup.open_loop) && setup.open_loop) {
        recorder.NotSent(1);  // nothing was live to send it for
      }
      state = scheduler.Refill();
      // A down server fails every call at once: back off instead of spinning.
      if (scheduler.last_code() == kUnavailable) {
        outage.Failed(Clock::now(), scheduler.last_message());
        Nap(Clock::now() + backoff.Next(), control);
      } else if (scheduler.last_code() == 0) {
        outage.Succeeded();
        backoff.Reset();
      }
    }
    if (stage_over) source.Close();  // the stage is ending: nobody starts new sequences
    scheduler.Drain();
    std::lock_guard<std::mutex> lock(done_mu);
    --running;
    done_cv.notify_all();
  };

  // The servers' figures when the warm-up ends (read by this thread while the workers run).
  const client::CallOptions stats_call = client::CallOptions::Timeout(options.timeout);
  std::optional<absl::StatusOr<ServerCounters>> stats_before;
  if (!options.server_stats) stats_before = absl::UnimplementedError("not asked for");

  // At the end of an extendable stage: extend it by a window while its last windows disagree
  // and the measured time allows one more.
  const auto decide_extension = [&] {
    const Clock::time_point end = control.end();
    const StabilityVerdict v = JudgeStability(
        recorder.Windows(options.stability_windows, window_s, end), options.stability_percent,
        options.stability_windows);
    const double measured_s = Seconds(end - recorder.warmup_end());
    if (v.checked && !v.stable && measured_s + window_s <= options.max_duration_s + 1e-9) {
      control.Extend(FromSeconds(window_s));
    } else {
      control.Finalize();
    }
  };

  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(setup.concurrency));
  for (int w = 0; w < setup.concurrency; ++w) threads.emplace_back(worker, w);
  {
    std::unique_lock<std::mutex> lock(done_mu);
    while (running > 0) {
      Clock::time_point wake = Clock::now() + std::chrono::milliseconds(500);
      const bool await_warmup = !stats_before.has_value() && gate.open();
      if (await_warmup) {
        wake = std::min(wake, recorder.warmup_end());
      } else if (!stats_before.has_value()) {
        wake = Clock::now() + std::chrono::milliseconds(5);  // look again soon: the gate may open
      }
      const bool await_end = extendable && gate.open() && !control.final();
      if (await_end) wake = std::min(wake, control.end());
      done_cv.wait_until(lock, wake, [&] { return running == 0; });
      if (running == 0) break;
      lock.unlock();
      const Clock::time_point now = Clock::now();
      if (await_warmup && now >= recorder.warmup_end()) {
        stats_before = ReadServerCounters(*connections[0], stats_call);
      }
      if (await_end && now >= control.end()) decide_extension();
      if (const std::optional<OutageMonitor::Outage> o = outage.Current(now);
          o && options.unreachable_timeout_s > 0 && o->seconds >= options.unreachable_timeout_s) {
        control.Stop(absl::StrFormat("the servers could not be reached for %.1f s (%s)",
                                     o->seconds, o->message));
        source.Close();
      }
      if (progress) {
        ProgressSnapshot snapshot = recorder.Snapshot();
        snapshot.prefilling = !gate.open();
        progress(setup, stage, stages, snapshot);
      }
      lock.lock();
    }
  }
  for (std::thread& t : threads) t.join();
  StageResult result =
      recorder.Finish(setup, offset_s, Seconds(Clock::now() - stage_begin), options.check);
  result.stop_reason = control.reason();
  {
    // The last windows of the measured time: its length over the windows for a count-limited
    // stage.
    const double w = timed ? window_s : result.measured_s / std::max(1, options.stability_windows);
    result.stability =
        JudgeStability(recorder.Windows(options.stability_windows, w, recorder.last_done()),
                       options.stability_percent, options.stability_windows);
    result.stability.extensions = control.extensions();
  }
  if (!stats_before.has_value()) {
    result.server.note = "the stage ended within its warm-up";
  } else if (!stats_before->ok()) {
    result.server.note = std::string(stats_before->status().message());
  } else {
    absl::StatusOr<ServerCounters> after = ReadServerCounters(*connections[0], stats_call);
    if (!after.ok()) {
      result.server.note = std::string(after.status().message());
    } else if (!after->has_backend) {
      result.server.note = "the servers report no backend figures";
    } else {
      result.server.available = true;
      result.server.delta = Difference(*after, **stats_before);
    }
  }
  return result;
}

absl::StatusOr<std::vector<double>> ParseSweepValues(absl::string_view text) {
  std::vector<double> values;
  text = absl::StripAsciiWhitespace(text);
  if (const size_t dots = text.find(".."); dots != absl::string_view::npos) {
    const absl::string_view start_text = text.substr(0, dots);
    const absl::string_view rest = text.substr(dots + 2);
    const size_t star = rest.find('*');
    double start = 0, end = 0, factor = 0;
    if (star == absl::string_view::npos || !absl::SimpleAtod(start_text, &start) ||
        !absl::SimpleAtod(rest.substr(0, star), &end) ||
        !absl::SimpleAtod(rest.substr(star + 1), &factor) || !(start > 0) || !(end >= start) ||
        !(factor > 1)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sweep values '", text, "' are not START..END*FACTOR with 0 < START <= END, FACTOR > 1"));
    }
    for (double v = start; v <= end * (1 + 1e-9); v *= factor) {
      values.push_back(v);
      if (values.size() > 64) break;
    }
  } else {
    for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
      double v = 0;
      if (!absl::SimpleAtod(absl::StripAsciiWhitespace(part), &v) || !(v > 0)) {
        return absl::InvalidArgumentError(
            absl::StrCat("sweep value '", part, "' is not a positive number"));
      }
      values.push_back(v);
    }
  }
  if (values.empty()) return absl::InvalidArgumentError("the sweep has no values");
  if (values.size() > 64) return absl::InvalidArgumentError("a sweep has at most 64 stages");
  return values;
}

absl::StatusOr<SweepOutcome> RunSweep(const SweepPlan& plan, const WorkloadSpec& spec,
                                      const ServerShape& shape, const ValuePool& pool,
                                      const std::vector<client::ShardedClient*>& connections,
                                      const LoadOptions& options, const ProgressFn& progress) {
  SweepOutcome outcome;
  const Clock::time_point begin = Clock::now();
  const int stages = static_cast<int>(plan.stages.size());
  for (int i = 0; i < stages; ++i) {
    if (StopRequested()) {
      outcome.stop_reason = "interrupted";
      break;
    }
    WorkloadSpec stage_spec = spec;
    stage_spec.id_prefix = absl::StrCat(spec.id_prefix, "s", i, "-");
    absl::StatusOr<StageResult> r =
        RunStage(plan.stages[i], stage_spec, shape, pool, connections, options,
                 Seconds(Clock::now() - begin), progress, i, stages);
    if (!r.ok() && outcome.stages.empty()) return r.status();
    if (!r.ok()) {
      outcome.stop_reason = absl::StrCat("stage ", i + 1, " (", plan.stages[i].label,
                                         ") could not run: ", r.status().message());
      break;
    }
    outcome.stages.push_back(std::move(*r));
    StageResult& last = outcome.stages.back();
    if (StopRequested()) {
      outcome.stop_reason = "interrupted";
      break;
    }
    if (!last.stop_reason.empty()) {
      outcome.stop_reason = stages > 1 ? absl::StrCat("stage ", i + 1, " (", last.setup.label,
                                                      ") ended early: ", last.stop_reason)
                                       : last.stop_reason;
      break;
    }
    if (plan.kind.empty()) continue;
    const double latency_ms =
        static_cast<double>(last.decode().latency.Percentile(plan.percentile)) / 1e6;
    if (plan.max_latency_ms > 0 && latency_ms > plan.max_latency_ms) {
      last.over_threshold = true;
      if (i + 1 < stages) {
        outcome.stop_reason =
            absl::StrCat("stage ", i + 1, " (", last.setup.label, "): p", plan.percentile * 100,
                         " ", latency_ms, " ms > ", plan.max_latency_ms, " ms");
      }
      break;
    }
    if (last.error_rate() > plan.max_error_rate) {
      last.over_threshold = true;
      if (i + 1 < stages) {
        outcome.stop_reason =
            absl::StrCat("stage ", i + 1, " (", last.setup.label, "): error rate ",
                         last.error_rate() * 100, "% > ", plan.max_error_rate * 100, "%");
      }
      break;
    }
  }
  return outcome;
}

std::vector<std::string> IdenticalStageWarnings(const std::vector<StageResult>& stages,
                                                double percent) {
  std::vector<std::string> warnings;
  if (percent <= 0) return warnings;
  std::vector<bool> done(stages.size(), false);
  for (size_t i = 0; i < stages.size(); ++i) {
    if (done[i]) continue;
    std::vector<size_t> same = {i};
    for (size_t j = i + 1; j < stages.size(); ++j) {
      if (stages[j].setup.label == stages[i].setup.label) {
        same.push_back(j);
        done[j] = true;
      }
    }
    if (same.size() < 2) continue;
    double rps_lo = 0, rps_hi = 0, p50_lo = 0, p50_hi = 0;
    for (size_t k = 0; k < same.size(); ++k) {
      const StageResult& r = stages[same[k]];
      const double rps = r.throughput();
      const double p50 = static_cast<double>(r.decode().latency.Percentile(0.5)) / 1e6;
      rps_lo = k == 0 ? rps : std::min(rps_lo, rps);
      rps_hi = k == 0 ? rps : std::max(rps_hi, rps);
      p50_lo = k == 0 ? p50 : std::min(p50_lo, p50);
      p50_hi = k == 0 ? p50 : std::max(p50_hi, p50);
    }
    const auto apart = [](double lo, double hi) { return lo > 0 ? (hi - lo) / lo * 100 : 0.0; };
    const double rps_pct = apart(rps_lo, rps_hi), p50_pct = apart(p50_lo, p50_hi);
    if (rps_pct <= percent && p50_pct <= percent) continue;
    std::string names;
    for (size_t k : same) absl::StrAppend(&names, names.empty() ? "" : ", ", k + 1);
    warnings.push_back(absl::StrFormat(
        "stages %s (%s) ran the same load but differ: %.1f to %.1f req/s (%.0f%%), p50 %.3f to "
        "%.3f ms (%.0f%%), more than %g%%: the servers or this machine were not steady",
        names, stages[i].setup.label, rps_lo, rps_hi, rps_pct, p50_lo, p50_hi, p50_pct,
        percent));
  }
  return warnings;
}

std::vector<std::string> RunWarnings(const std::vector<StageResult>& stages, double percent) {
  std::vector<std::string> warnings;
  for (size_t i = 0; i < stages.size(); ++i) {
    const StabilityVerdict& v = stages[i].stability;
    if (!v.checked || v.stable) continue;
    warnings.push_back(absl::StrCat(stages.size() > 1 ? absl::StrCat("stage ", i + 1, " (")
                                                      : std::string("the stage ("),
                                    stages[i].setup.label, ") did not settle: ",
                                    DescribeStability(v),
                                    "; run longer (--duration, --max_duration) or quieten the "
                                    "machine before trusting its figures"));
  }
  for (std::string& w : IdenticalStageWarnings(stages, percent)) warnings.push_back(std::move(w));
  return warnings;
}

}  // namespace indexer::bench
