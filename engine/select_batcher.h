// SelectBatcher: dynamic batching for one backend (one device). The key writes and selections
// that concurrent engine calls submit are merged into one KeyCacheBackend::Run, so that 256
// schedulers each sending one decode step cost about one device round trip, not 256.
//
// The engine (engine/wave.h) submits a group -- the writes and selections of one chunk of one
// call's wave, on sequences that call holds -- with a callback. It may submit to several batchers
// (one per device) at once, so devices run in parallel.
//
// Dispatch: at most `slots` launches run at once, slots = min(batching.max_inflight,
// backend.MaxConcurrentSteps()). A launch takes whole groups in arrival order (a group is never
// split; one larger than the bounds goes alone) while their selections fit batching.max_tasks
// and their raw block scores fit config.max_select_scores. A launch starts once a group is
// queued, a slot is free and either the queued selections reach max_tasks or the oldest group
// has waited batching.max_delay_us (0: at once; groups arriving meanwhile form the next launch,
// "continuous batching"). Just before the launch, groups whose call was cancelled complete with
// CANCELLED and groups whose deadline passed with DEADLINE_EXCEEDED, unlaunched. Every other
// group completes with the launch's StepStatus. Results do not depend on what else shared the
// launch (the KeyCacheBackend contract).
//
// Where launches run, so that no thread waits for another to wake when a step could start at
// once (max_delay_us 0):
//  - A group submitted while nothing is queued and a slot is free launches on the submitting
//    thread. With a backend that RunsAsync() that costs the caller only the staging; with a
//    synchronous one only groups of at most kInlineScores raw scores run so (a longer selection
//    would hold the caller's thread for its whole computation).
//  - With an asynchronous backend, the thread that completes a launch starts the next launch
//    from the queue before it runs the completed groups' callbacks.
//  - Otherwise `batching.max_inflight` worker threads take launches from the queue (they wait
//    for max_delay_us, and run synchronous backends' long selections).
// With `batching.enabled` false, Submit runs the group's step on the caller's thread (no queue,
// no workers): an asynchronous backend's step still ends on its completion thread.
//
// Thread-safe: Submit from any thread. The caller keeps the writes and tasks, everything they
// point to and the CallControl valid, and does not touch the tasks' outputs, until its callback
// has run. Callbacks run on any thread (the submitter's, a worker's, or the backend's completion
// thread) and must not block. Destruction stops taking new groups (Submit then answers
// UNAVAILABLE), launches every group still queued, waits for every launch to end and joins the
// workers; the backend must outlive the batcher.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "engine/call_control.h"
#include "engine/config.h"
#include "engine/engine_observer.h"
#include "engine/key_cache_backend.h"

namespace indexer::engine {

// Called once when a submitted group has ended: launched (its StepStatus), or refused or
// dropped before its launch (both statuses the reason).
using GroupDone = absl::AnyInvocable<void(StepStatus) &&>;

class SelectBatcher {
 public:
  // Raw block scores up to which a synchronous backend's group runs on the submitting thread.
  static constexpr int64_t kInlineScores = 4096;

  // `config` must have passed Validate(); its batching, max_select_scores and page_table are
  // used. `backend` must outlive the batcher. Starts config.batching.max_inflight workers.
  SelectBatcher(KeyCacheBackend& backend, const EngineConfig& config);
  ~SelectBatcher();
  SelectBatcher(const SelectBatcher&) = delete;
  SelectBatcher& operator=(const SelectBatcher&) = delete;

  // Queues `writes` and `selects` as one group, or launches it now (see the fast path above).
  // Refused at once -- `done` runs before Submit returns, with RESOURCE_EXHAUSTED naming
  // batch_queue_bound -- when selections are already queued and these would take the queue past
  // batching.queue_bound (a group is always let into an empty queue, however large); CANCELLED
  // or DEADLINE_EXCEEDED when the call has already ended; UNAVAILABLE once the batcher stops.
  // An empty group completes at once with OK.
  // `may_run_here`: the caller allows the fast path on its thread for a synchronous backend (the
  // engine allows it for the last group of a wave, so that the groups for other devices, queued
  // first, run meanwhile); an asynchronous backend's launches may always start here.
  void Submit(std::span<const KeyWrite> writes, std::span<const SelectTask> selects,
              const CallControl& control, GroupDone done, bool may_run_here = false);

  // `observer` (may be null) sees every launch, queue wait and drop from now on.
  void SetObserver(EngineObserver* observer) { observer_.store(observer); }

  // Selections queued now (not counting launches in flight). For tests and metrics.
  int64_t queued_tasks() const;

 private:
  using Clock = std::chrono::steady_clock;
  struct Group {
    std::span<const KeyWrite> writes;
    std::span<const SelectTask> selects;
    const CallControl* control = nullptr;
    int64_t scores = 0;
    Clock::time_point enqueued;
    absl::Duration waited;  // in the queue, until its launch started
    GroupDone done;
  };
  struct Launch;

  // One worker: launches from the queue until stopped and drained.
  void Work();
  // Whether the queue's head should launch now. Needs mu_ and a non-empty queue.
  bool ReadyLocked(Clock::time_point now) const;
  // Moves the groups of the next launch off the queue (whole groups, within the bounds) and
  // takes a slot. Needs mu_ and a non-empty queue.
  std::unique_ptr<Launch> TakeLocked();
  // Drops the launch's cancelled and expired groups (unless `checked`: Submit has just checked
  // its one group), runs the rest on the backend; Finish runs when it ends.
  void Start(std::unique_ptr<Launch> launch, bool checked);
  void Finish(Launch* launch, StepStatus status);

  KeyCacheBackend& backend_;
  const BatcherConfig config_;
  const bool async_;
  const int slots_;
  const int64_t max_scores_;
  const kernels::PageTableParams page_table_;
  const Clock::duration max_delay_;
  std::atomic<EngineObserver*> observer_{nullptr};

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Group> queue_;
  int64_t queued_tasks_ = 0;
  int inflight_ = 0;  // launches started and not yet finished
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace indexer::engine
