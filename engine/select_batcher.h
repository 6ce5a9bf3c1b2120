// SelectBatcher: dynamic decode batching for one backend (one device). Selections submitted by
// concurrent engine calls are merged into one KeyCacheBackend::Select launch, so that 256
// schedulers each sending one decode step cost about one launch, not 256.
//
// The engine (Engine::RunWave) submits a group -- the select tasks of one chunk of one call's
// wave, on sequences that call has locked -- and waits on the ticket Submit returns. It may
// submit to several batchers (one per device) before it waits on any, so devices run in parallel.
//
// Dispatch: at most `batching.max_inflight` launches run at once. `max_inflight` worker threads
// take groups from the queue in arrival order, each running one backend Select at a time, while
// a launch slot is free. A worker starts a launch once a group is queued and either the queued
// tasks reach
// `batching.max_tasks` or the oldest group has waited `batching.max_delay_us` (0: at once; groups
// arriving meanwhile form the next launch, "continuous batching"). A launch takes whole groups in
// order (a group is never split; one larger than max_tasks goes alone) while their tasks fit
// max_tasks and their raw block scores fit config.max_select_scores. Just before the launch,
// groups whose call was cancelled complete with CANCELLED and groups whose deadline passed with
// DEADLINE_EXCEEDED, unlaunched. Every other group completes with the launch's status. Results do
// not depend on what else shared the launch (the KeyCacheBackend contract).
//
// Fast path: when max_delay is 0, nothing is queued and a launch slot is free, a group submitted
// with `may_run_here` could merge with nothing, so Submit launches it on the calling thread
// (counted as a launch in flight) instead of handing it to a worker and back; groups arriving
// meanwhile queue for the workers as usual. The engine allows it for the last group it submits
// in a wave, so that a wave's groups for other devices are queued first and run in parallel.
//
// With `batching.enabled` false, Submit runs the Select on the caller's thread (no queue, no
// workers), as the engine did before batching.
//
// Thread-safe: Submit from any thread. The caller must keep the tasks, everything their spans
// point to and the CallControl valid, and must not touch the tasks' outputs, until the ticket's
// Wait() has returned. Destruction stops taking new groups (Submit then answers UNAVAILABLE),
// launches every group still queued, and joins the workers; the backend must outlive the batcher.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <future>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "engine/call_control.h"
#include "engine/config.h"
#include "engine/engine_observer.h"
#include "engine/key_cache_backend.h"

namespace indexer::engine {

// The completion of one submitted group. Movable, not copyable; Wait() once.
class SelectTicket {
 public:
  SelectTicket() = default;
  // Blocks until the group's launch has finished (or the group was refused or dropped) and
  // returns its status: OK, the backend's error, RESOURCE_EXHAUSTED (queue bound),
  // DEADLINE_EXCEEDED, CANCELLED or UNAVAILABLE (the batcher is shutting down).
  absl::Status Wait();

 private:
  friend class SelectBatcher;
  explicit SelectTicket(std::future<absl::Status> done) : done_(std::move(done)) {}
  static SelectTicket Ready(absl::Status status);

  std::future<absl::Status> done_;
};

class SelectBatcher {
 public:
  // `config` must have passed Validate(); its batching, max_select_scores and page_table are
  // used. `backend` must outlive the batcher. Starts config.batching.max_inflight workers when
  // batching is enabled.
  SelectBatcher(KeyCacheBackend& backend, const EngineConfig& config);
  ~SelectBatcher();
  SelectBatcher(const SelectBatcher&) = delete;
  SelectBatcher& operator=(const SelectBatcher&) = delete;

  // Queues `tasks` as one group (or, with batching off, selects them now; or, with
  // `may_run_here` and the fast path's conditions, launches them now on this thread). Refused at
  // once -- the ticket is ready with RESOURCE_EXHAUSTED naming batch_queue_bound -- when tasks
  // are already queued and these would take the queue past batching.queue_bound (a group is
  // always let into an empty queue, however large). An empty `tasks` completes at once with OK.
  SelectTicket Submit(std::span<const SelectTask> tasks, const CallControl& control,
                      bool may_run_here = false);

  // `observer` (may be null) sees every launch, queue wait and drop from now on.
  void SetObserver(EngineObserver* observer) { observer_.store(observer); }

  // Tasks queued now (not counting launches in flight). For tests and metrics.
  int64_t queued_tasks() const;

 private:
  using Clock = std::chrono::steady_clock;
  struct Group {
    std::span<const SelectTask> tasks;
    const CallControl* control = nullptr;
    int64_t scores = 0;
    Clock::time_point enqueued;
    std::promise<absl::Status> done;
  };

  // One worker: forms launches from the queue and runs them until stopped and drained.
  void Work();
  // Whether a launch should start now. Needs mu_ and a non-empty queue.
  absl::Status GuardedSelect(std::span<const SelectTask> tasks);
  bool ReadyLocked(Clock::time_point now) const;
  // Drops cancelled and expired groups, runs one Select for the rest, completes every group.
  void Launch(std::vector<Group>& batch, std::vector<SelectTask>& merged);

  KeyCacheBackend& backend_;
  const BatcherConfig config_;
  const int64_t max_scores_;
  const kernels::PageTableParams page_table_;
  const Clock::duration max_delay_;
  std::atomic<EngineObserver*> observer_{nullptr};

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Group> queue_;
  int64_t queued_tasks_ = 0;
  int inflight_ = 0;  // launches running: by workers, or by callers on the fast path
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace indexer::engine
