// Top-k strategy "bitonic whole-row sort": the CTA sorts every row of a pass in shared memory
// together. The fallback of the shared-keys strategy (shared_keys_topk.cuh) for rows that no warp
// can select alone: topk above 32 on rows longer than kWarpCandidates, or WarpTopK's candidates
// overflowing (many ties). Exact whatever the keys, at the price of every key through every stage.
#pragma once

#include <cstdint>

#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/span_desc.h"
#include "kernels/cuda/warp_sort.cuh"

namespace indexer::kernels::cuda {

// Sorts `count` keys in shared memory, as independent runs of `run` (a power of two) keys each,
// in descending order. Called by every thread of the CTA.
__device__ __forceinline__ void BitonicSortRunsDesc(uint64_t* keys, int count, int run) {
  for (int k = 2; k <= run; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < count / 2; i += blockDim.x) {
        const int lo = PairLow(i, j);
        const int hi = lo + j;
        const uint64_t a = keys[lo];
        const uint64_t b = keys[hi];
        // Within a run, positions with (lo & k) == 0 sort descending and the others ascending,
        // so that each pair of k-runs forms a bitonic sequence; the last pass (k == run) sorts
        // every run descending.
        const bool descending = k == run || (lo & k) == 0;
        if (descending ? a < b : a > b) {
          keys[lo] = b;
          keys[hi] = a;
        }
      }
      __syncthreads();
    }
  }
}

// Leaves, at the start of every segment of n keys (n a power of two), that segment's `kept`
// largest keys in descending order (kept a power of two <= n); the rest of each segment is
// scratch. Runs of `kept` are sorted, then pairs of runs are merged keeping the top `kept` (the
// elementwise max of one run and the other reversed is a bitonic sequence holding the top kept),
// halving the runs each round. Called by every thread of the CTA.
__device__ __forceinline__ void TopKSegmentsDesc(uint64_t* keys, int count, int n, int kept) {
  BitonicSortRunsDesc(keys, count, kept);
  const int log_kept = __ffs(kept) - 1;
  for (int stride = kept; stride < n; stride <<= 1) {
    // Runs start every 2*stride keys; merge the run at +stride into it.
    const int pairs = count / (2 * stride);
    for (int i = threadIdx.x; i < pairs * kept; i += blockDim.x) {
      const int p = i >> log_kept;
      const int j = i & (kept - 1);
      uint64_t* a = keys + p * 2 * stride;
      const uint64_t x = a[j];
      const uint64_t y = a[stride + kept - 1 - j];
      a[j] = x > y ? x : y;
    }
    __syncthreads();
    for (int h = kept >> 1; h > 0; h >>= 1) {
      for (int i = threadIdx.x; i < pairs * (kept >> 1); i += blockDim.x) {
        const int p = i >> (log_kept - 1);
        const int q = i & ((kept >> 1) - 1);
        const int lo = PairLow(q, h);
        uint64_t* a = keys + p * 2 * stride;
        const uint64_t x = a[lo];
        const uint64_t y = a[lo + h];
        if (x < y) {
          a[lo] = y;
          a[lo + h] = x;
        }
      }
      __syncthreads();
    }
  }
}

// Selects every one of rows [row_begin, row_begin + rows) of span `s` from their keys in shared
// memory (`keys`, at keys[(r << log2(n)) + b], 0 past a row's visible blocks), writing their block
// ids: the `kept` (min(n, NextPow2(topk))) largest of each row by TopKSegmentsDesc. `topk` is
// s.topk, as the caller read it. Called by every thread of the CTA.
__device__ __forceinline__ void SelectRowsBitonic(const SpanDesc& s, int row_begin, int rows, int n, int topk,
                                                  int kept, uint64_t* keys) {
  const int log_n = __ffs(n) - 1;
  const int count = rows << log_n;
  TopKSegmentsDesc(keys, count, n, kept);
  for (int idx = threadIdx.x; idx < rows * topk; idx += blockDim.x) {
    const int r = idx / topk;
    const int j = idx - r * topk;
    const int row = row_begin + r;
    const int64_t visible = (s.start_pos + row / s.num_heads) / kBlockSize + 1;
    s.block_ids[int64_t{row} * topk + j] = (j < visible && j < kept) ? SelectionKeyBlock(keys[(r << log_n) + j]) : -1;
  }
}

}  // namespace indexer::kernels::cuda
