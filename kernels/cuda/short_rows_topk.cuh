// Top-k strategy "short rows", for the prefill top-k kernel's rows of 33 to 64 visible blocks with
// topk <= 32: one warp per row, its keys straight from global memory into registers, two per
// lane, ordered by WarpTop32Of64. No shared memory and no barrier: a sort of each row through
// shared memory takes several times the instructions, and the many rows of this length make that
// kernel issue-bound.
#pragma once

#include <cstdint>

#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/span_desc.h"
#include "kernels/cuda/topk_plan.h"
#include "kernels/cuda/warp_sort.cuh"

namespace indexer::kernels::cuda {

// Selects rows [row_begin, row_begin + rows) of a span whose rows see at most 64 blocks, topk <=
// 32, writing their block ids. Called by every thread (any block size).
__device__ __forceinline__ void SelectShortRows(const SpanDesc& s, const float* scores, int row_begin, int rows) {
  const int lane = threadIdx.x & 31;
  const int warps = blockDim.x >> 5;
  const int topk = s.topk;
  const int init_blocks = s.init_blocks;
  const int local_blocks = s.local_blocks;
  const RowDivider per_head(s.num_heads);
  for (int r = threadIdx.x >> 5; r < rows; r += warps) {
    const int row = row_begin + r;
    const int visible = static_cast<int>((s.start_pos + per_head(row)) / kBlockSize) + 1;
    const float* row_scores = scores + s.score_offset + int64_t{row} * s.visible_blocks;
    // Branch-free, from valid addresses (the row's last block) either way.
    const float x0 = __ldcg(row_scores + min(lane, visible - 1));
    const float x1 = __ldcg(row_scores + min(lane + 32, visible - 1));
    const uint64_t k0 =
        lane < visible ? SelectionKey(ForcedScore(x0, lane, visible, init_blocks, local_blocks), lane) : 0;
    const uint64_t k1 = lane + 32 < visible
                            ? SelectionKey(ForcedScore(x1, lane + 32, visible, init_blocks, local_blocks), lane + 32)
                            : 0;
    const uint64_t x = WarpTop32Of64(k0, k1);
    if (lane < topk) s.block_ids[int64_t{row} * topk + lane] = lane < visible ? SelectionKeyBlock(x) : -1;
  }
}

}  // namespace indexer::kernels::cuda
