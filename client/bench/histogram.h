// LatencyHistogram: an HDR-style log-linear histogram of non-negative integer values (indexer-
// bench records latencies in nanoseconds), small enough to keep one per time interval and
// precise enough for p99.9.
//
// Layout: with b significant bits, values below 2^b have a bucket each (exact); above, every
// power-of-two range [2^e, 2^(e+1)) is cut into 2^(b-1) equal buckets, so a bucket is at most
// 2^(1-b) of its values wide and the value reported for it (its midpoint) is within 2^-b of any
// value in it (b = 8: 0.39%). min, max, count, sum and sum of squares are kept exactly.
//
// Percentile(q) is nearest-rank: the value of the ceil(q * count)-th smallest sample (the first
// for q = 0), reported as its bucket's midpoint clamped to [min, max], so Percentile(1) is the
// exact max and Percentile(0) the exact min.
//
// Threads: a plain value; callers synchronise (indexer-bench's Recorder holds a mutex).
#pragma once

#include <cstdint>
#include <vector>

namespace indexer::bench {

// The 1-based rank of the q-quantile of n samples, nearest-rank: ceil(q * n) in [1, n] (1 for
// q <= 0), robust to q * n landing a hair above an integer. The reference that tests use too.
int64_t NearestRank(double q, int64_t n);

class LatencyHistogram {
 public:
  // significant_bits b in [2, 12]; 8 for totals, fewer for per-interval histograms.
  explicit LatencyHistogram(int significant_bits = 8);

  // Records `count` samples of `value` (negative values count as 0).
  void Record(int64_t value, int64_t count = 1);
  // Adds another histogram's samples. Both must have the same significant bits.
  void Merge(const LatencyHistogram& other);
  void Clear();

  int64_t count() const { return count_; }
  bool empty() const { return count_ == 0; }
  int64_t min() const { return count_ == 0 ? 0 : min_; }
  int64_t max() const { return count_ == 0 ? 0 : max_; }
  double mean() const;
  double stddev() const;
  // See the header comment. 0 when empty; q is clamped to [0, 1].
  int64_t Percentile(double q) const;
  int significant_bits() const { return bits_; }

  // One non-empty bucket: samples in [low, high) (high is exclusive).
  struct Bucket {
    int64_t low;
    int64_t high;
    int64_t count;
  };
  // The non-empty buckets in increasing order.
  std::vector<Bucket> Buckets() const;

  // A coarse view for printing and charts: at most `bins` bins of equal width on a log scale
  // from min to max, each with the samples whose bucket midpoint falls in it (bins[i].high ==
  // bins[i+1].low). Empty when there are no samples.
  std::vector<Bucket> DisplayBins(int bins) const;

  // Index of the bucket holding `value`, and that bucket's bounds (exposed for tests).
  int BucketIndex(int64_t value) const;
  int64_t BucketLow(int index) const;
  int64_t BucketHigh(int index) const;

 private:
  int64_t Representative(int index) const;

  int bits_;
  std::vector<int64_t> counts_;  // grows to the largest index recorded
  int64_t count_ = 0;
  int64_t min_ = 0;
  int64_t max_ = 0;
  double sum_ = 0;
  double sum_squares_ = 0;
};

}  // namespace indexer::bench
