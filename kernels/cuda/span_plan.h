// The launch planners of the CUDA selectors and the choice of selector per span: how a batch of
// span selections is laid out over work units (CTAs) and scratch. Plain C++ (no CUDA types),
// implemented in span_plan.cc, so that the CPU tests exercise every decision without a GPU.
//
// The CUDA backend fills one SpanDesc per SelectTask, picks its path with ChoosePath, calls a
// planner to assign work units and scratch offsets, uploads the array and calls a launcher
// (launchers.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "kernels/cuda/span_desc.h"
#include "kernels/numeric.h"

namespace indexer::kernels::cuda {

// Rows (tokens x heads) the decode selector holds in registers at most; spans with more rows
// take the prefill path.
INDEXER_HD int MaxDecodeRows(int head_dim) { return head_dim == 256 ? 16 : 32; }

struct DecodePlan {
  int32_t total_units = 0;
  int32_t max_chunk_blocks = 1;  // blocks per CTA
  int32_t warps_per_block = 8;   // DecodeWarpsPerBlock: 2 or 8 of the CTA's 8 (DecodeWarpsSupported)
  int64_t score_floats = 0;  // scratch size
  int32_t max_rows = 0;
  int32_t max_visible_blocks = 0;
};

// Blocks per decode CTA at most: 512 KB of keys (16 bf16 or 32 fp8 blocks at head_dim 128). Less
// leaves per-CTA set-up and the final atomics unamortised; more gains nothing on large batches and
// unbalances ragged ones (docs/PERF.md).
INDEXER_HD int DecodeChunkBlocks(int head_dim, KeyStorage storage) {
  const int page_bytes = static_cast<int>(PageBytes(storage, head_dim));
  const int blocks = (512 * 1024) / page_bytes;
  return blocks < 4 ? 4 : (blocks > 64 ? 64 : blocks);
}

// Warps of a decode CTA that score one block together (decode_select.cuh), for units of
// `chunk_blocks` blocks: eight, one 16-token tile each, for bf16 and fp8, which stream at the
// memory's speed, and for short units, whose latency the split keeps low; fp4 keys cost more
// instructions to decode than to stream, and two warps per block (four tiles each) spread the
// per-block work over more tokens where units hold at least a round of four blocks.
INDEXER_HD int DecodeWarpsPerBlock(KeyStorage storage, int chunk_blocks) {
  return storage == KeyStorage::kFp4E2M1 && chunk_blocks >= 4 ? 2 : 8;
}

// Whether the decode kernel has a variant with `warps` warps per block for this storage: eight
// for every storage, two for fp4 (the kernel also takes four, which docs/PERF.md measured slower
// on long fp4 units; it is not built).
INDEXER_HD constexpr bool DecodeWarpsSupported(KeyStorage storage, int warps) {
  return warps == 8 || (warps == 2 && storage == KeyStorage::kFp4E2M1);
}

// The decode plan's knobs, for the benchmark and the tests; 0 leaves one to the planner.
struct DecodeTuning {
  int32_t chunk_blocks = 0;     // most blocks per CTA (DecodeChunkBlocks)
  int32_t warps_per_block = 0;  // DecodeWarpsPerBlock; must be DecodeWarpsSupported
};

// Writes the decode index (span_desc.h) of `planned` (PlanDecode's output) into `out`
// (DecodeIndexBytes bytes).
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
// prefill scorer, ExactRowTile for the exact one); top-k groups are runs of TopkRowsPerGroup(V)
// rows (topk_plan.h).
PrefillPlan PlanPrefill(std::span<SpanDesc> spans, int row_tile);

// Query rows per prefill score CTA (PrefillShape::kRowsPerCta) and per exact score CTA for a
// head dimension.
INDEXER_HD constexpr int PrefillRowTile(int /*head_dim*/) { return 128; }
INDEXER_HD constexpr int ExactRowTile(int head_dim) { return head_dim == 256 ? 64 : 128; }

// Which selector a span takes (the CUDA backend decides per span, on the host).
enum class SpanPath { kDecode, kPrefill, kExact };

// Largest |value| of bf16 bits, and whether every value is exactly representable in f16 (zero,
// or magnitude in [2^-14, 65504]).
struct Bf16Range {
  float max_abs = 0.0f;
  bool fits_f16 = true;
};
Bf16Range ScanBf16(const uint16_t* values, int64_t n);

// kExact when fp32 products or sums could overflow (head_dim * max|q| * max|k| >= 2^126, with
// max|k| the largest stored value the written keys can give), or for fp8 and fp4 keys on the
// decode path (f16 products) when a query does not fit f16; else kDecode for spans of at
// most MaxDecodeRows rows, kPrefill for the rest.
SpanPath ChoosePath(int rows, int head_dim, KeyStorage storage, const Bf16Range& queries,
                    float max_abs_key);

}  // namespace indexer::kernels::cuda
