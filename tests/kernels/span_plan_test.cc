// The CUDA selectors' launch planners (kernels/cuda/span_plan.h), plain C++: every visible block
// of every span belongs to exactly one decode work unit, units stay within the cap, a long span
// spreads over the GPU next to short ones, and the decode index holds what the plan says. Runs
// without a GPU.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "kernels/cuda/span_plan.h"
#include "kernels/cuda/topk_plan.h"

namespace indexer::testing {
namespace {

using kernels::KeyStorage;
using kernels::cuda::DecodeChunkBlocks;
using kernels::cuda::DecodePlan;
using kernels::cuda::NextPow2;
using kernels::cuda::PlanDecode;
using kernels::cuda::RowDivider;
using kernels::cuda::SpanDesc;

TEST(DecodeChunkBlocksTest, HalfAMegabyteOfKeysPerCta) {
  EXPECT_EQ(16, DecodeChunkBlocks(128, KeyStorage::kBf16));  // 16 x 32 KB pages
  EXPECT_EQ(32, DecodeChunkBlocks(128, KeyStorage::kFp8E4M3));
  EXPECT_EQ(32, DecodeChunkBlocks(64, KeyStorage::kBf16));
  EXPECT_EQ(8, DecodeChunkBlocks(256, KeyStorage::kBf16));
  EXPECT_EQ(64, DecodeChunkBlocks(64, KeyStorage::kFp8E4M3));
}

// The top-k's division of row indices by the head count: exact against the hardware division,
// for every row below 2^16 at small divisors, at the edges of the range and on random pairs.
TEST(RowDividerTest, MatchesIntegerDivision) {
  for (int d = 1; d <= 64; ++d) {
    const RowDivider div(d);
    for (int x = 0; x < (1 << 16); ++x) ASSERT_EQ(x / d, div(x)) << x << " / " << d;
    for (int x : {0x7fffffff, 0x7ffffffe, 0x40000000, 0x3fffffff}) ASSERT_EQ(x / d, div(x)) << x << " / " << d;
  }
  std::mt19937 rng(11);
  for (int i = 0; i < 1000000; ++i) {
    const int d = static_cast<int>(rng() % 0x7fffffffu) + 1;
    const int x = static_cast<int>(rng() % 0x80000000u);
    const RowDivider div(d);
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
  for (int32_t v = -3; v < (1 << 20); ++v) ASSERT_EQ(doubling(v), NextPow2(v)) << v;
  for (int32_t v : {(1 << 29) - 1, 1 << 29, (1 << 29) + 1, (1 << 30) - 1, 1 << 30}) {
    ASSERT_EQ(doubling(v), NextPow2(v)) << v;
  }
}

// Checks the plan's invariants for `spans` (already planned).
void ExpectCovering(const std::vector<SpanDesc>& spans, const DecodePlan& plan, int cap) {
  std::vector<int> owner(plan.total_units, -1);
  int64_t scores = 0;
  for (size_t i = 0; i < spans.size(); ++i) {
    const SpanDesc& s = spans[i];
    const int64_t last = s.start_pos + s.num_tokens - 1;
    EXPECT_EQ(last / 128 + 1, s.visible_blocks);
    EXPECT_LE(s.chunk_blocks, cap);
    EXPECT_EQ(s.score_offset, scores);
    scores += int64_t{s.Rows()} * s.visible_blocks;
    // Units [unit_begin, unit_begin + block_chunks) cover blocks [0, visible) exactly once.
    EXPECT_GE(int64_t{s.block_chunks} * s.chunk_blocks, s.visible_blocks);
    EXPECT_LT(int64_t{s.block_chunks - 1} * s.chunk_blocks, s.visible_blocks);
    for (int u = s.unit_begin; u < s.unit_begin + s.block_chunks; ++u) {
      ASSERT_GE(u, 0);
      ASSERT_LT(u, plan.total_units);
      EXPECT_EQ(-1, owner[u]) << "unit " << u << " planned twice";
      owner[u] = static_cast<int>(i);
    }
  }
  for (int u = 0; u < plan.total_units; ++u) EXPECT_NE(-1, owner[u]) << "unit " << u << " unowned";
  EXPECT_EQ(scores, plan.score_floats);
}

TEST(PlanDecodeTest, EveryBlockInExactlyOneUnit) {
  std::mt19937_64 rng(std::random_device{}());
  for (int round = 0; round < 50; ++round) {
    std::vector<SpanDesc> spans(1 + rng() % 300);
    for (SpanDesc& s : spans) {
      s.num_tokens = 1 + static_cast<int>(rng() % 4);
      s.num_heads = 1 + static_cast<int>(rng() % 8);
      s.start_pos = static_cast<int64_t>(rng() % 300000);
    }
    const int cap = 1 + static_cast<int>(rng() % 64);
    const DecodePlan plan = PlanDecode(spans, 132, cap);
    ExpectCovering(spans, plan, cap);
    if (HasFailure()) return;
  }
}

TEST(PlanDecodeTest, OneLongSpanSpreadsOverTheGpu) {
  std::vector<SpanDesc> spans(3);
  spans[1].start_pos = 131071;  // 1024 blocks next to two 1-block spans
  const DecodePlan plan = PlanDecode(spans, 132, DecodeChunkBlocks(128, KeyStorage::kBf16));
  ExpectCovering(spans, plan, 16);
  // Two CTAs per multiprocessor: the long span's 1024 blocks take 4 blocks per CTA, 256 CTAs.
  EXPECT_EQ(4, spans[1].chunk_blocks);
  EXPECT_EQ(256, spans[1].block_chunks);
  EXPECT_EQ(1, spans[0].block_chunks);
}

// The decode index (WriteDecodeIndex) holds, in arrays, each planned span's block table, first
// unit and visible blocks; the decode selector takes every span's unit size from the plan, so the
// planner must give all spans the same.
TEST(DecodeIndexTest, ArraysMatchThePlannedSpans) {
  std::mt19937_64 rng(std::random_device{}());
  std::vector<int32_t> tables(4096);
  for (int round = 0; round < 20; ++round) {
    std::vector<SpanDesc> spans(1 + rng() % 700);
    for (SpanDesc& s : spans) {
      s.start_pos = static_cast<int64_t>(rng() % 300000);
      s.block_table = tables.data() + rng() % tables.size();
    }
    const DecodePlan plan = PlanDecode(spans, 132, 16);
    std::vector<unsigned char> index(kernels::cuda::DecodeIndexBytes(spans.size()));
    kernels::cuda::WriteDecodeIndex(spans, index.data());
    const size_t n = spans.size();
    for (size_t i = 0; i < n; ++i) {
      const int32_t* table = nullptr;
      int32_t begin = 0, visible = 0;
      std::memcpy(&table, index.data() + 8 * i, 8);
      std::memcpy(&begin, index.data() + 8 * n + 4 * i, 4);
      std::memcpy(&visible, index.data() + 12 * n + 4 * i, 4);
      ASSERT_EQ(spans[i].block_table, table) << "span " << i;
      ASSERT_EQ(spans[i].unit_begin, begin) << "span " << i;
      ASSERT_EQ(spans[i].visible_blocks, visible) << "span " << i;
      ASSERT_EQ(plan.max_chunk_blocks, spans[i].chunk_blocks) << "span " << i;
    }
  }
}

}  // namespace
}  // namespace indexer::testing
