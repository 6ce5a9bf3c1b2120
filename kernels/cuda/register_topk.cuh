// Top-k strategy "rows in registers", for the decode selector's last CTA: SPEC.md steps 3-4 for
// up to 8 rows with NextPow2(rows) * n <= 4096 (n = NextPow2(V): one row of up to 4096 visible
// blocks, four of up to 1024, eight of up to 512) and topk <= 16 (ChooseTopk in topk_plan.h).
//
// A row's keys lie across the lanes of its warps as vectors of 32, one key per lane each; bitonic
// networks of shuffles sort each vector and fold them into the warp's 32 largest, and one more
// round through shared memory merges the row's warps. No candidate lists, and no barrier where one
// warp holds a whole row: selecting these rows from shared memory is a chain of dependent loads
// and shuffles of one warp per row. Only rows of 16 vectors per warp pass through shared memory
// first, as raw scores (StageScores says why).
#pragma once

#include <cstdint>

#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/span_desc.h"
#include "kernels/cuda/topk_plan.h"
#include "kernels/cuda/warp_sort.cuh"

namespace indexer::kernels::cuda {

// Shared memory SelectRowsInRegisters needs, in keys: 16 per warp for the warps' lists, then
// 32 * kRegisterVectors per warp for each warp's own buffer.
inline constexpr int kRegisterTopKSmemKeys = 8 * 16 + 8 * 32 * kRegisterVectors;
// All the shared memory SelectRowsInRegisters needs, in bytes: those keys, then up to 4096 staged
// scores and 4 floats of alignment (StageScores).
inline constexpr int kRegisterTopKSmemBytes = kRegisterTopKSmemKeys * 8 + (4096 + 4) * 4;

// The final merge of a row's `warps` (2, 4 or 8) warp lists of 16 keys each (shared memory,
// descending), by the row's first warp: pairs of lists form bitonic vectors (the second list
// reversed on lanes 16 to 31), which WarpFoldVectors folds. Lanes 0 to 15 return the row's 16
// largest keys, descending.
template <int P>
__device__ __forceinline__ uint64_t MergeWarpLists(const uint64_t* lists) {
  const int lane = threadIdx.x & 31;
  uint64_t y[P];
#pragma unroll
  for (int j = 0; j < P; ++j) {
    y[j] = lane < 16 ? lists[(2 * j) * 16 + lane] : lists[(2 * j + 1) * 16 + (31 - lane)];
  }
#pragma unroll
  for (int j = 0; j < P; ++j) y[j] = WarpMergeLanes(y[j], (j & 1) == 0);
  WarpFoldVectors<P>(y);
  return y[0];
}

// Loads one warp's M vectors of a row's keys (block b = (i * warps + warp_in_row) * 32 + lane for
// vector i: each load instruction reads 128 contiguous bytes) from `row_scores` (the row's raw
// scores: in global memory, read through L2, or kStaged: staged in shared memory by StageScores)
// and returns the warp's 16 largest keys on lanes 0 to 15, descending (lanes 16 to 31: smaller
// keys or 0). `buffer` is this warp's 32 * kRegisterVectors keys of shared memory. Called by all
// 32 lanes.
//
// Four vectors and more go through a threshold first: the 16th largest of the lanes' maxima is at
// most the warp's 16th largest key, so the warp's top 16 are among the keys at or above it, which
// are usually a few more than 16. Up to 32 of them are gathered one per lane and sorted: two sorts
// of one vector instead of M sorts and M - 1 merges (up to 64: two vectors). More (ties, or keys
// in few lanes) merge all M vectors in turn.
template <int M, bool kStaged>
__device__ __forceinline__ uint64_t WarpRowTop(const SpanDesc& s, const float* row_scores, int64_t row_visible,
                                               int warps, int warp_in_row, uint64_t* buffer) {
  const int lane = threadIdx.x & 31;
  const int visible = s.visible_blocks;
  float raw[M];
#pragma unroll
  for (int i = 0; i < M; ++i) {
    // Branch-free, from a valid address either way (the row's first score).
    const int b = (i * warps + warp_in_row) * 32 + lane;
    const float* at = b < visible ? row_scores + b : row_scores;
    raw[i] = kStaged ? *at : __ldcg(at);
  }
  uint64_t x[M];
#pragma unroll
  for (int i = 0; i < M; ++i) {
    const int b = (i * warps + warp_in_row) * 32 + lane;
    // 0 is below every real key: padding sorts last.
    x[i] = b < row_visible ? SelectionKey(ForcedScore(raw[i], b, row_visible, s.init_blocks, s.local_blocks), b) : 0;
  }
  if constexpr (M >= 4) {
    uint64_t mx = x[0];
#pragma unroll
    for (int i = 1; i < M; ++i) mx = max(mx, x[i]);
    const uint64_t threshold = __shfl_sync(0xffffffffu, WarpSortLanes(mx, true), 15);
    unsigned pass[M];
    int count = 0;
#pragma unroll
    for (int i = 0; i < M; ++i) {
      pass[i] = __ballot_sync(0xffffffffu, x[i] != 0 && x[i] >= threshold);
      count += __popc(pass[i]);
    }
    if (count <= 64) {  // the same for every lane
      const unsigned below = (1u << lane) - 1u;
      int base = 0;
#pragma unroll
      for (int i = 0; i < M; ++i) {
        if ((pass[i] >> lane) & 1u) buffer[base + __popc(pass[i] & below)] = x[i];
        base += __popc(pass[i]);
      }
      __syncwarp();
      if (count <= 32) return WarpSortLanes(lane < count ? buffer[lane] : 0, true);
      // 33 to 64: two vectors.
      uint64_t y[2] = {WarpSortLanes(buffer[lane], true), WarpSortLanes(lane + 32 < count ? buffer[lane + 32] : 0, false)};
      WarpFoldVectors<2>(y);
      return y[0];
    }
    // Too many: every vector through the buffer, sorted and merged into the running top 32 in
    // turn (a loop: the rare path keeps its code small).
#pragma unroll
    for (int i = 0; i < M; ++i) buffer[i * 32 + lane] = x[i];
    __syncwarp();
    uint64_t top = WarpSortLanes(buffer[lane], true);
#pragma unroll 1
    for (int i = 1; i < M; ++i) top = WarpMergeLanes(max(top, WarpSortLanes(buffer[i * 32 + lane], false)), true);
    return top;
  } else {
#pragma unroll
    for (int i = 0; i < M; ++i) x[i] = WarpSortLanes(x[i], (i & 1) == 0);
    WarpFoldVectors<M>(x);
    return x[0];
  }
}

// Copies rows [row_begin, row_begin + rows) of span `s`'s raw scores (contiguous in global memory,
// written by other CTAs: read through L2; at most 4096 floats) into shared memory at `staged`
// (4100 floats) and returns where the first row begins there, as an offset of 0 to 3 floats.
// 16-byte loads, each thread's all issued before its first store. Called by every thread of the
// CTA (256 threads, as ChooseTopk requires for this strategy); the caller synchronizes before
// reading.
//
// Why, for rows of 16 vectors per warp only: loaded straight from L2, 16 scores per lane arrive
// one L2 latency after another, and that latency dominates the selection; staged with 16-byte
// loads, all in flight at once, they arrive together. At 8 vectors per warp and fewer the direct
// loads are as fast or faster (docs/PERF.md), so those rows skip the staging.
__device__ __forceinline__ int StageScores(const SpanDesc& s, const float* scores, int row_begin, int rows,
                                           float* staged) {
  const float* src = scores + s.score_offset + int64_t{row_begin} * s.visible_blocks;
  const int total = rows * s.visible_blocks;
  // src[head] is 16-byte aligned; so is staged[shift + head], where src[0] goes to staged[shift].
  const int head = min(total, static_cast<int>((4 - ((reinterpret_cast<uintptr_t>(src) >> 2) & 3)) & 3));
  const int shift = (4 - head) & 3;
  staged += shift;
  const int body = (total - head) >> 2;  // float4s: at most 1024, four per thread
  const int tail = head + body * 4;      // the last total - tail (< 4) floats
  const int t = threadIdx.x;
  const float4* src4 = reinterpret_cast<const float4*>(src + head);
  float4 vec[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if (t + k * 256 < body) vec[k] = __ldcg(src4 + t + k * 256);
  }
  // Threads 0 to head - 1 take the head, the next total - tail ones the tail.
  const int edge = t < head ? t : tail + (t - head);
  const bool has_edge = t < head + (total - tail);
  const float edge_value = has_edge ? __ldcg(src + edge) : 0.0f;
  float4* dst4 = reinterpret_cast<float4*>(staged + head);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if (t + k * 256 < body) dst4[t + k * 256] = vec[k];
  }
  if (has_edge) staged[edge] = edge_value;
  return shift;
}

// Selects rows [row_begin, row_begin + rows) of span `s` (n = NextPow2(V); `warps_per_row` and
// `vectors_per_warp` from ChooseTopk) from raw scores in global memory, written by other CTAs (read
// through L2, or staged in shared memory first), writing their block ids. `lists` is shared
// memory of kRegisterTopKSmemBytes. Called by every thread of the CTA (256 threads).
__device__ __forceinline__ void SelectRowsInRegisters(const SpanDesc& s, const float* scores, int row_begin,
                                                      int rows, int warps_per_row, int vectors_per_warp,
                                                      uint64_t* lists, unsigned long long* stamps) {
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int r = warp / warps_per_row;
  const int warp_in_row = warp - r * warps_per_row;
  const bool active = r < rows;
  const int row = row_begin + min(r, rows - 1);
  const int64_t row_visible = (s.start_pos + row / s.num_heads) / kBlockSize + 1;
  // A pass of several may follow another (the decode selector's passes of rows_per_pass rows)
  // whose warps still read the shared memory this one writes.
  __syncthreads();
  // Rows of 16 vectors per warp are staged in shared memory first (StageScores says why).
  float* staged = reinterpret_cast<float*>(lists + kRegisterTopKSmemKeys);
  int shift = 0;
  if (vectors_per_warp == kRegisterVectors) {
    shift = StageScores(s, scores, row_begin, rows, staged);
    __syncthreads();
    Stamp(stamps, kTimelineLoaded);
  }
  uint64_t top = 0;
  if (active) {
    uint64_t* buffer = lists + 8 * 16 + warp * 32 * kRegisterVectors;
    const int64_t offset = int64_t{row - row_begin} * s.visible_blocks;
    // Two pointers, not one that may be either: the staged reads stay shared-memory loads.
    const float* global_row = scores + s.score_offset + int64_t{row_begin} * s.visible_blocks + offset;
    const float* staged_row = staged + shift + offset;
    switch (vectors_per_warp) {
      case 1: top = WarpRowTop<1, false>(s, global_row, row_visible, warps_per_row, warp_in_row, buffer); break;
      case 2: top = WarpRowTop<2, false>(s, global_row, row_visible, warps_per_row, warp_in_row, buffer); break;
      case 4: top = WarpRowTop<4, false>(s, global_row, row_visible, warps_per_row, warp_in_row, buffer); break;
      case 8: top = WarpRowTop<8, false>(s, global_row, row_visible, warps_per_row, warp_in_row, buffer); break;
      default: top = WarpRowTop<16, true>(s, staged_row, row_visible, warps_per_row, warp_in_row, buffer); break;
    }
  }
  Stamp(stamps, kTimelineThreshold);
  if (warps_per_row > 1) {
    if (active && lane < 16) lists[warp * 16 + lane] = top;
    __syncthreads();
    if (active && warp_in_row == 0) {
      const uint64_t* row_lists = lists + warp * 16;
      switch (warps_per_row) {
        case 2: top = MergeWarpLists<1>(row_lists); break;
        case 4: top = MergeWarpLists<2>(row_lists); break;
        default: top = MergeWarpLists<4>(row_lists); break;
      }
    }
  }
  Stamp(stamps, kTimelineSelected);
  // Lanes 0 to 15 hold the row's 16 largest keys in order; past its row_visible real keys, -1.
  const int topk = s.topk;
  if (active && warp_in_row == 0 && lane < topk) {
    s.block_ids[int64_t{row} * topk + lane] = lane < row_visible ? SelectionKeyBlock(top) : -1;
  }
}

}  // namespace indexer::kernels::cuda
