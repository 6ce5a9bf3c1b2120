// Top-k of raw block scores, shared by the decode selector (its last CTA per span) and the
// prefill top-k kernel: SPEC.md steps 3-4 and the sparse page table, for a group of rows.
#pragma once

#include <cstdint>

#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/span_desc.h"

namespace indexer::kernels::cuda {

// The lower index of compare-exchange pair i at distance j (a power of two) in a bitonic pass:
// 2j (i / j) + i % j, without the division.
__device__ __forceinline__ int PairLow(int i, int j) { return ((i & ~(j - 1)) << 1) | (i & (j - 1)); }

// Sorts one key per lane across the warp in registers, descending by lane (lane 0 holds the
// largest). Called by all 32 lanes.
__device__ __forceinline__ uint64_t WarpSortLanesDesc(uint64_t x) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int k = 2; k <= 32; k <<= 1) {
#pragma unroll
    for (int j = k >> 1; j > 0; j >>= 1) {
      const uint64_t other = __shfl_xor_sync(0xffffffffu, x, j);
      // Runs of k alternate direction so that pairs of runs form bitonic sequences; the last
      // stage (k == 32) sorts the whole warp descending.
      const bool lower = (lane & j) == 0;
      const bool descending = (lane & k) == 0 || k == 32;
      x = lower == descending ? max(x, other) : min(x, other);
    }
  }
  return x;
}

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

// Leaves, at the start of every segment of n keys (n a power of two), that segment's `kk`
// largest keys in descending order (kk a power of two <= n); the rest of each segment is
// scratch. Runs of kk are sorted, then pairs of runs are merged keeping the top kk (the
// elementwise max of one run and the other reversed is a bitonic sequence holding the top kk),
// halving the runs each round. Called by every thread of the CTA.
__device__ __forceinline__ void TopKSegmentsDesc(uint64_t* keys, int count, int n, int kk) {
  BitonicSortRunsDesc(keys, count, kk);
  const int log_kk = __ffs(kk) - 1;
  for (int stride = kk; stride < n; stride <<= 1) {
    // Runs start every 2*stride keys; merge the run at +stride into it.
    const int pairs = count / (2 * stride);
    for (int i = threadIdx.x; i < pairs * kk; i += blockDim.x) {
      const int p = i >> log_kk;
      const int j = i & (kk - 1);
      uint64_t* a = keys + p * 2 * stride;
      const uint64_t x = a[j];
      const uint64_t y = a[stride + kk - 1 - j];
      a[j] = x > y ? x : y;
    }
    __syncthreads();
    for (int h = kk >> 1; h > 0; h >>= 1) {
      for (int i = threadIdx.x; i < pairs * (kk >> 1); i += blockDim.x) {
        const int p = i >> (log_kk - 1);
        const int q = i & ((kk >> 1) - 1);
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

// Writes one row's sparse page table (SPEC.md) from its selection `ids`.
// Called by all 32 lanes of one warp.
__device__ __forceinline__ void WritePageTableRow(const int32_t* ids, int topk, int64_t pos,
                                                  const int32_t* attn_pages, PageTableParams pt,
                                                  int32_t* row, int32_t* context_len) {
  const int lane = threadIdx.x & 31;
  const int64_t self_block = pos / kBlockSize;
  int n_full = 0;
  bool has_tail = false;
  for (int base = 0; base < topk; base += 32) {
    const int j = base + lane;
    const int32_t b = j < topk ? ids[j] : -1;
    const bool full = b >= 0 && b < self_block;
    const unsigned mask = __ballot_sync(0xffffffffu, full);
    has_tail = has_tail || __any_sync(0xffffffffu, b == self_block);
    if (full) {
      const int slot = n_full + __popc(mask & ((1u << lane) - 1u));
      const int32_t page0 = attn_pages[b] * pt.block_page_stride;
      for (int p = 0; p < pt.pages_per_block; ++p) row[slot * pt.pages_per_block + p] = page0 + p;
    }
    n_full += __popc(mask);
  }
  int filled = n_full;
  if (has_tail) {
    const int32_t page0 = attn_pages[self_block] * pt.block_page_stride;
    for (int p = lane; p < pt.pages_per_block; p += 32) row[n_full * pt.pages_per_block + p] = page0 + p;
    filled = n_full + 1;
  }
  for (int e = filled * pt.pages_per_block + lane; e < topk * pt.pages_per_block; e += 32) row[e] = 0;
  if (lane == 0) {
    const int64_t len = has_tail ? int64_t{n_full} * kBlockSize + (pos + 1 - self_block * kBlockSize)
                                 : min(int64_t{filled} * kBlockSize, pos + 1);
    *context_len = static_cast<int32_t>(len);
  }
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

// One warp selects the top kk (<= 32) of the n keys at `row` (shared memory), into `out`
// (shared memory, kWarpCandidates keys) in descending order. A threshold first: the kk-th
// largest of the 32 lanes' maxima is at most the row's kk-th largest key, so every key of the
// top kk is at or above it, and usually few others are. Returns false (out unspecified) when
// more than kWarpCandidates keys pass the threshold; the caller then sorts the whole row.
__device__ __forceinline__ bool WarpTopK(const uint64_t* row, int n, int kk, uint64_t* out) {
  const int lane = threadIdx.x & 31;
  uint64_t mx = 0;
  for (int i = lane; i < n; i += 32) mx = max(mx, row[i]);
  mx = WarpSortLanesDesc(mx);
  const uint64_t threshold = __shfl_sync(0xffffffffu, mx, kk - 1);
  int total = 0;
  for (int base = 0; base < n; base += 32) {
    const int i = base + lane;
    const bool pass = i < n && row[i] >= threshold;
    const unsigned mask = __ballot_sync(0xffffffffu, pass);
    const int slot = total + __popc(mask & ((1u << lane) - 1u));
    if (pass && slot < kWarpCandidates) out[slot] = row[i];
    total += __popc(mask);
  }
  if (total > kWarpCandidates) return false;
  __syncwarp();
  if (total <= 32) {
    // One candidate per lane: sorted in registers (the shared-memory sort below costs a
    // few microseconds of dependent passes).
    const uint64_t x = WarpSortLanesDesc(lane < total ? out[lane] : 0);
    out[lane] = x;
    __syncwarp();
    return true;
  }
  const int padded = max(NextPow2(total), 2);
  for (int i = total + lane; i < padded; i += 32) out[i] = 0;
  __syncwarp();
  WarpSortDesc(out, padded);
  return true;
}

// Selects rows [row_begin, row_begin + rows) of span `s` from raw scores in global memory
// (written by other CTAs: read through L2). `keys` is shared memory for rows * n keys, with
// n = NextPow2(s.visible_blocks), followed by kWarpCandidates keys per warp. Called by every
// thread of the CTA.
__device__ __forceinline__ void SelectRows(const SpanDesc& s, const float* scores, int row_begin,
                                           int rows, int n, uint64_t* keys, PageTableParams pt) {
  __syncthreads();  // callers may still be reading the shared memory `keys` reuses
  const int log_n = __ffs(n) - 1;
  const int count = rows << log_n;
  {
    // The span's fields in registers, and the score loads of a thread issued together, sixteen
    // at a time: one at a time (the H200 timeline showed it) they cost an L2 round trip per key,
    // 7.7 µs for four rows of 1024 blocks.
    const int64_t start_pos = s.start_pos;
    const int num_heads = s.num_heads;
    const int64_t score_offset = s.score_offset;
    const int64_t visible = s.visible_blocks;
    const int init_blocks = s.init_blocks;
    const int local_blocks = s.local_blocks;
    constexpr int kBatch = 16;
    const auto where = [&](int idx, int& b, int64_t& v) {
      const int row = row_begin + (idx >> log_n);
      b = idx & (n - 1);
      v = (start_pos + row / num_heads) / kBlockSize + 1;
      return score_offset + int64_t{row} * visible + b;
    };
    for (int base = threadIdx.x; base < count; base += kBatch * blockDim.x) {
      float raw[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        // Branch-free, from a valid address either way (the span's first score), so that the
        // loads are in flight together.
        const int idx = base + u * blockDim.x;
        int b = 0;
        int64_t v = 0;
        const int64_t at = where(min(idx, count - 1), b, v);
        raw[u] = __ldcg(scores + (idx < count && b < v ? at : score_offset));
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int idx = base + u * blockDim.x;
        if (idx >= count) break;
        int b = 0;
        int64_t v = 0;
        (void)where(idx, b, v);
        // 0 is below every real key: padding sorts last.
        keys[idx] = b < v ? SelectionKey(ForcedScore(raw[u], b, v, init_blocks, local_blocks), b) : 0;
      }
    }
  }
  __syncthreads();
  const int topk = s.topk;
  const int kk = min(n, NextPow2(topk));
  const int warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  const int lane = threadIdx.x & 31;
  uint64_t* candidates = keys + count + warp * kWarpCandidates;
  // Rows whose top-k the warps could not find alone are sorted whole, by the CTA, afterwards.
  __shared__ int s_need_full;
  if (threadIdx.x == 0) s_need_full = 0;
  __syncthreads();
  for (int r = warp; r < rows; r += warps) {
    const int row = row_begin + r;
    const int64_t pos = s.start_pos + row / s.num_heads;
    const int64_t v = pos / kBlockSize + 1;
    const uint64_t* sorted = nullptr;
    if (n <= 32) {
      // The whole row fits a warp: sort it in registers and write the ids directly.
      const uint64_t x = WarpSortLanesDesc(lane < n ? keys[(r << log_n) + lane] : 0);
      for (int j = lane; j < topk; j += 32) {
        s.block_ids[int64_t{row} * topk + j] = j < v && j < kk ? SelectionKeyBlock(x) : -1;
      }
    } else if (n <= 64 || (n <= kWarpCandidates && kk > 32)) {
      // Short rows: sort a copy of the whole row within the warp.
      for (int i = lane; i < max(n, 2); i += 32) candidates[i] = i < n ? keys[(r << log_n) + i] : 0;
      __syncwarp();
      WarpSortDesc(candidates, max(n, 2));
      sorted = candidates;
    } else if (kk <= 32 && WarpTopK(keys + (r << log_n), n, kk, candidates)) {
      sorted = candidates;
    } else if (lane == 0) {
      atomicOr(&s_need_full, 1);
    }
    if (sorted != nullptr) {
      for (int j = lane; j < topk; j += 32) {
        s.block_ids[int64_t{row} * topk + j] = j < v && j < kk ? SelectionKeyBlock(sorted[j]) : -1;
      }
    }
    __syncwarp();
  }
  __syncthreads();
  if (s_need_full) {
    // Some rows need the CTA-wide reduction: run it on every row of the pass (rare).
    TopKSegmentsDesc(keys, count, n, kk);
    for (int idx = threadIdx.x; idx < rows * topk; idx += blockDim.x) {
      const int r = idx / topk;
      const int j = idx - r * topk;
      const int row = row_begin + r;
      const int64_t v = (s.start_pos + row / s.num_heads) / kBlockSize + 1;
      s.block_ids[int64_t{row} * topk + j] = (j < v && j < kk) ? SelectionKeyBlock(keys[(r << log_n) + j]) : -1;
    }
  }
  if (s.attn_pages == nullptr) return;
  __syncthreads();  // the ids just written are read back by other warps of this CTA
  const int row_len = topk * pt.pages_per_block;
  for (int r = warp; r < rows; r += warps) {
    const int row = row_begin + r;
    const int64_t pos = s.start_pos + row / s.num_heads;
    WritePageTableRow(s.block_ids + int64_t{row} * topk, topk, pos, s.attn_pages, pt,
                      s.page_table + int64_t{row} * row_len, s.context_lens + row);
  }
}

}  // namespace indexer::kernels::cuda
