// ArrivalPacer: the intended send times of indexer-bench's open-loop load, constant or Poisson
// at a given rate, or replayed from a list of gaps between requests (a recorded trace's request
// intervals, as perf_analyzer's --request-intervals). Workers take the next time, sleep until it and send; latency is measured from
// the intended time, not from when the send actually happened, so a server (or tester) that
// falls behind shows up as latency instead of silently lowering the rate ("coordinated
// omission").
//
// Threads: Next() may be called from any number of threads; times come out in increasing order.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace indexer::bench {

using Clock = std::chrono::steady_clock;

enum class Arrivals { kConstant, kPoisson, kReplay };

// "constant" or "poisson"; INVALID_ARGUMENT otherwise ("file:PATH" is ReadRequestIntervals').
absl::StatusOr<Arrivals> ParseArrivals(absl::string_view text);
const char* ArrivalsName(Arrivals a);

// The gaps between successive requests, in seconds, from a file of intervals in microseconds
// (one a line, '#' comments, blank lines skipped; perf_analyzer's --request-intervals format).
// INVALID_ARGUMENT naming the file and line for an unreadable file, a negative or malformed
// value, or a file with no interval or only zero intervals.
absl::StatusOr<std::vector<double>> ReadRequestIntervals(const std::string& path);

class ArrivalPacer {
 public:
  // rate_per_second > 0. Arrival i (from 0) of a constant pacer is at start + i / rate; a Poisson
  // pacer's gaps are independent exponentials of mean 1 / rate, drawn from `seed`.
  ArrivalPacer(double rate_per_second, Arrivals arrivals, Clock::time_point start, uint64_t seed);
  // kReplay: arrival 0 at start, arrival i at start + gaps[0] + ... + gaps[i-1], the gaps taken
  // in order and again from the first after the last. `gaps_s` is not empty and sums to > 0.
  ArrivalPacer(std::shared_ptr<const std::vector<double>> gaps_s, Clock::time_point start);

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
  double last_offset_s_ = 0;  // Poisson and replay: time of the last arrival after start
  std::mt19937_64 rng_;
  std::shared_ptr<const std::vector<double>> gaps_s_;  // replay
};

// Sleeps until `t` (returns at once when it has passed).
void SleepUntil(Clock::time_point t);

// Seconds between two clock readings.
inline double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }
inline int64_t Nanos(Clock::duration d) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(d).count();
}

}  // namespace indexer::bench
