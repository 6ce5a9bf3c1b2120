#include "engine/select_batcher.h"

#include <algorithm>
#include <exception>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace indexer::engine {
namespace {

int64_t Scores(std::span<const SelectTask> tasks) {
  int64_t scores = 0;
  for (const SelectTask& t : tasks) scores += t.Scores();
  return scores;
}

StepStatus Both(const absl::Status& status) { return StepStatus{status, status, {}}; }

}  // namespace

// One backend Run: the groups it carries and their work, merged (or, for one group, its own
// spans).
struct SelectBatcher::Launch {
  std::vector<Group> groups;
  std::vector<KeyWrite> writes;
  std::vector<SelectTask> selects;
  BackendStep step;
  absl::Time started;
};

SelectBatcher::SelectBatcher(KeyCacheBackend& backend, const EngineConfig& config)
    : backend_(backend),
      config_(config.batching),
      async_(backend.RunsAsync()),
      slots_(std::max(1, std::min(config.batching.max_inflight, backend.MaxConcurrentSteps()))),
      max_scores_(config.max_select_scores),
      page_table_(config.page_table),
      max_delay_(std::chrono::microseconds(config.batching.max_delay_us)) {
  for (int i = 0; i < std::max(1, config_.max_inflight); ++i) {
    workers_.emplace_back([this] { Work(); });
  }
}

SelectBatcher::~SelectBatcher() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (std::thread& t : workers_) t.join();
  // Launches of an asynchronous backend may still be running: their completions touch this.
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return inflight_ == 0; });
}

int64_t SelectBatcher::queued_tasks() const {
  std::lock_guard<std::mutex> lock(mu_);
  return queued_tasks_;
}

void SelectBatcher::Submit(std::span<const KeyWrite> writes, std::span<const SelectTask> selects,
                           const CallControl& control, GroupDone done, bool may_run_here) {
  if (writes.empty() && selects.empty()) {
    std::move(done)(StepStatus{});
    return;
  }
  EngineObserver* observer = observer_.load();
  // A call that has already run out of time (it may have waited for its sequences) or was
  // cancelled is not run, whichever path it would take.
  if (absl::Status late = control.Check(); !late.ok()) {
    if (observer != nullptr) observer->OnBatchDropped(late.code());
    std::move(done)(Both(late));
    return;
  }
  if (!config_.enabled) {
    // No batching: the group is its own launch, run on this thread.
    const absl::Time start = absl::Now();
    const int64_t tasks = static_cast<int64_t>(selects.size());
    backend_.Run(BackendStep{writes, selects}, page_table_,
                 [observer, start, tasks, done = std::move(done)](StepStatus status) mutable {
                   if (observer != nullptr && tasks > 0) {
                     observer->OnBackendSelect(tasks, absl::Now() - start);
                   }
                   std::move(done)(std::move(status));
                 });
    return;
  }
  Group g{writes, selects, &control, Scores(selects), Clock::now(), absl::ZeroDuration(),
          std::move(done)};
  const int64_t n = static_cast<int64_t>(selects.size());
  std::unique_ptr<Launch> now;
  absl::Status refused;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const bool run_here_ok = async_ || (may_run_here && g.scores <= kInlineScores);
    if (stopping_) {
      refused = absl::UnavailableError("the server is shutting down; the selection was not run");
    } else if (queued_tasks_ > 0 && queued_tasks_ + n > config_.queue_bound) {
      refused = absl::ResourceExhaustedError(absl::StrCat(
          "the select queue holds ", queued_tasks_, " span selections waiting for the backend and "
          "this call's ", n, " would pass batch_queue_bound ", config_.queue_bound,
          ": the server is overloaded; retry later"));
    } else {
      queue_.push_back(std::move(g));
      queued_tasks_ += n;
      // Nothing waits and a slot is free: this group could merge with nothing, so launch it now
      // on this thread rather than pay two thread hand-offs. What arrives meanwhile queues.
      if (run_here_ok && max_delay_ == Clock::duration::zero() && queue_.size() == 1 &&
          inflight_ < slots_) {
        now = TakeLocked();
      }
    }
  }
  if (!refused.ok()) {
    if (observer != nullptr) observer->OnBatchDropped(refused.code());
    std::move(g.done)(Both(refused));
    return;
  }
  if (now != nullptr) {
    Start(std::move(now), /*checked=*/true);
  } else {
    cv_.notify_all();
  }
}

bool SelectBatcher::ReadyLocked(Clock::time_point now) const {
  return stopping_ || queued_tasks_ >= config_.max_tasks ||
         now >= queue_.front().enqueued + max_delay_;
}

std::unique_ptr<SelectBatcher::Launch> SelectBatcher::TakeLocked() {
  auto launch = std::make_unique<Launch>();
  int64_t tasks = 0;
  int64_t scores = 0;
  while (!queue_.empty()) {
    Group& g = queue_.front();
    const int64_t n = static_cast<int64_t>(g.selects.size());
    if (!launch->groups.empty() &&
        (tasks + n > config_.max_tasks || scores + g.scores > max_scores_)) {
      break;
    }
    tasks += n;
    scores += g.scores;
    queued_tasks_ -= n;
    launch->groups.push_back(std::move(g));
    queue_.pop_front();
  }
  ++inflight_;
  return launch;
}

void SelectBatcher::Work() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    // A slot and something to launch (or, stopping, nothing left to launch).
    cv_.wait(lock, [this] {
      return (stopping_ && queue_.empty()) || (!queue_.empty() && inflight_ < slots_);
    });
    if (queue_.empty()) return;  // stopping, and nothing left to launch
    if (!ReadyLocked(Clock::now())) {
      // Wake at the oldest group's deadline, or earlier when the queue fills or another worker
      // takes the group; then look again.
      cv_.wait_until(lock, queue_.front().enqueued + max_delay_);
      continue;
    }
    std::unique_ptr<Launch> launch = TakeLocked();
    // What is left may already fill another launch: let an idle worker look at it.
    if (!queue_.empty()) cv_.notify_all();
    lock.unlock();
    Start(std::move(launch), /*checked=*/false);
    lock.lock();
  }
}

void SelectBatcher::Start(std::unique_ptr<Launch> launch, bool checked) {
  EngineObserver* observer = observer_.load();
  const Clock::time_point now = Clock::now();
  std::vector<Group> live;
  live.reserve(launch->groups.size());
  for (Group& g : launch->groups) {
    absl::Status status = checked ? absl::OkStatus() : g.control->Check();
    if (!status.ok()) {
      if (observer != nullptr) observer->OnBatchDropped(status.code());
      std::move(g.done)(Both(status));
      continue;
    }
    if (observer != nullptr && !g.selects.empty()) {
      observer->OnBatchQueued(absl::FromChrono(now - g.enqueued));
    }
    g.waited = absl::FromChrono(now - g.enqueued);
    live.push_back(std::move(g));
  }
  launch->groups = std::move(live);
  if (launch->groups.empty()) {
    Finish(launch.release(), StepStatus{});
    return;
  }
  try {
    if (launch->groups.size() == 1) {
      launch->step = BackendStep{launch->groups[0].writes, launch->groups[0].selects};
    } else {
      for (const Group& g : launch->groups) {
        launch->writes.insert(launch->writes.end(), g.writes.begin(), g.writes.end());
        launch->selects.insert(launch->selects.end(), g.selects.begin(), g.selects.end());
      }
      launch->step = BackendStep{launch->writes, launch->selects};
    }
  } catch (const std::exception& e) {
    Finish(launch.release(), Both(absl::InternalError(absl::StrCat("merging steps failed: ", e.what()))));
    return;
  }
  launch->started = absl::Now();
  Launch* raw = launch.release();
  try {
    backend_.Run(raw->step, page_table_, [this, raw](StepStatus s) { Finish(raw, std::move(s)); });
  } catch (const std::exception& e) {
    // The backend's staging threw (say std::bad_alloc) before it took the step over.
    Finish(raw, Both(absl::InternalError(absl::StrCat("the backend's step failed: ", e.what()))));
  }
}

void SelectBatcher::Finish(Launch* raw, StepStatus status) {
  std::unique_ptr<Launch> launch(raw);
  EngineObserver* observer = observer_.load();
  // Selection metrics count launches that select (a launch of key writes alone is not one).
  if (observer != nullptr && !launch->step.selects.empty()) {
    observer->OnBackendSelect(static_cast<int64_t>(launch->step.selects.size()),
                              absl::Now() - launch->started);
    int64_t selecting = 0;
    for (const Group& g : launch->groups) selecting += g.selects.empty() ? 0 : 1;
    observer->OnBatchLaunched(selecting);
  }
  std::unique_ptr<Launch> next;
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    --inflight_;
    // An asynchronous backend's completion thread starts the next launch at once: the device
    // stays busy while the callbacks below run.
    if (async_ && !queue_.empty() && inflight_ < slots_ && ReadyLocked(Clock::now())) {
      next = TakeLocked();
    }
    // The freed slot matters to a worker only when something is queued, and to the destructor
    // only once stopping: otherwise waking the workers would cost every step a futex call and
    // a context switch for nothing.
    wake = stopping_ || !queue_.empty();
  }
  if (wake) cv_.notify_all();
  if (next != nullptr) Start(std::move(next), /*checked=*/false);
  for (Group& g : launch->groups) {
    StepStatus own = status;
    own.timing.queue += g.waited;
    std::move(g.done)(std::move(own));
  }
}

}  // namespace indexer::engine
