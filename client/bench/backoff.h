// How indexer-bench behaves while the servers cannot be reached: a down server fails every call
// at once (UNAVAILABLE), so a worker that simply sent again would spin. Each worker backs off
// (Backoff: 10 ms, doubling to 1 s, back to 10 ms after a success), and the stage's
// OutageMonitor tells how long every call has been failing, so that the stage can be ended with a
// reason (--unreachable_timeout) instead of piling up errors.
//
// Threads: a Backoff belongs to one worker; OutageMonitor is thread-safe.
#pragma once

#include <mutex>
#include <optional>
#include <string>

#include "client/bench/pacer.h"

namespace indexer::bench {

class Backoff {
 public:
  // The wait before the next attempt: 10 ms after the first failure, doubling up to 1 s.
  Clock::duration Next();
  void Reset();

 private:
  Clock::duration next_ = std::chrono::milliseconds(10);
};

class OutageMonitor {
 public:
  // A call failed because the servers could not be reached: an outage starts, or goes on.
  void Failed(Clock::time_point now, const std::string& message);
  // A call succeeded: the outage, if any, is over.
  void Succeeded();

  struct Outage {
    double seconds = 0;  // since its first failure
    std::string message;  // the latest failure's
  };
  // The outage going on at `now`, if any.
  std::optional<Outage> Current(Clock::time_point now) const;

 private:
  mutable std::mutex mu_;
  std::optional<Clock::time_point> since_;
  std::string message_;
};

}  // namespace indexer::bench
