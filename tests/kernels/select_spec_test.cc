// kernels/cpu_reference: SPEC.md's worked example and hand-computed edge cases.
//
// Keys are built so that every dot product is exact (integer or power-of-two values, mostly one
// non-zero dimension), which makes every raw block score a known number; expected selections
// and page-table rows are worked out by hand in the comments.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/cpu_reference.h"
#include "kernels/numeric.h"
#include "kernels/select_types.h"
#include "tests/testing/host_key_pool.h"
#include "tests/testing/storages.h"

namespace indexer::kernels {
namespace {

using ::indexer::testing::Bf16;
using ::indexer::testing::HostKeyPool;
using ::indexer::testing::IdentityTable;
using ::indexer::testing::kPoison;
using ::indexer::testing::RunSelectSpan;
using ::indexer::testing::SpanResult;

constexpr int kD = 128;
using Ids = std::vector<int32_t>;

// Keys [len][kD] whose dims d < value_of(t).size() hold value_of(t)[d] and the rest 0.
std::vector<uint16_t> MakeKeys(int64_t len, const std::function<std::vector<float>(int64_t)>& value_of,
                               int d_count = kD) {
  std::vector<uint16_t> keys(static_cast<size_t>(len) * d_count, Bf16(0.0f));
  for (int64_t t = 0; t < len; ++t) {
    const std::vector<float> v = value_of(t);
    for (size_t d = 0; d < v.size(); ++d) keys[t * d_count + d] = Bf16(v[d]);
  }
  return keys;
}

// Queries [n][H][kD]: head h of every token is `per_head[h]` padded with zeros.
std::vector<uint16_t> MakeQueries(int n, const std::vector<std::vector<float>>& per_head,
                                  int d_count = kD) {
  const int h_count = static_cast<int>(per_head.size());
  std::vector<uint16_t> q(static_cast<size_t>(n) * h_count * d_count, Bf16(0.0f));
  for (int i = 0; i < n; ++i) {
    for (int h = 0; h < h_count; ++h) {
      for (size_t d = 0; d < per_head[h].size(); ++d) {
        q[(static_cast<size_t>(i) * h_count + h) * d_count + d] = Bf16(per_head[h][d]);
      }
    }
  }
  return q;
}

// One sequence in a pool, keys placed through `table` (identity unless given).
struct Sequence {
  Sequence(const std::vector<uint16_t>& keys, int64_t len, KeyStorage storage = KeyStorage::kBf16,
           std::vector<int32_t> table_in = {}, int d_count = kD)
      : table(table_in.empty() ? IdentityTable(testing::BlocksFor(len)) : table_in),
        pool(d_count, storage, *std::max_element(table.begin(), table.end()) + 1) {
    pool.Write(table, keys.data(), len);
  }
  std::vector<int32_t> table;
  HostKeyPool pool;
};

Ids Row(const SpanResult& r, int row, int topk) {
  return Ids(r.block_ids.begin() + row * topk, r.block_ids.begin() + (row + 1) * topk);
}

// Raw scores of every visible block for one token (H = 1), through ScoreBlocks.
std::vector<float> RawScores(const Sequence& s, int64_t pos, const std::vector<uint16_t>& q) {
  SpanSelect span;
  span.block_table = s.table.data();
  span.start_pos = pos;
  span.queries = q.data();
  const int64_t v = VisibleBlocks(pos);
  std::vector<float> raw(v, std::numeric_limits<float>::quiet_NaN());
  ScoreBlocks(s.pool.view(), span, 0, v, raw.data(), v);
  return raw;
}

// ---------------------------------------------------------------------------------------------
// SPEC.md "Worked example"

TEST(WorkedExample, SelectFromScoresAndPageTableRow) {
  const float raw[5] = {0.5f, 2.0f, -3.0f, 2.0f, 7.0f};
  uint64_t scratch[5];
  Ids selected(3, kPoison);
  SelectFromScores(raw, 5, SelectParams{3, 1, 1}, scratch, selected.data());
  EXPECT_EQ(selected, (Ids{0, 4, 1}));

  const int32_t attn[5] = {10, 11, 12, 13, 14};
  Ids row(6, kPoison);
  int32_t context_len = kPoison;
  BuildPageTableRow(selected.data(), 3, 600, attn, PageTableParams{2, 2}, row.data(), &context_len);
  EXPECT_EQ(row, (Ids{20, 21, 22, 23, 28, 29}));
  EXPECT_EQ(context_len, 345);
}

class WorkedExampleEndToEnd : public ::testing::TestWithParam<KeyStorage> {};

TEST_P(WorkedExampleEndToEnd, SelectSpanFromKeys) {
  // Block b's raw score s_b is reached at slot 7; its other keys score s_b - 1 - (t % 3).
  // Every value is a small multiple of 0.5, exact in bf16 and in e4m3.
  const float s[5] = {0.5f, 2.0f, -3.0f, 2.0f, 7.0f};
  const int64_t len = 601;  // p = 600 is the last token; block 4 holds positions 512..600
  const auto keys = MakeKeys(len, [&](int64_t t) {
    const float sb = s[t / 128];
    return std::vector<float>{t % 128 == 7 ? sb : sb - 1.0f - static_cast<float>(t % 3)};
  });
  // Pages placed out of order, as a real pool would.
  const Sequence seq(keys, len, GetParam(), {6, 2, 8, 0, 4});
  const auto q = MakeQueries(1, {{1.0f}});

  // fp4 stores a lone value x of a group as sign(x) * 6 * e4m3(|x| / 6): 0.5 -> 6 * 0.0859375,
  // 2 -> 6 * 0.34375, -3 exactly, 7 -> 6 * 1.125 (monotone, so the order stays).
  EXPECT_EQ(RawScores(seq, 600, q),
            GetParam() == KeyStorage::kFp4E2M1
                ? (std::vector<float>{0.515625f, 2.0625f, -3.0f, 2.0625f, 6.75f})
                : (std::vector<float>{0.5f, 2.0f, -3.0f, 2.0f, 7.0f}));

  const Ids attn = {10, 11, 12, 13, 14};
  const SpanResult r = RunSelectSpan(seq.pool.view(), seq.table, attn, 600, 1, 1, q,
                                     SelectParams{3, 1, 1}, PageTableParams{2, 2});
  EXPECT_EQ(r.block_ids, (Ids{0, 4, 1}));
  EXPECT_EQ(r.page_table, (Ids{20, 21, 22, 23, 28, 29}));
  EXPECT_EQ(r.context_lens, (Ids{345}));
}

INSTANTIATE_TEST_SUITE_P(Storage, WorkedExampleEndToEnd, ::indexer::testing::EveryStorage(),
                         ::indexer::testing::StorageTestName);

// ---------------------------------------------------------------------------------------------
// Visibility at block boundaries, and spans where each token is causal on its own

// dim-0 key values: block 0 all 1; position 128 is -2, 129..255 are 4; position 256 is 2.5,
// 257..299 are 0.5. With q = e0 every dot is the key's dim-0 value.
float BoundaryKey(int64_t t) {
  if (t < 128) return 1.0f;
  if (t == 128) return -2.0f;
  if (t < 256) return 4.0f;
  if (t == 256) return 2.5f;
  return 0.5f;
}

// Hand-computed selections with topk 4, no forced blocks:
//   p < 128:        V = 1: [0]
//   p = 128:        b0 = 1, b1 = -2 (only position 128 visible): [0, 1]
//   128 < p < 256:  b0 = 1, b1 = 4: [1, 0]
//   p >= 256:       b0 = 1, b1 = 4, b2 = 2.5: [1, 2, 0]
Ids BoundaryExpected(int64_t p) {
  if (p < 128) return {0, -1, -1, -1};
  if (p == 128) return {0, 1, -1, -1};
  if (p < 256) return {1, 0, -1, -1};
  return {1, 2, 0, -1};
}

TEST(BlockBoundaries, SingleTokenAtEachBoundary) {
  const int64_t len = 300;
  const auto keys = MakeKeys(len, [](int64_t t) { return std::vector<float>{BoundaryKey(t)}; });
  const Sequence seq(keys, len);
  const auto q = MakeQueries(1, {{1.0f}});
  for (int64_t p : {0, 1, 126, 127, 128, 129, 254, 255, 256, 257, 299}) {
    const SpanResult r =
        RunSelectSpan(seq.pool.view(), seq.table, {}, p, 1, 1, q, SelectParams{4, 0, 0});
    EXPECT_EQ(r.block_ids, BoundaryExpected(p)) << "p = " << p;
  }
  // The visible block count itself.
  EXPECT_EQ(VisibleBlocks(127), 1);
  EXPECT_EQ(VisibleBlocks(128), 2);
  EXPECT_EQ(VisibleBlocks(255), 2);
  EXPECT_EQ(VisibleBlocks(256), 3);
  // With local_blocks 1 at p = 128 the self block b1 is forced ahead of b0.
  const SpanResult local =
      RunSelectSpan(seq.pool.view(), seq.table, {}, 128, 1, 1, q, SelectParams{4, 0, 1});
  EXPECT_EQ(local.block_ids, (Ids{1, 0, -1, -1}));
}

TEST(BlockBoundaries, RawScoresSeeOnlyTheTokensUpToP) {
  const int64_t len = 300;
  const auto keys = MakeKeys(len, [](int64_t t) { return std::vector<float>{BoundaryKey(t)}; });
  const Sequence seq(keys, len);
  const auto q = MakeQueries(1, {{1.0f}});
  EXPECT_EQ(RawScores(seq, 127, q), (std::vector<float>{1.0f}));
  EXPECT_EQ(RawScores(seq, 128, q), (std::vector<float>{1.0f, -2.0f}));
  EXPECT_EQ(RawScores(seq, 255, q), (std::vector<float>{1.0f, 4.0f}));
  EXPECT_EQ(RawScores(seq, 256, q), (std::vector<float>{1.0f, 4.0f, 2.5f}));
}

TEST(BlockBoundaries, SpanTokensAreEachCausal) {
  const int64_t len = 300;
  const auto keys = MakeKeys(len, [](int64_t t) { return std::vector<float>{BoundaryKey(t)}; });
  const Sequence seq(keys, len);
  // attn pages 5, 9, 2 with one page per block and stride 1.
  const Ids attn = {5, 9, 2};
  const PageTableParams pt{1, 1};

  // Three tokens straddling the first boundary.
  {
    const auto q = MakeQueries(3, {{1.0f}});
    const SpanResult r =
        RunSelectSpan(seq.pool.view(), seq.table, attn, 127, 3, 1, q, SelectParams{4, 0, 0}, pt);
    EXPECT_EQ(Row(r, 0, 4), BoundaryExpected(127));
    EXPECT_EQ(Row(r, 1, 4), BoundaryExpected(128));
    EXPECT_EQ(Row(r, 2, 4), BoundaryExpected(129));
  }
  // The whole sequence as one 300-token prefill chunk. Every visible block is selected here, so
  // the tail is always selected and context_len = n_full * 128 + (p + 1 - 128 S) = p + 1.
  // Rows: full blocks in selection order, then the tail:
  //   p < 128: [5]; 128 <= p < 256: [5, 9] (b0 full, b1 tail); p >= 256: [9, 5, 2].
  const auto q = MakeQueries(300, {{1.0f}});
  const SpanResult r =
      RunSelectSpan(seq.pool.view(), seq.table, attn, 0, 300, 1, q, SelectParams{4, 0, 0}, pt);
  for (int64_t p = 0; p < 300; ++p) {
    const int i = static_cast<int>(p);
    EXPECT_EQ(Row(r, i, 4), BoundaryExpected(p)) << "p = " << p;
    const Ids row(r.page_table.begin() + i * 4, r.page_table.begin() + i * 4 + 4);
    const Ids expected_row = p < 128 ? Ids{5, 0, 0, 0} : p < 256 ? Ids{5, 9, 0, 0} : Ids{9, 5, 2, 0};
    EXPECT_EQ(row, expected_row) << "p = " << p;
    EXPECT_EQ(r.context_lens[i], p + 1) << "p = " << p;
  }
}

// ---------------------------------------------------------------------------------------------
// topk past the visible blocks

TEST(TopkPastVisibleBlocks, PadsWithMinusOne) {
  // Blocks score 1, 3, 2 (dim 0 constant per block).
  const float s[3] = {1.0f, 3.0f, 2.0f};
  const int64_t len = 301;
  const auto keys = MakeKeys(len, [&](int64_t t) { return std::vector<float>{s[t / 128]}; });
  const Sequence seq(keys, len);
  const auto q = MakeQueries(1, {{1.0f}});
  {
    // p = 10: V = 1, topk 5 -> [0, -1, -1, -1, -1]. Page table with the default 8 pages per
    // block, stride 8, attn page 3: the tail block b0 -> 24..31, the rest 0; context 11.
    const SpanResult r = RunSelectSpan(seq.pool.view(), seq.table, {3, 4, 5}, 10, 1, 1, q,
                                       SelectParams{5, 0, 1});
    EXPECT_EQ(r.block_ids, (Ids{0, -1, -1, -1, -1}));
    Ids row(40, 0);
    for (int j = 0; j < 8; ++j) row[j] = 24 + j;
    EXPECT_EQ(r.page_table, row);
    EXPECT_EQ(r.context_lens, (Ids{11}));
  }
  {
    // p = 300: V = 3, local b2 forced, then b1 (3), b0 (1); 61 entries of padding.
    const SpanResult r =
        RunSelectSpan(seq.pool.view(), seq.table, {}, 300, 1, 1, q, SelectParams{64, 0, 1});
    Ids expected(64, -1);
    expected[0] = 2;
    expected[1] = 1;
    expected[2] = 0;
    EXPECT_EQ(r.block_ids, expected);
  }
}

// ---------------------------------------------------------------------------------------------
// Forced blocks

TEST(ForcedBlocks, InitBeforeLocalBeforeOrdinaryScores) {
  uint64_t scratch[8];
  Ids out(5, kPoison);
  // init b0 -> 1e30, local b4 -> 1e29; b1's raw 5e29 lies between them.
  const float raw[5] = {0.0f, 5e29f, 0.0f, 0.0f, 0.0f};
  SelectFromScores(raw, 5, SelectParams{5, 1, 1}, scratch, out.data());
  EXPECT_EQ(out, (Ids{0, 1, 4, 2, 3}));
  // Forced blocks rank by their forced score even when their raw score was lowest.
  const float low[5] = {-9.0f, 1.0f, 2.0f, 3.0f, -9.0f};
  SelectFromScores(low, 5, SelectParams{5, 1, 1}, scratch, out.data());
  EXPECT_EQ(out, (Ids{0, 4, 3, 2, 1}));
  // Several init and local blocks: init in id order, then local in id order.
  const float mixed[7] = {-1.0f, -2.0f, 9.0f, 8.0f, 7.0f, -3.0f, -4.0f};
  Ids seven(7, kPoison);
  SelectFromScores(mixed, 7, SelectParams{7, 2, 2}, scratch, seven.data());
  EXPECT_EQ(seven, (Ids{0, 1, 5, 6, 2, 3, 4}));
}

TEST(ForcedBlocks, OverlappingInitAndLocalForceEveryBlock) {
  // V = 3, init 2, local 2: b0 init (1e30); b1 init then local (1e29: local overrides); b2 local.
  // 1e30 before 1e29, ties to the lower id: [0, 1, 2]. (With every block forced and init ids
  // below local ids, which of init/local wins for b1 cannot change the order; this checks that
  // every forced block outranks raw scores, here raw b2 = 9.)
  uint64_t scratch[4];
  Ids out(3, kPoison);
  const float raw[3] = {-5.0f, -1.0f, 9.0f};
  SelectFromScores(raw, 3, SelectParams{3, 2, 2}, scratch, out.data());
  EXPECT_EQ(out, (Ids{0, 1, 2}));
  // init and local both past V.
  SelectFromScores(raw, 3, SelectParams{3, 7, 7}, scratch, out.data());
  EXPECT_EQ(out, (Ids{0, 1, 2}));
  // Only local past V: all three blocks 1e29, id order.
  SelectFromScores(raw, 3, SelectParams{3, 0, 5}, scratch, out.data());
  EXPECT_EQ(out, (Ids{0, 1, 2}));
  // topk 2 of V = 4 with init 1, local 3: b0 (1e30) then b1 (1e29, lowest local id).
  const float four[4] = {0.0f, 0.0f, 0.0f, 100.0f};
  Ids two(2, kPoison);
  SelectFromScores(four, 4, SelectParams{2, 1, 3}, scratch, two.data());
  EXPECT_EQ(two, (Ids{0, 1}));
}

TEST(ForcedBlocks, EndToEndScoreBetweenInitAndLocal) {
  // Blocks 0..4 with dim-0 keys 0, bf16(5e29), 0, 0, 0 and q = e0: b1's raw score is
  // bf16(5e29) ~ 4.99e29, between 1e29 and 1e30.
  const int64_t len = 5 * 128;
  const auto keys = MakeKeys(len, [](int64_t t) {
    return std::vector<float>{t / 128 == 1 ? 5e29f : 0.0f};
  });
  const Sequence seq(keys, len);
  const auto q = MakeQueries(1, {{1.0f}});
  const SpanResult r =
      RunSelectSpan(seq.pool.view(), seq.table, {}, len - 1, 1, 1, q, SelectParams{5, 1, 1});
  EXPECT_EQ(r.block_ids, (Ids{0, 1, 4, 2, 3}));
}

// ---------------------------------------------------------------------------------------------
// NaN, Inf and signed zeros

TEST(NanDots, AreLeftOutOfTheMaxAndEmptyBlocksScoreMinus1e30) {
  // big = the largest finite bf16, ~3.39e38. With q = [big, big, 1, 0, ...]:
  //   key [big, -big, 0, ...]: products +Inf and -Inf (fp32 overflow), sum NaN (in any order);
  //   key [0, 0, v, 0, ...]:   dot v exactly.
  const float big = Bf16ToFloat(0x7f7f);
  const std::vector<float> nan_key = {big, -big};
  const auto value_key = [](float v) { return std::vector<float>{0.0f, 0.0f, v}; };
  // b0: every key NaN -> -1e30. b1: slot 0 NaN, slot 5 = 3, rest 2 -> 3.
  // b2: slot 127 NaN, rest -4 -> -4. b3: even slots NaN, odd slots 1 -> 1.
  const int64_t len = 512;
  const auto keys = MakeKeys(len, [&](int64_t t) {
    const int64_t b = t / 128, r = t % 128;
    switch (b) {
      case 0: return nan_key;
      case 1: return r == 0 ? nan_key : value_key(r == 5 ? 3.0f : 2.0f);
      case 2: return r == 127 ? nan_key : value_key(-4.0f);
      default: return r % 2 == 0 ? nan_key : value_key(1.0f);
    }
  });
  const Sequence seq(keys, len);
  const auto q = MakeQueries(1, {{big, big, 1.0f}});

  EXPECT_EQ(RawScores(seq, 511, q), (std::vector<float>{-1e30f, 3.0f, -4.0f, 1.0f}));
  // At p = 384 only b3's slot 0 (NaN) is visible: b3 is empty too.
  EXPECT_EQ(RawScores(seq, 384, q), (std::vector<float>{-1e30f, 3.0f, -4.0f, -1e30f}));

  auto run = [&](int64_t p, SelectParams params) {
    return RunSelectSpan(seq.pool.view(), seq.table, {}, p, 1, 1, q, params).block_ids;
  };
  EXPECT_EQ(run(511, SelectParams{4, 0, 0}), (Ids{1, 3, 2, 0}));
  EXPECT_EQ(run(511, SelectParams{3, 0, 0}), (Ids{1, 3, 2}));
  EXPECT_EQ(run(511, SelectParams{4, 1, 0}), (Ids{0, 1, 3, 2}));  // an empty block can be forced
  // Two empty blocks (-1e30) tie: the lower id first.
  EXPECT_EQ(run(384, SelectParams{4, 0, 0}), (Ids{1, 2, 0, 3}));
}

TEST(InfDots, CountLikeAnyOtherNonNanDot) {
  // A single +Inf product (big * big) is a dot of +Inf: the largest score; a single -Inf product
  // gives -Inf, below an empty block's -1e30.
  const float big = Bf16ToFloat(0x7f7f);
  const int64_t len = 4 * 128;
  const auto keys = MakeKeys(len, [&](int64_t t) {
    switch (t / 128) {
      case 0: return std::vector<float>{0.0f, 0.0f, 5.0f};
      case 1: return std::vector<float>{t % 128 == 9 ? big : 0.0f, 0.0f, 1.0f};  // one +Inf dot
      case 2: return std::vector<float>{-big, 0.0f, 0.0f};                      // all -Inf
      default: return std::vector<float>{big, -big, 0.0f};                      // all NaN
    }
  });
  const Sequence seq(keys, len);
  const auto q = MakeQueries(1, {{big, big, 1.0f}});
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(RawScores(seq, 511, q), (std::vector<float>{5.0f, inf, -inf, -1e30f}));
  const SpanResult r =
      RunSelectSpan(seq.pool.view(), seq.table, {}, 511, 1, 1, q, SelectParams{4, 0, 0});
  EXPECT_EQ(r.block_ids, (Ids{1, 0, 3, 2}));
}

TEST(SignedZero, MinusZeroTiesWithPlusZeroAndTheLowerIdWins) {
  uint64_t scratch[4];
  Ids out(2, kPoison);
  const float a[2] = {-0.0f, 0.0f};
  SelectFromScores(a, 2, SelectParams{2, 0, 0}, scratch, out.data());
  EXPECT_EQ(out, (Ids{0, 1}));
  const float b[2] = {0.0f, -0.0f};
  SelectFromScores(b, 2, SelectParams{2, 0, 0}, scratch, out.data());
  EXPECT_EQ(out, (Ids{0, 1}));
  Ids four(4, kPoison);
  const float c[4] = {-1.0f, -0.0f, 0.0f, -0.0f};
  SelectFromScores(c, 4, SelectParams{4, 0, 0}, scratch, four.data());
  EXPECT_EQ(four, (Ids{1, 2, 3, 0}));

  // End to end: keys of -0.0 and +0.0 give dots of zero, whatever their sign: tie, lower id.
  const int64_t len = 3 * 128;
  for (bool minus_first : {true, false}) {
    const auto keys = MakeKeys(len, [&](int64_t t) {
      const int64_t blk = t / 128;
      if (blk == 2) return std::vector<float>{-1.0f};
      return std::vector<float>{(blk == 0) == minus_first ? -0.0f : 0.0f};
    });
    const Sequence seq(keys, len);
    for (float qv : {1.0f, -1.0f}) {
      const auto q = MakeQueries(1, {{qv}});
      const SpanResult r =
          RunSelectSpan(seq.pool.view(), seq.table, {}, len - 1, 1, 1, q, SelectParams{3, 0, 0});
      const Ids expected = qv > 0 ? Ids{0, 1, 2} : Ids{2, 0, 1};
      EXPECT_EQ(r.block_ids, expected) << "minus_first " << minus_first << " q " << qv;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Exact ties

TEST(ExactTies, IntegerVectorsTieAndTheLowerIdWins) {
  // q = [1, 2, -1]; dot = k0 + 2 k1 - k2. Block maxima (different vectors, equal dots):
  //   b0: (1, 1, 0) = 3    b1: (1, 2, 0) = 5   b2: (3, 1, 2) = 3   b3: (3, 1, 0) = 5
  //   b4: (1, 0, 0) = 1    b5: (5, 1, 2) = 5   b6: (0, 2, 1) = 3   b7: (2, 0, 0) = 2
  // Other keys (0, 0, 1) = -1. Descending, ties to the lower id: 5s b1 b3 b5, 3s b0 b2 b6, b7, b4.
  const std::vector<std::vector<float>> best = {{1, 1, 0}, {1, 2, 0}, {3, 1, 2}, {3, 1, 0},
                                                {1, 0, 0}, {5, 1, 2}, {0, 2, 1}, {2, 0, 0}};
  const int64_t len = 8 * 128;
  const auto keys = MakeKeys(len, [&](int64_t t) {
    const int64_t b = t / 128;
    return t % 128 == (b * 37) % 128 ? best[b] : std::vector<float>{0, 0, 1};
  });
  for (KeyStorage storage : {KeyStorage::kBf16, KeyStorage::kFp8E4M3}) {
    const Sequence seq(keys, len, storage, {3, 9, 1, 7, 0, 12, 5, 10});
    const auto q = MakeQueries(1, {{1.0f, 2.0f, -1.0f}});
    const SpanResult r8 =
        RunSelectSpan(seq.pool.view(), seq.table, {}, len - 1, 1, 1, q, SelectParams{8, 0, 0});
    EXPECT_EQ(r8.block_ids, (Ids{1, 3, 5, 0, 2, 6, 7, 4}));
    const SpanResult r4 =
        RunSelectSpan(seq.pool.view(), seq.table, {}, len - 1, 1, 1, q, SelectParams{4, 0, 0});
    EXPECT_EQ(r4.block_ids, (Ids{1, 3, 5, 0}));
  }
}

// ---------------------------------------------------------------------------------------------
// A prefill chunk with several heads

// Three heads, each looking at one key dimension (q_h = e_{16 h}, one dimension per fp4 group,
// so that fp4 stores each value alone in its group: monotone in the value, and distinct for the
// distinct values below); b = t / 128, r = t % 128:
//   head 0: k[t][0] = b + 1 at r = 64, else 0. Full blocks score b + 1; the tail block S scores
//           S + 1 once p % 128 >= 64, else 0.
//   head 1: k[t][16] = 1: every block ties at 1.
//   head 2: k[t][32] = b - r: maximum at r = 0, so every visible block scores b.
// topk 3, no forced blocks. Hand-computed, with S = p / 128 and ids < 0 meaning padding:
//   head 0: p % 128 >= 64: [S, S-1, S-2]; else S=0: [0], S=1: [0, 1], S=2: [1, 0, 2],
//           S=3: [2, 1, 0].
//   head 1: [0, 1, 2] cut to V blocks.
//   head 2: [S, S-1, S-2].
// Keys run to 511 so that tokens before 448 must not see block 3's r = 64 key (value 4).
Ids Padded(Ids ids) {
  for (int32_t& b : ids) b = b < 0 ? -1 : b;
  return ids;
}

Ids PrefillExpected(int h, int64_t p) {
  const int32_t s = static_cast<int32_t>(p / 128);
  const bool late = p % 128 >= 64;
  switch (h) {
    case 0:
      if (late || s == 0) return Padded({s, s - 1, s - 2});
      if (s == 1) return {0, 1, -1};
      return {s - 1, s - 2, s == 2 ? 2 : s - 3};
    case 1:
      return Padded({0, s >= 1 ? 1 : -1, s >= 2 ? 2 : -1});
    default:
      return Padded({s, s - 1, s - 2});
  }
}

class PrefillChunk : public ::testing::TestWithParam<KeyStorage> {};

TEST_P(PrefillChunk, ThreeHundredTokensAcrossBlocksWithThreeHeads) {
  const int64_t len = 512;
  const auto keys = MakeKeys(len, [](int64_t t) {
    const float b = static_cast<float>(t / 128), r = static_cast<float>(t % 128);
    std::vector<float> k(33, 0.0f);
    k[0] = t % 128 == 64 ? b + 1 : 0.0f;
    k[16] = 1.0f;
    k[32] = b - r;
    return k;
  });
  const Sequence seq(keys, len, GetParam(), {2, 0, 3, 1});
  const int64_t p0 = 100;
  const int n = 300;  // positions 100 .. 399: blocks 0 .. 3
  std::vector<std::vector<float>> heads(3, std::vector<float>(33, 0.0f));
  for (int h = 0; h < 3; ++h) heads[h][16 * h] = 1.0f;
  const auto q = MakeQueries(n, heads);
  const SelectParams params{3, 0, 0};
  const SpanResult r = RunSelectSpan(seq.pool.view(), seq.table, {}, p0, n, 3, q, params);
  for (int i = 0; i < n; ++i) {
    for (int h = 0; h < 3; ++h) {
      EXPECT_EQ(Row(r, i * 3 + h, 3), PrefillExpected(h, p0 + i)) << "p " << p0 + i << " h " << h;
    }
  }
  // The same tokens one at a time give the same rows.
  const auto q1 = MakeQueries(1, heads);
  for (int i = 0; i < n; i += 7) {
    const SpanResult one = RunSelectSpan(seq.pool.view(), seq.table, {}, p0 + i, 1, 3, q1, params);
    for (int h = 0; h < 3; ++h) EXPECT_EQ(Row(one, h, 3), Row(r, i * 3 + h, 3)) << i << " " << h;
  }
}

INSTANTIATE_TEST_SUITE_P(Storage, PrefillChunk, ::indexer::testing::EveryStorage(),
                         ::indexer::testing::StorageTestName);

// ---------------------------------------------------------------------------------------------
// Page tables with other shapes

struct RowCase {
  Ids selected;
  int64_t pos;
  Ids row;
  int32_t context_len;
};

TEST(PageTableRow, ThreePagesPerBlockStrideFive) {
  // attn = [7, 3, 9, 1, 4]; block b contributes attn[b] * 5 + j for j = 0, 1, 2:
  //   b0: 35 36 37   b1: 15 16 17   b2: 45 46 47   b3: 5 6 7   b4: 20 21 22
  const int32_t attn[5] = {7, 3, 9, 1, 4};
  const std::vector<RowCase> cases = {
      // p 600 (S 4): full b2, b0 in selection order, then the tail b4; 2 * 128 + (601 - 512).
      {{2, 4, 0, -1}, 600, {45, 46, 47, 35, 36, 37, 20, 21, 22, 0, 0, 0}, 345},
      // no tail: min(2 * 128, 601).
      {{3, 1, -1, -1}, 600, {5, 6, 7, 15, 16, 17, 0, 0, 0, 0, 0, 0}, 256},
      // only the tail: 0 * 128 + 89.
      {{4, -1, -1, -1}, 600, {20, 21, 22, 0, 0, 0, 0, 0, 0, 0, 0, 0}, 89},
      // nothing valid: min(0, 601) = 0.
      {{-1, -1, -1, -1}, 600, {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}, 0},
      // the tail listed first still goes last: 128 + 89.
      {{4, 3, -1, -1}, 600, {5, 6, 7, 20, 21, 22, 0, 0, 0, 0, 0, 0}, 217},
      // p 511 (S 3, last slot of its block): b0 full, b3 tail; 128 + (512 - 384).
      {{3, 0, -1, -1}, 511, {35, 36, 37, 5, 6, 7, 0, 0, 0, 0, 0, 0}, 256},
      // p 512 (S 4, first slot): b3 b2 b1 full, b4 tail; 3 * 128 + 1.
      {{4, 3, 2, 1}, 512, {5, 6, 7, 45, 46, 47, 15, 16, 17, 20, 21, 22}, 385},
      // p 300 (S 2), no tail: full b1, b0; min(2 * 128, 301) = 256.
      {{1, 0, -1, -1}, 300, {15, 16, 17, 35, 36, 37, 0, 0, 0, 0, 0, 0}, 256},
  };
  for (const RowCase& c : cases) {
    Ids row(12, kPoison);
    int32_t context_len = kPoison;
    BuildPageTableRow(c.selected.data(), 4, c.pos, attn, PageTableParams{3, 5}, row.data(),
                      &context_len);
    EXPECT_EQ(row, c.row) << "pos " << c.pos << " selected " << ::testing::PrintToString(c.selected);
    EXPECT_EQ(context_len, c.context_len)
        << "pos " << c.pos << " selected " << ::testing::PrintToString(c.selected);
  }
}

TEST(PageTableRow, StrideSixteenForKAndVSides) {
  // 8 pages per block, stride 16 (K and V sides): attn [2, 0]; p = 200 (S 1), selected [1, 0]:
  // b0 full -> 2 * 16 + j = 32..39, then tail b1 -> 0 * 16 + j = 0..7; context
  // 128 + (201 - 128) = 201.
  const int32_t attn[2] = {2, 0};
  const Ids selected = {1, 0};
  Ids row(16, kPoison);
  int32_t context_len = kPoison;
  BuildPageTableRow(selected.data(), 2, 200, attn, PageTableParams{8, 16}, row.data(),
                    &context_len);
  EXPECT_EQ(row, (Ids{32, 33, 34, 35, 36, 37, 38, 39, 0, 1, 2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(context_len, 201);
}

TEST(PageTableRow, ThroughSelectSpanWithOtherShapes) {
  // The worked example's keys at p = 600 with topk 4, init 1, local 1: [0, 4, 1, 3] (b1 and b3
  // tie at 2.0). pages_per_block 3, stride 5, attn [7, 3, 9, 1, 4]:
  // full b0 (35..37), b1 (15..17), b3 (5..7), tail b4 (20..22); context 3 * 128 + 89 = 473.
  const float s[5] = {0.5f, 2.0f, -3.0f, 2.0f, 7.0f};
  const int64_t len = 640;  // keys past p = 600 exist but must not count
  const auto keys = MakeKeys(len, [&](int64_t t) {
    return std::vector<float>{t > 600 ? 100.0f : s[t / 128]};
  });
  const Sequence seq(keys, len);
  const auto q = MakeQueries(1, {{1.0f}});
  const SpanResult r = RunSelectSpan(seq.pool.view(), seq.table, {7, 3, 9, 1, 4}, 600, 1, 1, q,
                                     SelectParams{4, 1, 1}, PageTableParams{3, 5});
  EXPECT_EQ(r.block_ids, (Ids{0, 4, 1, 3}));
  EXPECT_EQ(r.page_table, (Ids{35, 36, 37, 15, 16, 17, 5, 6, 7, 20, 21, 22}));
  EXPECT_EQ(r.context_lens, (Ids{473}));
  // No forced blocks, topk 2: b4 (raw 7) then b1 (2.0, tied with b3, lower id): [4, 1].
  // Row: full b1 first, then the tail b4; context 128 + 89 = 217.
  const SpanResult r2 = RunSelectSpan(seq.pool.view(), seq.table, {7, 3, 9, 1, 4}, 600, 1, 1, q,
                                      SelectParams{2, 0, 0}, PageTableParams{3, 5});
  EXPECT_EQ(r2.block_ids, (Ids{4, 1}));
  EXPECT_EQ(r2.page_table, (Ids{15, 16, 17, 20, 21, 22}));
  EXPECT_EQ(r2.context_lens, (Ids{217}));
  // Tail not selected: p = 520 (S 4), topk 1, init 1: [0] -> row 35..37, context
  // min(1 * 128, 521) = 128.
  const SpanResult r3 = RunSelectSpan(seq.pool.view(), seq.table, {7, 3, 9, 1, 4}, 520, 1, 1, q,
                                      SelectParams{1, 1, 0}, PageTableParams{3, 5});
  EXPECT_EQ(r3.block_ids, (Ids{0}));
  EXPECT_EQ(r3.page_table, (Ids{35, 36, 37}));
  EXPECT_EQ(r3.context_lens, (Ids{128}));
}

}  // namespace
}  // namespace indexer::kernels
