// SpanDesc and the launch planners: how a batch of span selections is laid out for the CUDA
// selectors. Plain C++ (no CUDA types), so the planners are unit-tested on any machine.
//
// The CUDA backend fills one SpanDesc per SelectTask with device pointers, calls a planner to
// assign work units and scratch offsets, uploads the array and calls a launcher (launchers.h).
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <span>

#include "kernels/numeric.h"
#include "kernels/select_types.h"

namespace indexer::kernels::cuda {

// One span selection in device memory. Rows are (token, head) pairs, row = i * H + h.
struct SpanDesc {
  const void* keys = nullptr;            // the layer's key pool
  const int32_t* block_table = nullptr;  // [>= visible_blocks]
  const int32_t* attn_pages = nullptr;   // [>= visible_blocks] or nullptr
  const uint16_t* queries = nullptr;     // bf16 [n][H][head_dim]
  int32_t* block_ids = nullptr;          // [n][H][topk]
  int32_t* page_table = nullptr;         // [n][H][topk * pages_per_block] when attn_pages
  int32_t* context_lens = nullptr;       // [n][H] when attn_pages
  int64_t start_pos = 0;
  int32_t num_tokens = 1;
  int32_t num_heads = 1;
  int32_t topk = 16;
  int32_t init_blocks = 0;
  int32_t local_blocks = 1;
  // Filled by the planner:
  int32_t visible_blocks = 0;  // V of the span's last token
  int32_t unit_begin = 0;      // first work unit (CTA) of this span
  int32_t row_tiles = 1;       // prefill: query-row tiles; decode: 1
  int32_t block_chunks = 1;    // work units per row tile (block ranges)
  int32_t chunk_blocks = 1;    // blocks per work unit
  int32_t topk_group_begin = 0;  // prefill: first top-k CTA of this span
  int64_t score_offset = 0;    // raw scores at scores[score_offset + row * visible_blocks + b]

  int Rows() const { return num_tokens * num_heads; }
};

// Rows (tokens x heads) the decode selector holds in registers at most; spans with more rows
// take the prefill path.
INDEXER_HD int MaxDecodeRows(int head_dim) { return head_dim == 256 ? 16 : 32; }

struct DecodePlan {
  int32_t total_units = 0;
  int32_t max_chunk_blocks = 1;  // blocks per CTA
  int64_t score_floats = 0;  // scratch size
  int32_t max_rows = 0;
  int32_t max_visible_blocks = 0;
};

// Blocks per decode CTA at most: 512 KB of keys (16 bf16 or 32 fp8 blocks at head_dim 128), what
// the H200 streamed fastest (docs/PERF.md: 16 and 32 bf16 blocks within 1% on large batches,
// 16 ahead on ragged ones; 32 fp8 blocks 6% ahead of 16).
INDEXER_HD int DecodeChunkBlocks(int head_dim, KeyStorage storage) {
  const int page_bytes = kBlockSize * head_dim * KeyStorageBytes(storage);
  const int blocks = (512 * 1024) / page_bytes;
  return blocks < 4 ? 4 : (blocks > 64 ? 64 : blocks);
}

// The decode selector's index of its spans, in device memory right after the batch's descriptors
// (SelectBatch::WriteDevice): for every decode span, in arrays, its block table, its first work
// unit and its visible blocks. A CTA finds its span and the start of its page ids in one round
// trip through it (one warp probing 64 consecutive spans touches four cache lines; in the
// descriptors, 64), then fetches its page ids while its descriptor arrives. Layout for n spans:
// const int32_t* block_table[n], int32_t unit_begin[n], int32_t visible_blocks[n].
inline size_t DecodeIndexBytes(size_t n) { return n * 16; }

// Writes the index of `planned` (PlanDecode's output) into `out` (DecodeIndexBytes bytes).
void WriteDecodeIndex(std::span<const SpanDesc> planned, void* out);

// Splits every span's blocks into work units of chunk_blocks blocks (one CTA each), chosen so that
// the whole batch spreads over `num_sms` multiprocessors whatever the mix of lengths.
// `max_chunk_blocks` caps the blocks per CTA: DecodeChunkBlocks (the benchmark varies it).
DecodePlan PlanDecode(std::span<SpanDesc> spans, int num_sms, int max_chunk_blocks);

struct PrefillPlan {
  int32_t total_units = 0;        // score CTAs
  int32_t total_topk_groups = 0;  // top-k CTAs
  int64_t score_floats = 0;
  int32_t max_visible_blocks = 0;
};

// Score units are (row tile, block chunk) pairs, `row_tile` rows each (PrefillRowTile for the
// prefill scorer, ExactRowTile for the exact one); top-k groups are runs of `rows_per_group(V)` rows.
PrefillPlan PlanPrefill(std::span<SpanDesc> spans, int row_tile);

// Which selector a span takes (the CUDA backend decides per span, on the host).
enum class SpanPath { kDecode, kPrefill, kExact };

// Largest |value| of bf16 bits, and whether every value is exactly representable in f16 (zero,
// or magnitude in [2^-14, 65504]).
struct Bf16Range {
  float max_abs = 0.0f;
  bool fits_f16 = true;
};
Bf16Range ScanBf16(const uint16_t* values, int64_t n);

// kExact when fp32 products or sums could overflow (head_dim * max|q| * max|k| >= 2^126), or
// for fp8 keys on the decode path when a query does not fit f16; else kDecode for spans of at
// most MaxDecodeRows rows, kPrefill for the rest.
SpanPath ChoosePath(int rows, int head_dim, KeyStorage storage, const Bf16Range& queries,
                    float max_abs_key);

// Keys (uint64) one top-k pass holds in shared memory at least, and the candidate keys each of
// the 8 warps of a top-k CTA keeps beside them.
inline constexpr int kTopkSmemKeys = 4096;
inline constexpr int kWarpCandidates = 256;
inline constexpr int kTopkWarps = 8;

// The smallest power of two >= v, for 0 <= v <= 2^30: one count of leading zeros, the same
// formula on host and device (the decode top-k's set-up calls it on its critical path, where a
// loop of dependent shifts cost a few hundred cycles).
INDEXER_HD int32_t NextPow2(int32_t v) {
  if (v <= 1) return 1;
#ifdef __CUDA_ARCH__
  const int zeros = __clz(v - 1);
#else
  const int zeros = std::countl_zero(static_cast<uint32_t>(v - 1));
#endif
  return static_cast<int32_t>(1u << (32 - zeros));
}

// x / d for 0 <= x < 2^31 and 1 <= d < 2^31, exactly, with one multiply-high and one
// correction: magic = floor((2^32 - 1) / d) gives a quotient at most one short. The top-k kernels
// divide a row index by the span's head count for every key they load, and a hardware-less
// integer division there was most of the time of short passes (docs/PERF.md).
struct RowDivider {
  uint32_t d = 1;
  uint32_t magic = 0xffffffffu;
  INDEXER_HD explicit RowDivider(int divisor)
      : d(static_cast<uint32_t>(divisor)), magic(0xffffffffu / static_cast<uint32_t>(divisor)) {}
  INDEXER_HD int operator()(int x) const {
    const uint32_t u = static_cast<uint32_t>(x);
    uint32_t q = static_cast<uint32_t>((uint64_t{u} * magic) >> 32);
    if ((q + 1) * d <= u) ++q;
    return static_cast<int>(q);
  }
};

// Rows sorted together by one top-k CTA for spans whose last token sees `visible_blocks`.
INDEXER_HD int TopkRowsPerGroup(int32_t visible_blocks) {
  const int n = NextPow2(visible_blocks > 1 ? visible_blocks : 1);
  return n >= kTopkSmemKeys ? 1 : kTopkSmemKeys / n;
}

// The decode kernel's timeline slots (the kernel benchmark's --timeline; DecodeParams): the first
// CTA starts, the last CTA ends its streaming, the last CTA of a span knows it is last, then the
// phases of that CTA's top-k (topk.cuh): keys loaded, thresholds known and candidates listed (by
// the threshold pass, or by the first warp's WarpTopK), shared-memory selection done, end.
enum DecodeTimelineSlot {
  kTimelineStart, kTimelineStreamed, kTimelineLast, kTimelineLoaded, kTimelineThreshold,
  kTimelineSelected, kTimelineShared, kTimelineEnd, kDecodeTimelineSlots
};

// Query rows per prefill score CTA (PrefillShape::kRowsPerCta) and per exact score CTA for a
// head dimension.
INDEXER_HD constexpr int PrefillRowTile(int /*head_dim*/) { return 128; }
INDEXER_HD constexpr int ExactRowTile(int head_dim) { return head_dim == 256 ? 64 : 128; }

}  // namespace indexer::kernels::cuda
