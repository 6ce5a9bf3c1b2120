// Top-k of raw block scores, shared by the decode selector (its last CTA per span) and the
// prefill top-k kernel: SPEC.md steps 3-4 and the sparse page table, for a group of rows.
// SelectRows dispatches a group to the strategy ChooseTopk (topk_plan.h) picks, one file each:
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

// The threshold pass or the shared-keys strategy over rows [row_begin, row_begin + rows), in
// passes of choice.rows_per_pass rows through shared memory. Called by every thread of the CTA.
template <TopkCaller kCaller>
__device__ __forceinline__ void SelectRowsInPasses(const SpanDesc& s, const float* scores, int row_begin,
                                                   int rows, int n, const TopkChoice& choice, uint64_t* keys,
                                                   unsigned long long* stamps) {
  __shared__ int s_count[kThresholdRowsPerPass];
  // A constant false in the prefill top-k kernel, which never takes the threshold pass: its code
  // and shared arrays are not compiled into that kernel.
  const bool threshold = kCaller == TopkCaller::kDecodeSelector && choice.strategy == TopkStrategy::kThresholdPass;
  // The shared-keys strategy's one pass holds every row (ChooseTopk's rows_per_pass == rows).
  const int pass_rows = threshold ? choice.rows_per_pass : rows;
  const int cap = choice.candidates_per_row;
  for (int r0 = 0; r0 < rows; r0 += pass_rows) {
    const int n_rows = min(pass_rows, rows - r0);
    if (threshold) {
      SelectRowsThreshold(s, scores, row_begin + r0, n_rows, n, choice.threads_per_row, keys, s_count, cap,
                          stamps);
    } else {
      LoadKeysShared(s, scores, row_begin + r0, n_rows, n, keys);
      Stamp(stamps, kTimelineLoaded);
    }
    // Rows the threshold pass did not finish (all of them after LoadKeysShared).
    __syncthreads();
    SelectFromSharedKeys(s, row_begin + r0, n_rows, n, keys, threshold ? s_count : nullptr, cap, stamps);
    Stamp(stamps, kTimelineShared);
  }
}

// Selects rows [row_begin, row_begin + rows) of span `s` from raw scores in global memory
// (written by other CTAs: read through L2) and writes their page tables: ChooseTopk picks the
// strategy, this dispatches to it. `keys` is shared memory for rows * n keys, with
// n = NextPow2(s.visible_blocks), followed by kWarpCandidates keys per warp (and, in the decode
// selector, at least kRegisterTopKSmemBytes). Called by every thread of the CTA. Strategies that
// ChooseTopk never picks for kCaller are not compiled into its kernel: the prefill top-k kernel
// keeps its registers for occupancy.
template <TopkCaller kCaller>
__device__ __forceinline__ void SelectRows(const SpanDesc& s, const float* scores, int row_begin,
                                           int rows, int n, uint64_t* keys, PageTableParams pt,
                                           unsigned long long* stamps = nullptr) {
  const TopkChoice choice = ChooseTopk(kCaller, rows, n, s.topk, static_cast<int>(blockDim.x));
  if constexpr (kCaller == TopkCaller::kPrefillTopk) {
    if (choice.strategy == TopkStrategy::kShortRows) {
      SelectShortRows(s, scores, row_begin, rows);
      WritePageTables(s, row_begin, rows, pt);
      return;
    }
  }
  if constexpr (kCaller == TopkCaller::kDecodeSelector) {
    if (choice.strategy == TopkStrategy::kRegisters) {
      SelectRowsInRegisters(s, scores, row_begin, rows, choice.warps_per_row, choice.vectors_per_warp, keys,
                            stamps);
      Stamp(stamps, kTimelineShared);
      WritePageTables(s, row_begin, rows, pt);
      Stamp(stamps, kTimelineEnd);
      return;
    }
  }
  SelectRowsInPasses<kCaller>(s, scores, row_begin, rows, n, choice, keys, stamps);
  WritePageTables(s, row_begin, rows, pt);
  Stamp(stamps, kTimelineEnd);
}

}  // namespace indexer::kernels::cuda
