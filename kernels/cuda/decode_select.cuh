// Fused decode selector: block scores on tensor cores, and the top-k of each span by the last
// CTA that finishes one of its blocks. One launch per batch.
//
// Work: every span's visible blocks are cut into units of chunk_blocks blocks; one CTA (8 warps)
// per unit, so a long span spreads over the whole GPU next to short ones. Warp 0 finds its unit's
// span through the decode index (span_desc.h), then loads the unit's page ids and the span's
// descriptor together: two round trips before the first copy. The CTA streams its
// blocks' key pages into a ring of shared-memory stages with cp.async (each warp instruction
// copies 512 contiguous bytes; 64 to 150 KB of pages per CTA: docs/PERF.md has the streaming
// probe that chose this over register loads and bulk copies). The CTA scores its blocks in
// rounds of 8 / WPB blocks, one barrier per round: WPB warps share a block, each scoring
// 128 / WPB of its tokens as tiles of 16 (the A operand of mma.m16n8k16, read with ldmatrix from
// an XOR-swizzled layout, free of bank conflicts); the span's rows (token, head) are the B
// operand, 8 per n-tile, held in registers for the whole CTA. A block's warps meet in shared
// memory and its scores are written one round later. Fewer warps per block spread the
// per-block work (barrier, reductions, score writes) over more tokens, which pays where decoding
// the keys costs more instructions than streaming them (fp4); eight suit short units
// (DecodeWarpsPerBlock).
//
// fp8 keys are read as 16-bit pairs by ldmatrix and converted to f16 (one exact instruction per
// pair), so their dot product's dimensions are permuted, identically for keys and queries, which
// SPEC.md allows: only the summation order changes. That mma runs in f16 with the queries
// converted to f16 too, exact for the queries the backend sends here (|q| in [2^-14, 65504] or
// 0; others take the exact path).
//
// fp4 pages stream as their codes (swizzled like the other storages' rows) and their scales
// (copied as they are). A lane's 32-bit word of codes holds 8 values of one group; they are
// decoded in registers to f16 code * scale * 2^-6, exact (at most 6 significant bits,
// magnitudes in [2^-16, 42]): each code is rewritten as an e4m3 byte of value code * 2^-6,
// converted to f16 by the same instruction as fp8, and multiplied by the scale (exact in f16).
// The sums are then exactly the stored keys' times 2^-6, and the block maxima are multiplied by
// 64. Even and odd values of a word feed different k-steps, again permuting dimensions for keys
// and queries alike.
#pragma once

#include <cuda/atomic>

#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/topk.cuh"

namespace indexer::kernels::cuda {

inline constexpr int kDecodeWarps = 8;  // = tiles of 16 tokens per 128-token block

struct DecodeParams {
  const SpanDesc* spans;
  const unsigned char* index;  // WriteDecodeIndex's image of `spans`
  int num_spans;
  int chunk_blocks;  // every span's (PlanDecode gives them all the same)
  float* scores;
  int* counters;
  PageTableParams pt;
  int smem_keys;  // top-k keys the dynamic shared memory holds
  // The kernel benchmark's --timeline (nullptr otherwise): DecodeTimelineSlot stamps; with
  // several spans, their last CTAs overwrite each other's top-k stamps.
  unsigned long long* timeline;
};

// Bytes of shared memory for a unit's page ids (16-byte aligned, for what follows them).
INDEXER_HD constexpr int64_t DecodePageIdBytes(int chunk_blocks) { return (int64_t{chunk_blocks} * 4 + 15) / 16 * 16; }

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

// What FindDecodeSpan finds for a work unit: its span, the span's first unit, visible blocks and
// block table (device).
struct DecodeUnitSpan {
  int span;
  int unit_begin;
  int visible_blocks;
  const int32_t* block_table;
};

// The span of work unit `unit`, by all 32 lanes of one warp, from the decode index (span_desc.h:
// WriteDecodeIndex) of `num_spans` spans; every lane returns the answer. Rounds of 32 probes narrow
// the candidates to 64 consecutive spans, whose fields the last round loads, two spans per lane,
// in one round trip: one round in all for up to 64 spans, two for up to 2048.
__device__ __forceinline__ DecodeUnitSpan FindDecodeSpan(const unsigned char* index, int num_spans, int unit) {
  const int lane = threadIdx.x & 31;
  const auto* tables = reinterpret_cast<const int32_t* const*>(index);
  const int32_t* begins = reinterpret_cast<const int32_t*>(index + 8 * int64_t{num_spans});
  const int32_t* visible = begins + num_spans;
  int lo = 0, end = num_spans;  // the answer is in [lo, end); begins[lo] <= unit
  while (end - lo > 64) {
    const int step = (end - lo + 31) / 32;
    const int idx = lo + lane * step;
    const bool ok = idx < end && begins[idx] <= unit;
    lo += (31 - __clz(__ballot_sync(0xffffffffu, ok))) * step;
    end = min(end, lo + step);
  }
  // Branch-free loads from valid addresses (the last candidate's past the end).
  const int i0 = min(lo + lane, end - 1);
  const int i1 = min(lo + 32 + lane, end - 1);
  const int b0 = begins[i0], b1 = begins[i1];
  const int v0 = visible[i0], v1 = visible[i1];
  const int32_t* t0 = tables[i0];
  const int32_t* t1 = tables[i1];
  const unsigned m0 = __ballot_sync(0xffffffffu, lo + lane < end && b0 <= unit);
  const unsigned m1 = __ballot_sync(0xffffffffu, lo + 32 + lane < end && b1 <= unit);
  const bool second = m1 != 0;  // lane 0's first candidate (lo) always qualifies
  const int src = 31 - __clz(second ? m1 : m0);
  DecodeUnitSpan found;
  found.span = lo + (second ? 32 : 0) + src;
  found.unit_begin = __shfl_sync(0xffffffffu, second ? b1 : b0, src);
  found.visible_blocks = __shfl_sync(0xffffffffu, second ? v1 : v0, src);
  found.block_table = reinterpret_cast<const int32_t*>(
      __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(second ? t1 : t0), src));
  return found;
}

template <int D, KeyStorage S>
struct DecodeShape {
  // Bytes of a key row as ldmatrix reads it: the whole key, or an fp4 key's codes.
  static constexpr int kRowBytes =
      S == KeyStorage::kBf16 ? D * 2 : (S == KeyStorage::kFp8E4M3 ? D : D / 2);
  static constexpr int kRowChunks = kRowBytes / 16;  // 16-byte chunks per key row: 2 to 32
  static constexpr int kRowsBytes = kRowBytes * kBlockSize;  // a page's rows (fp4: its codes)
  // fp4 scales follow the codes, in the page as in its stage: one byte per group of 16.
  static constexpr int kScaleBytes = S == KeyStorage::kFp4E2M1 ? kBlockSize * D / kFp4GroupSize : 0;
  static constexpr int kScaleChunks = kScaleBytes / 16;
  static constexpr int kPageBytes = kRowsBytes + kScaleBytes;
  static_assert(kPageBytes == PageBytes(S, D), "the pool's page layout (numeric.h)");
  // Pages staged per CTA with eight warps per block (docs/PERF.md): three 32 KB (or larger)
  // pages, two CTAs per multiprocessor; smaller pages four or more, 64 KB in all (six 16 KB
  // stages streamed slower than four on the H200).
  static constexpr int kBaseStages =
      kPageBytes >= 32768
          ? 3
          : (65536 / kPageBytes > 16 ? 16 : (65536 / kPageBytes < 4 ? 4 : 65536 / kPageBytes));
  static_assert(kRowsBytes % (kDecodeWarps * 32 * 16) == 0, "whole copy rounds");
  static_assert(kScaleChunks <= kDecodeWarps * 32, "one scale chunk per thread at most");
  static_assert(kPageBytes % 16 == 0, "pages stay 16-byte aligned");
  // Where logical chunk c of row r sits in a staged page: ldmatrix reads one chunk of 8
  // consecutive rows at a time, and the swizzle puts those 8 on 8 different bank groups.
  static __device__ __forceinline__ int Chunk(int r, int c) {
    if constexpr (kRowChunks >= 8) {
      return r * kRowChunks + (c ^ (r & 7));
    } else if constexpr (kRowChunks == 4) {
      return r * kRowChunks + (c ^ ((r >> 1) & 3));  // two 64-byte rows per 128-byte line
    } else {
      return r * kRowChunks + (c ^ ((r >> 2) & 1));  // four 32-byte rows per 128-byte line
    }
  }
  // Dims of the query values in k-slots 2t + 8j (first) and 2t + 8j + 1 (second) of k-step ks:
  // the natural order for bf16; for fp8, ldmatrix gives lane t the dims 4t..4t+3 of a 16-dim
  // chunk (one k-step); for fp4, the dims 8t..8t+7 of a 32-dim chunk c, whose even dims are
  // k-step 2c and odd dims k-step 2c + 1 (DecodeFp4Word's pairs).
  static __device__ __forceinline__ int2 QueryDims(int t, int ks, int j) {
    if constexpr (S == KeyStorage::kBf16) {
      return make_int2(16 * ks + 8 * j + 2 * t, 16 * ks + 8 * j + 2 * t + 1);
    } else if constexpr (S == KeyStorage::kFp8E4M3) {
      return make_int2(16 * ks + 4 * t + 2 * j, 16 * ks + 4 * t + 2 * j + 1);
    } else {
      const int d = 32 * (ks >> 1) + 8 * t + 4 * j + (ks & 1);
      return make_int2(d, d + 2);
    }
  }
};

// The stage ring of a decode CTA whose blocks take WPB warps each: whole rounds of
// kRoundBlocks pages (one per block a round scores). While one round is scored the others stream
// in: at least the kBaseStages - 1 pages that eight warps per block keep in flight.
template <int D, KeyStorage S, int WPB>
struct DecodeRing {
  static_assert(WPB == 2 || WPB == 4 || WPB == 8, "warps per block: a divisor of the CTA's 8, more than one");
  using Shape = DecodeShape<D, S>;
  static constexpr int kRoundBlocks = kDecodeWarps / WPB;
  static constexpr int kWarpTiles = (kBlockSize / 16) / WPB;  // 16-token tiles per warp per block
  static constexpr int kRounds = 1 + (Shape::kBaseStages - 2 + kRoundBlocks) / kRoundBlocks;
  static constexpr int kRoundBytes = kRoundBlocks * Shape::kPageBytes;
  static constexpr int kStageBytes = kRounds * kRoundBytes;
  static_assert(kStageBytes >= kRegisterTopKSmemBytes, "the register top-k's buffers fit the stages");
  // Two CTAs per multiprocessor where shared memory allows: 228 KB per multiprocessor, less each
  // CTA's page ids, maxima, static variables and 1 KB reserve, leaves about 109 KB of stages.
  static constexpr int kMinCtas = kStageBytes > 108 * 1024 ? 1 : 2;
};

// WPB warps per block (DecodeRing); two CTAs per multiprocessor where registers and shared
// memory allow.
template <int D, KeyStorage S, int NT, int WPB>
__global__ void __launch_bounds__(kDecodeWarps * 32,
                                  (NT >= 4 || D == 256 || DecodeRing<D, S, WPB>::kMinCtas == 1) ? 1 : 2)
    DecodeSelectKernel(const DecodeParams p) {
  using Shape = DecodeShape<D, S>;
  using Ring = DecodeRing<D, S, WPB>;
  constexpr int kSteps = D / 16;
  constexpr int kRound = Ring::kRoundBlocks;
  // 128-byte aligned: with the static variables below the dynamic block can start 16 bytes in,
  // and a cp.async whose 32-byte sector lands across two shared sectors fetches it twice, which
  // doubles the L2 traffic and makes the L2 the bottleneck.
  extern __shared__ __align__(128) uint4 decode_smem[];
  char* smem = reinterpret_cast<char*>(decode_smem);
  __shared__ int s_span;
  __shared__ bool s_last;
  __shared__ __align__(16) unsigned char s_desc[sizeof(SpanDesc)];  // the span's descriptor
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  if (p.timeline != nullptr && threadIdx.x == 0) atomicMin(p.timeline + kTimelineStart, GlobalTimer());
  // The unit's page ids, fetched by warp 0 in the same round trip as the span's descriptor: every
  // load is issued before any store waits for one (a store right after its load would hold the
  // next load back a round trip).
  int32_t* pages = reinterpret_cast<int32_t*>(smem + Ring::kStageBytes);
  if (warp == 0) {
    const DecodeUnitSpan u = FindDecodeSpan(p.index, p.num_spans, blockIdx.x);
    const int first = (blockIdx.x - u.unit_begin) * p.chunk_blocks;
    const int count = min(p.chunk_blocks, u.visible_blocks - first);
    // Branch-free, from valid addresses (the unit's first page id) either way.
    const int32_t page0 = u.block_table[first + (lane < count ? lane : 0)];
    const int32_t page1 = u.block_table[first + (lane + 32 < count ? lane + 32 : 0)];
    constexpr int kDescWords = sizeof(SpanDesc) / 4;
    static_assert(sizeof(SpanDesc) % 4 == 0 && kDescWords <= 32, "one descriptor word per lane");
    const int32_t word = reinterpret_cast<const int32_t*>(p.spans + u.span)[lane < kDescWords ? lane : 0];
    if (lane < count) pages[lane] = page0;
    if (lane + 32 < count) pages[lane + 32] = page1;
    if (lane < kDescWords) reinterpret_cast<int32_t*>(s_desc)[lane] = word;
    for (int i = 64 + lane; i < count; i += 32) pages[i] = u.block_table[first + i];  // units past 64 blocks
    if (lane == 0) s_span = u.span;
  }
  __syncthreads();
  const SpanDesc& s = *reinterpret_cast<const SpanDesc*>(s_desc);
  // mma fragment coordinates: lane group g (lane / 4) and thread t within it (lane % 4); query
  // n-tiles nt of 8 rows; k-steps ks of 16 dimensions.
  const int g = lane >> 2;
  const int t = lane & 3;
  // The span's fields in registers: the score stores below would otherwise make the compiler
  // read them again from global memory on every block.
  const int num_heads = s.num_heads;
  const int rows = s.num_tokens * num_heads;
  const int64_t p0 = s.start_pos;
  const int64_t pos_max = p0 + s.num_tokens - 1;
  const int visible_blocks = s.visible_blocks;
  const int64_t score_offset = s.score_offset;
  const int b_begin = (blockIdx.x - s.unit_begin) * s.chunk_blocks;
  const int b_end = min(b_begin + s.chunk_blocks, visible_blocks);
  const char* key_pool = static_cast<const char*>(s.keys);
  const uint16_t* queries = s.queries;

  // Stage ring: round r's blocks (b_begin + r kRound + j, j < kRound) sit in its set of pages,
  // r % kRounds, page j. Every thread copies the chunks threadIdx.x + 256 i of a page, so a warp
  // instruction reads 512 contiguous bytes. Chunk threadIdx.x + 256 i lands where chunk
  // threadIdx.x does, one copy round (4 KB) per i further (256 chunks are whole swizzle periods
  // of 8 rows), so the swizzle is computed once: per page, a thread computes one source and one
  // destination address (recomputing every chunk's address per page would cost tens of
  // instructions per page, and the integer pipe is the busiest).
  constexpr int kCopyBytes = kDecodeWarps * 32 * 16;  // one 16-byte copy per thread
  constexpr int kCopies = Shape::kRowsBytes / kCopyBytes;
  static_assert((kDecodeWarps * 32 / Shape::kRowChunks) % 8 == 0, "256 chunks span whole swizzle periods");
  const int copy_dst = Shape::Chunk(threadIdx.x / Shape::kRowChunks, threadIdx.x % Shape::kRowChunks) * 16;
  // Byte offsets of the sets that the next issue fills and the next round reads, stepped around
  // the ring (a modulo by the number of sets costs several instructions per round).
  const auto next_set = [](int offset) {
    return offset + Ring::kRoundBytes == Ring::kStageBytes ? 0 : offset + Ring::kRoundBytes;
  };
  int issue_set = 0, read_set = 0;
  const auto issue = [&](int first) {  // called once per round, in order
#pragma unroll
    for (int j = 0; j < kRound; ++j) {
      const int b = first + j;
      if (b < b_end) {
        const char* src = key_pool + int64_t{pages[b - b_begin]} * Shape::kPageBytes + threadIdx.x * 16;
        char* page = smem + issue_set + j * Shape::kPageBytes;
#pragma unroll
        for (int i = 0; i < kCopies; ++i) CpAsync16(page + copy_dst + i * kCopyBytes, src + i * kCopyBytes);
        if constexpr (Shape::kScaleChunks > 0) {
          if (threadIdx.x < Shape::kScaleChunks) {
            CpAsync16(page + Shape::kRowsBytes + threadIdx.x * 16, src + Shape::kRowsBytes);
          }
        }
      }
    }
    CpAsyncCommit();  // empty groups past the end keep the wait count uniform
    issue_set = next_set(issue_set);
  };
#pragma unroll
  for (int r = 0; r + 1 < Ring::kRounds; ++r) issue(b_begin + r * kRound);

  uint32_t query_frags[NT][kSteps][2];
  int64_t col_pos[NT][2];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int qrow = nt * 8 + g;
    const uint32_t* q = reinterpret_cast<const uint32_t*>(queries + int64_t{qrow} * D);
#pragma unroll
    for (int ks = 0; ks < kSteps; ++ks) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int2 dims = Shape::QueryDims(t, ks, j);
        const uint16_t* qh = reinterpret_cast<const uint16_t*>(q);
        uint32_t x = qrow < rows ? uint32_t{qh[dims.x]} | (uint32_t{qh[dims.y]} << 16) : 0u;
        if constexpr (S != KeyStorage::kBf16) x = Bf16x2ToF16x2(x);
        query_frags[nt][ks][j] = x;
      }
    }
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int col = nt * 8 + 2 * t + c;
      col_pos[nt][c] = col < rows ? p0 + col / num_heads : -1;
    }
  }

  // Per-warp maxima of the last two rounds: [2][8 warps][rows].
  float* warp_maxima = reinterpret_cast<float*>(smem + Ring::kStageBytes + DecodePageIdBytes(p.chunk_blocks));
  static_assert(NT * 8 <= 32, "one lane per row writes its scores");
  // Scores of block `block` for row `col` (a lane's), where the row's token sees the block.
  const auto write_score = [&](int block, int col, int64_t pos, float best) {
    if (col < rows && block < b_end && block <= pos / kBlockSize) {
      p.scores[score_offset + int64_t{col} * visible_blocks + block] = best == best ? best : kEmptyScore;
    }
  };
  // Round `first`'s scores from its per-warp maxima (after a barrier that follows their writes):
  // warp j flushes the round's block j, lane col its row col.
  const int64_t lane_pos = lane < rows ? p0 + lane / num_heads : -1;
  const auto flush = [&](int first, int its_parity) {
    if (warp < kRound) {
      const float* maxima = warp_maxima + (its_parity * kDecodeWarps + warp * WPB) * rows + lane;
      float best = NaNf();
      if (lane < rows) {
#pragma unroll
        for (int w = 0; w < WPB; ++w) best = MaxSkipNaN(best, maxima[w * rows]);
      }
      write_score(first + warp, lane, lane_pos, best);
    }
  };
  // This warp's block in each round and its first tile of 16 tokens there.
  const int round_block = warp / WPB;
  const int first_tile = (warp % WPB) * Ring::kWarpTiles;
  // ldmatrix source rows: lane l reads row 16 tile + 8 ((l >> 3) & 1) + (l & 7) at chunk
  // (l >> 4) of a chunk pair.
  const int ld_row0 = ((lane >> 3) & 1) * 8 + (lane & 7);
  const int ld_half = lane >> 4;

  int parity = 0;
  for (int first = b_begin; first < b_end; first += kRound, parity ^= 1) {
    CpAsyncWait<Ring::kRounds - 2>();
    __syncthreads();  // this round staged for all; the last round's set and maxima are done with
    issue(first + (Ring::kRounds - 1) * kRound);
    if (first > b_begin) flush(first - kRound, parity ^ 1);
    const char* page = smem + read_set + round_block * Shape::kPageBytes;
    read_set = next_set(read_set);
    const int b = first + round_block;
    float row_max[NT][2];  // this warp's block maximum per query row
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) row_max[nt][0] = row_max[nt][1] = NaNf();
#pragma unroll(Ring::kWarpTiles > 2 ? 2 : Ring::kWarpTiles)
    for (int tile = first_tile; tile < first_tile + Ring::kWarpTiles; ++tile) {
      const int64_t tok = int64_t{b} * kBlockSize + tile * 16 + g;
      if (b >= b_end || tok - g > pos_max) continue;
      const char* stage = page;
      const int ld_row = tile * 16 + ld_row0;
      float acc[NT][4];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
      const auto mma = [&](int ks, const uint32_t(&a)[4]) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          if (nt == 0 || nt * 8 < rows) {  // a span has a row: no branch around the first tile
            if constexpr (S == KeyStorage::kBf16) {
              MmaBf16(acc[nt], a, query_frags[nt][ks][0], query_frags[nt][ks][1]);
            } else {
              MmaF16(acc[nt], a, query_frags[nt][ks][0], query_frags[nt][ks][1]);
            }
          }
        }
      };
      if constexpr (S == KeyStorage::kBf16) {
        // One ldmatrix.x4 per k-step: chunks 2ks, 2ks + 1 of rows g and g + 8.
#pragma unroll
        for (int ks = 0; ks < kSteps; ++ks) {
          uint32_t a[4];
          LdMatrixX4(a, stage + Shape::Chunk(ld_row, 2 * ks + ld_half) * 16);
          mma(ks, a);
        }
      } else if constexpr (S == KeyStorage::kFp4E2M1) {
        // One ldmatrix.x4 per four k-steps: word t of code chunks 2kp, 2kp + 1 of rows g and
        // g + 8, 8 values of group 4kp + 2h + t / 2 each; their scales from the row's scale bytes.
        // The operands are the stored values times 2^-6 (DecodeFp4Word), and so are the sums,
        // exactly: the block maxima below take the factor back.
        const unsigned char* scale_rows =
            reinterpret_cast<const unsigned char*>(stage) + Shape::kRowsBytes;
        Fp4ScaleRow<D> scales_g, scales_g8;
        scales_g.Load(scale_rows + (tile * 16 + g) * (D / kFp4GroupSize));
        scales_g8.Load(scale_rows + (tile * 16 + g + 8) * (D / kFp4GroupSize));
#pragma unroll
        for (int kp = 0; kp < kSteps / 4; ++kp) {
          uint32_t r[4];
          LdMatrixX4(r, stage + Shape::Chunk(ld_row, 2 * kp + ld_half) * 16);
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int group = 4 * kp + 2 * h;  // + t / 2, which Fp4ScaleRow::F16x2 adds
            uint32_t pg[4], pg8[4];
            DecodeFp4Word(r[2 * h], scales_g.F16x2(group, t), pg);
            DecodeFp4Word(r[2 * h + 1], scales_g8.F16x2(group, t), pg8);
            const uint32_t even[4] = {pg[0], pg8[0], pg[1], pg8[1]};
            const uint32_t odd[4] = {pg[2], pg8[2], pg[3], pg8[3]};
            mma(4 * kp + 2 * h, even);
            mma(4 * kp + 2 * h + 1, odd);
          }
        }
      } else {
        // One ldmatrix.x4 per two k-steps: word t of chunks 2kp, 2kp + 1 of rows g and g + 8.
#pragma unroll
        for (int kp = 0; kp < kSteps / 2; ++kp) {
          uint32_t r[4];
          LdMatrixX4(r, stage + Shape::Chunk(ld_row, 2 * kp + ld_half) * 16);
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const uint32_t row_g = r[2 * h], row_g8 = r[2 * h + 1];  // dims 4t..4t+3
            const uint32_t a[4] = {Fp8x2ToF16x2(static_cast<uint16_t>(row_g & 0xffffu)),
                                   Fp8x2ToF16x2(static_cast<uint16_t>(row_g8 & 0xffffu)),
                                   Fp8x2HiToF16x2(row_g), Fp8x2HiToF16x2(row_g8)};
            mma(2 * kp + h, a);
          }
        }
      }
      const bool unmasked = tok - g + 15 <= p0;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        if (unmasked) {
          row_max[nt][0] = MaxSkipNaN(row_max[nt][0], MaxSkipNaN(acc[nt][0], acc[nt][2]));
          row_max[nt][1] = MaxSkipNaN(row_max[nt][1], MaxSkipNaN(acc[nt][1], acc[nt][3]));
        } else {
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const float lo = tok <= col_pos[nt][c] ? acc[nt][c] : NaNf();
            const float hi = tok + 8 <= col_pos[nt][c] ? acc[nt][2 + c] : NaNf();
            row_max[nt][c] = MaxSkipNaN(row_max[nt][c], MaxSkipNaN(lo, hi));
          }
        }
      }
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        if constexpr (S == KeyStorage::kFp4E2M1) {
          row_max[nt][c] *= kFp4CodeFactor;  // exact: a power of two, far from fp32's limits
        }
#pragma unroll
        for (int off = 4; off < 32; off <<= 1) {
          row_max[nt][c] = MaxSkipNaN(row_max[nt][c], __shfl_xor_sync(0xffffffffu, row_max[nt][c], off));
        }
      }
    }
    if (g == 0) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int col = nt * 8 + 2 * t + c;
          if (col < rows) warp_maxima[(parity * kDecodeWarps + warp) * rows + col] = row_max[nt][c];
        }
      }
    }
  }
  CpAsyncWait<0>();
  __syncthreads();
  if (b_end > b_begin) flush(b_begin + (b_end - b_begin - 1) / kRound * kRound, parity ^ 1);
  if (p.timeline != nullptr && threadIdx.x == 0) atomicMax(p.timeline + kTimelineStreamed, GlobalTimer());
  // The span's counter, by thread 0 between two barriers: its release publishes this CTA's scores
  // (ordered before it by the first barrier), its acquire makes every other CTA's visible to the
  // whole CTA (through the second); no separate fences.
  __syncthreads();
  if (threadIdx.x == 0) {
    ::cuda::atomic_ref<int, ::cuda::thread_scope_device> counter(p.counters[s_span]);
    const int done = counter.fetch_add(1, ::cuda::memory_order_acq_rel);
    s_last = done == s.block_chunks - 1;
  }
  __syncthreads();
  if (!s_last) return;
  unsigned long long* stamps = p.timeline;
  Stamp(stamps, kTimelineLast);
  const int n = NextPow2(s.visible_blocks);
  const int rows_per_pass = max(1, p.smem_keys >> (__ffs(n) - 1));  // smem_keys / n
  uint64_t* keys = reinterpret_cast<uint64_t*>(smem);
  for (int r0 = 0; r0 < rows; r0 += rows_per_pass) {
    SelectRows<TopkCaller::kDecodeSelector>(s, p.scores, r0, min(rows_per_pass, rows - r0), n, keys, p.pt,
                                            stamps);
  }
  if (threadIdx.x == 0) p.counters[s_span] = 0;
}

}  // namespace indexer::kernels::cuda
