// Fused decode selector: block scores on tensor cores, and the top-k of each span by the last
// CTA that finishes one of its blocks. One launch per batch.
//
// Work: every span's visible blocks are cut into units of chunk_blocks blocks; one CTA (8 warps)
// per unit, so a long span spreads over the whole GPU next to short ones. Warp w scores tokens
// [16w, 16w + 16) of each block of its unit: those 16 key rows are the A operand of
// mma.m16n8k16, loaded straight from global memory into registers (16-byte loads, the next
// block's tile in flight while the current one is scored); the span's rows (token, head) are the
// B operand, 8 per n-tile, held in registers for the whole CTA. Per-warp block maxima meet in
// shared memory at the end of the unit.
//
// Lane t of a quad owns the 16-byte chunks t, t + 4, t + 8, ... of every key row, so the four
// lanes of a quad read 64 contiguous bytes and each 32-byte sector is fetched by one instruction
// (staging through shared memory with cp.async fetched every sector twice, and a bulk-copy
// pipeline streamed slower: docs/PERF.md). The dot product's dimensions are therefore permuted,
// identically for keys and queries, which SPEC.md allows: only the summation order changes.
// fp8 keys are converted to f16 (one exact instruction per pair) and that mma runs in f16 with
// the queries converted to f16 too, exact for the queries the backend sends here
// (|q| in [2^-14, 65504] or 0; others take the exact path).
#pragma once

#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/topk.cuh"

namespace indexer::kernels::cuda {

inline constexpr int kDecodeWarps = 8;  // = tiles of 16 tokens per 128-token block

struct DecodeParams {
  const SpanDesc* spans;
  int num_spans;
  float* scores;
  int* counters;
  PageTableParams pt;
  int smem_keys;  // top-k keys the dynamic shared memory holds
};

// The span whose units contain `unit`: the last span with unit_begin <= unit.
__device__ __forceinline__ int FindSpan(const SpanDesc* spans, int num_spans, int unit,
                                        bool by_topk_group) {
  int lo = 0, hi = num_spans - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    const int begin = by_topk_group ? spans[mid].topk_group_begin : spans[mid].unit_begin;
    if (begin <= unit) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

template <int D, KeyStorage S>
struct DecodeShape {
  static constexpr int kRowBytes = S == KeyStorage::kBf16 ? D * 2 : D;
  static constexpr int kLaneChunks = kRowBytes / 64;  // 16-byte chunks per lane per row
  static constexpr int kRegs = D / 8;
  // First dim of the pair in k-slots (2t + 8j, +1) of k-step ks.
  static __device__ __forceinline__ int PairDim(int t, int ks, int j) {
    if constexpr (S == KeyStorage::kBf16) {
      return 8 * (4 * (ks / 2) + t) + 4 * (ks % 2) + 2 * j;
    } else {
      return 16 * (4 * (ks / 4) + t) + 4 * (ks % 4) + 2 * j;
    }
  }
};

template <int D, KeyStorage S>
struct DecodeTile {
  using Shape = DecodeShape<D, S>;
  uint4 raw[2][Shape::kLaneChunks];
  __device__ __forceinline__ void Load(const char* row_g, int t) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int v = 0; v < Shape::kLaneChunks; ++v) {
        raw[h][v] = LoadStream16(row_g + h * 8 * Shape::kRowBytes + (4 * v + t) * 16);
      }
    }
  }
  __device__ __forceinline__ void Unpack(int h, uint32_t (&out)[Shape::kRegs]) const {
#pragma unroll
    for (int v = 0; v < Shape::kLaneChunks; ++v) {
      const uint32_t w[4] = {raw[h][v].x, raw[h][v].y, raw[h][v].z, raw[h][v].w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        if constexpr (S == KeyStorage::kBf16) {
          out[4 * v + k] = w[k];
        } else {
          out[8 * v + 2 * k] = Fp8x2ToF16x2(static_cast<uint16_t>(w[k] & 0xffffu));
          out[8 * v + 2 * k + 1] = Fp8x2ToF16x2(static_cast<uint16_t>(w[k] >> 16));
        }
      }
    }
  }
};

// Two CTAs per multiprocessor where registers allow.
template <int D, KeyStorage S, int NT>
__global__ void __launch_bounds__(kDecodeWarps * 32, (NT >= 4 || D == 256) ? 1 : 2)
    DecodeSelectKernel(const DecodeParams p) {
  using Shape = DecodeShape<D, S>;
  constexpr int kSteps = D / 16;
  extern __shared__ uint4 smem4[];
  char* smem = reinterpret_cast<char*>(smem4);
  __shared__ int s_span;
  __shared__ bool s_last;
  if (threadIdx.x == 0) s_span = FindSpan(p.spans, p.num_spans, blockIdx.x, false);
  __syncthreads();
  const SpanDesc& s = p.spans[s_span];
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int rows = s.num_tokens * s.num_heads;
  const int64_t p0 = s.start_pos;
  const int64_t pos_max = p0 + s.num_tokens - 1;
  const int b_begin = (blockIdx.x - s.unit_begin) * s.chunk_blocks;
  const int b_end = min(b_begin + s.chunk_blocks, s.visible_blocks);

  const auto row_g = [&](int b) {
    return static_cast<const char*>(s.keys) +
           (int64_t{s.block_table[b]} * kBlockSize + warp * 16 + g) * Shape::kRowBytes;
  };
  const auto live = [&](int b) { return int64_t{b} * kBlockSize + warp * 16 <= pos_max; };
  DecodeTile<D, S> cur, next;
  if (b_begin < b_end && live(b_begin)) cur.Load(row_g(b_begin), t);

  uint32_t qf[NT][kSteps][2];
  int64_t col_pos[NT][2];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int qrow = nt * 8 + g;
    const uint32_t* q = reinterpret_cast<const uint32_t*>(s.queries + int64_t{qrow} * D);
#pragma unroll
    for (int ks = 0; ks < kSteps; ++ks) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        uint32_t x = qrow < rows ? q[Shape::PairDim(t, ks, j) / 2] : 0u;
        if constexpr (S != KeyStorage::kBf16) x = Bf16x2ToF16x2(x);
        qf[nt][ks][j] = x;
      }
    }
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int col = nt * 8 + 2 * t + c;
      col_pos[nt][c] = col < rows ? p0 + col / s.num_heads : -1;
    }
  }

  float* part = reinterpret_cast<float*>(smem);  // [chunk_blocks][8 warps][rows]
  for (int b = b_begin; b < b_end; ++b) {
    if (b + 1 < b_end && live(b + 1)) next.Load(row_g(b + 1), t);
    float m[NT][2];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) m[nt][0] = m[nt][1] = NaNf();
    const int64_t tok = int64_t{b} * kBlockSize + warp * 16 + g;
    if (live(b)) {
      uint32_t ra[Shape::kRegs], rb[Shape::kRegs];
      cur.Unpack(0, ra);
      cur.Unpack(1, rb);
      float acc[NT][4];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
#pragma unroll
      for (int ks = 0; ks < kSteps; ++ks) {
        const uint32_t a[4] = {ra[2 * ks], rb[2 * ks], ra[2 * ks + 1], rb[2 * ks + 1]};
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          if (nt * 8 < rows) {
            if constexpr (S == KeyStorage::kBf16) {
              MmaBf16(acc[nt], a, qf[nt][ks][0], qf[nt][ks][1]);
            } else {
              MmaF16(acc[nt], a, qf[nt][ks][0], qf[nt][ks][1]);
            }
          }
        }
      }
      const bool unmasked = tok - g + 15 <= p0;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        if (unmasked) {
          m[nt][0] = MaxSkipNaN(acc[nt][0], acc[nt][2]);
          m[nt][1] = MaxSkipNaN(acc[nt][1], acc[nt][3]);
        } else {
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const float lo = tok <= col_pos[nt][c] ? acc[nt][c] : NaNf();
            const float hi = tok + 8 <= col_pos[nt][c] ? acc[nt][2 + c] : NaNf();
            m[nt][c] = MaxSkipNaN(lo, hi);
          }
        }
      }
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
#pragma unroll
        for (int off = 4; off < 32; off <<= 1) {
          m[nt][c] = MaxSkipNaN(m[nt][c], __shfl_xor_sync(0xffffffffu, m[nt][c], off));
        }
      }
    }
    if (g == 0) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int col = nt * 8 + 2 * t + c;
          if (col < rows) part[((b - b_begin) * kDecodeWarps + warp) * rows + col] = m[nt][c];
        }
      }
    }
    cur = next;
  }
  __syncthreads();
  const int n_blocks = b_end - b_begin;
  for (int idx = threadIdx.x; idx < n_blocks * rows; idx += blockDim.x) {
    const int bl = idx / rows;
    const int col = idx - bl * rows;
    float mx = NaNf();
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) mx = MaxSkipNaN(mx, part[(bl * kDecodeWarps + w) * rows + col]);
    const int64_t b = b_begin + bl;
    if (b * kBlockSize <= p0 + col / s.num_heads) {
      p.scores[s.score_offset + int64_t{col} * s.visible_blocks + b] = mx == mx ? mx : kEmptyScore;
    }
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const int done = atomicAdd(&p.counters[s_span], 1);
    s_last = done == s.block_chunks - 1;
  }
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  const int n = NextPow2(s.visible_blocks);
  const int rows_per_pass = max(1, p.smem_keys / n);
  uint64_t* keys = reinterpret_cast<uint64_t*>(smem);
  for (int r0 = 0; r0 < rows; r0 += rows_per_pass) {
    SelectRows(s, p.scores, r0, min(rows_per_pass, rows - r0), n, keys, p.pt);
  }
  if (threadIdx.x == 0) p.counters[s_span] = 0;
}

}  // namespace indexer::kernels::cuda
