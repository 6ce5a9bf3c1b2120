#include "client/bench/pacer.h"

#include <thread>

#include "absl/strings/str_cat.h"

namespace indexer::bench {

absl::StatusOr<Arrivals> ParseArrivals(absl::string_view text) {
  if (text == "constant") return Arrivals::kConstant;
  if (text == "poisson") return Arrivals::kPoisson;
  return absl::InvalidArgumentError(
      absl::StrCat("arrivals '", text, "' is not 'constant' or 'poisson'"));
}

const char* ArrivalsName(Arrivals a) { return a == Arrivals::kConstant ? "constant" : "poisson"; }

ArrivalPacer::ArrivalPacer(double rate_per_second, Arrivals arrivals, Clock::time_point start,
                           uint64_t seed)
    : rate_(rate_per_second), arrivals_(arrivals), start_(start), rng_(seed) {}

Clock::time_point ArrivalPacer::Next() {
  std::lock_guard<std::mutex> lock(mu_);
  double offset_s;
  if (arrivals_ == Arrivals::kConstant) {
    // From the index, not by adding gaps, so that rounding never drifts.
    offset_s = static_cast<double>(issued_) / rate_;
  } else {
    if (issued_ > 0) poisson_offset_s_ += std::exponential_distribution<double>(rate_)(rng_);
    offset_s = poisson_offset_s_;
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
