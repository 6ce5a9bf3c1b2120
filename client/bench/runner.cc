#include "client/bench/runner.h"

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "client/bench/pacer.h"
#include "client/bench/scheduler.h"
#include "client/bench/server_stats.h"

namespace indexer::bench {
namespace {

std::atomic<bool> stop_requested{false};

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

}  // namespace

void RequestStop() { stop_requested.store(true, std::memory_order_relaxed); }
bool StopRequested() { return stop_requested.load(std::memory_order_relaxed); }

absl::StatusOr<StageResult> RunStage(const StageSetup& setup, const WorkloadSpec& spec,
                                     const ServerShape& shape, const ValuePool& pool,
                                     const std::vector<client::ShardedClient*>& connections,
                                     const LoadOptions& options, double offset_s,
                                     const ProgressFn& progress, int stage, int stages) {
  if (setup.concurrency < 1) return absl::InvalidArgumentError("concurrency must be >= 1");
  if (connections.empty()) return absl::InvalidArgumentError("no connections");
  if (setup.duration_s <= 0 && setup.max_requests <= 0 && setup.max_sequences <= 0) {
    return absl::InvalidArgumentError(
        "a stage needs a limit: a duration, a request count or a sequence count");
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

  std::unique_ptr<ArrivalPacer> pacer;
  StartGate gate(setup.concurrency, [&](Clock::time_point start) {
    recorder.Begin(start);
    if (setup.open_loop) {
      pacer = std::make_unique<ArrivalPacer>(setup.target_rate, setup.arrivals, start,
                                             options.seed * 7919 + static_cast<uint64_t>(stage));
    }
  });
  std::atomic<int64_t> claimed{0};
  std::mutex done_mu;
  std::condition_variable done_cv;
  int running = setup.concurrency;

  const auto worker = [&](int w) {
    SimulatedScheduler scheduler(
        ctx, *connections[static_cast<size_t>(w) % connections.size()],
        options.seed * 1000003 + static_cast<uint64_t>(w) * 7919 + static_cast<uint64_t>(stage));
    bool alive = scheduler.Refill();
    const Clock::time_point start = gate.ArriveAndWait();
    const Clock::time_point warmup_end = start + FromSeconds(setup.warmup_s);
    const bool timed = setup.duration_s > 0;
    const Clock::time_point end = warmup_end + FromSeconds(timed ? setup.duration_s : 0);
    // Open loop: arrivals still waiting this long after the end are dropped and counted.
    const Clock::time_point backlog_limit =
        end + FromSeconds(std::max(1.0, 0.1 * setup.duration_s));
    bool stage_over = false;  // ended by a limit, not by running out of sequences
    while (alive) {
      if (StopRequested()) {
        stage_over = true;
        break;
      }
      Clock::time_point intended;
      stage_over = true;
      if (setup.open_loop) {
        intended = pacer->Next();
        if (timed && intended >= end) break;
        if (timed && Clock::now() > backlog_limit) {
          recorder.NotSent(1);
          continue;
        }
      } else {
        intended = Clock::now();
        if (timed && intended >= end) break;
      }
      const bool measured = intended >= warmup_end;
      if (measured && setup.max_requests > 0 && claimed.fetch_add(1) >= setup.max_requests) break;
      stage_over = false;
      if (setup.open_loop) SleepUntil(intended);
      scheduler.Decode(intended, measured, setup.open_loop);
      alive = scheduler.Refill();
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
      done_cv.wait_until(lock, wake, [&] { return running == 0; });
      if (running > 0 && await_warmup && Clock::now() >= recorder.warmup_end()) {
        lock.unlock();
        stats_before = ReadServerCounters(*connections[0], stats_call);
        lock.lock();
      }
      if (running > 0 && progress) {
        lock.unlock();
        ProgressSnapshot snapshot = recorder.Snapshot();
        snapshot.prefilling = !gate.open();
        progress(setup, stage, stages, snapshot);
        lock.lock();
      }
    }
  }
  for (std::thread& t : threads) t.join();
  StageResult result =
      recorder.Finish(setup, offset_s, Seconds(Clock::now() - stage_begin), options.check);
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
    if (!r.ok()) return r.status();
    outcome.stages.push_back(std::move(*r));
    StageResult& last = outcome.stages.back();
    if (StopRequested()) {
      outcome.stop_reason = "interrupted";
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

}  // namespace indexer::bench
