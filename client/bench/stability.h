// Whether a stage's measurement settled, in the manner of perf_analyzer's
// --stability-percentage: the measured window is cut into consecutive windows of equal length,
// and the stage is stable when every window's throughput and p50 latency lie within a given
// percentage of the windows' mean. indexer-bench warns about an unstable stage, and can extend a
// timed stage window by window until its last windows agree (--max_duration).
//
// Pure values and functions; any thread.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace indexer::bench {

// One window of a stage's measured time (completions of decode requests in it).
struct WindowFigures {
  double start_s = 0;  // since the stage's load began
  double seconds = 0;
  int64_t ok = 0;
  int64_t errors = 0;
  int64_t p50_ns = 0;  // of the successful requests
  double rps() const { return seconds > 0 ? static_cast<double>(ok) / seconds : 0; }
};

struct StabilityVerdict {
  bool checked = false;  // false: the check was off or the stage too short (`note` says)
  bool stable = true;
  double percent = 0;  // the allowed deviation from the mean, in percent
  // The largest |window - mean| / mean over the windows, as fractions.
  double throughput_spread = 0;
  double p50_spread = 0;
  int extensions = 0;  // windows the stage was extended by to let it settle
  std::vector<WindowFigures> windows;
  std::string note;
};

// Judges `windows` (the last windows of a stage, in time order) against `percent`; fewer than
// `wanted` windows, or no successful request in them, leaves it unchecked with a note.
StabilityVerdict JudgeStability(std::vector<WindowFigures> windows, double percent, int wanted);

// One line about the verdict, e.g. "3 windows of 1.33 s: throughput within 2.1%, p50 within
// 3.4% (limit 10%): stable".
std::string DescribeStability(const StabilityVerdict& v);

}  // namespace indexer::bench
