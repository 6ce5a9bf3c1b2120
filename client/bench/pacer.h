// ArrivalPacer: the intended send times of indexer-bench's open-loop load, constant or Poisson
// at a given rate. Workers take the next time, sleep until it and send; latency is measured from
// the intended time, not from when the send actually happened, so a server (or tester) that
// falls behind shows up as latency instead of silently lowering the rate ("coordinated
// omission").
//
// Threads: Next() may be called from any number of threads; times come out in increasing order.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <random>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace indexer::bench {

using Clock = std::chrono::steady_clock;

enum class Arrivals { kConstant, kPoisson };

// "constant" or "poisson"; INVALID_ARGUMENT otherwise.
absl::StatusOr<Arrivals> ParseArrivals(absl::string_view text);
const char* ArrivalsName(Arrivals a);

class ArrivalPacer {
 public:
  // rate_per_second > 0. Arrival i (from 0) of a constant pacer is at start + i / rate; a Poisson
  // pacer's gaps are independent exponentials of mean 1 / rate, drawn from `seed`.
  ArrivalPacer(double rate_per_second, Arrivals arrivals, Clock::time_point start, uint64_t seed);

  // The intended time of the next arrival.
  Clock::time_point Next();
  // Arrivals handed out so far.
  int64_t issued() const;

 private:
  const double rate_;
  const Arrivals arrivals_;
  const Clock::time_point start_;
  mutable std::mutex mu_;
  int64_t issued_ = 0;
  double poisson_offset_s_ = 0;  // Poisson: time of the last arrival after start
  std::mt19937_64 rng_;
};

// Sleeps until `t` (returns at once when it has passed).
void SleepUntil(Clock::time_point t);

// Seconds between two clock readings.
inline double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }
inline int64_t Nanos(Clock::duration d) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(d).count();
}

}  // namespace indexer::bench
