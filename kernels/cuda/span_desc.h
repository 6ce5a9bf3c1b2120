// The CUDA selectors' kernel ABI: the span descriptor each kernel reads, the decode index that
// follows the descriptors in device memory, and the timeline slots the decode kernel stamps for
// the kernel benchmark. Plain C++ (no CUDA types), shared by the host and the device.
//
// The CUDA backend fills one SpanDesc per SelectTask with device pointers; the planners
// (span_plan.h) fill in the work layout; launchers.h launches the kernels on the result.
#pragma once

#include <cstddef>
#include <cstdint>

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

// The decode selector's index of its spans, in device memory right after the batch's descriptors
// (SelectBatch::WriteDevice): for every decode span, in arrays, its block table, its first work
// unit and its visible blocks. A CTA finds its span and the start of its page ids in one round
// trip through it (one warp probing 64 consecutive spans touches four cache lines; in the
// descriptors, 64), then fetches its page ids while its descriptor arrives. Layout for n spans:
// const int32_t* block_table[n], int32_t unit_begin[n], int32_t visible_blocks[n].
inline size_t DecodeIndexBytes(size_t n) { return n * 16; }

// The decode kernel's timeline slots (the kernel benchmark's --timeline; DecodeParams): the first
// CTA starts, the last CTA ends its streaming, the last CTA of a span knows it is last, then the
// phases of that CTA's top-k (topk.cuh): keys loaded, thresholds known and candidates listed (by
// the threshold pass, or by the first warp's WarpTopK), shared-memory selection done, end.
enum DecodeTimelineSlot {
  kTimelineStart, kTimelineStreamed, kTimelineLast, kTimelineLoaded, kTimelineThreshold,
  kTimelineSelected, kTimelineShared, kTimelineEnd, kDecodeTimelineSlots
};

}  // namespace indexer::kernels::cuda
