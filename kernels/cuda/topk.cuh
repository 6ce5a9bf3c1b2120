// Top-k of raw block scores, shared by the decode selector (its last CTA per span) and the
// prefill top-k kernel: SPEC.md steps 3-4 and the sparse page table, for a group of rows.
#pragma once

#include <cstdint>

#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/register_topk.cuh"
#include "kernels/cuda/span_desc.h"

namespace indexer::kernels::cuda {

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

// One warp selects the top kk (<= 32) of the n keys at `row` (shared memory), into out[0, kk)
// (shared memory, kWarpCandidates keys) in descending order. A threshold first: the kk-th
// largest of the 32 lanes' maxima is at most the row's kk-th largest key, so every key of the
// top kk is at or above it, and usually few others are. Returns false (out unspecified) when
// more than kWarpCandidates keys pass the threshold; the caller then sorts the whole row.
__device__ __forceinline__ bool WarpTopK(const uint64_t* row, int n, int kk, uint64_t* out,
                                         unsigned long long* stamps = nullptr) {
  const int lane = threadIdx.x & 31;
  uint64_t mx = 0;
#pragma unroll 4
  for (int i = lane; i < n; i += 32) mx = max(mx, row[i]);
  // The kk-th largest lane maximum: the lane whose maximum ranks kk - 1.
  const unsigned at = __ballot_sync(0xffffffffu, WarpRankDesc(mx) == kk - 1);
  const uint64_t threshold = __shfl_sync(0xffffffffu, mx, __ffs(at) - 1);
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
    // Up to two candidates per lane, placed by rank (the top kk only: the rest is unused).
    const uint64_t c0 = lane < total ? out[lane] : 0;
    const uint64_t c1 = lane + 32 < total ? out[lane + 32] : 0;
    int r0 = 0, r1 = 0;
    for (int j = 0; j < total; ++j) {
      const uint64_t y = out[j];
      r0 += (y > c0 || (y == c0 && j < lane)) ? 1 : 0;
      r1 += (y > c1 || (y == c1 && j < lane + 32)) ? 1 : 0;
    }
    __syncwarp();
    if (lane < total && r0 < kk) out[r0] = c0;
    if (lane + 32 < total && r1 < kk) out[r1] = c1;
    __syncwarp();
    return true;
  }
  const int padded = NextPow2(total);
  for (int i = total + lane; i < padded; i += 32) out[i] = 0;
  __syncwarp();
  WarpSortDesc(out, padded);
  return true;
}

// Copies spans[span] into `out` (shared memory, sizeof(SpanDesc) bytes, 16-byte aligned), one
// word per lane in one round trip. Called by all 32 lanes of one warp; visible to the CTA after
// a barrier. The top-k reads many fields one after another, some only after a decision on
// others; from global memory each was an L2 round trip (the SASS showed the decode selector's
// fence invalidating L1 first, CCTL.IVALL), 0.3 to 0.4 µs of the last CTA's time on the H200.
__device__ __forceinline__ const SpanDesc& CopySpanDesc(const SpanDesc* spans, int span, unsigned char* out) {
  static_assert(sizeof(SpanDesc) % 4 == 0 && sizeof(SpanDesc) / 4 <= 32, "one word per lane");
  const int lane = threadIdx.x & 31;
  if (lane < static_cast<int>(sizeof(SpanDesc) / 4)) {
    reinterpret_cast<int32_t*>(out)[lane] = reinterpret_cast<const int32_t*>(spans + span)[lane];
  }
  return *reinterpret_cast<const SpanDesc*>(out);
}

// Rows [row_begin, row_begin + rows) of span `s` are selected in passes; both passes below leave
// the rows' keys in shared memory at keys[(r << log2(n)) + b] (0 past the row's visible blocks, which
// sorts last) and the candidate scratch after them, kTopkWarps * kWarpCandidates keys.

// Each warp selects its rows of the pass from the shared keys, writing their block ids; rows
// with `counts` set and counts[r] <= cap were selected already and are left alone. Rows whose
// top-k a warp cannot find alone are sorted whole by the CTA afterwards. Called by every thread.
__device__ __forceinline__ void SelectFromSharedKeys(const SpanDesc& s, int row_begin, int rows, int n,
                                                     uint64_t* keys, const int* counts, int cap,
                                                     unsigned long long* stamps = nullptr) {
  const int log_n = __ffs(n) - 1;
  const int count = rows << log_n;
  const int topk = s.topk;
  const int kk = min(n, NextPow2(topk));
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
    const int64_t v = pos / kBlockSize + 1;
    const uint64_t* sorted = nullptr;
    if (n <= 32) {
      // The whole row fits a warp: each lane writes its key's id at the key's rank.
      const uint64_t x = lane < n ? keys[(r << log_n) + lane] : 0;
      const int rank = WarpRankDesc(x);
      if (rank < topk) s.block_ids[int64_t{row} * topk + rank] = rank < v && rank < kk ? SelectionKeyBlock(x) : -1;
      for (int j = 32 + lane; j < topk; j += 32) s.block_ids[int64_t{row} * topk + j] = -1;
    } else if (n == 64 && kk <= 32) {
      // Two keys per lane, sorted in registers (a shared-memory sort of the row took four times
      // the instructions: the prefill top-k of 32768 rows of 64 blocks was issue-bound).
      const uint64_t x = WarpTop32Of64(keys[(r << log_n) + lane], keys[(r << log_n) + 32 + lane]);
      if (lane < topk) s.block_ids[int64_t{row} * topk + lane] = lane < v && lane < kk ? SelectionKeyBlock(x) : -1;
    } else if (n <= 64 || (n <= kWarpCandidates && kk > 32)) {
      // Short rows: sort a copy of the whole row within the warp.
      for (int i = lane; i < max(n, 2); i += 32) candidates[i] = i < n ? keys[(r << log_n) + i] : 0;
      __syncwarp();
      WarpSortDesc(candidates, max(n, 2));
      sorted = candidates;
    } else if (kk <= 32 && WarpTopK(keys + (r << log_n), n, kk, candidates, stamps)) {
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
    // Some rows need the CTA-wide reduction: run it on every row of the pass (rare; the rows
    // selected already get the same ids again).
    TopKSegmentsDesc(keys, count, n, kk);
    for (int idx = threadIdx.x; idx < rows * topk; idx += blockDim.x) {
      const int r = idx / topk;
      const int j = idx - r * topk;
      const int row = row_begin + r;
      const int64_t v = (s.start_pos + row / s.num_heads) / kBlockSize + 1;
      s.block_ids[int64_t{row} * topk + j] = (j < v && j < kk) ? SelectionKeyBlock(keys[(r << log_n) + j]) : -1;
    }
  }
}

// LoadKeysShared's loads in batches of kBatch keys per thread, every load of a batch issued
// before any is used (one at a time, the H200 timeline showed an L2 round trip per key: 7.7 µs for
// four rows of 1024 blocks). Past the pass's keys a thread re-reads its last key.
template <int kBatch>
__device__ __forceinline__ void LoadKeyBatches(const SpanDesc& s, const float* scores, int row_begin, int log_n,
                                               int count, uint64_t* keys) {
  // The span's fields in registers; the row's visible blocks computed once per key, with a
  // multiply for the division by the head count (the division dominated the pass's time).
  const uint64_t start_pos = static_cast<uint64_t>(s.start_pos);
  const RowDivider per_head(s.num_heads);
  const int64_t score_offset = s.score_offset;
  const int64_t visible = s.visible_blocks;
  const int init_blocks = s.init_blocks;
  const int local_blocks = s.local_blocks;
  const int b_mask = (1 << log_n) - 1;
  for (int base = threadIdx.x; base < count; base += kBatch * blockDim.x) {
    float raw[kBatch];
    int32_t row_v[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int idx = min(base + u * static_cast<int>(blockDim.x), count - 1);
      const int row = row_begin + (idx >> log_n);
      const int b = idx & b_mask;
      const int32_t v = static_cast<int32_t>((start_pos + static_cast<uint64_t>(per_head(row))) / kBlockSize) + 1;
      row_v[u] = v;
      // Branch-free, from a valid address either way (the span's first score).
      raw[u] = __ldcg(scores + (b < v ? score_offset + int64_t{row} * visible + b : score_offset));
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int idx = base + u * static_cast<int>(blockDim.x);
      if (idx < count) {
        const int b = idx & b_mask;
        // 0 is below every real key: padding sorts last.
        keys[idx] = b < row_v[u] ? SelectionKey(ForcedScore(raw[u], b, row_v[u], init_blocks, local_blocks), b) : 0;
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
  // Batches no longer than the pass: a thread's index arithmetic for keys past the pass was most
  // of the time of short passes.
  const int threads = static_cast<int>(blockDim.x);
  if (count <= threads) {
    LoadKeyBatches<1>(s, scores, row_begin, log_n, count, keys);
  } else if (count <= 4 * threads) {
    LoadKeyBatches<4>(s, scores, row_begin, log_n, count, keys);
  } else {
    LoadKeyBatches<16>(s, scores, row_begin, log_n, count, keys);
  }
}

// Keys one thread of the threshold pass holds at most.
inline constexpr int kThresholdKeys = 16;

// Threshold pass: rows of `tpr` threads each (32 or 64: one or two warps), every thread loading
// n / tpr <= kThresholdKeys keys of its row. The kk-th largest of the row's thread maxima (kk =
// min(n, NextPow2(topk)) <= 32) is at most the row's kk-th largest key, so every key of the top
// kk is at or above it: the threads append those keys to the row's candidate list together (a
// few dozen for random scores), and one warp per row orders that list (by rank up to 32 keys).
// A row whose list overflows `cap` is left to SelectFromSharedKeys; `s_count` (shared,
// kThresholdRowsPerPass) receives each row's candidate count.
inline constexpr int kThresholdRowsPerPass = 8;

__device__ __forceinline__ void SelectRowsThreshold(const SpanDesc& s, const float* scores, int row_begin,
                                                    int rows, int n, int tpr, uint64_t* keys, int* s_count,
                                                    int cap, unsigned long long* stamps) {
  __shared__ uint64_t s_threshold[kThresholdRowsPerPass];
  __shared__ uint64_t s_upper[kThresholdRowsPerPass][16];  // the second warp's 16 largest maxima
  __syncthreads();  // callers may still be reading the shared memory `keys` reuses
  const int log_n = __ffs(n) - 1;
  const int count = rows << log_n;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int kk = min(n, NextPow2(s.topk));
  const int log_tpr = __ffs(tpr) - 1;
  const int r = threadIdx.x >> log_tpr;
  const bool active = r < rows;
  const int per_thread = active ? n >> log_tpr : 0;
  const int first = (r << log_n) + (threadIdx.x & (tpr - 1));
  uint64_t* lists = keys + count;  // cap keys per row
  if (threadIdx.x < kThresholdRowsPerPass) {
    s_threshold[threadIdx.x] = 0;
    s_count[threadIdx.x] = 0;
  }
  uint64_t mx = 0;
  {
    // Thread c of a row holds blocks c, c + tpr, ...: a warp's loads are contiguous. Every
    // load is issued, branch-free from a valid address, before any is used.
    const int row = row_begin + min(r, rows - 1);
    const int64_t v = (s.start_pos + row / s.num_heads) / kBlockSize + 1;
    const int64_t score_offset = s.score_offset;
    const float* row_scores = scores + score_offset + int64_t{row} * s.visible_blocks;
    const int init_blocks = s.init_blocks;
    const int local_blocks = s.local_blocks;
    const int c = threadIdx.x & (tpr - 1);
    float raw[kThresholdKeys];
    const int visible = s.visible_blocks;
#pragma unroll
    for (int i = 0; i < kThresholdKeys; ++i) {
      // Bounded by the span's visible blocks, not the row's (v, after a division): the loads
      // need not wait for it; scores past v are read and ignored.
      const int b = c + (i << log_tpr);
      raw[i] = __ldcg(i < per_thread && b < visible ? row_scores + b : scores + score_offset);
    }
#pragma unroll
    for (int i = 0; i < kThresholdKeys; ++i) {
      const int b = c + (i << log_tpr);
      if (i < per_thread) {
        const uint64_t key = b < v ? SelectionKey(ForcedScore(raw[i], b, v, init_blocks, local_blocks), b) : 0;
        keys[first + (i << log_tpr)] = key;
        mx = max(mx, key);
      }
    }
  }
  Stamp(stamps, kTimelineLoaded);
  // The threshold: the kk-th largest of the row's thread maxima (0 when fewer than kk threads
  // hold a real key, which lets every real key through).
  const uint64_t sorted = WarpSortLanesDesc(mx);
  uint64_t threshold = __shfl_sync(0xffffffffu, sorted, kk - 1);
  if (tpr == 64 && (warp & 1) && active && lane < 16) s_upper[r][lane] = sorted;
  __syncthreads();  // the counters, thresholds and upper halves are visible
  if (tpr == 64) {
    if (kk <= 16) {
      // The first warp merges the second's 16 largest (reversed: a bitonic sequence) into its own.
      if ((warp & 1) == 0 && active) {
        uint64_t y = lane < 16 ? sorted : s_upper[r][31 - lane];
        for (int j = 16; j > 0; j >>= 1) {
          const uint64_t other = __shfl_xor_sync(0xffffffffu, y, j);
          y = (lane & j) == 0 ? max(y, other) : min(y, other);
        }
        const uint64_t t = __shfl_sync(0xffffffffu, y, kk - 1);
        if (lane == 0) s_threshold[r] = t;
      }
    } else if (active && lane == 0) {
      // Each warp's kk-th largest is a lower bound too.
      atomicMax(reinterpret_cast<unsigned long long*>(&s_threshold[r]), threshold);
    }
    __syncthreads();
    threshold = s_threshold[min(r, kThresholdRowsPerPass - 1)];
  }
  Stamp(stamps, kTimelineThreshold);
  // The thread's keys at or above the threshold join its row's list.
  int mine = 0;
  for (int i = 0; i < per_thread; ++i) {
    const uint64_t key = keys[first + (i << log_tpr)];
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
      const uint64_t key = keys[first + (i << log_tpr)];
      if (key != 0 && key >= threshold) {
        if (slot < cap) lists[r * cap + slot] = key;
        ++slot;
      }
    }
  }
  __syncthreads();
  const int topk = s.topk;
  const int warps = blockDim.x >> 5;
  for (int rr = warp; rr < rows; rr += warps) {
    const int total = s_count[rr];
    if (total > cap) continue;
    uint64_t* list = lists + rr * cap;
    const int out_row = row_begin + rr;
    const int64_t out_v = (s.start_pos + out_row / s.num_heads) / kBlockSize + 1;
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
      s.block_ids[int64_t{out_row} * topk + at] = at < out_v && at < kk ? SelectionKeyBlock(x) : -1;
    }
  }
  Stamp(stamps, kTimelineSelected);
}

// Writes the sparse page tables of rows [row_begin, row_begin + rows) from their block ids
// (written by this CTA). Called by every thread.
__device__ __forceinline__ void WritePageTables(const SpanDesc& s, int row_begin, int rows, PageTableParams pt) {
  if (s.attn_pages == nullptr) return;
  __syncthreads();  // the ids just written are read back by other warps of this CTA
  const int warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  const int topk = s.topk;
  const int row_len = topk * pt.pages_per_block;
  for (int r = warp; r < rows; r += warps) {
    const int row = row_begin + r;
    const int64_t pos = s.start_pos + row / s.num_heads;
    WritePageTableRow(s.block_ids + int64_t{row} * topk, topk, pos, s.attn_pages, pt,
                      s.page_table + int64_t{row} * row_len, s.context_lens + row);
  }
}

// Rows [row_begin, row_begin + rows) of a span whose rows see at most 64 blocks, topk <= 32: one
// warp per row, its keys straight from global memory into registers (two per lane), ordered by
// WarpTop32Of64; no shared memory and no barrier. Called by every thread (any block size).
__device__ __forceinline__ void SelectShortRows(const SpanDesc& s, const float* scores, int row_begin, int rows) {
  const int lane = threadIdx.x & 31;
  const int warps = blockDim.x >> 5;
  const int topk = s.topk;
  const int init_blocks = s.init_blocks;
  const int local_blocks = s.local_blocks;
  const RowDivider per_head(s.num_heads);
  for (int r = threadIdx.x >> 5; r < rows; r += warps) {
    const int row = row_begin + r;
    const int v = static_cast<int>((s.start_pos + per_head(row)) / kBlockSize) + 1;
    const float* row_scores = scores + s.score_offset + int64_t{row} * s.visible_blocks;
    // Branch-free, from valid addresses (the row's last block) either way.
    const float x0 = __ldcg(row_scores + min(lane, v - 1));
    const float x1 = __ldcg(row_scores + min(lane + 32, v - 1));
    const uint64_t k0 = lane < v ? SelectionKey(ForcedScore(x0, lane, v, init_blocks, local_blocks), lane) : 0;
    const uint64_t k1 =
        lane + 32 < v ? SelectionKey(ForcedScore(x1, lane + 32, v, init_blocks, local_blocks), lane + 32) : 0;
    const uint64_t x = WarpTop32Of64(k0, k1);
    if (lane < topk) s.block_ids[int64_t{row} * topk + lane] = lane < v ? SelectionKeyBlock(x) : -1;
  }
}

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
  // The threshold pass where it pays (the H200 timeline): several rows of 512 or 1024 blocks
  // (shorter rows and single rows select as fast from shared memory), topk <= 32; two warps per
  // row for up to four rows, else one. Otherwise one pass of every row through shared memory.
  __shared__ int s_count[kThresholdRowsPerPass];
  const int tpr = (rows <= 4 || n > 32 * kThresholdKeys) ? 64 : 32;
  const bool threshold = kThreshold && rows >= 2 && n >= 512 && n <= 64 * kThresholdKeys &&
                         s.topk <= 32 && static_cast<int>(blockDim.x) == kTopkWarps * 32;
  const int pass_rows = threshold ? static_cast<int>(blockDim.x) / tpr : rows;
  // Candidate lists after a pass's keys: this many per row (a power of two).
  const int cap = min(kWarpCandidates, (kTopkWarps * kWarpCandidates) / NextPow2(pass_rows));
  for (int r0 = 0; r0 < rows; r0 += pass_rows) {
    const int n_rows = min(pass_rows, rows - r0);
    if (threshold) {
      SelectRowsThreshold(s, scores, row_begin + r0, n_rows, n, tpr, keys, s_count, cap, stamps);
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
