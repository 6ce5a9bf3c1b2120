// Top-k strategy "threshold pass", for the decode selector's last CTA on several long rows (2 or
// more rows of 512 to 1024 visible blocks, topk <= 32; ChooseTopk in topk_plan.h): each row is
// held by one or two warps, every thread with up to 16 of its scores in registers, all loads in
// flight together. A bound from the threads' maxima lets only a few dozen keys per row through to
// a candidate list, which one warp orders; rows whose list overflows are left to the shared-keys
// strategy (shared_keys_topk.cuh), which reads the keys this pass also leaves in shared memory.
#pragma once

#include <cstdint>

#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/span_desc.h"
#include "kernels/cuda/topk_plan.h"
#include "kernels/cuda/warp_sort.cuh"

namespace indexer::kernels::cuda {

// Threshold pass: rows of `threads_per_row` threads each (32 or 64: one or two warps), every
// thread loading n / threads_per_row <= kThresholdKeys keys of its row. The kept-th largest of the
// row's thread maxima (kept = KeptKeys(n, topk) <= 32) is at most the row's kept-th largest
// key, so every key of the top `kept` is at or above it: the threads append those keys to the
// row's candidate list together (a few dozen for random scores), and one warp per row orders that
// list (by rank up to 32 keys). A row whose list overflows `cap` is left to SelectFromSharedKeys;
// `s_count` (shared, kThresholdRowsPerPass) receives each row's candidate count. Called by every
// thread of the CTA.
__device__ __forceinline__ void SelectRowsThreshold(const SpanDesc& s, const float* scores, int row_begin,
                                                    int rows, int n, int threads_per_row, uint64_t* keys, int* s_count,
                                                    int cap, unsigned long long* stamps) {
  __shared__ uint64_t s_threshold[kThresholdRowsPerPass];
  __shared__ uint64_t s_upper[kThresholdRowsPerPass][16];  // the second warp's 16 largest maxima
  __syncthreads();  // callers may still be reading the shared memory `keys` reuses
  const int log_n = __ffs(n) - 1;
  const int count = rows << log_n;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int kept = KeptKeys(n, s.topk);
  const int log_threads_per_row = __ffs(threads_per_row) - 1;
  const int r = threadIdx.x >> log_threads_per_row;
  const bool active = r < rows;
  const int per_thread = active ? n >> log_threads_per_row : 0;
  const int first = (r << log_n) + (threadIdx.x & (threads_per_row - 1));
  uint64_t* lists = keys + count;  // cap keys per row
  if (threadIdx.x < kThresholdRowsPerPass) {
    s_threshold[threadIdx.x] = 0;
    s_count[threadIdx.x] = 0;
  }
  uint64_t thread_max = 0;
  {
    // Thread c of a row holds blocks c, c + threads_per_row, ...: a warp's loads are contiguous.
    // Every load is issued, branch-free from a valid address, before any is used.
    const int row = row_begin + min(r, rows - 1);
    const int64_t row_visible = (s.start_pos + row / s.num_heads) / kBlockSize + 1;
    const int64_t score_offset = s.score_offset;
    const float* row_scores = scores + score_offset + int64_t{row} * s.visible_blocks;
    const int init_blocks = s.init_blocks;
    const int local_blocks = s.local_blocks;
    const int c = threadIdx.x & (threads_per_row - 1);
    float raw[kThresholdKeys];
    const int visible = s.visible_blocks;
#pragma unroll
    for (int i = 0; i < kThresholdKeys; ++i) {
      // Bounded by the span's visible blocks, not the row's (row_visible, after a division): the
      // loads need not wait for it; scores past row_visible are read and ignored.
      const int b = c + (i << log_threads_per_row);
      raw[i] = __ldcg(i < per_thread && b < visible ? row_scores + b : scores + score_offset);
    }
#pragma unroll
    for (int i = 0; i < kThresholdKeys; ++i) {
      const int b = c + (i << log_threads_per_row);
      if (i < per_thread) {
        const uint64_t key =
            b < row_visible ? SelectionKey(ForcedScore(raw[i], b, row_visible, init_blocks, local_blocks), b) : 0;
        keys[first + (i << log_threads_per_row)] = key;
        thread_max = max(thread_max, key);
      }
    }
  }
  Stamp(stamps, kTimelineLoaded);
  // The threshold: the kept-th largest of the row's thread maxima (0 when fewer than `kept`
  // threads hold a real key, which lets every real key through).
  const uint64_t sorted = WarpSortLanesDesc(thread_max);
  uint64_t threshold = __shfl_sync(0xffffffffu, sorted, kept - 1);
  if (threads_per_row == 64 && (warp & 1) && active && lane < 16) s_upper[r][lane] = sorted;
  __syncthreads();  // the counters, thresholds and upper halves are visible
  if (threads_per_row == 64) {
    if (kept <= 16) {
      // The first warp merges the second's 16 largest (reversed: a bitonic sequence) into its own.
      if ((warp & 1) == 0 && active) {
        uint64_t y = lane < 16 ? sorted : s_upper[r][31 - lane];
        for (int j = 16; j > 0; j >>= 1) {
          const uint64_t other = __shfl_xor_sync(0xffffffffu, y, j);
          y = (lane & j) == 0 ? max(y, other) : min(y, other);
        }
        const uint64_t t = __shfl_sync(0xffffffffu, y, kept - 1);
        if (lane == 0) s_threshold[r] = t;
      }
    } else if (active && lane == 0) {
      // Each warp's kept-th largest is a lower bound too.
      atomicMax(reinterpret_cast<unsigned long long*>(&s_threshold[r]), threshold);
    }
    __syncthreads();
    threshold = s_threshold[min(r, kThresholdRowsPerPass - 1)];
  }
  Stamp(stamps, kTimelineThreshold);
  // The thread's keys at or above the threshold join its row's list.
  int mine = 0;
  for (int i = 0; i < per_thread; ++i) {
    const uint64_t key = keys[first + (i << log_threads_per_row)];
    mine += (key != 0 && key >= threshold) ? 1 : 0;
  }
  // Slots by a prefix sum over the warp (all of whose lanes share a row) and one shared atomic
  // per warp, not one per thread on the row's counter.
  int before = mine;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int x = __shfl_up_sync(0xffffffffu, before, d);
    if (lane >= d) before += x;
  }
  int base = 0;
  if (lane == 31 && active && before > 0) base = atomicAdd(&s_count[r], before);
  base = __shfl_sync(0xffffffffu, base, 31);
  if (mine > 0) {
    int slot = base + before - mine;
    for (int i = 0; i < per_thread; ++i) {
      const uint64_t key = keys[first + (i << log_threads_per_row)];
      if (key != 0 && key >= threshold) {
        if (slot < cap) lists[r * cap + slot] = key;
        ++slot;
      }
    }
  }
  __syncthreads();
  const int topk = s.topk;
  const int warps = blockDim.x >> 5;
  for (int list_row = warp; list_row < rows; list_row += warps) {
    const int total = s_count[list_row];
    if (total > cap) continue;
    uint64_t* list = lists + list_row * cap;
    const int out_row = row_begin + list_row;
    const int64_t out_visible = (s.start_pos + out_row / s.num_heads) / kBlockSize + 1;
    uint64_t x;
    int at;  // the output position of x
    if (total <= 32) {
      x = lane < total ? list[lane] : 0;
      at = WarpRankDesc(x);
    } else {
      const int padded = NextPow2(total);
      for (int i = total + lane; i < padded; i += 32) list[i] = 0;
      __syncwarp();
      WarpSortDesc(list, padded);
      x = list[lane];
      at = lane;
    }
    if (at < topk) {
      s.block_ids[int64_t{out_row} * topk + at] = at < out_visible && at < kept ? SelectionKeyBlock(x) : -1;
    }
  }
  Stamp(stamps, kTimelineSelected);
}

}  // namespace indexer::kernels::cuda
