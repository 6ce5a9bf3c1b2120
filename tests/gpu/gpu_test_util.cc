#include "tests/gpu/gpu_test_util.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <sstream>

#include "kernels/cpu_reference.h"

namespace indexer::testing {
namespace {

using kernels::kBlockSize;

uint16_t RandomValue(Values v, std::mt19937_64& rng) {
  if (v == Values::kIntegers) {
    return kernels::FloatToBf16(static_cast<float>(static_cast<int>(rng() % 9) - 4));
  }
  std::normal_distribution<float> normal(0.0f, 1.0f);
  return kernels::FloatToBf16(normal(rng));
}

}  // namespace

SpanCase RandomSpan(std::mt19937_64& rng, int64_t max_len, int max_n, int max_rows) {
  SpanCase s;
  s.length = 1 + static_cast<int64_t>(rng() % max_len);
  s.num_tokens = 1 + static_cast<int>(rng() % std::min<int64_t>(max_n, s.length));
  s.num_heads = 1 + static_cast<int>(rng() % std::max(1, max_rows / s.num_tokens));
  s.params.topk = 1 + static_cast<int>(rng() % 64);
  s.params.init_blocks = static_cast<int>(rng() % 3);
  s.params.local_blocks = static_cast<int>(rng() % 3);
  s.attn = (rng() % 2) == 0;
  return s;
}

void BuildCase(PoolCase& c, std::mt19937_64& rng) {
  const int d = c.head_dim;
  int64_t blocks = 0;
  for (const SpanCase& s : c.spans) blocks += (s.length + kBlockSize - 1) / kBlockSize;
  c.num_pages = blocks + 7;
  std::vector<int32_t> perm(c.num_pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  c.pool.assign(static_cast<size_t>(c.num_pages * kernels::PageBytes(c.storage, d)), 0);
  // Unused slots get garbage, including NaN patterns, as a real cache past a sequence's end may.
  for (size_t i = 0; i < c.pool.size(); ++i) c.pool[i] = static_cast<uint8_t>(rng());
  int64_t next = 0;
  for (SpanCase& s : c.spans) {
    if (s.start_pos < 0) s.start_pos = s.length - s.num_tokens;
    const int64_t nb = (s.length + kBlockSize - 1) / kBlockSize;
    s.block_table.assign(perm.begin() + next, perm.begin() + next + nb);
    next += nb;
    std::uniform_real_distribution<double> unit(0.0, 1.0);
    std::vector<uint16_t> key(static_cast<size_t>(d));
    for (int64_t t = 0; t < s.length; ++t) {
      const bool huge = unit(rng) < c.huge_token_fraction;
      for (int i = 0; i < d; ++i) {
        uint16_t v = RandomValue(c.values, rng);
        if (huge && i < 2) v = kernels::FloatToBf16((rng() & 1) ? 3e38f : -3e38f);
        c.max_abs_key = std::max(c.max_abs_key, std::fabs(kernels::Bf16ToFloat(v)));
        key[i] = v;
      }
      kernels::StoreKey(c.pool.data(), c.storage, d, s.block_table[t / kBlockSize],
                        static_cast<int>(t % kBlockSize), key.data());
    }
    const int rows = s.num_tokens * s.num_heads;
    s.queries.resize(static_cast<size_t>(rows) * d);
    for (auto& q : s.queries) q = RandomValue(c.values, rng);
    if (s.attn) {
      s.attn_pages.resize(nb);
      for (auto& a : s.attn_pages) a = static_cast<int32_t>(rng() % 100000);
    }
    const kernels::KeyPoolView view{c.pool.data(), c.storage, d};
    kernels::SpanSelect span = SpanInputs(s);
    s.ref_ids.assign(static_cast<size_t>(rows) * s.params.topk, 0);
    span.block_ids = s.ref_ids.data();
    if (s.attn) {
      s.ref_table.assign(static_cast<size_t>(rows) * s.params.topk * c.pt.pages_per_block, 0);
      s.ref_ctx.assign(rows, 0);
      span.page_table = s.ref_table.data();
      span.context_lens = s.ref_ctx.data();
    }
    kernels::SelectSpan(view, span, c.pt);
    const int64_t v = kernels::VisibleBlocks(s.start_pos + s.num_tokens - 1);
    s.ref_raw.assign(static_cast<size_t>(rows) * v, 0.0f);
    kernels::ScoreBlocks(view, span, 0, v, s.ref_raw.data(), v);
  }
}

kernels::SpanSelect SpanInputs(const SpanCase& s) {
  kernels::SpanSelect span;
  span.block_table = s.block_table.data();
  span.attn_pages = s.attn ? s.attn_pages.data() : nullptr;
  span.start_pos = s.start_pos;
  span.num_tokens = s.num_tokens;
  span.num_heads = s.num_heads;
  span.queries = s.queries.data();
  span.params = s.params;
  return span;
}

std::string CheckSpan(const PoolCase& c, const SpanCase& s, const int32_t* ids,
                      const int32_t* table, const int32_t* ctx) {
  const int rows = s.num_tokens * s.num_heads;
  const int k = s.params.topk;
  const int64_t v_max = kernels::VisibleBlocks(s.start_pos + s.num_tokens - 1);
  std::ostringstream why;
  for (int row = 0; row < rows; ++row) {
    const int32_t* got = ids + int64_t{row} * k;
    const int32_t* want = s.ref_ids.data() + int64_t{row} * k;
    if (std::equal(got, got + k, want)) continue;
    const int64_t pos = s.start_pos + row / s.num_heads;
    const int64_t v = kernels::VisibleBlocks(pos);
    why << "row " << row << " (pos " << pos << ", V " << v << "): got [";
    for (int j = 0; j < k; ++j) why << got[j] << (j + 1 < k ? "," : "]");
    why << " want [";
    for (int j = 0; j < k; ++j) why << want[j] << (j + 1 < k ? "," : "]");
    if (c.values == Values::kIntegers) return why.str() + " (integer inputs: must be exact)";
    // Real values: accept only a valid top-k order under the reference's scores, up to rounding.
    const float* raw = s.ref_raw.data() + int64_t{row} * v_max;
    const auto forced = [&](int64_t b) {
      float x = raw[b];
      if (b < s.params.init_blocks) x = kernels::kInitScore;
      if (b >= v - s.params.local_blocks) x = kernels::kLocalScore;
      return x;
    };
    const int64_t kk = std::min<int64_t>(k, v);
    std::vector<char> chosen(v, 0);
    for (int j = 0; j < k; ++j) {
      if (j >= kk) {
        if (got[j] != -1) return why.str() + ": expected -1 padding";
        continue;
      }
      if (got[j] < 0 || got[j] >= v || chosen[got[j]]) return why.str() + ": invalid or repeated id";
      chosen[got[j]] = 1;
    }
    const auto tol = [](float a) { return 1e-4f * std::max(1.0f, std::fabs(a)); };
    for (int j = 0; j + 1 < kk; ++j) {
      const float a = forced(got[j]), b = forced(got[j + 1]);
      if (a < b - tol(b)) return why.str() + ": not in descending score order";
    }
    const float last = forced(got[kk - 1]);
    for (int64_t b = 0; b < v; ++b) {
      if (!chosen[b] && forced(b) > last + tol(last)) {
        return why.str() + ": an unselected block scores clearly higher";
      }
    }
  }
  if (!s.attn) return "";
  // Page tables follow from the ids: rebuild them from the device's ids with the reference.
  const int row_len = k * c.pt.pages_per_block;
  std::vector<int32_t> want_row(row_len);
  for (int row = 0; row < rows; ++row) {
    int32_t want_ctx = 0;
    const int64_t pos = s.start_pos + row / s.num_heads;
    kernels::BuildPageTableRow(ids + int64_t{row} * k, k, pos, s.attn_pages.data(), c.pt,
                               want_row.data(), &want_ctx);
    if (!std::equal(want_row.begin(), want_row.end(), table + int64_t{row} * row_len)) {
      why << "page table row " << row << " differs";
      return why.str();
    }
    if (ctx[row] != want_ctx) {
      why << "context_len of row " << row << " is " << ctx[row] << ", want " << want_ctx;
      return why.str();
    }
  }
  return "";
}

}  // namespace indexer::testing
