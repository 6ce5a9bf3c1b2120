#include "client/bench/backoff.h"

#include <algorithm>

namespace indexer::bench {
namespace {

constexpr Clock::duration kFirst = std::chrono::milliseconds(10);
constexpr Clock::duration kMost = std::chrono::seconds(1);

}  // namespace

Clock::duration Backoff::Next() {
  const Clock::duration wait = next_;
  next_ = std::min<Clock::duration>(next_ * 2, kMost);
  return wait;
}

void Backoff::Reset() { next_ = kFirst; }

void OutageMonitor::Failed(Clock::time_point now, const std::string& message) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!since_) since_ = now;
  message_ = message;
}

void OutageMonitor::Succeeded() {
  std::lock_guard<std::mutex> lock(mu_);
  since_.reset();
}

std::optional<OutageMonitor::Outage> OutageMonitor::Current(Clock::time_point now) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!since_) return std::nullopt;
  return Outage{Seconds(now - *since_), message_};
}

}  // namespace indexer::bench
