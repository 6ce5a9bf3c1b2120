// Top-k of raw block scores, shared by the decode selector (its last CTA per span) and the
// prefill top-k kernel: SPEC.md steps 3-4 and the sparse page table, for a group of rows.
// SelectRows dispatches a group to one of the strategies, one file each:
//   short_rows_topk.cuh   rows of 33 to 64 blocks, one warp per row in registers (prefill)
//   register_topk.cuh     up to 8 short rows across the warps' registers (decode)
//   threshold_topk.cuh    several long rows, a threshold and candidate lists (decode)
//   shared_keys_topk.cuh  any rows, keys in shared memory, WarpTopK per row (both)
//   bitonic_topk.cuh      the whole-row sort that the shared-keys strategy falls back to
#pragma once

#include <cstdint>

#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/page_table.cuh"
#include "kernels/cuda/register_topk.cuh"
#include "kernels/cuda/shared_keys_topk.cuh"
#include "kernels/cuda/short_rows_topk.cuh"
#include "kernels/cuda/span_desc.h"
#include "kernels/cuda/threshold_topk.cuh"
#include "kernels/cuda/topk_plan.h"
#include "kernels/select_types.h"

namespace indexer::kernels::cuda {

// Selects rows [row_begin, row_begin + rows) of span `s` from raw scores in global memory
// (written by other CTAs: read through L2). `keys` is shared memory for rows * n keys, with
// n = NextPow2(s.visible_blocks), followed by kWarpCandidates keys per warp. Called by every
// thread of the CTA. kThreshold allows the register path (register_topk.cuh) and the threshold
// pass (the decode selector; the prefill top-k kernel, with many CTAs per multiprocessor and rows
// too short or too many for them to pay, keeps its registers for occupancy).
template <bool kThreshold>
__device__ __forceinline__ void SelectRows(const SpanDesc& s, const float* scores, int row_begin,
                                           int rows, int n, uint64_t* keys, PageTableParams pt,
                                           unsigned long long* stamps = nullptr) {
  if constexpr (kThreshold) {
    // Up to 8 rows with NextPow2(rows) * n <= 4096, topk <= 16: in registers.
    const RegisterTopKShape shape = RegisterTopKLayout(rows, n, s.topk);
    if (shape.vectors != 0) {
      SelectRowsInRegisters(s, scores, row_begin, rows, shape, keys, stamps);
      Stamp(stamps, kTimelineShared);
      WritePageTables(s, row_begin, rows, pt);
      Stamp(stamps, kTimelineEnd);
      return;
    }
  }
  // The threshold pass where it pays: several rows of 512 or 1024 blocks (shorter rows and single
  // rows select as fast from shared memory), topk <= 32; two warps per row for up to four rows,
  // else one. Otherwise one pass of every row through shared memory.
  __shared__ int s_count[kThresholdRowsPerPass];
  const int threads_per_row = (rows <= 4 || n > 32 * kThresholdKeys) ? 64 : 32;
  const bool threshold = kThreshold && rows >= 2 && n >= 512 && n <= 64 * kThresholdKeys &&
                         s.topk <= 32 && static_cast<int>(blockDim.x) == kTopkWarps * 32;
  const int pass_rows = threshold ? static_cast<int>(blockDim.x) / threads_per_row : rows;
  // Candidate lists after a pass's keys: this many per row (a power of two).
  const int cap = min(kWarpCandidates, (kTopkWarps * kWarpCandidates) / NextPow2(pass_rows));
  for (int r0 = 0; r0 < rows; r0 += pass_rows) {
    const int n_rows = min(pass_rows, rows - r0);
    if (threshold) {
      SelectRowsThreshold(s, scores, row_begin + r0, n_rows, n, threads_per_row, keys, s_count, cap, stamps);
    } else {
      LoadKeysShared(s, scores, row_begin + r0, n_rows, n, keys);
      Stamp(stamps, kTimelineLoaded);
    }
    // Rows the threshold pass did not finish (all of them after LoadKeysShared).
    __syncthreads();
    SelectFromSharedKeys(s, row_begin + r0, n_rows, n, keys, threshold ? s_count : nullptr, cap, stamps);
    Stamp(stamps, kTimelineShared);
  }
  WritePageTables(s, row_begin, rows, pt);
  Stamp(stamps, kTimelineEnd);
}

}  // namespace indexer::kernels::cuda
