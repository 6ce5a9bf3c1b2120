// Prefill selector: many query rows against their causal prefixes, on tensor cores.
//
// Scores: one CTA (4 warps) per (tile of query rows, chunk of 16 blocks). Each warp holds
// 16 * kMTiles query rows as mma A fragments for the whole CTA; key blocks stream through a
// two-stage cp.async pipeline into XOR-swizzled shared memory (conflict-free ldmatrix) and are
// the B operand. Row maxima per block go to a raw score array; a second kernel selects the
// top-k of each row (topk.cuh). Scores are 1/32768 of the key bytes per row: writing them costs
// little next to the scoring, and splitting rows and blocks over CTAs keeps every SM busy
// whatever the causal shape.
#pragma once

#include "kernels/cuda/decode_select.cuh"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/topk.cuh"

namespace indexer::kernels::cuda {

template <int D, KeyStorage S>
struct PrefillShape {
  static constexpr int kWarps = 4;
  static constexpr int kMTiles = D == 256 ? 1 : 2;
  static constexpr int kRowsPerCta = kWarps * 16 * kMTiles;
  static constexpr int kSteps = D / 16;
  static constexpr int kRowBytes = D * 2;  // bf16 rows in shared memory
  static constexpr int kChunks = D / 8;    // 16-byte chunks per row
  static constexpr int kStageBytes = kBlockSize * kRowBytes;
  static constexpr int kRawStageBytes = S == KeyStorage::kBf16 ? 0 : kBlockSize * D;
  static constexpr int kSmemBytes = 2 * kStageBytes + 2 * kRawStageBytes;
};

template <int D, KeyStorage S>
__global__ void __launch_bounds__(PrefillShape<D, S>::kWarps * 32)
    PrefillScoreKernel(const SpanDesc* spans, int num_spans, float* scores) {
  using Shape = PrefillShape<D, S>;
  constexpr int kMT = Shape::kMTiles;
  constexpr int kSteps = Shape::kSteps;
  extern __shared__ uint4 smem4[];
  char* smem = reinterpret_cast<char*>(smem4);

  const SpanDesc& s = spans[FindSpan(spans, num_spans, blockIdx.x, false)];
  const int local = blockIdx.x - s.unit_begin;
  const int tile = local / s.block_chunks;
  const int chunk = local - tile * s.block_chunks;
  const int rows = s.num_tokens * s.num_heads;
  const int heads = s.num_heads;
  const int64_t p0 = s.start_pos;
  const int row0 = tile * Shape::kRowsPerCta;
  const int last_row = min(row0 + Shape::kRowsPerCta, rows) - 1;
  const int64_t pos_lo = p0 + row0 / heads;
  const int64_t pos_hi = p0 + last_row / heads;
  const int b_begin = chunk * s.chunk_blocks;
  const int b_end = static_cast<int>(min(int64_t{b_begin + s.chunk_blocks}, pos_hi / kBlockSize + 1));
  if (b_begin >= b_end) return;

  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;
  const int t = lane & 3;

  // A fragments of this warp's query rows, and each row's position (-1: no such row).
  uint32_t qa[kMT][kSteps][4];
  int64_t row_pos[kMT][2];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = row0 + warp * 16 * kMT + mt * 16 + g + 8 * h;
      row_pos[mt][h] = r < rows ? p0 + r / heads : -1;
      const uint32_t* q = reinterpret_cast<const uint32_t*>(s.queries + int64_t{r} * D);
#pragma unroll
      for (int ks = 0; ks < kSteps; ++ks) {
        qa[mt][ks][h] = r < rows ? q[(16 * ks + 2 * t) / 2] : 0u;
        qa[mt][ks][2 + h] = r < rows ? q[(16 * ks + 2 * t + 8) / 2] : 0u;
      }
    }
  }

  const auto stage_buf = [&](int stage) { return smem + stage * Shape::kStageBytes; };
  const auto raw_buf = [&](int stage) {
    return smem + 2 * Shape::kStageBytes + stage * Shape::kRawStageBytes;
  };
  const auto issue = [&](int b, int stage) {
    const int64_t page = s.block_table[b];
    if constexpr (S == KeyStorage::kBf16) {
      const char* src = static_cast<const char*>(s.keys) + page * Shape::kStageBytes;
      char* dst = stage_buf(stage);
      for (int c = threadIdx.x; c < kBlockSize * Shape::kChunks; c += blockDim.x) {
        const int token = c / Shape::kChunks;
        const int ch = c - token * Shape::kChunks;
        CpAsync16(dst + token * Shape::kRowBytes + ((ch ^ (token & 7)) << 4), src + c * 16);
      }
    } else {
      const char* src = static_cast<const char*>(s.keys) + page * Shape::kRawStageBytes;
      char* dst = raw_buf(stage);
      for (int c = threadIdx.x; c < Shape::kRawStageBytes / 16; c += blockDim.x) {
        CpAsync16(dst + c * 16, src + c * 16);
      }
    }
    CpAsyncCommit();
  };

  issue(b_begin, 0);
  for (int b = b_begin; b < b_end; ++b) {
    const int stage = (b - b_begin) & 1;
    if (b + 1 < b_end) {
      issue(b + 1, stage ^ 1);
      CpAsyncWait<1>();
    } else {
      CpAsyncWait<0>();
    }
    __syncthreads();
    char* buf = stage_buf(stage);
    if constexpr (S == KeyStorage::kFp8E4M3) {
      // 16 fp8 values (one raw chunk) become two swizzled bf16 chunks.
      const uint4* raw = reinterpret_cast<const uint4*>(raw_buf(stage));
      for (int c = threadIdx.x; c < Shape::kRawStageBytes / 16; c += blockDim.x) {
        const uint4 v = raw[c];
        const int token = (c * 16) / D;
        const int ch = ((c * 16) % D) / 8;
        const uint32_t w[4] = {v.x, v.y, v.z, v.w};
        uint32_t o[8];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          o[2 * i] = Fp8x2ToBf16x2(static_cast<uint16_t>(w[i] & 0xffffu));
          o[2 * i + 1] = Fp8x2ToBf16x2(static_cast<uint16_t>(w[i] >> 16));
        }
        char* row = buf + token * Shape::kRowBytes;
        *reinterpret_cast<uint4*>(row + ((ch ^ (token & 7)) << 4)) = make_uint4(o[0], o[1], o[2], o[3]);
        *reinterpret_cast<uint4*>(row + (((ch + 1) ^ (token & 7)) << 4)) = make_uint4(o[4], o[5], o[6], o[7]);
      }
      __syncthreads();
    }

    float mrow[kMT][2];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) mrow[mt][0] = mrow[mt][1] = NaNf();
    const bool masked = int64_t{b} * kBlockSize + kBlockSize - 1 > pos_lo;
    const int mi = lane >> 3;
    const int ri = lane & 7;
#pragma unroll 2
    for (int nt = 0; nt < kBlockSize / 8; ++nt) {
      float acc[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.f;
      const int token = nt * 8 + ri;
      const char* row = buf + token * Shape::kRowBytes;
#pragma unroll
      for (int kp = 0; kp < kSteps / 2; ++kp) {
        uint32_t r[4];
        LdMatrixX4(r, row + (((4 * kp + mi) ^ (token & 7)) << 4));
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          MmaBf16(acc[mt], qa[mt][2 * kp], r[0], r[1]);
          MmaBf16(acc[mt], qa[mt][2 * kp + 1], r[2], r[3]);
        }
      }
      const int64_t tok = int64_t{b} * kBlockSize + nt * 8 + 2 * t;
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        if (!masked) {
          mrow[mt][0] = MaxSkipNaN(mrow[mt][0], MaxSkipNaN(acc[mt][0], acc[mt][1]));
          mrow[mt][1] = MaxSkipNaN(mrow[mt][1], MaxSkipNaN(acc[mt][2], acc[mt][3]));
        } else {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const float x0 = tok <= row_pos[mt][h] ? acc[mt][2 * h] : NaNf();
            const float x1 = tok + 1 <= row_pos[mt][h] ? acc[mt][2 * h + 1] : NaNf();
            mrow[mt][h] = MaxSkipNaN(mrow[mt][h], MaxSkipNaN(x0, x1));
          }
        }
      }
    }
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float m = mrow[mt][h];
        m = MaxSkipNaN(m, __shfl_xor_sync(0xffffffffu, m, 1));
        m = MaxSkipNaN(m, __shfl_xor_sync(0xffffffffu, m, 2));
        const int r = row0 + warp * 16 * kMT + mt * 16 + g + 8 * h;
        if (t == 0 && r < rows && int64_t{b} * kBlockSize <= row_pos[mt][h]) {
          scores[s.score_offset + int64_t{r} * s.visible_blocks + b] = m == m ? m : kEmptyScore;
        }
      }
    }
    __syncthreads();  // this stage is refilled two iterations on
  }
}

__global__ void __launch_bounds__(256)
    PrefillTopkKernel(const SpanDesc* spans, int num_spans, const float* scores,
                      PageTableParams pt) {
  extern __shared__ uint64_t keys[];
  __shared__ __align__(16) unsigned char s_desc[sizeof(SpanDesc)];
  if (threadIdx.x < 32) (void)CopySpanDesc(spans, FindSpan(spans, num_spans, blockIdx.x, true), s_desc);
  __syncthreads();
  const SpanDesc& s = *reinterpret_cast<const SpanDesc*>(s_desc);
  const int rows_per_group = TopkRowsPerGroup(s.visible_blocks);
  const int r0 = (blockIdx.x - s.topk_group_begin) * rows_per_group;
  const int rows = s.num_tokens * s.num_heads;
  SelectRows<false>(s, scores, r0, min(rows_per_group, rows - r0), NextPow2(s.visible_blocks), keys, pt);
}

}  // namespace indexer::kernels::cuda
