// The reference selector: SPEC.md written as plain C++. Every backend is tested against it, and
// the CPU backend runs it (splitting the work of one span across threads by block ranges).
//
// All functions are pure and thread-safe; they only read their inputs and write their outputs.
// Callers validate shapes first (the engine does): these functions assume valid arguments.
#pragma once

#include <cstdint>

#include "kernels/select_types.h"

namespace indexer::kernels {

// Raw block scores (SPEC.md Select step 2, NaN dots excluded, -1e30 when none is left) of blocks
// [block_begin, block_end) for every (token i, head h) of `span`:
//   raw[(i * H + h) * raw_stride + b]  for block_begin <= b < min(block_end, V_i).
// Entries for blocks a token cannot see are left untouched.
void ScoreBlocks(const KeyPoolView& keys, const SpanSelect& span, int64_t block_begin,
                 int64_t block_end, float* raw, int64_t raw_stride);

// Forces init/local blocks on a copy of raw[0..V) and writes the top min(topk, V) block ids in
// descending score order, ties to the lower id, -1 padded to `topk` (SPEC.md steps 3 and 4).
// `scratch` must hold V entries.
void SelectFromScores(const float* raw, int64_t visible_blocks, const SelectParams& params,
                      uint64_t* scratch, int32_t* out);

// One sparse page-table row and its context length for a query at position `pos` whose
// selection is `selected` (topk entries), SPEC.md "Sparse page table".
void BuildPageTableRow(const int32_t* selected, int topk, int64_t pos, const int32_t* attn_pages,
                       const PageTableParams& pt, int32_t* row, int32_t* context_len);

// The whole selection of one span, single-threaded: scores, top-k and, when span.attn_pages is
// set, page-table rows.
void SelectSpan(const KeyPoolView& keys, const SpanSelect& span, const PageTableParams& pt);

}  // namespace indexer::kernels
