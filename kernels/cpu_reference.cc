#include "kernels/cpu_reference.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <vector>

namespace indexer::kernels {
namespace {

// fp32 dot product of two D-vectors. Sixteen partial sums let the compiler use vector registers;
// SPEC.md allows any summation order (scores may differ by rounding of the dot products).
template <int D>
float Dot(const float* a, const float* b) {
  float acc[16] = {};
  for (int d = 0; d < D; d += 16) {
    for (int j = 0; j < 16; ++j) acc[j] += a[d + j] * b[d + j];
  }
  float s = 0.0f;
  for (int j = 0; j < 16; ++j) s += acc[j];
  return s;
}

template <int D>
void ScoreBlocksD(const KeyPoolView& keys, const SpanSelect& span, int64_t block_begin,
                  int64_t block_end, float* raw, int64_t raw_stride) {
  const int rows = span.num_tokens * span.num_heads;
  const int64_t p0 = span.start_pos;
  const int64_t p_last = p0 + span.num_tokens - 1;
  std::vector<float> q(static_cast<size_t>(rows) * D);
  for (size_t i = 0; i < q.size(); ++i) q[i] = Bf16ToFloat(span.queries[i]);
  std::vector<float> key(D);
  std::vector<float> best(rows);
  const float kNone = std::numeric_limits<float>::quiet_NaN();

  for (int64_t b = block_begin; b < block_end && b * kBlockSize <= p_last; ++b) {
    const int64_t page = span.block_table[b];
    std::fill(best.begin(), best.end(), kNone);
    const int64_t t_end = std::min(b * kBlockSize + kBlockSize - 1, p_last);
    for (int64_t t = b * kBlockSize; t <= t_end; ++t) {
      LoadKey(keys.data, keys.storage, D, page, static_cast<int>(t - b * kBlockSize), key.data());
      // Token i sees position t when p0 + i >= t.
      for (int64_t i = std::max<int64_t>(0, t - p0); i < span.num_tokens; ++i) {
        for (int h = 0; h < span.num_heads; ++h) {
          const int row = static_cast<int>(i) * span.num_heads + h;
          const float d = Dot<D>(&q[static_cast<size_t>(row) * D], key.data());
          // NaN dots are left out; `best` starts as NaN, so !(d <= best) takes the first one.
          if (d == d && !(d <= best[row])) best[row] = d;
        }
      }
    }
    for (int i = 0; i < span.num_tokens; ++i) {
      if (b * kBlockSize > p0 + i) continue;  // block not visible to token i
      for (int h = 0; h < span.num_heads; ++h) {
        const int row = i * span.num_heads + h;
        raw[row * raw_stride + b] = best[row] == best[row] ? best[row] : kEmptyScore;
      }
    }
  }
}

}  // namespace

void ScoreBlocks(const KeyPoolView& keys, const SpanSelect& span, int64_t block_begin,
                 int64_t block_end, float* raw, int64_t raw_stride) {
  switch (keys.head_dim) {
    case 64: return ScoreBlocksD<64>(keys, span, block_begin, block_end, raw, raw_stride);
    case 128: return ScoreBlocksD<128>(keys, span, block_begin, block_end, raw, raw_stride);
    case 256: return ScoreBlocksD<256>(keys, span, block_begin, block_end, raw, raw_stride);
    default: break;  // the engine's config only admits the three above
  }
}

void SelectFromScores(const float* raw, int64_t visible_blocks, const SelectParams& params,
                      uint64_t* scratch, int32_t* out) {
  const int64_t v = visible_blocks;
  for (int64_t b = 0; b < v; ++b) {
    float s = raw[b];
    if (b < params.init_blocks) s = kInitScore;
    if (b >= v - params.local_blocks) s = kLocalScore;  // local overrides init
    scratch[b] = SelectionKey(s, static_cast<int32_t>(b));
  }
  const int64_t k = std::min<int64_t>(params.topk, v);
  std::partial_sort(scratch, scratch + k, scratch + v, std::greater<uint64_t>());
  for (int64_t j = 0; j < params.topk; ++j) out[j] = j < k ? SelectionKeyBlock(scratch[j]) : -1;
}

void BuildPageTableRow(const int32_t* selected, int topk, int64_t pos, const int32_t* attn_pages,
                       const PageTableParams& pt, int32_t* row, int32_t* context_len) {
  const int64_t self_block = pos / kBlockSize;
  int n_full = 0;
  int slot = 0;
  bool has_tail = false;
  const auto put = [&](int32_t block) {
    const int32_t base = attn_pages[block] * pt.block_page_stride;
    for (int j = 0; j < pt.pages_per_block; ++j) row[slot * pt.pages_per_block + j] = base + j;
    ++slot;
  };
  for (int j = 0; j < topk; ++j) {
    const int32_t b = selected[j];
    if (b >= 0 && b < self_block) {
      put(b);
      ++n_full;
    } else if (b == self_block) {
      has_tail = true;
    }
  }
  if (has_tail) put(static_cast<int32_t>(self_block));
  for (int e = slot * pt.pages_per_block; e < topk * pt.pages_per_block; ++e) row[e] = 0;
  const int64_t len = has_tail ? int64_t{n_full} * kBlockSize + (pos + 1 - self_block * kBlockSize)
                               : std::min<int64_t>(int64_t{slot} * kBlockSize, pos + 1);
  *context_len = static_cast<int32_t>(len);
}

void SelectSpan(const KeyPoolView& keys, const SpanSelect& span, const PageTableParams& pt) {
  const int rows = span.num_tokens * span.num_heads;
  const int64_t v_max = VisibleBlocks(span.start_pos + span.num_tokens - 1);
  std::vector<float> raw(static_cast<size_t>(rows) * v_max);
  ScoreBlocks(keys, span, 0, v_max, raw.data(), v_max);
  std::vector<uint64_t> scratch(v_max);
  const int k = span.params.topk;
  for (int i = 0; i < span.num_tokens; ++i) {
    const int64_t pos = span.start_pos + i;
    for (int h = 0; h < span.num_heads; ++h) {
      const int row = i * span.num_heads + h;
      int32_t* ids = span.block_ids + static_cast<int64_t>(row) * k;
      SelectFromScores(&raw[static_cast<size_t>(row) * v_max], VisibleBlocks(pos), span.params,
                       scratch.data(), ids);
      if (span.attn_pages != nullptr) {
        BuildPageTableRow(ids, k, pos, span.attn_pages, pt,
                          span.page_table + static_cast<int64_t>(row) * k * pt.pages_per_block,
                          span.context_lens + row);
      }
    }
  }
}

}  // namespace indexer::kernels
