#include "client/bench/pacer.h"

#include <cmath>
#include <fstream>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace indexer::bench {

absl::StatusOr<Arrivals> ParseArrivals(absl::string_view text) {
  if (text == "constant") return Arrivals::kConstant;
  if (text == "poisson") return Arrivals::kPoisson;
  return absl::InvalidArgumentError(
      absl::StrCat("arrivals '", text, "' is not 'constant' or 'poisson'"));
}

const char* ArrivalsName(Arrivals a) {
  switch (a) {
    case Arrivals::kConstant:
      return "constant";
    case Arrivals::kPoisson:
      return "poisson";
    case Arrivals::kReplay:
      return "replayed intervals";
  }
  return "?";
}

absl::StatusOr<std::vector<double>> ReadRequestIntervals(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::InvalidArgumentError(absl::StrCat("cannot read '", path, "'"));
  std::vector<double> gaps;
  double total = 0;
  std::string line;
  for (int line_no = 1; std::getline(in, line); ++line_no) {
    absl::string_view l = line;
    if (const size_t hash = l.find('#'); hash != absl::string_view::npos) l = l.substr(0, hash);
    l = absl::StripAsciiWhitespace(l);
    if (l.empty()) continue;
    double us = 0;
    if (!absl::SimpleAtod(l, &us) || !(us >= 0) || !std::isfinite(us)) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ":", line_no, ": '", l, "' is not an interval in microseconds (a number >= 0)"));
    }
    gaps.push_back(us * 1e-6);
    total += us;
  }
  if (!(total > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", path, "' holds no interval above zero (microseconds, one a line)"));
  }
  return gaps;
}

ArrivalPacer::ArrivalPacer(double rate_per_second, Arrivals arrivals, Clock::time_point start,
                           uint64_t seed)
    : rate_(rate_per_second), arrivals_(arrivals), start_(start), rng_(seed) {}

ArrivalPacer::ArrivalPacer(std::shared_ptr<const std::vector<double>> gaps_s,
                           Clock::time_point start)
    : rate_(0), arrivals_(Arrivals::kReplay), start_(start), rng_(0), gaps_s_(std::move(gaps_s)) {}

Clock::time_point ArrivalPacer::Next() {
  std::lock_guard<std::mutex> lock(mu_);
  double offset_s;
  if (arrivals_ == Arrivals::kConstant) {
    // From the index, not by adding gaps, so that rounding never drifts.
    offset_s = static_cast<double>(issued_) / rate_;
  } else if (arrivals_ == Arrivals::kPoisson) {
    if (issued_ > 0) last_offset_s_ += std::exponential_distribution<double>(rate_)(rng_);
    offset_s = last_offset_s_;
  } else {
    const std::vector<double>& gaps = *gaps_s_;
    if (issued_ > 0) {
      last_offset_s_ += gaps[static_cast<size_t>(issued_ - 1) % gaps.size()];
    }
    offset_s = last_offset_s_;
  }
  ++issued_;
  return start_ +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(offset_s));
}

int64_t ArrivalPacer::issued() const {
  std::lock_guard<std::mutex> lock(mu_);
  return issued_;
}

void SleepUntil(Clock::time_point t) {
  if (Clock::now() < t) std::this_thread::sleep_until(t);
}

}  // namespace indexer::bench
