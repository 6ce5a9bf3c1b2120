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

// One stage while it runs: what its workers share (recorder, sequence source, end of the load,
// outage view, pacer), the workers' loop, and the supervising thread's duties (server figures
// at the end of the warm-up, stability extensions, the outage limit, progress).
class Stage {
 public:
  Stage(const StageSetup& setup, const WorkloadSpec& spec, const ServerShape& shape,
        const ValuePool& pool, const std::vector<client::ShardedClient*>& connections,
        const LoadOptions& options, int stage)
      : setup_(setup),
        options_(options),
        connections_(connections),
        stage_(stage),
        timed_(setup.duration_s > 0),
        window_s_(timed_ ? setup.duration_s / std::max(1, options.stability_windows) : 0.0),
        extendable_(timed_ && options.stability_percent > 0 &&
                    options.max_duration_s > setup.duration_s && window_s_ > 0),
        backlog_(FromSeconds(std::max(1.0, 0.1 * setup.duration_s))),
        recorder_(setup.warmup_s, options.interval_s),
        source_(spec, setup.max_sequences),
        control_(extendable_),
        gate_(setup.concurrency, [this](Clock::time_point start) { Open(start); }),
        stats_call_(client::CallOptions::Timeout(options.timeout)) {
    ctx_.spec = &spec;
    ctx_.shape = &shape;
    ctx_.pool = &pool;
    ctx_.recorder = &recorder_;
    ctx_.source = &source_;
    ctx_.call = client::CallOptions::Timeout(options.timeout);
    ctx_.check = options.check;
    ctx_.check_params.select = EffectiveParams(spec, shape);
    ctx_.check_params.page_table = shape.page_table;
    ctx_.check_params.exact = spec.values == ValueKind::kInteger;
    ctx_.check_params.tolerance = options.tolerance;
    ctx_.attention_pages = &attention_pages_;
    if (!options.server_stats) stats_before_ = absl::UnimplementedError("not asked for");
  }

  // Runs the workers to the end of the stage, supervising them from this thread.
  void Run(const ProgressFn& progress, int stages) {
    running_ = setup_.concurrency;
    std::vector<std::thread> threads;
    threads.reserve(static_cast<size_t>(setup_.concurrency));
    for (int w = 0; w < setup_.concurrency; ++w) threads.emplace_back(&Stage::Worker, this, w);
    Supervise(progress, stages);
    for (std::thread& t : threads) t.join();
  }

  StageResult Result(double offset_s, double wall_s) {
    StageResult result = recorder_.Finish(setup_, offset_s, wall_s, options_.check);
    result.stop_reason = control_.reason();
    // The last windows of the measured time (a count-limited stage: its length over the
    // windows).
    const double w =
        timed_ ? window_s_ : result.measured_s / std::max(1, options_.stability_windows);
    result.stability =
        JudgeStability(recorder_.Windows(options_.stability_windows, w, recorder_.last_done()),
                       options_.stability_percent, options_.stability_windows);
    result.stability.extensions = control_.extensions();
    result.server = ServerWindow();
    return result;
  }

 private:
  // The gate opens: the load begins.
  void Open(Clock::time_point start) {
    recorder_.Begin(start);
    source_.Begin(start);
    if (timed_) control_.SetEnd(start + FromSeconds(setup_.warmup_s + setup_.duration_s));
    if (setup_.open_loop && setup_.arrivals == Arrivals::kReplay) {
      pacer_ = std::make_unique<ArrivalPacer>(setup_.gaps_s, start);
    } else if (setup_.open_loop) {
      pacer_ = std::make_unique<ArrivalPacer>(setup_.target_rate, setup_.arrivals, start,
                                              options_.seed * 7919 + static_cast<uint64_t>(stage_));
    }
  }

  void Worker(int w) {
    SimulatedScheduler scheduler(ctx_, *connections_[static_cast<size_t>(w) % connections_.size()],
                                 options_.seed * 1000003 + static_cast<uint64_t>(w) * 7919 +
                                     static_cast<uint64_t>(stage_));
    SimulatedScheduler::RefillState state = scheduler.Refill();
    const Clock::time_point warmup_end = gate_.ArriveAndWait() + FromSeconds(setup_.warmup_s);
    if (state.live == 0) state = scheduler.Refill();  // a trace's arrivals count from the start
    Backoff backoff;
    const bool ended_by_limit = Load(scheduler, state, warmup_end, backoff);
    if (ended_by_limit) source_.Close();  // the stage is ending: nobody starts new sequences
    scheduler.Drain();
    std::lock_guard<std::mutex> lock(done_mu_);
    --running_;
    done_cv_.notify_all();
  }

  // A worker's requests until the stage ends: true when a limit ended it, false when the
  // sequences ran out.
  bool Load(SimulatedScheduler& scheduler, SimulatedScheduler::RefillState state,
            Clock::time_point warmup_end, Backoff& backoff) {
    for (;;) {
      if (StopRequested() || control_.stopped()) return true;
      if (state.live == 0) {
        if (state.source_done) return false;
        // The next arrival of a trace, or a prefill the servers refused: wait, then try again.
        const Clock::time_point wake =
            state.next_arrival ? *state.next_arrival : Clock::now() + backoff.Next();
        if (control_.Over(wake)) return true;
        Nap(wake, control_);
        state = scheduler.Refill();
        Account(scheduler, backoff, /*nap=*/false);  // the nap above was the back-off
        continue;
      }
      const Clock::time_point intended = setup_.open_loop ? pacer_->Next() : Clock::now();
      if (control_.Over(intended)) return true;
      if (setup_.open_loop && control_.has_end() && Clock::now() > control_.end() + backlog_) {
        recorder_.NotSent(1);  // the backlog at the end is dropped, and counted
        continue;
      }
      const bool measured = intended >= warmup_end;
      if (measured && setup_.max_requests > 0 && claimed_.fetch_add(1) >= setup_.max_requests) {
        return true;
      }
      if (setup_.open_loop) SleepUntil(intended);
      if (!scheduler.Decode(intended, measured, setup_.open_loop) && setup_.open_loop) {
        recorder_.NotSent(1);  // nothing was live to send it for
      }
      state = scheduler.Refill();
      Account(scheduler, backoff, /*nap=*/true);
    }
  }

  // After a worker's calls: the outage view follows its latest answered call, and while the
  // servers cannot be reached (a down server fails every call at once) the worker backs off
  // instead of spinning; `nap`: sleep the back-off here.
  void Account(const SimulatedScheduler& scheduler, Backoff& backoff, bool nap) {
    if (scheduler.last_code() == kUnavailable) {
      outage_.Failed(Clock::now(), scheduler.last_message());
      if (nap) Nap(Clock::now() + backoff.Next(), control_);
    } else if (scheduler.last_code() == 0) {
      outage_.Succeeded();
      backoff.Reset();
    }
  }

  // Until every worker is done: reads the servers' figures when the warm-up ends, decides
  // extensions at the end of an extendable stage, ends the stage after an outage too long, and
  // reports progress about twice a second.
  void Supervise(const ProgressFn& progress, int stages) {
    std::unique_lock<std::mutex> lock(done_mu_);
    while (running_ > 0) {
      Clock::time_point wake = Clock::now() + std::chrono::milliseconds(500);
      const bool await_warmup = !stats_before_.has_value() && gate_.open();
      if (await_warmup) {
        wake = std::min(wake, recorder_.warmup_end());
      } else if (!stats_before_.has_value()) {
        wake = Clock::now() + std::chrono::milliseconds(5);  // look again soon: the gate may open
      }
      const bool await_end = extendable_ && gate_.open() && !control_.final();
      if (await_end) wake = std::min(wake, control_.end());
      done_cv_.wait_until(lock, wake, [&] { return running_ == 0; });
      if (running_ == 0) break;
      lock.unlock();
      const Clock::time_point now = Clock::now();
      if (await_warmup && now >= recorder_.warmup_end()) {
        stats_before_ = ReadServerCounters(*connections_[0], stats_call_);
      }
      if (await_end && now >= control_.end()) DecideExtension();
      CheckOutage(now);
      if (progress) {
        ProgressSnapshot snapshot = recorder_.Snapshot();
        snapshot.prefilling = !gate_.open();
        progress(setup_, stage_, stages, snapshot);
      }
      lock.lock();
    }
  }

  // At the end of an extendable stage: one more window while its last windows disagree and the
  // measured time allows it.
  void DecideExtension() {
    const Clock::time_point end = control_.end();
    const StabilityVerdict v = JudgeStability(
        recorder_.Windows(options_.stability_windows, window_s_, end),
        options_.stability_percent, options_.stability_windows);
    const double measured_s = Seconds(end - recorder_.warmup_end());
    if (v.checked && !v.stable && measured_s + window_s_ <= options_.max_duration_s + 1e-9) {
      control_.Extend(FromSeconds(window_s_));
    } else {
      control_.Finalize();
    }
  }

  void CheckOutage(Clock::time_point now) {
    const std::optional<OutageMonitor::Outage> o = outage_.Current(now);
    if (!o || options_.unreachable_timeout_s <= 0 || o->seconds < options_.unreachable_timeout_s) {
      return;
    }
    control_.Stop(absl::StrFormat("the servers could not be reached for %.1f s (%s)", o->seconds,
                                  o->message));
    source_.Close();
  }

  // The servers' figures over the measured window, or why there are none.
  ServerStatsWindow ServerWindow() {
    ServerStatsWindow window;
    if (!stats_before_.has_value()) {
      window.note = "the stage ended within its warm-up";
      return window;
    }
    if (!stats_before_->ok()) {
      window.note = std::string(stats_before_->status().message());
      return window;
    }
    absl::StatusOr<ServerCounters> after = ReadServerCounters(*connections_[0], stats_call_);
    if (!after.ok()) {
      window.note = std::string(after.status().message());
    } else if (!after->has_backend) {
      window.note = "the servers report no backend figures";
    } else {
      window.available = true;
      window.delta = Difference(*after, **stats_before_);
    }
    return window;
  }

  const StageSetup& setup_;
  const LoadOptions& options_;
  const std::vector<client::ShardedClient*>& connections_;
  const int stage_;
  const bool timed_;
  const double window_s_;  // the stability windows' length (timed stages)
  const bool extendable_;
  // Open loop: arrivals still waiting this long after the end are dropped and counted.
  const Clock::duration backlog_;
  Recorder recorder_;
  SequenceSource source_;
  std::atomic<int64_t> attention_pages_{0};
  SchedulerContext ctx_;
  StageControl control_;
  OutageMonitor outage_;
  std::unique_ptr<ArrivalPacer> pacer_;  // set when the gate opens, before any worker reads it
  StartGate gate_;
  std::atomic<int64_t> claimed_{0};  // measured requests started (--requests)
  std::mutex done_mu_;
  std::condition_variable done_cv_;
  int running_ = 0;  // workers not yet done (done_mu_)
  const client::CallOptions stats_call_;
  // The servers' figures when the warm-up ended (the supervising thread's).
  std::optional<absl::StatusOr<ServerCounters>> stats_before_;
};

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
  const Clock::time_point begin = Clock::now();
  Stage run(setup, spec, shape, pool, connections, options, stage);
  run.Run(progress, stages);
  return run.Result(offset_s, Seconds(Clock::now() - begin));
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
