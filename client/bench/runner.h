// The load generator of indexer-bench: runs stages of SimulatedSchedulers (scheduler.h) in closed
// loop (each worker sends its next decode request as soon as the last one answered) or open loop
// (requests start at ArrivalPacer times, latency counted from the intended time), stops them by
// duration, request count or sequence count, and runs sweeps of stages over concurrency or rate
// that stop once a latency threshold is crossed. A timed stage may be extended until it is
// stable (LoadOptions::max_duration_s), and ends early when the servers cannot be reached.
//
// Threads: RunStage and RunSweep block the calling thread and start their own workers;
// RequestStop may be called from any thread (or a signal handler) to end the run early, keeping
// what was measured.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/bench/checker.h"
#include "client/bench/recorder.h"
#include "client/bench/workload.h"
#include "client/cpp/sharded_client.h"

namespace indexer::bench {

// How the load of every stage is generated, besides what StageSetup says.
struct LoadOptions {
  double interval_s = 1.0;                     // timeline resolution
  absl::Duration timeout = absl::Seconds(30);  // deadline of each unary call
  bool check = false;
  double tolerance = 1e-2;
  uint64_t seed = 1;
  // Read the servers' GetStats when the warm-up ends and when the stage ends, and report the
  // difference (StageResult::server).
  bool server_stats = true;
  // The stability check (stability.h): the measured window cut into this many windows, each
  // within this percentage of their mean (0: no check).
  double stability_percent = 10;
  int stability_windows = 3;
  // Above the stage's duration: an unstable timed stage is extended one window at a time, up to
  // this much measured time, until its last windows agree.
  double max_duration_s = 0;
  // End the stage when every call has failed with UNAVAILABLE for this long (0: never).
  double unreachable_timeout_s = 10;
};

// Progress callback: called about twice a second from the stage's own thread.
using ProgressFn =
    std::function<void(const StageSetup&, int stage, int stages, const ProgressSnapshot&)>;

// Ends every running stage soon (workers finish the requests in flight). Async-signal-safe.
void RequestStop();
bool StopRequested();

// Runs one stage with fresh sequences: workers (setup.concurrency) each with a
// SimulatedScheduler on connections[worker % connections.size()], initial prefills, then the
// load until the stage's limits, then releases everything. `offset_s` is stamped on the result.
// INVALID_ARGUMENT when the setup has no limit (a duration, counts or a trace) or no workers.
absl::StatusOr<StageResult> RunStage(const StageSetup& setup, const WorkloadSpec& spec,
                                     const ServerShape& shape, const ValuePool& pool,
                                     const std::vector<client::ShardedClient*>& connections,
                                     const LoadOptions& options, double offset_s,
                                     const ProgressFn& progress, int stage = 0, int stages = 1);

// A sweep: the stages to run in order and when to stop.
struct SweepPlan {
  std::string kind;  // "" (a single stage), "concurrency" or "rate"
  std::vector<StageSetup> stages;
  double max_latency_ms = 0;  // stop after a stage whose percentile exceeds this (0: never)
  double percentile = 0.99;
  double max_error_rate = 0.01;  // stop after a stage with more errors than this
};

// Parses a sweep's values: "1,2,4,8" or a geometric range "START..END*FACTOR" (e.g.
// "100..3200*2"). INVALID_ARGUMENT for anything else, non-positive values or over 64 stages.
absl::StatusOr<std::vector<double>> ParseSweepValues(absl::string_view text);

struct SweepOutcome {
  std::vector<StageResult> stages;
  std::string stop_reason;  // why the sweep stopped early, or empty
};

// Runs the plan's stages in order (each with its own sequences, ids prefixed per stage), stopping
// early per the plan, when a stage ended early (its stop_reason) or on RequestStop; the outcome
// says why. Stage ids are spec.id_prefix + "s<stage>-" + index. An error before any stage ran
// fails the call; one later stops the sweep with the stages run so far.
absl::StatusOr<SweepOutcome> RunSweep(const SweepPlan& plan, const WorkloadSpec& spec,
                                      const ServerShape& shape, const ValuePool& pool,
                                      const std::vector<client::ShardedClient*>& connections,
                                      const LoadOptions& options, const ProgressFn& progress);

// Stages of a sweep run with identical settings (the same label) whose throughput or p50
// latency differ by more than `percent` (of the smaller): one warning each, naming the stages.
std::vector<std::string> IdenticalStageWarnings(const std::vector<StageResult>& stages,
                                                double percent);

// The warnings of a finished run: each stage found unstable, then IdenticalStageWarnings.
std::vector<std::string> RunWarnings(const std::vector<StageResult>& stages, double percent);

}  // namespace indexer::bench
