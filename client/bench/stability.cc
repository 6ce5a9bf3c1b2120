#include "client/bench/stability.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace indexer::bench {
namespace {

// max |x - mean| / mean of the values (0 for a zero mean).
double Spread(const std::vector<double>& values) {
  double mean = 0;
  for (double v : values) mean += v;
  mean /= static_cast<double>(std::max<size_t>(1, values.size()));
  if (!(mean > 0)) return 0;
  double most = 0;
  for (double v : values) most = std::max(most, std::fabs(v - mean) / mean);
  return most;
}

}  // namespace

StabilityVerdict JudgeStability(std::vector<WindowFigures> windows, double percent, int wanted) {
  StabilityVerdict v;
  v.percent = percent;
  v.windows = std::move(windows);
  if (percent <= 0) {
    v.note = "the stability check is off";
    return v;
  }
  if (wanted < 2 || static_cast<int>(v.windows.size()) < wanted) {
    v.note = absl::StrFormat("the measured time holds %d of the %d windows the check needs",
                             static_cast<int>(v.windows.size()), wanted);
    return v;
  }
  std::vector<double> rps, p50;
  int64_t ok = 0;
  for (const WindowFigures& w : v.windows) {
    rps.push_back(w.rps());
    p50.push_back(static_cast<double>(w.p50_ns));
    ok += w.ok;
  }
  if (ok == 0) {
    v.note = "no request succeeded in the measured windows";
    return v;
  }
  v.checked = true;
  v.throughput_spread = Spread(rps);
  v.p50_spread = Spread(p50);
  v.stable = v.throughput_spread * 100 <= percent && v.p50_spread * 100 <= percent;
  return v;
}

std::string DescribeStability(const StabilityVerdict& v) {
  if (!v.checked) return absl::StrCat("not checked: ", v.note);
  std::string s = absl::StrFormat(
      "%d windows of %.2f s: throughput within %.1f%%, p50 within %.1f%% (limit %g%%): %s",
      static_cast<int>(v.windows.size()), v.windows.empty() ? 0.0 : v.windows.front().seconds,
      v.throughput_spread * 100, v.p50_spread * 100, v.percent,
      v.stable ? "stable" : "NOT STABLE");
  if (v.extensions > 0) absl::StrAppendFormat(&s, ", after %d extension(s)", v.extensions);
  return s;
}

}  // namespace indexer::bench
