#include "client/bench/histogram.h"

#include <algorithm>
#include <bit>
#include <cmath>

namespace indexer::bench {

int64_t NearestRank(double q, int64_t n) {
  if (n <= 0) return 0;
  if (q <= 0) return 1;
  if (q >= 1) return n;
  const int64_t r = static_cast<int64_t>(std::ceil(q * static_cast<double>(n) - 1e-9));
  return std::clamp<int64_t>(r, 1, n);
}

LatencyHistogram::LatencyHistogram(int significant_bits)
    : bits_(std::clamp(significant_bits, 2, 12)) {}

int LatencyHistogram::BucketIndex(int64_t value) const {
  if (value <= 0) return 0;
  const uint64_t v = static_cast<uint64_t>(value);
  if (v < (uint64_t{1} << bits_)) return static_cast<int>(v);
  const int e = 63 - std::countl_zero(v);
  const int shift = e - bits_ + 1;
  const int64_t sub = static_cast<int64_t>(v >> shift);  // in [2^(b-1), 2^b)
  return static_cast<int>((int64_t{shift} << (bits_ - 1)) + sub);
}

int64_t LatencyHistogram::BucketLow(int index) const {
  if (index < (1 << bits_)) return index;
  const int half = 1 << (bits_ - 1);
  const int shift = index / half - 1;
  const int64_t sub = index - int64_t{shift} * half;
  return sub << shift;
}

int64_t LatencyHistogram::BucketHigh(int index) const {
  if (index < (1 << bits_)) return int64_t{index} + 1;
  const int half = 1 << (bits_ - 1);
  const int shift = index / half - 1;
  const int64_t sub = index - int64_t{shift} * half;
  // The very last bucket's bound would overflow int64: cap it.
  if (shift >= 63 - bits_ && sub == (int64_t{1} << bits_) - 1) return INT64_MAX;
  return (sub + 1) << shift;
}

int64_t LatencyHistogram::Representative(int index) const {
  const int64_t low = BucketLow(index);
  return low + (BucketHigh(index) - low) / 2;  // exact buckets (width 1) report their value
}

void LatencyHistogram::Record(int64_t value, int64_t count) {
  if (count <= 0) return;
  value = std::max<int64_t>(value, 0);
  const int index = BucketIndex(value);
  if (index >= static_cast<int>(counts_.size())) counts_.resize(index + 1, 0);
  counts_[index] += count;
  if (count_ == 0) {
    min_ = max_ = value;
  } else {
    min_ = std::min(min_, value);
    max_ = std::max(max_, value);
  }
  count_ += count;
  const double v = static_cast<double>(value);
  sum_ += v * static_cast<double>(count);
  sum_squares_ += v * v * static_cast<double>(count);
}

void LatencyHistogram::Merge(const LatencyHistogram& other) {
  if (other.count_ == 0) return;
  if (other.counts_.size() > counts_.size()) counts_.resize(other.counts_.size(), 0);
  for (size_t i = 0; i < other.counts_.size(); ++i) counts_[i] += other.counts_[i];
  if (count_ == 0) {
    min_ = other.min_;
    max_ = other.max_;
  } else {
    min_ = std::min(min_, other.min_);
    max_ = std::max(max_, other.max_);
  }
  count_ += other.count_;
  sum_ += other.sum_;
  sum_squares_ += other.sum_squares_;
}

void LatencyHistogram::Clear() { *this = LatencyHistogram(bits_); }

double LatencyHistogram::mean() const {
  return count_ == 0 ? 0 : sum_ / static_cast<double>(count_);
}

double LatencyHistogram::stddev() const {
  if (count_ < 2) return 0;
  const double m = mean();
  const double var = sum_squares_ / static_cast<double>(count_) - m * m;
  return var > 0 ? std::sqrt(var) : 0;
}

int64_t LatencyHistogram::Percentile(double q) const {
  if (count_ == 0) return 0;
  if (q <= 0) return min_;
  if (q >= 1) return max_;
  const int64_t rank = NearestRank(q, count_);
  int64_t seen = 0;
  for (size_t i = 0; i < counts_.size(); ++i) {
    seen += counts_[i];
    if (seen >= rank) return std::clamp(Representative(static_cast<int>(i)), min_, max_);
  }
  return max_;
}

std::vector<LatencyHistogram::Bucket> LatencyHistogram::Buckets() const {
  std::vector<Bucket> out;
  for (size_t i = 0; i < counts_.size(); ++i) {
    if (counts_[i] == 0) continue;
    const int index = static_cast<int>(i);
    out.push_back(Bucket{BucketLow(index), BucketHigh(index), counts_[i]});
  }
  return out;
}

std::vector<LatencyHistogram::Bucket> LatencyHistogram::DisplayBins(int bins) const {
  std::vector<Bucket> out;
  if (count_ == 0 || bins < 1) return out;
  const int64_t lo = std::max<int64_t>(min_, 1);
  const int64_t hi = std::max<int64_t>(max_ + 1, lo + 1);
  // Edges on a log scale, rounded to integers and made strictly increasing.
  std::vector<int64_t> edges = {min_ < lo ? min_ : lo};
  const double ratio = std::log(static_cast<double>(hi) / static_cast<double>(lo));
  for (int i = 1; i <= bins; ++i) {
    int64_t e = i == bins ? hi
                          : static_cast<int64_t>(
                                std::llround(static_cast<double>(lo) * std::exp(ratio * i / bins)));
    if (e > edges.back()) edges.push_back(e);
  }
  if (edges.back() < hi) edges.push_back(hi);
  for (size_t i = 0; i + 1 < edges.size(); ++i) out.push_back(Bucket{edges[i], edges[i + 1], 0});
  for (size_t i = 0; i < counts_.size(); ++i) {
    if (counts_[i] == 0) continue;
    const int64_t v = std::clamp(Representative(static_cast<int>(i)), min_, max_);
    auto it = std::upper_bound(edges.begin(), edges.end(), v);
    size_t bin = it == edges.begin() ? 0 : static_cast<size_t>(it - edges.begin()) - 1;
    bin = std::min(bin, out.size() - 1);
    out[bin].count += counts_[i];
  }
  return out;
}

}  // namespace indexer::bench
