#include "server/call_tracker.h"

#include "absl/time/clock.h"

namespace indexer::server {

bool CallTracker::Admit() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!admitting_) return false;
  ++in_flight_;
  return true;
}

void CallTracker::Done() {
  std::lock_guard<std::mutex> lock(mu_);
  --in_flight_;
  last_done_ = absl::Now();
  if (in_flight_ == 0) idle_.notify_all();
}

void CallTracker::StopAdmitting() {
  std::lock_guard<std::mutex> lock(mu_);
  admitting_ = false;
}

bool CallTracker::WaitUntilIdle(absl::Time deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  const auto idle = [this] { return in_flight_ == 0; };
  if (deadline == absl::InfiniteFuture()) {
    idle_.wait(lock, idle);
    return true;
  }
  return idle_.wait_until(lock, absl::ToChronoTime(deadline), idle);
}

int64_t CallTracker::in_flight() const {
  std::lock_guard<std::mutex> lock(mu_);
  return in_flight_;
}

absl::Time CallTracker::last_done() const {
  std::lock_guard<std::mutex> lock(mu_);
  return last_done_;
}

}  // namespace indexer::server
