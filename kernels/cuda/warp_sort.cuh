// Sorting networks of one warp, shared by the top-k strategies: in registers (one key per lane,
// bitonic stages of shuffles; ranks by independent shuffles) and in shared memory (bitonic passes
// over a power-of-two run of keys). Keys are SelectionKey values: larger is better, 0 is padding.
#pragma once

#include <cstdint>

#include "kernels/cuda/device_common.cuh"

namespace indexer::kernels::cuda {

// One compare-exchange step across lanes at distance j: the lane keeps the larger key of its pair
// when `keep_max`, else the smaller. One 64-bit comparison and one select (a max and a min and a
// select of the two would be twice the instructions, and the register top-k is issue-bound).
// Called by all 32 lanes.
__device__ __forceinline__ uint64_t LaneExchange(uint64_t x, int j, bool keep_max) {
  const uint64_t other = __shfl_xor_sync(0xffffffffu, x, j);
  return (other > x) == keep_max ? other : x;
}

// Sorts one key per lane across the warp: descending by lane (lane 0 holds the largest) when
// `desc`, else ascending. Called by all 32 lanes.
__device__ __forceinline__ uint64_t WarpSortLanes(uint64_t x, bool desc) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int k = 2; k <= 32; k <<= 1) {
#pragma unroll
    for (int j = k >> 1; j > 0; j >>= 1) {
      // Runs of k alternate direction so that pairs of runs form bitonic sequences; the last
      // stage (k == 32) sorts the whole warp in the direction asked.
      const bool run_desc = k == 32 ? desc : (lane & k) == 0;
      x = LaneExchange(x, j, ((lane & j) == 0) == run_desc);
    }
  }
  return x;
}

// Sorts a bitonic sequence of one key per lane: descending by lane when `desc`. Called by all 32
// lanes.
__device__ __forceinline__ uint64_t WarpMergeLanes(uint64_t x, bool desc) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int j = 16; j > 0; j >>= 1) x = LaneExchange(x, j, ((lane & j) == 0) == desc);
  return x;
}

// Folds M sorted vectors (x[v] descending by lane for even v, ascending for odd v; M a power of
// two) into x[0]: the 32 largest keys of all, descending by lane. The elementwise maximum of a
// descending and an ascending vector is a bitonic sequence holding the larger half of the two, so
// each fold is one merge. Called by all 32 lanes.
template <int M>
__device__ __forceinline__ void WarpFoldVectors(uint64_t (&x)[M]) {
#pragma unroll
  for (int s = 1; s < M; s <<= 1) {
#pragma unroll
    for (int v = 0; v < M; v += 2 * s) x[v] = WarpMergeLanes(max(x[v], x[v + s]), ((v / (2 * s)) & 1) == 0);
  }
}

// The lower index of compare-exchange pair i at distance j (a power of two) in a bitonic pass:
// 2j (i / j) + i % j, without the division.
__device__ __forceinline__ int PairLow(int i, int j) { return ((i & ~(j - 1)) << 1) | (i & (j - 1)); }

// Sorts one key per lane across the warp in registers, descending by lane (lane 0 holds the
// largest). Called by all 32 lanes.
__device__ __forceinline__ uint64_t WarpSortLanesDesc(uint64_t x) { return WarpSortLanes(x, true); }

// The 32 largest of 64 keys, two per lane (any order), in registers: lane i returns the i-th
// largest. Each half is sorted across the warp (the second reversed), so that the larger key of
// each lane's pair forms a bitonic sequence holding the top 32; one more merge sorts it. Called by
// all 32 lanes.
__device__ __forceinline__ uint64_t WarpTop32Of64(uint64_t a, uint64_t b) {
  const int lane = threadIdx.x & 31;
  a = WarpSortLanesDesc(a);
  b = __shfl_sync(0xffffffffu, WarpSortLanesDesc(b), 31 - lane);  // ascending by lane
  uint64_t x = max(a, b);
#pragma unroll
  for (int j = 16; j > 0; j >>= 1) {
    const uint64_t other = __shfl_xor_sync(0xffffffffu, x, j);
    x = (lane & j) == 0 ? max(x, other) : min(x, other);
  }
  return x;
}

// The rank of the lane's key in the warp, descending (0: the largest), ties to the lower lane:
// the 32 ranks are a permutation of 0..31. Called by all 32 lanes. Independent shuffles, no
// chain of dependent exchange stages like WarpSortLanesDesc's: selecting by rank is the cheaper
// way to place a warp's keys in order.
__device__ __forceinline__ int WarpRankDesc(uint64_t x) {
  const int lane = threadIdx.x & 31;
  int rank = 0;
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    const uint64_t y = __shfl_sync(0xffffffffu, x, j);
    rank += (y > x || (y == x && j < lane)) ? 1 : 0;
  }
  return rank;
}

// Sorts n keys (a power of two, <= kWarpCandidates) in shared memory in descending order with
// one warp. Called by all 32 lanes.
__device__ __forceinline__ void WarpSortDesc(uint64_t* keys, int n) {
  const int lane = threadIdx.x & 31;
  for (int k = 2; k <= n; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = lane; i < n / 2; i += 32) {
        const int lo = PairLow(i, j);
        const uint64_t a = keys[lo];
        const uint64_t b = keys[lo + j];
        const bool descending = k == n || (lo & k) == 0;
        if (descending ? a < b : a > b) {
          keys[lo] = b;
          keys[lo + j] = a;
        }
      }
      __syncwarp();
    }
  }
}

}  // namespace indexer::kernels::cuda
