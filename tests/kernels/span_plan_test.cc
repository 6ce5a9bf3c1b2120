// The CUDA selectors' launch planners (kernels/cuda/span_plan.h), plain C++: every visible block
// of every span belongs to exactly one decode work unit, units stay within the cap, a long span
// spreads over the GPU next to short ones, and the decode index holds what the plan says. Runs
// without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/cuda/span_plan.h"
#include "kernels/numeric.h"

namespace indexer::testing {
namespace {

using kernels::KeyStorage;
using kernels::cuda::DecodeChunkBlocks;
using kernels::cuda::DecodePlan;
using kernels::cuda::PlanDecode;
using kernels::cuda::SpanDesc;

TEST(DecodeChunkBlocksTest, HalfAMegabyteOfKeysPerCta) {
  EXPECT_EQ(16, DecodeChunkBlocks(128, KeyStorage::kBf16));  // 16 x 32 KB pages
  EXPECT_EQ(32, DecodeChunkBlocks(128, KeyStorage::kFp8E4M3));
  EXPECT_EQ(32, DecodeChunkBlocks(64, KeyStorage::kBf16));
  EXPECT_EQ(8, DecodeChunkBlocks(256, KeyStorage::kBf16));
  EXPECT_EQ(64, DecodeChunkBlocks(64, KeyStorage::kFp8E4M3));
  EXPECT_EQ(56, DecodeChunkBlocks(128, KeyStorage::kFp4E2M1));  // 56 x 9 KB pages
  EXPECT_EQ(28, DecodeChunkBlocks(256, KeyStorage::kFp4E2M1));
}

// Fewer warps per block only for fp4 units of a round of four blocks or more; every choice has
// a kernel variant.
TEST(DecodeWarpsPerBlockTest, TwoForLongFp4UnitsEightOtherwise) {
  using kernels::cuda::DecodeWarpsPerBlock;
  using kernels::cuda::DecodeWarpsSupported;
  for (KeyStorage st : {KeyStorage::kBf16, KeyStorage::kFp8E4M3}) {
    for (int chunk : {1, 4, 64}) EXPECT_EQ(8, DecodeWarpsPerBlock(st, chunk));
  }
  EXPECT_EQ(8, DecodeWarpsPerBlock(KeyStorage::kFp4E2M1, 1));
  EXPECT_EQ(8, DecodeWarpsPerBlock(KeyStorage::kFp4E2M1, 3));
  EXPECT_EQ(2, DecodeWarpsPerBlock(KeyStorage::kFp4E2M1, 4));
  EXPECT_EQ(2, DecodeWarpsPerBlock(KeyStorage::kFp4E2M1, 56));
  for (KeyStorage st : {KeyStorage::kBf16, KeyStorage::kFp8E4M3, KeyStorage::kFp4E2M1}) {
    for (int chunk : {1, 4, 64}) EXPECT_TRUE(DecodeWarpsSupported(st, DecodeWarpsPerBlock(st, chunk)));
    for (int warps : {0, 1, 3, 4}) EXPECT_FALSE(DecodeWarpsSupported(st, warps));
  }
  EXPECT_FALSE(DecodeWarpsSupported(KeyStorage::kBf16, 2));
  EXPECT_FALSE(DecodeWarpsSupported(KeyStorage::kFp8E4M3, 2));
}

// fp4 takes the decode selector's f16 products like fp8: queries outside f16 go exact; its
// overflow bound counts stored values up to 1/16 above the largest key written, at most 2688.
TEST(ChoosePathTest, Fp4KeysAndTheirBounds) {
  using kernels::cuda::Bf16Range;
  using kernels::cuda::ChoosePath;
  using kernels::cuda::SpanPath;
  const Bf16Range small{2.0f, true}, wide{2.0f, false};
  EXPECT_EQ(ChoosePath(4, 128, KeyStorage::kFp4E2M1, small, 3.0f), SpanPath::kDecode);
  EXPECT_EQ(ChoosePath(4, 128, KeyStorage::kFp4E2M1, wide, 3.0f), SpanPath::kExact);
  EXPECT_EQ(ChoosePath(4, 128, KeyStorage::kBf16, wide, 3.0f), SpanPath::kDecode);
  EXPECT_EQ(ChoosePath(100, 128, KeyStorage::kFp4E2M1, wide, 3.0f), SpanPath::kPrefill);
  // 128 * 2^119 * k: bf16 keys of 2^0 stay below 2^126; fp4 bounds them by 1.0625 + 0.01.
  const Bf16Range huge{0x1p119f, true};
  EXPECT_EQ(ChoosePath(4, 128, KeyStorage::kBf16, huge, 0.999f), SpanPath::kDecode);
  EXPECT_EQ(ChoosePath(4, 128, KeyStorage::kFp4E2M1, huge, 0.999f), SpanPath::kExact);
  // Keys of 1e30 store at most 2688 in fp4.
  const Bf16Range big{0x1p100f, true};
  EXPECT_EQ(ChoosePath(4, 128, KeyStorage::kFp4E2M1, big, 1e30f), SpanPath::kDecode);
  EXPECT_EQ(ChoosePath(4, 128, KeyStorage::kBf16, big, 1e30f), SpanPath::kExact);
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

namespace indexer::kernels::cuda {
namespace {

// ScanBf16 (on the bits) against its definition on the floats: the largest |value|, and whether
// every value is zero or has a magnitude in [2^-14, 65504] (exact in f16), over every finite bf16
// value and over random runs of them.
TEST(ScanBf16Test, AgreesWithTheDefinitionOnEveryFiniteValue) {
  const auto definition = [](const uint16_t* v, int64_t n) {
    Bf16Range r;
    for (int64_t i = 0; i < n; ++i) {
      const float a = std::fabs(Bf16ToFloat(v[i]));
      r.max_abs = std::max(r.max_abs, a);
      if (a != 0.0f && (a < 0x1p-14f || a > 65504.0f)) r.fits_f16 = false;
    }
    return r;
  };
  std::vector<uint16_t> finite;
  for (uint32_t b = 0; b < 0x10000; ++b) {
    if (Bf16IsFinite(static_cast<uint16_t>(b))) finite.push_back(static_cast<uint16_t>(b));
  }
  for (uint16_t b : finite) {
    const Bf16Range got = ScanBf16(&b, 1), want = definition(&b, 1);
    ASSERT_EQ(got.max_abs, want.max_abs) << b;
    ASSERT_EQ(got.fits_f16, want.fits_f16) << b;
  }
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 2000; ++trial) {
    std::vector<uint16_t> v(1 + rng() % 300);
    for (uint16_t& x : v) x = finite[rng() % finite.size()];
    const Bf16Range got = ScanBf16(v.data(), static_cast<int64_t>(v.size()));
    const Bf16Range want = definition(v.data(), static_cast<int64_t>(v.size()));
    ASSERT_EQ(got.max_abs, want.max_abs) << trial;
    ASSERT_EQ(got.fits_f16, want.fits_f16) << trial;
  }
}

}  // namespace
}  // namespace indexer::kernels::cuda
