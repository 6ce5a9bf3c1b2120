// LatencyHistogram (client/bench/histogram.h): bucket layout, and percentiles against the exact
// nearest-rank percentiles of the sorted samples.
#include "client/bench/histogram.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

namespace indexer::bench {
namespace {

// The exact nearest-rank percentile of `samples`.
int64_t ExactPercentile(std::vector<int64_t> samples, double q) {
  std::sort(samples.begin(), samples.end());
  if (q <= 0) return samples.front();
  return samples[static_cast<size_t>(NearestRank(q, static_cast<int64_t>(samples.size())) - 1)];
}

void ExpectPercentilesClose(const std::vector<int64_t>& samples, int bits, const char* what) {
  LatencyHistogram h(bits);
  for (int64_t v : samples) h.Record(v);
  const double bound = std::ldexp(1.0, -bits);  // the midpoint's relative error bound
  for (double q : {0.0, 0.001, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 0.995, 0.999, 0.9999, 1.0}) {
    const int64_t exact = ExactPercentile(samples, q);
    const int64_t got = h.Percentile(q);
    EXPECT_LE(std::abs(static_cast<double>(got - exact)), bound * static_cast<double>(exact) + 1)
        << what << ": q " << q << " exact " << exact << " histogram " << got;
  }
  EXPECT_EQ(h.Percentile(0), *std::min_element(samples.begin(), samples.end())) << what;
  EXPECT_EQ(h.Percentile(1), *std::max_element(samples.begin(), samples.end())) << what;
}

TEST(NearestRankTest, MatchesDefinition) {
  EXPECT_EQ(NearestRank(0.5, 10), 5);
  EXPECT_EQ(NearestRank(0.99, 100), 99);
  EXPECT_EQ(NearestRank(0.999, 1000), 999);  // 0.999 * 1000 is not exactly 999 in binary
  EXPECT_EQ(NearestRank(0.999, 1001), 1000);
  EXPECT_EQ(NearestRank(0.0, 7), 1);
  EXPECT_EQ(NearestRank(1.0, 7), 7);
  EXPECT_EQ(NearestRank(0.3, 10), 3);
  EXPECT_EQ(NearestRank(0.31, 10), 4);
}

TEST(LatencyHistogramTest, BucketsAreContiguousAndNarrow) {
  for (int bits : {3, 5, 8}) {
    LatencyHistogram h(bits);
    int64_t expected_low = 0;
    for (int i = 0; i < (62 - bits) * (1 << (bits - 1)); ++i) {
      ASSERT_EQ(h.BucketLow(i), expected_low) << "bits " << bits << " index " << i;
      const int64_t high = h.BucketHigh(i);
      ASSERT_GT(high, expected_low);
      // Width at most 2^(1-b) of the low bound above the exact region.
      if (expected_low >= (int64_t{1} << bits)) {
        ASSERT_LE(static_cast<double>(high - expected_low),
                  std::ldexp(static_cast<double>(expected_low), 1 - bits));
      } else {
        ASSERT_EQ(high, expected_low + 1);
      }
      ASSERT_EQ(h.BucketIndex(expected_low), i);
      ASSERT_EQ(h.BucketIndex(high - 1), i);
      expected_low = high;
    }
  }
}

TEST(LatencyHistogramTest, SmallValuesAreExact) {
  LatencyHistogram h(8);
  for (int v = 0; v < 256; ++v) h.Record(v);
  for (double q : {0.1, 0.5, 0.9, 0.99}) {
    EXPECT_EQ(h.Percentile(q), NearestRank(q, 256) - 1) << q;
  }
  EXPECT_EQ(h.min(), 0);
  EXPECT_EQ(h.max(), 255);
  EXPECT_DOUBLE_EQ(h.mean(), 127.5);
}

TEST(LatencyHistogramTest, PercentilesMatchSortedSamples) {
  std::mt19937_64 rng(7);
  // Log-normal latencies around 2 ms with a heavy tail, in ns.
  std::vector<int64_t> lognormal(200000);
  std::lognormal_distribution<double> ln(std::log(2e6), 0.6);
  for (int64_t& v : lognormal) v = static_cast<int64_t>(ln(rng));
  ExpectPercentilesClose(lognormal, 8, "lognormal, 8 bits");
  ExpectPercentilesClose(lognormal, 5, "lognormal, 5 bits");

  std::vector<int64_t> uniform(50001);
  std::uniform_int_distribution<int64_t> un(1000, 50'000'000);
  for (int64_t& v : uniform) v = un(rng);
  ExpectPercentilesClose(uniform, 8, "uniform");

  // Bimodal: most requests fast, 0.5% very slow: p99.9 must land in the slow mode.
  std::vector<int64_t> bimodal;
  for (int i = 0; i < 99500; ++i) bimodal.push_back(1'000'000 + i % 1000);
  for (int i = 0; i < 500; ++i) bimodal.push_back(900'000'000 + i * 1000);
  ExpectPercentilesClose(bimodal, 8, "bimodal");
  LatencyHistogram h(8);
  for (int64_t v : bimodal) h.Record(v);
  EXPECT_GT(h.Percentile(0.999), 800'000'000);
  EXPECT_LT(h.Percentile(0.99), 2'000'000);

  std::vector<int64_t> tiny = {5'000'000};
  ExpectPercentilesClose(tiny, 8, "one sample");
}

TEST(LatencyHistogramTest, MeanAndStddevAreExact) {
  LatencyHistogram h;
  std::vector<double> values = {1e6, 2e6, 3e6, 4e6, 10e6};
  for (double v : values) h.Record(static_cast<int64_t>(v));
  EXPECT_DOUBLE_EQ(h.mean(), 4e6);
  double var = 0;
  for (double v : values) var += (v - 4e6) * (v - 4e6);
  EXPECT_NEAR(h.stddev(), std::sqrt(var / 5), 1.0);
}

TEST(LatencyHistogramTest, MergeEqualsRecordingEverything) {
  std::mt19937_64 rng(3);
  std::uniform_int_distribution<int64_t> d(1, 1'000'000'000);
  LatencyHistogram a, b, all;
  for (int i = 0; i < 10000; ++i) {
    const int64_t v = d(rng);
    (i % 3 == 0 ? a : b).Record(v);
    all.Record(v);
  }
  a.Merge(b);
  EXPECT_EQ(a.count(), all.count());
  EXPECT_EQ(a.min(), all.min());
  EXPECT_EQ(a.max(), all.max());
  for (double q : {0.5, 0.9, 0.99, 0.999}) EXPECT_EQ(a.Percentile(q), all.Percentile(q));
  LatencyHistogram empty;
  empty.Merge(all);
  EXPECT_EQ(empty.Percentile(0.5), all.Percentile(0.5));
}

TEST(LatencyHistogramTest, EmptyAndEdgeValues) {
  LatencyHistogram h;
  EXPECT_EQ(h.Percentile(0.5), 0);
  EXPECT_TRUE(h.Buckets().empty());
  EXPECT_TRUE(h.DisplayBins(10).empty());
  h.Record(-5);  // counts as 0
  h.Record(INT64_MAX / 2);
  EXPECT_EQ(h.count(), 2);
  EXPECT_EQ(h.min(), 0);
  EXPECT_EQ(h.max(), INT64_MAX / 2);
  h.Record(7, 3);
  EXPECT_EQ(h.count(), 5);
  EXPECT_EQ(h.Percentile(0.5), 7);
}

TEST(LatencyHistogramTest, DisplayBinsCoverEverySample) {
  std::mt19937_64 rng(11);
  std::lognormal_distribution<double> ln(std::log(3e6), 1.0);
  LatencyHistogram h;
  for (int i = 0; i < 30000; ++i) h.Record(static_cast<int64_t>(ln(rng)));
  const auto bins = h.DisplayBins(20);
  ASSERT_FALSE(bins.empty());
  EXPECT_LE(bins.size(), 20u);
  int64_t total = 0;
  for (size_t i = 0; i < bins.size(); ++i) {
    total += bins[i].count;
    EXPECT_LT(bins[i].low, bins[i].high);
    if (i > 0) {
      EXPECT_EQ(bins[i].low, bins[i - 1].high);
    }
  }
  EXPECT_EQ(total, h.count());
  EXPECT_LE(bins.front().low, h.min());
  EXPECT_GT(bins.back().high, h.max());
  // Log-spaced: the widths grow.
  EXPECT_GT(bins.back().high - bins.back().low, bins.front().high - bins.front().low);
  // One distinct value: one bin.
  LatencyHistogram one;
  one.Record(1234, 10);
  ASSERT_EQ(one.DisplayBins(10).size(), 1u);
  EXPECT_EQ(one.DisplayBins(10)[0].count, 10);
}

}  // namespace
}  // namespace indexer::bench
