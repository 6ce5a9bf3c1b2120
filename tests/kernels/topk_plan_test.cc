// The CUDA top-k's shapes (kernels/cuda/topk_plan.h) on the CPU: NextPow2 and RowDivider against
// plain arithmetic, and ChooseTopk, the top-k's one decision: the strategy and layout of every
// group of rows, pinned at the bounds of each strategy and over a sweep of shapes, with the
// invariants the kernels rely on (a register layout holds every key, a threshold pass fits its
// shared arrays, a warp's method fits its candidate buffer). Runs without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/topk_plan.h"

namespace indexer::testing {
namespace {

namespace kc = kernels::cuda;
using kc::SharedRowMethod;
using kc::TopkCaller;
using kc::TopkStrategy;

constexpr TopkCaller kDecode = TopkCaller::kDecodeSelector;
constexpr TopkCaller kPrefill = TopkCaller::kPrefillTopk;
constexpr int kThreads = 256;  // both top-k kernels' block size

// The top-k's division of row indices by the head count: exact against the hardware division,
// for every row below 2^16 at small divisors, at the edges of the range and on random pairs.
TEST(RowDividerTest, MatchesIntegerDivision) {
  for (int d = 1; d <= 64; ++d) {
    const kc::RowDivider div(d);
    for (int x = 0; x < (1 << 16); ++x) ASSERT_EQ(x / d, div(x)) << x << " / " << d;
    for (int x : {0x7fffffff, 0x7ffffffe, 0x40000000, 0x3fffffff}) ASSERT_EQ(x / d, div(x)) << x << " / " << d;
  }
  std::mt19937 rng(11);
  for (int i = 0; i < 1000000; ++i) {
    const int d = static_cast<int>(rng() % 0x7fffffffu) + 1;
    const int x = static_cast<int>(rng() % 0x80000000u);
    const kc::RowDivider div(d);
    ASSERT_EQ(x / d, div(x)) << x << " / " << d;
  }
}

// NextPow2 (one count of leading zeros, the formula the device runs too) against a loop of
// doublings, over every value below 2^20 and the top of its range.
TEST(NextPow2Test, MatchesDoubling) {
  const auto doubling = [](int32_t v) {
    int32_t p = 1;
    while (p < v) p <<= 1;
    return p;
  };
  for (int32_t v = -3; v < (1 << 20); ++v) ASSERT_EQ(doubling(v), kc::NextPow2(v)) << v;
  for (int32_t v : {(1 << 29) - 1, 1 << 29, (1 << 29) + 1, (1 << 30) - 1, 1 << 30}) {
    ASSERT_EQ(doubling(v), kc::NextPow2(v)) << v;
  }
}

std::string Shape(TopkCaller caller, int rows, int n, int topk, int threads) {
  return std::string(caller == kDecode ? "decode" : "prefill") + " rows " + std::to_string(rows) + " n " +
         std::to_string(n) + " topk " + std::to_string(topk) + " threads " + std::to_string(threads);
}

// Decode rows in registers: up to 8 rows with NextPow2(rows) * n <= 4096, topk <= 16.
TEST(ChooseTopkTest, RegistersForUpTo8ShortRows) {
  struct Case {
    int rows, n, topk, warps_per_row, vectors_per_warp;
  };
  for (const Case& c : {Case{1, 1, 16, 1, 1}, Case{1, 64, 16, 2, 1}, Case{1, 4096, 16, 8, 16},
                        Case{4, 1024, 16, 2, 16}, Case{5, 512, 1, 1, 16}}) {
    SCOPED_TRACE(Shape(kDecode, c.rows, c.n, c.topk, kThreads));
    const kc::TopkChoice got = kc::ChooseTopk(kDecode, c.rows, c.n, c.topk, kThreads);
    ASSERT_EQ(got.strategy, TopkStrategy::kRegisters);
    EXPECT_EQ(got.warps_per_row, c.warps_per_row);
    EXPECT_EQ(got.vectors_per_warp, c.vectors_per_warp);
  }
}

// The decode threshold pass: 2 or more rows of 512 to 1024 blocks past the register strategy's
// bounds, topk <= 32; two warps per row for up to four rows or rows over 512 blocks.
TEST(ChooseTopkTest, ThresholdPassForSeveralRowsOf512To1024Blocks) {
  struct Case {
    int rows, n, topk, threads_per_row, rows_per_pass;
  };
  for (const Case& c : {Case{9, 512, 16, 32, 8}, Case{2, 512, 17, 64, 4}, Case{8, 1024, 16, 64, 4},
                        Case{32, 1024, 32, 64, 4}}) {
    SCOPED_TRACE(Shape(kDecode, c.rows, c.n, c.topk, kThreads));
    const kc::TopkChoice got = kc::ChooseTopk(kDecode, c.rows, c.n, c.topk, kThreads);
    ASSERT_EQ(got.strategy, TopkStrategy::kThresholdPass);
    EXPECT_EQ(got.threads_per_row, c.threads_per_row);
    EXPECT_EQ(got.rows_per_pass, c.rows_per_pass);
    EXPECT_EQ(got.candidates_per_row, kc::kWarpCandidates);
    EXPECT_EQ(got.row_method, SharedRowMethod::kWarpTopK);
  }
}

// Everything else through shared memory, in one pass of every row; each row by its method.
TEST(ChooseTopkTest, SharedKeysOtherwiseByRowMethod) {
  struct Case {
    TopkCaller caller;
    int rows, n, topk;
    SharedRowMethod method;
  };
  for (const Case& c : {Case{kDecode, 1, 8192, 16, SharedRowMethod::kWarpTopK},
                        Case{kDecode, 2, 1024, 33, SharedRowMethod::kWholeRowSort},
                        Case{kDecode, 3, 256, 64, SharedRowMethod::kWarpSort},
                        Case{kPrefill, 128, 32, 16, SharedRowMethod::kRankInWarp},
                        Case{kPrefill, 64, 64, 33, SharedRowMethod::kWarpSort}}) {
    SCOPED_TRACE(Shape(c.caller, c.rows, c.n, c.topk, kThreads));
    const kc::TopkChoice got = kc::ChooseTopk(c.caller, c.rows, c.n, c.topk, kThreads);
    ASSERT_EQ(got.strategy, TopkStrategy::kSharedKeys);
    EXPECT_EQ(got.rows_per_pass, c.rows);
    EXPECT_EQ(got.kept, std::min(c.n, kc::NextPow2(c.topk)));
    EXPECT_EQ(got.row_method, c.method);
  }
  EXPECT_EQ(kc::ChooseTopk(kDecode, 32, 64, 17, kThreads).row_method, SharedRowMethod::kTwoKeysPerLane);
}

// Short rows in the prefill kernel only; registers and the threshold pass in the decode kernel
// only, and only in 256-thread blocks.
TEST(ChooseTopkTest, KernelSpecificStrategiesStayInTheirKernel) {
  const auto strategy = [](TopkCaller caller, int rows, int n, int topk, int threads) {
    return kc::ChooseTopk(caller, rows, n, topk, threads).strategy;
  };
  EXPECT_EQ(strategy(kPrefill, 64, 64, 32, kThreads), TopkStrategy::kShortRows);
  EXPECT_EQ(strategy(kDecode, 1, 64, 32, kThreads), TopkStrategy::kSharedKeys);
  EXPECT_EQ(strategy(kPrefill, 4, 512, 16, kThreads), TopkStrategy::kSharedKeys);
  EXPECT_EQ(strategy(kDecode, 1, 64, 16, 128), TopkStrategy::kSharedKeys);
  EXPECT_EQ(strategy(kDecode, 4, 512, 16, 512), TopkStrategy::kSharedKeys);
}

bool IsPow2(int v) { return v > 0 && (v & (v - 1)) == 0; }

// Each strategy's domain, as the headers state it.
TopkStrategy ExpectedStrategy(TopkCaller caller, int rows, int n, int topk, int threads) {
  if (caller == kPrefill) {
    return n > 32 && n <= 64 && topk <= 32 ? TopkStrategy::kShortRows : TopkStrategy::kSharedKeys;
  }
  if (threads == 256 && rows <= 8 && topk <= 16 && int64_t{kc::NextPow2(rows)} * n <= 4096) {
    return TopkStrategy::kRegisters;
  }
  if (threads == 256 && rows >= 2 && n >= 512 && n <= 1024 && topk <= 32) return TopkStrategy::kThresholdPass;
  return TopkStrategy::kSharedKeys;
}

SharedRowMethod ExpectedRowMethod(int n, int kept) {
  if (n <= 32) return SharedRowMethod::kRankInWarp;
  if (n == 64 && kept <= 32) return SharedRowMethod::kTwoKeysPerLane;
  if (n <= 64 || (n <= 256 && kept > 32)) return SharedRowMethod::kWarpSort;
  return kept <= 32 ? SharedRowMethod::kWarpTopK : SharedRowMethod::kWholeRowSort;
}

// What SelectRowsInRegisters assumes of a layout: warps and vectors its switches cover, each row
// on warps of its own, every key held, one per lane of one vector. "" when it holds.
std::string CheckRegisterLayout(const kc::TopkChoice& c, int rows, int n, int topk) {
  const int warps = std::max(1, std::min(kc::kTopkWarps / kc::NextPow2(rows), n / 32));
  if (c.warps_per_row != warps || !IsPow2(c.warps_per_row)) return "warps per row";
  if (!IsPow2(c.vectors_per_warp) || c.vectors_per_warp > kc::kRegisterVectors) return "vectors";
  if (kc::NextPow2(rows) * c.warps_per_row > kc::kTopkWarps) return "rows share warps";
  if (c.warps_per_row * c.vectors_per_warp * 32 != std::max(n, 32)) return "keys not covered";
  return topk <= kc::kRegisterTopK ? "" : "topk";
}

// What SelectRowsThreshold assumes: whole warps per row, at most kThresholdKeys keys per thread, a
// pass that fills the CTA and fits the pass's shared arrays, lists that fit the scratch after
// the keys, kept keys within a warp.
std::string CheckThresholdLayout(const kc::TopkChoice& c, int rows, int n, int threads) {
  if (c.threads_per_row != ((rows <= 4 || n > 512) ? 64 : 32)) return "threads per row";
  if (n / c.threads_per_row > kc::kThresholdKeys) return "keys per thread";
  if (c.rows_per_pass * c.threads_per_row != threads) return "pass does not fill the CTA";
  if (c.rows_per_pass > kc::kThresholdRowsPerPass) return "pass rows";
  if (!IsPow2(c.candidates_per_row) || c.candidates_per_row > kc::kWarpCandidates ||
      c.rows_per_pass * c.candidates_per_row > kc::kTopkWarps * kc::kWarpCandidates) {
    return "candidate lists";
  }
  return c.kept <= 32 ? "" : "kept above a warp";
}

// Checks one choice against the domains and what its kernel code assumes; "" when fine.
std::string CheckChoice(TopkCaller caller, int rows, int n, int topk, int threads) {
  const kc::TopkChoice c = kc::ChooseTopk(caller, rows, n, topk, threads);
  const std::string where = Shape(caller, rows, n, topk, threads) + ": ";
  if (c.strategy != ExpectedStrategy(caller, rows, n, topk, threads)) return where + "strategy";
  if (c.strategy == TopkStrategy::kShortRows) return "";
  if (c.strategy == TopkStrategy::kRegisters) {
    const std::string why = CheckRegisterLayout(c, rows, n, topk);
    return why.empty() ? "" : where + why;
  }
  if (c.kept != std::min(n, kc::NextPow2(topk)) || !IsPow2(c.kept)) return where + "kept";
  if (c.row_method != ExpectedRowMethod(n, c.kept)) return where + "row method";
  if (c.row_method == SharedRowMethod::kWarpSort && std::max(n, 2) > kc::kWarpCandidates) {
    return where + "warp sort past the candidate buffer";
  }
  if (c.strategy == TopkStrategy::kSharedKeys) return c.rows_per_pass == rows ? "" : where + "pass rows";
  const std::string why = CheckThresholdLayout(c, rows, n, threads);
  return why.empty() ? "" : where + why;
}

TEST(ChooseTopkTest, SweepOfShapes) {
  std::vector<int> row_counts, topks;
  for (int r = 1; r <= 64; ++r) row_counts.push_back(r);
  for (int r : {100, 128, 255, 256, 512, 1024, 2048, 4096}) row_counts.push_back(r);
  for (int k = 1; k <= 64; ++k) topks.push_back(k);
  for (int k : {100, 127, 128, 129, 256, 1024, 2048}) topks.push_back(k);
  int64_t checked = 0;
  for (TopkCaller caller : {kDecode, kPrefill}) {
    for (int threads : {128, 256, 512}) {
      for (int rows : row_counts) {
        for (int log_n = 0; log_n <= 20; ++log_n) {
          for (int topk : topks) {
            ASSERT_EQ(CheckChoice(caller, rows, 1 << log_n, topk, threads), "");
            ++checked;
          }
        }
      }
    }
  }
  EXPECT_GT(checked, 600000);
}

}  // namespace
}  // namespace indexer::testing
