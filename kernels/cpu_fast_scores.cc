#include "kernels/cpu_fast_scores.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/numeric.h"

namespace indexer::kernels {
namespace {

// The reference's dot product (cpu_reference.cc): sixteen partial sums over the dimensions, then
// their sum in order. Each partial sum is a lane, so the compiler vectorises without reordering.
template <int D>
[[gnu::always_inline]] inline float Dot(const float* a, const float* b) {
  float acc[16] = {};
  for (int d = 0; d < D; d += 16) {
    for (int j = 0; j < 16; ++j) acc[j] += a[d + j] * b[d + j];
  }
  float s = 0.0f;
  for (int j = 0; j < 16; ++j) s += acc[j];
  return s;
}

// e2m1 code -> value, by table (Fp4E2M1ToFloat's values).
constexpr float kFp4Values[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                  -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// Key `slot` of page `page`, decoded: the values LoadKey gives (every decoded value is exact, so
// any way of computing it agrees bit for bit).
template <int D, KeyStorage S>
[[gnu::always_inline]] inline void DecodeRow(const void* pool, int64_t page, int slot, float* out) {
  const int64_t element = (page * kBlockSize + slot) * D;
  if constexpr (S == KeyStorage::kBf16) {
    const uint16_t* p = static_cast<const uint16_t*>(pool) + element;
    for (int i = 0; i < D; ++i) {
      const uint32_t bits = uint32_t{p[i]} << 16;
      std::memcpy(&out[i], &bits, 4);
    }
  } else if constexpr (S == KeyStorage::kFp8E4M3) {
    const uint8_t* p = static_cast<const uint8_t*>(pool) + element;
    for (int i = 0; i < D; ++i) out[i] = Fp8E4M3ToFloat(p[i]);
  } else {
    const uint8_t* codes = static_cast<const uint8_t*>(pool) + Fp4CodesOffset(page, slot, D);
    const uint8_t* scales = static_cast<const uint8_t*>(pool) + Fp4ScalesOffset(page, slot, D);
    for (int g = 0; g < D / kFp4GroupSize; ++g) {
      const float scale = Fp8E4M3ToFloat(scales[g]);
      for (int i = 0; i < kFp4GroupSize / 2; ++i) {
        const uint8_t c = codes[g * (kFp4GroupSize / 2) + i];
        out[g * kFp4GroupSize + 2 * i] = kFp4Values[c & 0xfu] * scale;
        out[g * kFp4GroupSize + 2 * i + 1] = kFp4Values[c >> 4] * scale;
      }
    }
  }
}

// Scratch reused by a thread's calls: the span's queries as floats and its rows' running maxima.
struct Scratch {
  std::vector<float> queries;
  std::vector<float> best;
};

template <int D, KeyStorage S>
[[gnu::always_inline]] inline void Score(const KeyPoolView& keys, const SpanSelect& span,
                                         int64_t block_begin, int64_t block_end, float* raw,
                                         int64_t raw_stride) {
  thread_local Scratch scratch;
  const int rows = span.num_tokens * span.num_heads;
  const int64_t p0 = span.start_pos;
  const int64_t p_last = p0 + span.num_tokens - 1;
  std::vector<float>& q = scratch.queries;
  q.resize(static_cast<size_t>(rows) * D);
  for (size_t i = 0; i < q.size(); ++i) q[i] = Bf16ToFloat(span.queries[i]);
  std::vector<float>& best = scratch.best;
  best.resize(rows);
  const float kNone = std::numeric_limits<float>::quiet_NaN();
  alignas(64) float key[D];
  for (int64_t b = block_begin; b < block_end && b * kBlockSize <= p_last; ++b) {
    const int64_t page = span.block_table[b];
    std::fill(best.begin(), best.end(), kNone);
    const int64_t t_end = std::min(b * kBlockSize + kBlockSize - 1, p_last);
    for (int64_t t = b * kBlockSize; t <= t_end; ++t) {
      DecodeRow<D, S>(keys.data, page, static_cast<int>(t - b * kBlockSize), key);
      // Token i sees position t when p0 + i >= t.
      for (int64_t i = std::max<int64_t>(0, t - p0); i < span.num_tokens; ++i) {
        for (int h = 0; h < span.num_heads; ++h) {
          const int row = static_cast<int>(i) * span.num_heads + h;
          const float d = Dot<D>(&q[static_cast<size_t>(row) * D], key);
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

template <int D, KeyStorage S>
void ScorePortable(const KeyPoolView& keys, const SpanSelect& span, int64_t begin, int64_t end,
                   float* raw, int64_t stride) {
  Score<D, S>(keys, span, begin, end, raw, stride);
}

#if defined(__x86_64__)
template <int D, KeyStorage S>
[[gnu::target("avx2")]] void ScoreAvx2(const KeyPoolView& keys, const SpanSelect& span,
                                       int64_t begin, int64_t end, float* raw, int64_t stride) {
  Score<D, S>(keys, span, begin, end, raw, stride);
}

bool HasAvx2() {
  static const bool avx2 = __builtin_cpu_supports("avx2");
  return avx2;
}
#endif

template <int D, KeyStorage S>
void Dispatch(const KeyPoolView& keys, const SpanSelect& span, int64_t begin, int64_t end,
              float* raw, int64_t stride) {
#if defined(__x86_64__)
  if (HasAvx2()) return ScoreAvx2<D, S>(keys, span, begin, end, raw, stride);
#endif
  ScorePortable<D, S>(keys, span, begin, end, raw, stride);
}

template <int D>
void DispatchStorage(const KeyPoolView& keys, const SpanSelect& span, int64_t begin, int64_t end,
                     float* raw, int64_t stride) {
  switch (keys.storage) {
    case KeyStorage::kBf16:
      return Dispatch<D, KeyStorage::kBf16>(keys, span, begin, end, raw, stride);
    case KeyStorage::kFp8E4M3:
      return Dispatch<D, KeyStorage::kFp8E4M3>(keys, span, begin, end, raw, stride);
    case KeyStorage::kFp4E2M1:
      return Dispatch<D, KeyStorage::kFp4E2M1>(keys, span, begin, end, raw, stride);
  }
}

}  // namespace

void ScoreBlocksFast(const KeyPoolView& keys, const SpanSelect& span, int64_t block_begin,
                     int64_t block_end, float* raw, int64_t raw_stride) {
  switch (keys.head_dim) {
    case 64: return DispatchStorage<64>(keys, span, block_begin, block_end, raw, raw_stride);
    case 128: return DispatchStorage<128>(keys, span, block_begin, block_end, raw, raw_stride);
    case 256: return DispatchStorage<256>(keys, span, block_begin, block_end, raw, raw_stride);
    default: break;  // the engine's config only admits the three above
  }
}

}  // namespace indexer::kernels
