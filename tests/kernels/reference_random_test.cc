// kernels::SelectSpan against the naive reference (naive_reference.h) on fresh random inputs
// every run. The seed comes from std::random_device and is printed with every failure; set
// INDEXER_TEST_SEED=<seed> to replay one.
//
// Integer-valued inputs make every dot product exact in fp32, so the two selectors must agree
// exactly. Real-valued inputs may round differently (summation order), so there the selection
// must be a valid top-k order of the naive scores within the rounding bound (IsValidTopK).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/cpu_reference.h"
#include "kernels/numeric.h"
#include "kernels/select_types.h"
#include "tests/kernels/naive_reference.h"
#include "tests/testing/host_key_pool.h"
#include "tests/testing/test_seed.h"

namespace indexer::kernels {
namespace {

using ::indexer::testing::BlocksFor;
using ::indexer::testing::HostKeyPool;
using ::indexer::testing::NaiveRow;
using ::indexer::testing::NaiveSpan;
using ::indexer::testing::RunSelectSpan;
using ::indexer::testing::ShuffledTable;
using ::indexer::testing::SpanResult;

using ::indexer::testing::TestSeed;

struct Trial {
  int head_dim = 128;
  KeyStorage storage = KeyStorage::kBf16;
  bool integer = true;
  int int_range = 8;
  float scale = 1.0f;
  int64_t len = 1;
  int64_t start_pos = 0;
  int num_tokens = 1;
  int num_heads = 1;
  SelectParams params;
  bool with_attn = false;
  PageTableParams pt;
  int64_t num_pages = 1;

  std::string Describe() const {
    std::ostringstream s;
    s << "head_dim " << head_dim << ", " << KeyStorageName(storage)
      << ", " << (integer ? "integer values in +-" + std::to_string(int_range) : "real values")
      << ", len " << len << ", p0 " << start_pos << ", n " << num_tokens << ", H " << num_heads
      << ", topk " << params.topk << ", init " << params.init_blocks << ", local "
      << params.local_blocks;
    if (with_attn) s << ", pages_per_block " << pt.pages_per_block << ", stride " << pt.block_page_stride;
    return s.str();
  }
};

Trial RandomTrial(std::mt19937_64& rng) {
  const auto uniform = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  Trial t;
  t.head_dim = std::vector<int>{64, 128, 256}[uniform(0, 2)];
  t.storage = static_cast<KeyStorage>(uniform(0, 2));
  t.integer = uniform(0, 1) == 1;
  t.int_range = std::vector<int>{1, 2, 8}[uniform(0, 2)];
  t.scale = std::ldexp(1.0f, static_cast<int>(uniform(-4, 4)));
  const int64_t bucket = uniform(0, 9);
  t.len = uniform(1, bucket < 3 ? 300 : bucket < 7 ? 2000 : 5000);
  if (uniform(0, 4) == 0 && t.len >= 9) {
    t.num_tokens = static_cast<int>(uniform(9, std::min<int64_t>(400, t.len)));  // prefill-sized
  } else {
    t.num_tokens = static_cast<int>(uniform(1, std::min<int64_t>(8, t.len)));
  }
  t.start_pos = uniform(0, 1) ? t.len - t.num_tokens : uniform(0, t.len - t.num_tokens);
  t.num_heads = static_cast<int>(uniform(1, 8));
  // Keep each trial's work (two selectors, n * H * keys * head_dim each) bounded.
  const auto work = [&] {
    return double(t.num_tokens) * t.num_heads * double(t.start_pos + t.num_tokens) * t.head_dim;
  };
  while (work() > 6e7 && t.num_heads > 1) --t.num_heads;
  while (work() > 6e7 && t.num_tokens > 1) {
    t.num_tokens = std::max(1, t.num_tokens / 2);
  }
  t.params.topk = static_cast<int>(uniform(1, 64));
  t.params.init_blocks = static_cast<int>(uniform(0, 3));
  t.params.local_blocks = static_cast<int>(uniform(0, 3));
  t.with_attn = uniform(0, 9) < 7;
  t.pt.pages_per_block = static_cast<int>(uniform(1, 8));
  t.pt.block_page_stride = static_cast<int>(uniform(t.pt.pages_per_block, 16));
  const int64_t blocks = BlocksFor(t.len);
  t.num_pages = blocks + uniform(0, blocks + 2);
  return t;
}

std::vector<uint16_t> RandomValues(const Trial& t, size_t count, std::mt19937_64& rng) {
  std::vector<uint16_t> v(count);
  std::uniform_int_distribution<int> ints(-t.int_range, t.int_range);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto& x : v) {
    x = FloatToBf16(t.integer ? static_cast<float>(ints(rng)) : normal(rng) * t.scale);
  }
  return v;
}

// Runs one trial; returns whether every row matched the naive rows exactly.
bool RunTrial(const Trial& t, std::mt19937_64& rng) {
  const std::vector<int32_t> table = ShuffledTable(BlocksFor(t.len), t.num_pages, rng);
  HostKeyPool pool(t.head_dim, t.storage, t.num_pages);
  const std::vector<uint16_t> keys = RandomValues(t, static_cast<size_t>(t.len) * t.head_dim, rng);
  pool.Write(table, keys.data(), t.len);
  const std::vector<uint16_t> queries =
      RandomValues(t, static_cast<size_t>(t.num_tokens) * t.num_heads * t.head_dim, rng);
  std::vector<int32_t> attn;
  if (t.with_attn) {
    std::uniform_int_distribution<int32_t> page(0, 100000);
    attn.resize(table.size());
    for (auto& a : attn) a = page(rng);
  }

  const SpanResult got = RunSelectSpan(pool.view(), table, attn, t.start_pos, t.num_tokens,
                                       t.num_heads, queries, t.params, t.pt);

  NaiveSpan ns;
  ns.pool = pool.data();
  ns.storage = t.storage;
  ns.head_dim = t.head_dim;
  ns.block_table = table.data();
  ns.attn_pages = t.with_attn ? attn.data() : nullptr;
  ns.start_pos = t.start_pos;
  ns.num_tokens = t.num_tokens;
  ns.num_heads = t.num_heads;
  ns.queries = queries.data();
  ns.topk = t.params.topk;
  ns.init_blocks = t.params.init_blocks;
  ns.local_blocks = t.params.local_blocks;
  ns.pages_per_block = t.pt.pages_per_block;
  ns.block_page_stride = t.pt.block_page_stride;
  const std::vector<NaiveRow> ref = testing::NaiveSelect(ns);

  // Summation-order rounding bound: each side's dot is within head_dim * 2^-24 * sum|q k| of the
  // exact value; doubled for safety.
  const double rel_tol = t.integer ? 0.0 : t.head_dim * std::ldexp(1.0, -22);
  const int k = t.params.topk;
  const int ppb = t.pt.pages_per_block;
  bool exact = true;
  for (size_t row = 0; row < ref.size(); ++row) {
    const int32_t* ids = got.block_ids.data() + row * k;
    const std::vector<int32_t> got_ids(ids, ids + k);
    SCOPED_TRACE(::testing::Message() << "row " << row << " (token " << row / t.num_heads
                                      << ", head " << row % t.num_heads << ")");
    EXPECT_TRUE(testing::IsValidTopK(ref[row], ids, k, rel_tol));
    if (t.integer) {
      EXPECT_EQ(got_ids, ref[row].selected);
    }
    exact = exact && got_ids == ref[row].selected;
    if (t.with_attn) {
      // The page-table row must be exactly SPEC's row for the ids SelectSpan chose.
      std::vector<int32_t> want_row;
      int32_t want_len = 0;
      testing::NaivePageTableRow(got_ids, ref[row].pos, attn.data(), ppb, t.pt.block_page_stride,
                                 &want_row, &want_len);
      const std::vector<int32_t> got_row(got.page_table.begin() + row * k * ppb,
                                         got.page_table.begin() + (row + 1) * k * ppb);
      EXPECT_EQ(got_row, want_row);
      EXPECT_EQ(got.context_lens[row], want_len);
    }
    if (::testing::Test::HasFailure()) break;
  }
  return exact;
}

TEST(ReferenceVsNaive, RandomSpans) {
  const uint64_t seed = TestSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " (replay: INDEXER_TEST_SEED=" << seed
                                    << ")");
  std::mt19937_64 rng(seed);
  int trials = 0, exact = 0, integer = 0;
  for (; trials < 400; ++trials) {
    const Trial t = RandomTrial(rng);
    SCOPED_TRACE(::testing::Message() << "trial " << trials << ": " << t.Describe());
    integer += t.integer;
    exact += RunTrial(t, rng);
    if (HasFailure()) break;
  }
  std::cout << "seed " << seed << ": " << trials << " trials (" << integer
            << " integer-valued), " << exact << " matched the naive reference exactly\n";
}

// The checker itself must reject wrong selections, or the random comparison proves nothing.
TEST(IsValidTopK, RejectsWrongSelections) {
  NaiveRow row;
  row.pos = 5 * 128 + 3;                                   // V = 6
  row.score = {1e30f, 2.0f, 2.0f, 5.0f, 2.0000002f, 1e29f};  // b0 init, b5 local
  row.forced = {true, false, false, false, false, true};
  row.magnitude = {0, 4, 4, 10, 4, 0};
  row.selected = {0, 5, 3, 4, 1, 2, -1};
  using V = std::vector<int32_t>;
  const auto ok = [&](const V& got, double tol) { return bool(testing::IsValidTopK(row, got.data(), 7, tol)); };
  EXPECT_TRUE(ok({0, 5, 3, 4, 1, 2, -1}, 0.0));
  EXPECT_FALSE(ok({0, 5, 3, 1, 4, 2, -1}, 0.0));          // b4 (2.0000002) belongs before b1
  EXPECT_TRUE(ok({0, 5, 3, 1, 4, 2, -1}, 1e-6));          // ... unless within rounding
  EXPECT_FALSE(ok({0, 5, 3, 4, 2, 1, -1}, 0.0));          // exact tie b1 = b2: lower id first
  EXPECT_FALSE(ok({5, 0, 3, 4, 1, 2, -1}, 1e-3));         // 1e30 before 1e29, tolerance or not
  EXPECT_FALSE(ok({0, 3, 5, 4, 1, 2, -1}, 1e-3));         // forced before ordinary
  EXPECT_FALSE(ok({0, 5, 3, 4, 1, 2, 2}, 0.0));           // padding must be -1
  EXPECT_FALSE(ok({0, 5, 3, 4, 1, 1, -1}, 0.0));          // duplicate
  EXPECT_FALSE(ok({0, 5, 3, 4, 1, 0x7eadbeef, -1}, 0.0)); // unwritten entry
  EXPECT_FALSE(ok({0, 5, 3, 4, 1, -1, -1}, 0.0));         // too short
  // topk 3: b3 must be chosen over b4 and b1 (scores 5 vs ~2).
  EXPECT_TRUE(bool(testing::IsValidTopK(row, V{0, 5, 3}.data(), 3, 0.0)));
  EXPECT_FALSE(bool(testing::IsValidTopK(row, V{0, 5, 4}.data(), 3, 1e-3)));
}

// Odd lengths and every head_dim and storage, fixed seed: the shapes most likely to break
// block-boundary arithmetic.
TEST(ReferenceVsNaive, OddShapes) {
  std::mt19937_64 rng(20240611);
  for (int head_dim : {64, 128, 256}) {
    for (KeyStorage storage : {KeyStorage::kBf16, KeyStorage::kFp8E4M3, KeyStorage::kFp4E2M1}) {
      for (int64_t len : {1, 3, 7, 19, 127, 128, 129, 255, 256, 257, 733}) {
        for (int n : {1, 3}) {
          if (n > len) continue;
          Trial t;
          t.head_dim = head_dim;
          t.storage = storage;
          t.integer = true;
          t.int_range = 2;
          t.len = len;
          t.num_tokens = n;
          t.start_pos = len - n;
          t.num_heads = 3;
          t.params = SelectParams{7, 1, 1};
          t.with_attn = true;
          t.pt = PageTableParams{3, 5};
          t.num_pages = BlocksFor(len) + 5;
          SCOPED_TRACE(t.Describe());
          RunTrial(t, rng);
          if (HasFailure()) return;
        }
      }
    }
  }
}

// The CPU backend scores one span in chunks of blocks; chunks must give exactly the raw scores
// of one call and leave the entries of blocks a token cannot see untouched.
TEST(ScoreBlocks, ChunksMatchOneCallAndInvisibleEntriesAreUntouched) {
  std::mt19937_64 rng(99);
  Trial t;
  t.integer = false;
  t.len = 1000;
  t.num_tokens = 300;
  t.start_pos = 600;
  t.num_heads = 2;
  t.num_pages = 20;
  const std::vector<int32_t> table = ShuffledTable(BlocksFor(t.len), t.num_pages, rng);
  HostKeyPool pool(t.head_dim, t.storage, t.num_pages);
  const auto keys = RandomValues(t, static_cast<size_t>(t.len) * t.head_dim, rng);
  pool.Write(table, keys.data(), t.len);
  const auto queries = RandomValues(t, static_cast<size_t>(t.num_tokens) * t.num_heads * t.head_dim, rng);
  SpanSelect span;
  span.block_table = table.data();
  span.start_pos = t.start_pos;
  span.num_tokens = t.num_tokens;
  span.num_heads = t.num_heads;
  span.queries = queries.data();
  const int64_t v_max = VisibleBlocks(t.start_pos + t.num_tokens - 1);  // 8
  const int rows = t.num_tokens * t.num_heads;
  const float sentinel = 12345.0f;
  std::vector<float> whole(static_cast<size_t>(rows) * v_max, sentinel);
  ScoreBlocks(pool.view(), span, 0, v_max, whole.data(), v_max);
  std::vector<float> chunked(whole.size(), sentinel);
  for (int64_t b = 0; b < v_max; b += 3) {
    ScoreBlocks(pool.view(), span, b, std::min(b + 3, v_max), chunked.data(), v_max);
  }
  for (int row = 0; row < rows; ++row) {
    const int64_t pos = t.start_pos + row / t.num_heads;
    for (int64_t b = 0; b < v_max; ++b) {
      const float w = whole[row * v_max + b];
      const float c = chunked[row * v_max + b];
      if (b < VisibleBlocks(pos)) {
        ASSERT_NE(w, sentinel) << "row " << row << " block " << b << " not written";
        ASSERT_EQ(std::memcmp(&w, &c, 4), 0) << "row " << row << " block " << b;
      } else {
        ASSERT_EQ(w, sentinel) << "row " << row << " block " << b << " is not visible at " << pos;
        ASSERT_EQ(c, sentinel) << "row " << row << " block " << b << " is not visible at " << pos;
      }
    }
  }
}

}  // namespace
}  // namespace indexer::kernels
