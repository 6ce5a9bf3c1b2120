// Top-k strategy "WarpTopK over shared keys": a pass's rows are loaded into shared memory as keys
// (LoadKeysShared, or the threshold pass for the rows it leaves), then each warp selects its rows
// from there: rows of up to 64 keys by ranks or sorts within the warp, longer ones by WarpTopK's
// threshold and candidate list. Rows no warp can select alone go to the bitonic whole-row sort
// (bitonic_topk.cuh). Any row count, length and topk: the strategy every other one falls back to.
//
// Layout: rows [row_begin, row_begin + rows) of span `s` keep their keys at
// keys[(r << log2(n)) + b] (0 past the row's visible blocks, which sorts last), n = NextPow2(V),
// and the candidate scratch after them, kTopkWarps * kWarpCandidates keys.
#pragma once

#include <cstdint>

#include "kernels/cuda/bitonic_topk.cuh"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/span_desc.h"
#include "kernels/cuda/topk_plan.h"
#include "kernels/cuda/warp_sort.cuh"

namespace indexer::kernels::cuda {

// LoadKeysShared's loads in batches of kBatch keys per thread, every load of a batch issued
// before any is used (issued one at a time, every key would wait a whole L2 round trip). Past the
// pass's keys a thread re-reads its last key.
template <int kBatch>
__device__ __forceinline__ void LoadKeyBatches(const SpanDesc& s, const float* scores, int row_begin, int log_n,
                                               int count, uint64_t* keys) {
  // The span's fields in registers; the row's visible blocks computed once per key, with a
  // multiply for the division by the head count (RowDivider).
  const uint64_t start_pos = static_cast<uint64_t>(s.start_pos);
  const RowDivider per_head(s.num_heads);
  const int64_t score_offset = s.score_offset;
  const int64_t visible = s.visible_blocks;
  const int init_blocks = s.init_blocks;
  const int local_blocks = s.local_blocks;
  const int b_mask = (1 << log_n) - 1;
  for (int base = threadIdx.x; base < count; base += kBatch * blockDim.x) {
    float raw[kBatch];
    int32_t row_visible[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int idx = min(base + u * static_cast<int>(blockDim.x), count - 1);
      const int row = row_begin + (idx >> log_n);
      const int b = idx & b_mask;
      const int32_t v = static_cast<int32_t>((start_pos + static_cast<uint64_t>(per_head(row))) / kBlockSize) + 1;
      row_visible[u] = v;
      // Branch-free, from a valid address either way (the span's first score).
      raw[u] = __ldcg(scores + (b < v ? score_offset + int64_t{row} * visible + b : score_offset));
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int idx = base + u * static_cast<int>(blockDim.x);
      if (idx < count) {
        const int b = idx & b_mask;
        // 0 is below every real key: padding sorts last.
        keys[idx] = b < row_visible[u]
                        ? SelectionKey(ForcedScore(raw[u], b, row_visible[u], init_blocks, local_blocks), b)
                        : 0;
      }
    }
  }
}

// Loads the keys of a pass of any row count and length into shared memory in index order, for
// SelectFromSharedKeys. Called by every thread.
__device__ __forceinline__ void LoadKeysShared(const SpanDesc& s, const float* scores, int row_begin,
                                               int rows, int n, uint64_t* keys) {
  __syncthreads();  // callers may still be reading the shared memory `keys` reuses
  const int log_n = __ffs(n) - 1;
  const int count = rows << log_n;
  // Batches no longer than the pass: a thread's index arithmetic for keys past the pass would be
  // most of the time of short passes.
  const int threads = static_cast<int>(blockDim.x);
  if (count <= threads) {
    LoadKeyBatches<1>(s, scores, row_begin, log_n, count, keys);
  } else if (count <= 4 * threads) {
    LoadKeyBatches<4>(s, scores, row_begin, log_n, count, keys);
  } else {
    LoadKeyBatches<16>(s, scores, row_begin, log_n, count, keys);
  }
}

// One warp selects the top `kept` (<= 32) of the n keys at `row` (shared memory), into
// out[0, kept) (shared memory, kWarpCandidates keys) in descending order. A threshold first: the
// kept-th largest of the 32 lanes' maxima is at most the row's kept-th largest key, so every key
// of the top `kept` is at or above it, and usually few others are. Returns false (out unspecified)
// when more than kWarpCandidates keys pass the threshold; the caller then sorts the whole row.
__device__ __forceinline__ bool WarpTopK(const uint64_t* row, int n, int kept, uint64_t* out,
                                         unsigned long long* stamps = nullptr) {
  const int lane = threadIdx.x & 31;
  uint64_t lane_max = 0;
#pragma unroll 4
  for (int i = lane; i < n; i += 32) lane_max = max(lane_max, row[i]);
  // The kept-th largest lane maximum: the lane whose maximum ranks kept - 1.
  const unsigned at = __ballot_sync(0xffffffffu, WarpRankDesc(lane_max) == kept - 1);
  const uint64_t threshold = __shfl_sync(0xffffffffu, lane_max, __ffs(at) - 1);
  Stamp(stamps, kTimelineThreshold);
  int total = 0;
#pragma unroll 4
  for (int base = 0; base < n; base += 32) {
    const int i = base + lane;
    const uint64_t key = i < n ? row[i] : 0;
    const bool pass = i < n && key >= threshold;
    const unsigned mask = __ballot_sync(0xffffffffu, pass);
    const int slot = total + __popc(mask & ((1u << lane) - 1u));
    if (pass && slot < kWarpCandidates) out[slot] = key;
    total += __popc(mask);
  }
  Stamp(stamps, kTimelineSelected);
  if (total > kWarpCandidates) return false;
  __syncwarp();
  if (total <= 64) {
    // Up to two candidates per lane, placed by rank (the top `kept` only: the rest is unused).
    const uint64_t c0 = lane < total ? out[lane] : 0;
    const uint64_t c1 = lane + 32 < total ? out[lane + 32] : 0;
    int r0 = 0, r1 = 0;
    for (int j = 0; j < total; ++j) {
      const uint64_t y = out[j];
      r0 += (y > c0 || (y == c0 && j < lane)) ? 1 : 0;
      r1 += (y > c1 || (y == c1 && j < lane + 32)) ? 1 : 0;
    }
    __syncwarp();
    if (lane < total && r0 < kept) out[r0] = c0;
    if (lane + 32 < total && r1 < kept) out[r1] = c1;
    __syncwarp();
    return true;
  }
  const int padded = NextPow2(total);
  for (int i = total + lane; i < padded; i += 32) out[i] = 0;
  __syncwarp();
  WarpSortDesc(out, padded);
  return true;
}

// Each warp selects its rows of the pass from the shared keys by ChooseSharedRowMethod's method
// (topk_plan.h: ChooseTopk's row_method), writing their block ids; rows with `counts` set and
// counts[r] <= cap were selected already (by the threshold pass) and are left alone. Rows whose
// top-k a warp cannot find alone are sorted whole by the CTA afterwards. Called by every thread.
//
// The method is evaluated here, from the descriptor's topk, rather than passed in: nothing derived
// from topk then stays live across the key loads before it, whose batches fill the prefill top-k
// kernel's 64 registers.
__device__ __forceinline__ void SelectFromSharedKeys(const SpanDesc& s, int row_begin, int rows, int n,
                                                     uint64_t* keys, const int* counts, int cap,
                                                     unsigned long long* stamps = nullptr) {
  const int log_n = __ffs(n) - 1;
  const int count = rows << log_n;
  const int topk = s.topk;
  const int kept = KeptKeys(n, topk);
  const SharedRowMethod method = ChooseSharedRowMethod(n, kept);
  const int warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  const int lane = threadIdx.x & 31;
  uint64_t* candidates = keys + count + warp * kWarpCandidates;
  __shared__ int s_need_full;
  if (threadIdx.x == 0) s_need_full = 0;
  __syncthreads();
  for (int r = warp; r < rows; r += warps) {
    if (counts != nullptr && counts[r] <= cap) continue;
    const int row = row_begin + r;
    const int64_t pos = s.start_pos + row / s.num_heads;
    const int64_t visible = pos / kBlockSize + 1;
    const uint64_t* sorted = nullptr;
    if (method == SharedRowMethod::kRankInWarp) {
      // The whole row fits a warp: each lane writes its key's id at the key's rank.
      const uint64_t x = lane < n ? keys[(r << log_n) + lane] : 0;
      const int rank = WarpRankDesc(x);
      if (rank < topk) {
        s.block_ids[int64_t{row} * topk + rank] = rank < visible && rank < kept ? SelectionKeyBlock(x) : -1;
      }
      for (int j = 32 + lane; j < topk; j += 32) s.block_ids[int64_t{row} * topk + j] = -1;
    } else if (method == SharedRowMethod::kTwoKeysPerLane) {
      // Two keys per lane, sorted in registers (a shared-memory sort of the row takes four times
      // the instructions, and the prefill top-k's many rows of 64 blocks are issue-bound).
      const uint64_t x = WarpTop32Of64(keys[(r << log_n) + lane], keys[(r << log_n) + 32 + lane]);
      if (lane < topk) {
        s.block_ids[int64_t{row} * topk + lane] = lane < visible && lane < kept ? SelectionKeyBlock(x) : -1;
      }
    } else if (method == SharedRowMethod::kWarpSort) {
      // Short rows: sort a copy of the whole row within the warp.
      for (int i = lane; i < max(n, 2); i += 32) candidates[i] = i < n ? keys[(r << log_n) + i] : 0;
      __syncwarp();
      WarpSortDesc(candidates, max(n, 2));
      sorted = candidates;
    } else if (method == SharedRowMethod::kWarpTopK && WarpTopK(keys + (r << log_n), n, kept, candidates, stamps)) {
      sorted = candidates;
    } else if (lane == 0) {
      // kWholeRowSort, or WarpTopK's candidates overflowed.
      atomicOr(&s_need_full, 1);
    }
    if (sorted != nullptr) {
      for (int j = lane; j < topk; j += 32) {
        s.block_ids[int64_t{row} * topk + j] = j < visible && j < kept ? SelectionKeyBlock(sorted[j]) : -1;
      }
    }
    __syncwarp();
  }
  __syncthreads();
  // Some rows need the CTA-wide sort: run it on every row of the pass (rare; the rows selected
  // already get the same ids again).
  if (s_need_full) SelectRowsBitonic(s, row_begin, rows, n, topk, kept, keys);
}

}  // namespace indexer::kernels::cuda
