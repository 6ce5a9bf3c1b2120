// Exact selector: block scores computed exactly as the CPU reference computes them (fp32
// products and sums, separately rounded, in the reference's order), for the rare spans where
// the tensor-core selectors could differ by more than rounding: values large enough for fp32
// products or sums to overflow (Inf and NaN dot products), or, for fp8 and fp4 keys, queries
// outside f16's exact range. Slow and simple; top-k is PrefillTopkKernel's.
//
// One CTA per (tile of ExactRowTile rows, chunk of blocks), as PlanPrefill lays them out;
// thread r owns row r of the tile and walks the tokens of the chunk.
#pragma once

#include "kernels/cuda/decode_select.cuh"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/span_plan.h"

namespace indexer::kernels::cuda {

template <int D, KeyStorage S>
__global__ void __launch_bounds__(128) ExactScoreKernel(const SpanDesc* spans, int num_spans,
                                                        float* scores) {
  constexpr int kTile = ExactRowTile(D);
  __shared__ uint16_t q[D][kTile];  // bf16, transposed: thread r reads q[d][r] without conflicts
  const SpanDesc& s = spans[FindSpan(spans, num_spans, blockIdx.x, false)];
  const int local = blockIdx.x - s.unit_begin;
  const int tile = local / s.block_chunks;
  const int chunk = local - tile * s.block_chunks;
  const int rows = s.num_tokens * s.num_heads;
  const int row0 = tile * kTile;
  const int r = row0 + threadIdx.x;
  for (int i = threadIdx.x; i < kTile * D; i += blockDim.x) {
    const int tile_row = i / D, d = i % D;
    q[d][tile_row] = row0 + tile_row < rows ? s.queries[int64_t{row0 + tile_row} * D + d] : uint16_t{0};
  }
  __syncthreads();
  if (threadIdx.x >= kTile || r >= rows) return;
  const int64_t pos = s.start_pos + r / s.num_heads;
  const int b_begin = chunk * s.chunk_blocks;
  const int64_t b_end = min(int64_t{b_begin + s.chunk_blocks}, pos / kBlockSize + 1);
  for (int64_t b = b_begin; b < b_end; ++b) {
    const int64_t page = s.block_table[b];
    float best = NaNf();
    const int64_t t_end = min(b * kBlockSize + kBlockSize - 1, pos);
    for (int64_t t = b * kBlockSize; t <= t_end; ++t) {
      const int slot = static_cast<int>(t - b * kBlockSize);
      float acc[16];
#pragma unroll
      for (int j = 0; j < 16; ++j) acc[j] = 0.f;
      for (int d = 0; d < D; d += 16) {
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          const float k = StoredKeyValue(s.keys, S, D, page, slot, d + j);
          acc[j] = __fadd_rn(acc[j], __fmul_rn(Bf16ToFloat(q[d + j][threadIdx.x]), k));
        }
      }
      float dot = 0.f;
#pragma unroll
      for (int j = 0; j < 16; ++j) dot = __fadd_rn(dot, acc[j]);
      if (dot == dot && !(dot <= best)) best = dot;
    }
    scores[s.score_offset + int64_t{r} * s.visible_blocks + b] = best == best ? best : kEmptyScore;
  }
}

}  // namespace indexer::kernels::cuda
