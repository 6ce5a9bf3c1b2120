// Prefill selector: many query rows against their causal prefixes, on tensor cores.
//
// Scores: one CTA per (tile of query rows, chunk of 16 blocks). Each warpgroup holds 64 query
// rows as A fragments in registers for the whole CTA; key blocks stream through a cp.async ring of
// kStages blocks into shared memory, laid out in 128-byte swizzled slabs of 64 dimensions (the
// wgmma K-major layout, also read by ldmatrix), and are the B operand: per block and warpgroup,
// D / 16 wgmma m64n128k16 on sm_90a, or the same product by mma.sync elsewhere. Row maxima per
// block go to a raw score array; a second kernel selects the top-k of each row (topk.cuh).
// Scores are 1/32768 of the key bytes per row: writing them costs little next to the scoring,
// and splitting rows and blocks over CTAs keeps every SM busy whatever the causal shape.
#pragma once

#include "kernels/cuda/decode_select.cuh"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/span_plan.h"
#include "kernels/cuda/topk.cuh"
#include "kernels/cuda/wgmma.cuh"

namespace indexer::kernels::cuda {

template <int D, KeyStorage S>
struct PrefillShape {
  // Two warpgroups of 64 rows and two CTAs per multiprocessor (one for head_dim 256, whose A
  // fragments and stages are twice the size): one CTA's barrier waits and pipeline start are the
  // other's tensor-core time. One CTA of four warpgroups (256 rows) would halve the shared-memory
  // reads per product but lose that overlap, and is slower (docs/PERF.md).
  static constexpr int kWarpGroups = 2;
  static constexpr int kMinBlocks = D == 256 ? 1 : 2;
  static constexpr int kThreads = kWarpGroups * 128;
  static constexpr int kRowsPerCta = kWarpGroups * 64;
  static constexpr int kSteps = D / 16;                       // k-steps of 16 dimensions
  static constexpr int kStageBytes = kBlockSize * D * 2;      // one block in bf16
  // Keys as stored: fp8 values, or fp4 codes followed by each copying thread's scale words.
  static constexpr int kRawStageBytes = S == KeyStorage::kBf16      ? 0
                                        : S == KeyStorage::kFp8E4M3 ? kBlockSize * D
                                                                    : kBlockSize * D / 2 * 5 / 4;
  static constexpr int kStages = kMinBlocks == 2 ? std::min(3, (112 << 10) / (kStageBytes + kRawStageBytes))
                                                : std::min(4, (200 << 10) / (kStageBytes + kRawStageBytes));
  static constexpr int kSmemBytes = kStages * (kStageBytes + kRawStageBytes) + 1024;  // + alignment
  // The swizzle of a thread's copies repeats: each pass over a block moves it by a multiple of 8 tokens.
  static_assert((kThreads / (D / 8)) % 8 == 0 && (kThreads / (D / 16)) % 8 == 0 &&
                (kThreads / (D / 32)) % 8 == 0);
  static_assert(kStages >= 2);
  static_assert(kRowsPerCta == PrefillRowTile(D), "PlanPrefill lays the units out by PrefillRowTile");
};

// Bytes of one slab of a staged block: 64 dimensions of its 128 tokens, in 128-byte rows.
inline constexpr int kSlabBytes = kBlockSize * 128;

// Byte offset of 16-byte chunk `ch` (dimensions 8 ch .. 8 ch + 7) of `token` in a staged block.
__device__ __forceinline__ int StagedChunk(int token, int ch) {
  return (ch >> 3) * kSlabBytes + token * 128 + (((ch & 7) ^ (token & 7)) << 4);
}

// acc (this warp's 16 rows x the block's 128 tokens, mma C fragments per 8 tokens) = q * block,
// q being `query_frags`, the A fragments of those rows.
// `stage` is the staged block's shared-memory address (1024-aligned); all warps of a warpgroup call.
template <int D>
__device__ __forceinline__ void ScoreBlock(float (&acc)[64], const uint32_t (&query_frags)[D / 16][4],
                                           uint32_t stage, const char* stage_ptr) {
#if defined(INDEXER_HAVE_WGMMA)
  (void)stage_ptr;
#pragma unroll
  for (int i = 0; i < 64; ++i) WgmmaFenceOperand(acc[i]);
  WgmmaFence();
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    const uint64_t desc = WgmmaDescSw128(stage + (ks >> 2) * kSlabBytes) + 2 * (ks & 3);
    WgmmaM64N128K16Bf16(acc, query_frags[ks], desc, ks > 0);
  }
  WgmmaCommit();
  WgmmaWait<0>();
#pragma unroll
  for (int i = 0; i < 64; ++i) WgmmaFenceOperand(acc[i]);
#else
  (void)stage;
  const int lane = threadIdx.x & 31;
  const int mi = lane >> 3;
  const int ri = lane & 7;
#pragma unroll
  for (int nt = 0; nt < kBlockSize / 8; ++nt) {
    float(&c)[4] = *reinterpret_cast<float(*)[4]>(&acc[4 * nt]);
    c[0] = c[1] = c[2] = c[3] = 0.f;
    const int token = nt * 8 + ri;
#pragma unroll
    for (int kp = 0; kp < D / 32; ++kp) {
      uint32_t r[4];
      LdMatrixX4(r, stage_ptr + StagedChunk(token, 4 * kp + mi));
      MmaBf16(c, query_frags[2 * kp], r[0], r[1]);
      MmaBf16(c, query_frags[2 * kp + 1], r[2], r[3]);
    }
  }
#endif
}

template <int D, KeyStorage S>
__global__ void __launch_bounds__(PrefillShape<D, S>::kThreads, PrefillShape<D, S>::kMinBlocks)
    PrefillScoreKernel(const SpanDesc* spans, int num_spans, float* scores) {
  using Shape = PrefillShape<D, S>;
  constexpr int kSteps = Shape::kSteps;
  constexpr int kStages = Shape::kStages;
  constexpr int kThreads = Shape::kThreads;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // 1024-aligned, as the swizzled layout needs (the launch adds 1 KB for this).
  const uint32_t raw_addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  char* smem = reinterpret_cast<char*>(smem_raw) + (((raw_addr + 1023u) & ~1023u) - raw_addr);
  const uint32_t smem_addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));

  // Units in reverse: a span's last row tiles see the most blocks, so the longest CTAs start first
  // and the short ones fill in at the end (two CTAs per multiprocessor: the tail is what balances).
  const int unit = gridDim.x - 1 - blockIdx.x;
  const SpanDesc& s = spans[FindSpan(spans, num_spans, unit, false)];
  const int local = unit - s.unit_begin;
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
  // This warpgroup's 64 rows: the last position they see bounds the blocks it multiplies.
  const int wg_row0 = row0 + (warp >> 2) * 64;
  const int64_t wg_pos_hi = wg_row0 < rows ? p0 + (min(wg_row0 + 64, rows) - 1) / heads : -1;

  // A fragments of this warp's 16 query rows, and each row's position (-1: no such row).
  uint32_t query_frags[kSteps][4];
  int64_t row_pos[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = row0 + warp * 16 + g + 8 * h;
    row_pos[h] = r < rows ? p0 + r / heads : -1;
    const uint32_t* q = reinterpret_cast<const uint32_t*>(s.queries + int64_t{r} * D);
#pragma unroll
    for (int ks = 0; ks < kSteps; ++ks) {
      query_frags[ks][h] = r < rows ? q[(16 * ks + 2 * t) / 2] : 0u;
      query_frags[ks][2 + h] = r < rows ? q[(16 * ks + 2 * t + 8) / 2] : 0u;
    }
  }

  const auto stage_off = [](int stage) { return stage * Shape::kStageBytes; };
  const auto raw_off = [](int stage) { return kStages * Shape::kStageBytes + stage * Shape::kRawStageBytes; };
  // This thread's copies: chunk threadIdx.x + kThreads * i of the block. Its swizzled destination
  // moves by a whole number of 8-token atoms per i, so one offset serves every pass.
  // 16-byte chunks of a token's stored values: 8 bf16, 16 fp8 or 32 fp4 codes (two groups).
  constexpr int kChunksPerToken =
      S == KeyStorage::kBf16 ? D / 8 : (S == KeyStorage::kFp8E4M3 ? D / 16 : D / 32);
  constexpr int kCopyChunks = kBlockSize * kChunksPerToken;
  constexpr int kTokensPerPass = kThreads / kChunksPerToken;
  const int my_token = threadIdx.x / kChunksPerToken;
  const int my_chunk = threadIdx.x - my_token * kChunksPerToken;
  const int my_dst = S == KeyStorage::kBf16 ? StagedChunk(my_token, my_chunk) : threadIdx.x * 16;
  const auto issue = [&](int b, int stage) {
    const int64_t page = s.block_table[b];
    const char* page_src = static_cast<const char*>(s.keys) + page * PageBytes(S, D);
    const char* src = page_src + threadIdx.x * 16;
    char* dst = smem + (S == KeyStorage::kBf16 ? stage_off(stage) : raw_off(stage)) + my_dst;
#pragma unroll
    for (int i = 0; i < kCopyChunks / kThreads; ++i) {
      CpAsync16(dst + (S == KeyStorage::kBf16 ? i * kTokensPerPass * 128 : i * kThreads * 16),
                src + i * kThreads * 16);
      if constexpr (S == KeyStorage::kFp4E2M1) {
        // The word holding this chunk's two scales (groups 2 my_chunk, + 1), into a slot of this
        // thread's own: it widens the chunk itself, with no barrier between copy and use.
        const int token = my_token + i * kTokensPerPass;
        CpAsync4(smem + raw_off(stage) + kBlockSize * D / 2 + (i * kThreads + threadIdx.x) * 4,
                 page_src + Fp4ScalesOffset(0, token, D) + (my_chunk >> 1) * 4);
      }
    }
  };

  // Blocks b_begin .. b_begin + kStages - 2 in flight; one commit group per block (empty ones too,
  // so that "block i landed" is always "at most kStages - 2 groups pending").
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) {
    if (b_begin + i < b_end) issue(b_begin + i, i);
    CpAsyncCommit();
  }
  for (int b = b_begin; b < b_end; ++b) {
    const int i = b - b_begin;
    const int stage = i % kStages;
    CpAsyncWait<kStages - 2>();
    if constexpr (S == KeyStorage::kFp8E4M3) {
      // Each thread widens the raw chunks it copied itself (16 fp8 values -> two bf16 chunks).
      const char* raw = smem + raw_off(stage) + threadIdx.x * 16;
      char* out = smem + stage_off(stage);
#pragma unroll
      for (int k = 0; k < kCopyChunks / kThreads; ++k) {
        const uint4 v = *reinterpret_cast<const uint4*>(raw + k * kThreads * 16);
        const uint32_t w[4] = {v.x, v.y, v.z, v.w};
        uint32_t o[8];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          o[2 * j] = Fp8x2ToBf16x2(static_cast<uint16_t>(w[j] & 0xffffu));
          o[2 * j + 1] = Fp8x2ToBf16x2(static_cast<uint16_t>(w[j] >> 16));
        }
        const int token = my_token + k * kTokensPerPass;
        *reinterpret_cast<uint4*>(out + StagedChunk(token, 2 * my_chunk)) = make_uint4(o[0], o[1], o[2], o[3]);
        *reinterpret_cast<uint4*>(out + StagedChunk(token, 2 * my_chunk + 1)) = make_uint4(o[4], o[5], o[6], o[7]);
      }
    }
    if constexpr (S == KeyStorage::kFp4E2M1) {
      // Each thread widens the code chunks it copied itself (32 values -> four bf16 chunks).
      const char* raw = smem + raw_off(stage);
      char* out = smem + stage_off(stage);
#pragma unroll
      for (int k = 0; k < kCopyChunks / kThreads; ++k) {
        const uint4 v = *reinterpret_cast<const uint4*>(raw + (k * kThreads + threadIdx.x) * 16);
        const int copy = k * kThreads + threadIdx.x;
        const uint32_t scales = *reinterpret_cast<const uint32_t*>(raw + kBlockSize * D / 2 + copy * 4);
        const uint32_t w[4] = {v.x, v.y, v.z, v.w};
        const int token = my_token + k * kTokensPerPass;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          // Word j: values 8j .. 8j + 7 of the chunk, in group 2 my_chunk + j / 2.
          const uint32_t byte = static_cast<uint32_t>(2 * (my_chunk & 1) + (j >> 1));
          const uint32_t pair = __byte_perm(scales, 0u, byte * 0x11u);
          const uint32_t scale64 =
              MulF16x2(Fp8x2ToF16x2(static_cast<uint16_t>(pair & 0xffffu)), kF16x2TwoPow6);
          uint32_t h[4];
          DecodeFp4Word(w[j], scale64, h);
          const float2 v02 = F16x2ToFloat2(h[0]), v46 = F16x2ToFloat2(h[1]);
          const float2 v13 = F16x2ToFloat2(h[2]), v57 = F16x2ToFloat2(h[3]);
          *reinterpret_cast<uint4*>(out + StagedChunk(token, 4 * my_chunk + j)) =
              make_uint4(Float2ToBf16x2(v02.x, v13.x), Float2ToBf16x2(v02.y, v13.y),
                         Float2ToBf16x2(v46.x, v57.x), Float2ToBf16x2(v46.y, v57.y));
        }
      }
    }
#if defined(INDEXER_HAVE_WGMMA)
    FenceProxyAsyncShared();
#endif
    // Block b is staged for everyone, and every warp is done with block b - 1, whose stage the
    // next copy refills.
    __syncthreads();
    if (b + kStages - 1 < b_end) issue(b + kStages - 1, (i + kStages - 1) % kStages);
    CpAsyncCommit();

    if (int64_t{b} * kBlockSize > wg_pos_hi) continue;  // warpgroup-uniform: no row of it sees b
    float acc[64];
    ScoreBlock<D>(acc, query_frags, smem_addr + stage_off(stage), smem + stage_off(stage));

    float row_max[2] = {NaNf(), NaNf()};
    const bool masked = int64_t{b} * kBlockSize + kBlockSize - 1 > pos_lo;
    const int64_t tok0 = int64_t{b} * kBlockSize + 2 * t;
#pragma unroll
    for (int nt = 0; nt < kBlockSize / 8; ++nt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float x0 = acc[4 * nt + 2 * h], x1 = acc[4 * nt + 2 * h + 1];
        if (masked) {
          x0 = tok0 + nt * 8 <= row_pos[h] ? x0 : NaNf();
          x1 = tok0 + nt * 8 + 1 <= row_pos[h] ? x1 : NaNf();
        }
        row_max[h] = MaxSkipNaN(row_max[h], MaxSkipNaN(x0, x1));
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float m = row_max[h];
      m = MaxSkipNaN(m, __shfl_xor_sync(0xffffffffu, m, 1));
      m = MaxSkipNaN(m, __shfl_xor_sync(0xffffffffu, m, 2));
      const int r = row0 + warp * 16 + g + 8 * h;
      if (t == 0 && r < rows && int64_t{b} * kBlockSize <= row_pos[h]) {
        scores[s.score_offset + int64_t{r} * s.visible_blocks + b] = m == m ? m : kEmptyScore;
      }
    }
  }
  CpAsyncWait<0>();  // no copy outlives the CTA
}

// Copies spans[span] into `out` (shared memory, sizeof(SpanDesc) bytes, 16-byte aligned), one
// word per lane in one round trip. Called by all 32 lanes of one warp; visible to the CTA after
// a barrier. The top-k reads many fields one after another, some only after a decision on
// others: from global memory each would be an L2 round trip of its own.
__device__ __forceinline__ const SpanDesc& CopySpanDesc(const SpanDesc* spans, int span, unsigned char* out) {
  static_assert(sizeof(SpanDesc) % 4 == 0 && sizeof(SpanDesc) / 4 <= 32, "one word per lane");
  const int lane = threadIdx.x & 31;
  if (lane < static_cast<int>(sizeof(SpanDesc) / 4)) {
    reinterpret_cast<int32_t*>(out)[lane] = reinterpret_cast<const int32_t*>(spans + span)[lane];
  }
  return *reinterpret_cast<const SpanDesc*>(out);
}

// Four CTAs per multiprocessor (64 registers; the shared memory allows four at up to 4096 keys).
__global__ void __launch_bounds__(256, 4)
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
  const int n = NextPow2(s.visible_blocks);
  SelectRows<TopkCaller::kPrefillTopk>(s, scores, r0, min(rows_per_group, rows - r0), n, keys, pt);
}

}  // namespace indexer::kernels::cuda
