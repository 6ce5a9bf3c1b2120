// ScoreBlocksFast (the CPU backend's scorer) against ScoreBlocks (the reference) on fresh random
// inputs every run: every raw score must agree bit for bit, for every head_dim and storage,
// spans of one or many tokens and heads, block ranges that start and stop anywhere, and keys
// large enough that some dot products overflow (NaN dots are left out the same way). The seed
// is printed with a failure; INDEXER_TEST_SEED=<seed> replays it.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/cpu_fast_scores.h"
#include "kernels/cpu_reference.h"
#include "kernels/numeric.h"
#include "tests/testing/host_key_pool.h"
#include "tests/testing/test_seed.h"

namespace indexer::kernels {
namespace {

using ::indexer::testing::BlocksFor;
using ::indexer::testing::HostKeyPool;
using ::indexer::testing::ShuffledTable;

using ::indexer::testing::TestSeed;

TEST(CpuFastScoresTest, EveryRawScoreEqualsTheReferenceBitForBit) {
  const uint64_t seed = TestSeed();
  std::mt19937_64 rng(seed);
  const auto uniform = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  std::normal_distribution<float> normal;
  for (int trial = 0; trial < 120; ++trial) {
    const int d = std::vector<int>{64, 128, 256}[uniform(0, 2)];
    const KeyStorage storage = static_cast<KeyStorage>(uniform(0, 2));
    const int64_t len = uniform(1, 1500);
    const int n = static_cast<int>(uniform(1, std::min<int64_t>(len, 6)));
    const int heads = static_cast<int>(uniform(1, 4));
    const bool huge = storage == KeyStorage::kBf16 && uniform(0, 3) == 0;
    const int64_t pages = BlocksFor(len) + 3;
    HostKeyPool pool(d, storage, pages);
    const std::vector<int32_t> table = ShuffledTable(BlocksFor(len), pages, rng);
    std::vector<uint16_t> keys(static_cast<size_t>(len) * d);
    for (uint16_t& k : keys) k = FloatToBf16(normal(rng) * 3.0f);
    if (huge) {  // +-3e38 in a few tokens: some products overflow, some dots are NaN
      for (int64_t t = 0; t < len; t += 7) keys[t * d] = FloatToBf16(uniform(0, 1) ? 3e38f : -3e38f);
    }
    pool.Write(table, keys.data(), len);
    std::vector<uint16_t> queries(static_cast<size_t>(n) * heads * d);
    for (uint16_t& q : queries) q = FloatToBf16(normal(rng) * (huge ? 1e3f : 1.0f));
    SpanSelect span;
    span.block_table = table.data();
    span.start_pos = len - n;
    span.num_tokens = n;
    span.num_heads = heads;
    span.queries = queries.data();
    const int64_t v = VisibleBlocks(len - 1);
    const int64_t begin = uniform(0, v - 1);
    const int64_t end = uniform(begin + 1, v);
    std::vector<float> want(static_cast<size_t>(n) * heads * v, 7.0f);
    std::vector<float> got = want;
    ScoreBlocks(pool.view(), span, begin, end, want.data(), v);
    ScoreBlocksFast(pool.view(), span, begin, end, got.data(), v);
    ASSERT_EQ(0, std::memcmp(want.data(), got.data(), want.size() * sizeof(float)))
        << "seed " << seed << ", trial " << trial << ": head_dim " << d << ", "
        << KeyStorageName(storage) << ", len " << len << ", n " << n
        << ", H " << heads << ", blocks [" << begin << ", " << end << ")";
  }
}

}  // namespace
}  // namespace indexer::kernels
