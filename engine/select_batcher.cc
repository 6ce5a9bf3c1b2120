#include "engine/select_batcher.h"

#include <algorithm>
#include <exception>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace indexer::engine {
namespace {

// Raw block scores a span's selection holds: one per (token, head, visible block).
int64_t TaskScores(std::span<const SelectTask> tasks) {
  int64_t scores = 0;
  for (const SelectTask& t : tasks) {
    scores += int64_t{t.span.num_tokens} * t.span.num_heads *
              kernels::VisibleBlocks(t.span.start_pos + t.span.num_tokens - 1);
  }
  return scores;
}

}  // namespace

absl::Status SelectTicket::Wait() {
  if (!done_.valid()) return absl::InternalError("select ticket waited on twice or never issued");
  return done_.get();
}

SelectTicket SelectTicket::Ready(absl::Status status) {
  std::promise<absl::Status> p;
  p.set_value(std::move(status));
  return SelectTicket(p.get_future());
}

SelectBatcher::SelectBatcher(KeyCacheBackend& backend, const EngineConfig& config)
    : backend_(backend),
      config_(config.batching),
      max_scores_(config.max_select_scores),
      page_table_(config.page_table),
      max_delay_(std::chrono::microseconds(config.batching.max_delay_us)) {
  if (!config_.enabled) return;
  for (int i = 0; i < config_.max_inflight; ++i) workers_.emplace_back([this] { Work(); });
}

SelectBatcher::~SelectBatcher() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

int64_t SelectBatcher::queued_tasks() const {
  std::lock_guard<std::mutex> lock(mu_);
  return queued_tasks_;
}

SelectTicket SelectBatcher::Submit(std::span<const SelectTask> tasks, const CallControl& control,
                                   bool may_run_here) {
  if (tasks.empty()) return SelectTicket::Ready(absl::OkStatus());
  EngineObserver* observer = observer_.load();
  // A call that has already run out of time (it may have waited long for its sequences' locks)
  // or was cancelled is not selected, whichever path it would take.
  if (absl::Status late = control.Check(); !late.ok()) {
    if (observer != nullptr) observer->OnBatchDropped(late.code());
    return SelectTicket::Ready(std::move(late));
  }
  if (!config_.enabled) {
    const absl::Time start = absl::Now();
    absl::Status status = GuardedSelect(tasks);
    if (observer != nullptr) {
      observer->OnBackendSelect(static_cast<int64_t>(tasks.size()), absl::Now() - start);
    }
    return SelectTicket::Ready(std::move(status));
  }
  const int64_t n = static_cast<int64_t>(tasks.size());
  absl::Status refused;
  bool run_here = false;
  std::future<absl::Status> done;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) {
      refused = absl::UnavailableError("the server is shutting down; the selection was not run");
    } else if (may_run_here && max_delay_ == Clock::duration::zero() && queue_.empty() &&
               inflight_ < config_.max_inflight) {
      // Nothing waits and the backend has room: this launch could merge with nothing, so run it
      // now on this thread rather than pay two thread hand-offs. What arrives meanwhile queues.
      ++inflight_;
      run_here = true;
    } else if (queued_tasks_ > 0 && queued_tasks_ + n > config_.queue_bound) {
      refused = absl::ResourceExhaustedError(absl::StrCat(
          "the select queue holds ", queued_tasks_, " span selections waiting for the backend and "
          "this call's ", n, " would pass batch_queue_bound ", config_.queue_bound,
          ": the server is overloaded; retry later"));
    } else {
      Group& g = queue_.emplace_back();
      g.tasks = tasks;
      g.control = &control;
      g.scores = TaskScores(tasks);
      g.enqueued = Clock::now();
      done = g.done.get_future();
      queued_tasks_ += n;
    }
  }
  if (run_here) {
    if (observer != nullptr) observer->OnBatchQueued(absl::ZeroDuration());
    const absl::Time start = absl::Now();
    absl::Status status = GuardedSelect(tasks);
    if (observer != nullptr) {
      observer->OnBackendSelect(n, absl::Now() - start);
      observer->OnBatchLaunched(1);
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      --inflight_;
    }
    cv_.notify_all();  // a worker may be waiting for the launch slot this call held
    return SelectTicket::Ready(std::move(status));
  }
  if (!refused.ok()) {
    if (observer != nullptr) observer->OnBatchDropped(refused.code());
    return SelectTicket::Ready(std::move(refused));
  }
  cv_.notify_all();
  return SelectTicket(std::move(done));
}

// The backend's Select, with an exception (say std::bad_alloc from a staging vector) turned into
// INTERNAL: it must neither end a worker thread (std::terminate) nor skip the caller's clean-up.
absl::Status SelectBatcher::GuardedSelect(std::span<const SelectTask> tasks) {
  try {
    return backend_.Select(tasks, page_table_);
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("the backend's selection failed: ", e.what()));
  } catch (...) {
    return absl::InternalError("the backend's selection failed with an unknown exception");
  }
}

bool SelectBatcher::ReadyLocked(Clock::time_point now) const {
  return stopping_ || queued_tasks_ >= config_.max_tasks ||
         now >= queue_.front().enqueued + max_delay_;
}

void SelectBatcher::Work() {
  std::vector<Group> batch;
  std::vector<SelectTask> merged;
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    // A launch slot and something to launch (or, stopping, nothing left to launch).
    cv_.wait(lock, [this] {
      return (stopping_ && queue_.empty()) ||
             (!queue_.empty() && inflight_ < config_.max_inflight);
    });
    if (queue_.empty()) return;  // stopping, and nothing left to launch
    if (!ReadyLocked(Clock::now())) {
      // Wake at the oldest group's deadline, or earlier when the queue fills or another worker
      // takes the group; then look again.
      cv_.wait_until(lock, queue_.front().enqueued + max_delay_);
      continue;
    }
    int64_t tasks = 0;
    int64_t scores = 0;
    while (!queue_.empty()) {
      Group& g = queue_.front();
      const int64_t n = static_cast<int64_t>(g.tasks.size());
      if (!batch.empty() && (tasks + n > config_.max_tasks || scores + g.scores > max_scores_)) {
        break;
      }
      tasks += n;
      scores += g.scores;
      queued_tasks_ -= n;
      batch.push_back(std::move(g));
      queue_.pop_front();
    }
    ++inflight_;
    // What is left may already fill another launch: let an idle worker look at it.
    if (!queue_.empty()) cv_.notify_all();
    lock.unlock();
    Launch(batch, merged);
    batch.clear();
    lock.lock();
    --inflight_;
    if (!queue_.empty()) cv_.notify_all();
  }
}

void SelectBatcher::Launch(std::vector<Group>& batch, std::vector<SelectTask>& merged) {
  EngineObserver* observer = observer_.load();
  const Clock::time_point now = Clock::now();
  std::vector<Group*> live;
  live.reserve(batch.size());
  for (Group& g : batch) {
    absl::Status status = g.control->Check();
    if (!status.ok()) {
      if (observer != nullptr) observer->OnBatchDropped(status.code());
      g.done.set_value(std::move(status));
      continue;
    }
    if (observer != nullptr) observer->OnBatchQueued(absl::FromChrono(now - g.enqueued));
    live.push_back(&g);
  }
  if (live.empty()) return;
  std::span<const SelectTask> tasks = live.front()->tasks;
  absl::Status status;
  if (live.size() > 1) {
    try {
      merged.clear();
      for (const Group* g : live) merged.insert(merged.end(), g->tasks.begin(), g->tasks.end());
      tasks = merged;
    } catch (const std::exception& e) {
      status = absl::InternalError(absl::StrCat("merging selections failed: ", e.what()));
    }
  }
  const absl::Time start = absl::Now();
  if (status.ok()) status = GuardedSelect(tasks);
  if (observer != nullptr) {
    observer->OnBackendSelect(static_cast<int64_t>(tasks.size()), absl::Now() - start);
    observer->OnBatchLaunched(static_cast<int64_t>(live.size()));
  }
  for (Group* g : live) g->done.set_value(status);
}

}  // namespace indexer::engine
