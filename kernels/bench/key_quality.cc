// indexer-key-quality: what fp8 and fp4 key storage cost in selection quality. For top-16 without
// forced blocks, the mean overlap (|S ∩ S_bf16| / 16) of the blocks selected on fp8 and on fp4
// keys with the blocks selected on bf16 keys, computed by the CPU reference's scorer
// (kernels/cpu_fast_scores.h, bit-identical to the reference), for three kinds of keys:
//
//   normal    every value N(0, 1)
//   outliers  N(0, 1), with 4 of the 128 channels ten times larger (as real key caches have)
//   low-rank  keys near an 8-dimensional subspace: U z + 0.1 N(0, 1), z ~ N(0, 1); queries near
//             the same subspace
//
// and lengths 4K, 32K and 128K tokens (32, 256 and 1024 blocks). Queries are N(0, 1) for the
// first two. Prints a markdown table.
//
//   indexer-key-quality [--queries=N] [--seed=S]
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu_fast_scores.h"
#include "kernels/cpu_reference.h"
#include "kernels/numeric.h"
#include "kernels/select_types.h"

namespace {

using indexer::kernels::KeyStorage;
namespace k = indexer::kernels;

constexpr int kD = 128;
constexpr int kTopk = 16;
constexpr int kRank = 8;
constexpr int kOutlierChannels = 4;  // spread over the key, in different fp4 groups

enum class Kind { kNormal, kOutliers, kLowRank };

const char* KindName(Kind kind) {
  return kind == Kind::kNormal ? "normal" : kind == Kind::kOutliers ? "outliers" : "low-rank";
}

// Keys [len][kD] and queries [queries][kD] as bf16 bits, drawn for `kind`.
struct Inputs {
  std::vector<uint16_t> keys;
  std::vector<uint16_t> queries;
};

Inputs Draw(Kind kind, int64_t len, int queries, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> basis(static_cast<size_t>(kRank) * kD);
  for (float& b : basis) b = normal(rng) / 2.8f;  // rows of norm ~4: keys of unit-ish values
  const auto near_subspace = [&](uint16_t* out) {
    float z[kRank];
    for (float& v : z) v = normal(rng);
    for (int d = 0; d < kD; ++d) {
      float v = 0.1f * normal(rng);
      for (int r = 0; r < kRank; ++r) v += z[r] * basis[static_cast<size_t>(r) * kD + d];
      out[d] = k::FloatToBf16(v);
    }
  };
  Inputs in;
  in.keys.resize(static_cast<size_t>(len) * kD);
  in.queries.resize(static_cast<size_t>(queries) * kD);
  for (int64_t t = 0; t < len; ++t) {
    uint16_t* key = in.keys.data() + t * kD;
    if (kind == Kind::kLowRank) {
      near_subspace(key);
      continue;
    }
    for (int d = 0; d < kD; ++d) {
      // Outlier channels 5, 37, 69, 101 at head_dim 128.
      const bool outlier = kind == Kind::kOutliers && d % (kD / kOutlierChannels) == 5;
      key[d] = k::FloatToBf16(normal(rng) * (outlier ? 10.0f : 1.0f));
    }
  }
  for (int q = 0; q < queries; ++q) {
    uint16_t* query = in.queries.data() + static_cast<size_t>(q) * kD;
    if (kind == Kind::kLowRank) {
      near_subspace(query);
    } else {
      for (int d = 0; d < kD; ++d) query[d] = k::FloatToBf16(normal(rng));
    }
  }
  return in;
}

// Per query, its selected block ids.
using Selections = std::vector<std::vector<int32_t>>;

// The top-16 blocks of each query at position len - 1, no forced blocks, on keys stored as `s`.
Selections Select(const Inputs& in, int64_t len, KeyStorage s) {
  const int64_t blocks = (len + k::kBlockSize - 1) / k::kBlockSize;
  std::vector<uint8_t> pool(static_cast<size_t>(blocks * k::PageBytes(s, kD)), 0);
  for (int64_t t = 0; t < len; ++t) {
    k::StoreKey(pool.data(), s, kD, t / k::kBlockSize, static_cast<int>(t % k::kBlockSize),
                in.keys.data() + t * kD);
  }
  std::vector<int32_t> table(blocks);
  for (int64_t b = 0; b < blocks; ++b) table[b] = static_cast<int32_t>(b);
  const int queries = static_cast<int>(in.queries.size() / kD);
  k::SpanSelect span;
  span.block_table = table.data();
  span.start_pos = len - 1;
  span.num_tokens = 1;
  span.num_heads = queries;  // one head per query: every query sees every key
  span.queries = in.queries.data();
  std::vector<float> raw(static_cast<size_t>(queries) * blocks);
  k::ScoreBlocksFast(k::KeyPoolView{pool.data(), s, kD}, span, 0, blocks, raw.data(), blocks);
  const k::SelectParams params{kTopk, 0, 0};
  std::vector<uint64_t> scratch(blocks);
  Selections out(queries, std::vector<int32_t>(kTopk));
  for (int q = 0; q < queries; ++q) {
    k::SelectFromScores(raw.data() + static_cast<size_t>(q) * blocks, blocks, params,
                        scratch.data(), out[q].data());
  }
  return out;
}

double Overlap(const Selections& a, const Selections& b) {
  double sum = 0;
  for (size_t q = 0; q < a.size(); ++q) {
    int common = 0;
    for (int32_t x : a[q]) common += std::count(b[q].begin(), b[q].end(), x) > 0 ? 1 : 0;
    sum += static_cast<double>(common) / kTopk;
  }
  return sum / static_cast<double>(a.size());
}

}  // namespace

int main(int argc, char** argv) {
  int queries = 64;
  uint64_t seed = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--queries=", 0) == 0) {
      queries = std::max(1, std::atoi(a.c_str() + 10));
    } else if (a.rfind("--seed=", 0) == 0) {
      seed = std::strtoull(a.c_str() + 7, nullptr, 10);
    } else {
      std::fprintf(stderr, "usage: indexer-key-quality [--queries=N] [--seed=S]\n");
      return 2;
    }
  }
  std::printf("top-%d overlap with the bf16 selection (mean over %d queries, no forced blocks)\n\n",
              kTopk, queries);
  std::printf("| keys | L | blocks | fp8 | fp4 |\n|---|---:|---:|---:|---:|\n");
  std::mt19937_64 rng(seed);
  for (Kind kind : {Kind::kNormal, Kind::kOutliers, Kind::kLowRank}) {
    for (int64_t len : {int64_t{4096}, int64_t{32768}, int64_t{131072}}) {
      const Inputs in = Draw(kind, len, queries, rng);
      const auto bf16 = Select(in, len, KeyStorage::kBf16);
      const auto fp8 = Select(in, len, KeyStorage::kFp8E4M3);
      const auto fp4 = Select(in, len, KeyStorage::kFp4E2M1);
      std::printf("| %s | %lldK | %lld | %.3f | %.3f |\n", KindName(kind),
                  static_cast<long long>(len / 1024), static_cast<long long>(len / k::kBlockSize),
                  Overlap(fp8, bf16), Overlap(fp4, bf16));
      std::fflush(stdout);
    }
  }
  return 0;
}
