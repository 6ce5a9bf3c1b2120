#include "server/call_tracker.h"

#include "absl/time/clock.h"

namespace indexer::server {

bool CallTracker::Admit() {
  absl::MutexLock lock(&mu_);
  if (!admitting_) return false;
  ++in_flight_;
  return true;
}

void CallTracker::Done() {
  absl::MutexLock lock(&mu_);
  --in_flight_;
  last_done_ = absl::Now();
}

void CallTracker::StopAdmitting() {
  absl::MutexLock lock(&mu_);
  admitting_ = false;
}

bool CallTracker::WaitUntilIdle(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  bool (*idle)(int64_t*) = [](int64_t* in_flight) { return *in_flight == 0; };
  return mu_.AwaitWithDeadline(absl::Condition(idle, &in_flight_), deadline);
}

int64_t CallTracker::in_flight() const {
  absl::MutexLock lock(&mu_);
  return in_flight_;
}

absl::Time CallTracker::last_done() const {
  absl::MutexLock lock(&mu_);
  return last_done_;
}

}  // namespace indexer::server
