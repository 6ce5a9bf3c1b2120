// Plain descriptions of a selection, shared by the CPU reference, the backends and the CUDA
// launchers. No behaviour here: see cpu_reference.h for what a selection computes.
#pragma once

#include <cstdint>

#include "kernels/numeric.h"

namespace indexer::kernels {

// Per-request selection parameters (SPEC.md "Select").
struct SelectParams {
  int topk = 16;
  int init_blocks = 0;
  int local_blocks = 1;
};

// Shape of sparse attention page-table rows (SPEC.md "Sparse page table").
struct PageTableParams {
  int pages_per_block = 8;
  int block_page_stride = 8;
};

// Read-only view of one layer's key pool, laid out as numeric.h's StoreKey writes it (for bf16
// and fp8, the element for page p, slot t (< kBlockSize), dimension d sits at index
// (p * kBlockSize + t) * head_dim + d; fp4 pages hold codes, then scales).
struct KeyPoolView {
  const void* data = nullptr;
  KeyStorage storage = KeyStorage::kBf16;
  int head_dim = 128;
};

// What the check of host bf16 values found (engine/wire_values.h, as it checks them finite),
// so that a backend choosing a kernel path by their range need not read them again: the bf16
// bits of the largest magnitude, and whether every nonzero magnitude lies in f16's normal range
// [2^-14, 65504]. `known` false: nobody looked; the backend scans the values itself.
struct Bf16Summary {
  bool known = false;
  uint16_t max_magnitude = 0;
  bool fits_f16 = true;
};

// One span of query tokens of one sequence and where its answers go. All pointers are in the
// memory of whoever runs the selection (host for the CPU, device for CUDA launchers).
struct SpanSelect {
  const int32_t* block_table = nullptr;  // cache page of each block, >= VisibleBlocks(last) entries
  const int32_t* attn_pages = nullptr;   // attention page of each block, or nullptr
  int64_t start_pos = 0;                 // p0
  int num_tokens = 1;                    // n
  int num_heads = 1;                     // H
  const uint16_t* queries = nullptr;     // bf16 bits, [n][H][head_dim]
  SelectParams params;
  int32_t* block_ids = nullptr;     // out: [n][H][topk]
  int32_t* page_table = nullptr;    // out: [n][H][topk * pages_per_block], when attn_pages
  int32_t* context_lens = nullptr;  // out: [n][H], when attn_pages
  // Queries, or the three outputs, in device memory of the backend that runs the selection (a
  // client's CUDA region) instead of host memory: only a CUDA backend takes them (the engine
  // checks). The backend copies device queries into its staging with NaN and Inf read as 0, and
  // then sets *queries_nonfinite (host memory) to 1 when it found one, else 0.
  bool queries_on_device = false;
  bool outputs_on_device = false;
  int32_t* queries_nonfinite = nullptr;
  Bf16Summary queries_summary;  // of host queries
};

// Blocks visible to a query at position p: V = floor(p / 128) + 1.
inline constexpr int64_t VisibleBlocks(int64_t p) { return p / kBlockSize + 1; }

// Raw block scores a span's selection holds while it runs, one per (token, head, visible block):
// the cost every backend's scratch memory and every launch bound is measured in.
inline constexpr int64_t SpanScores(int64_t num_tokens, int64_t num_heads, int64_t start_pos) {
  return num_tokens * num_heads * VisibleBlocks(start_pos + num_tokens - 1);
}
inline constexpr int64_t SpanScores(const SpanSelect& span) {
  return SpanScores(span.num_tokens, span.num_heads, span.start_pos);
}

// Keys for `num_tokens` tokens of layers [layer_begin, layer_begin + layer_count) of one
// sequence, as bf16 bits laid out [num_tokens][layer_count][head_dim]. Layer layer_begin + l
// receives them at positions [layer_start[l], layer_start[l] + num_tokens); position t goes to
// page block_table[t / 128], slot t % 128. Pointers are host memory, the keys aside when keys_on_device.
struct KeyWrite {
  const int32_t* block_table = nullptr;
  int64_t num_tokens = 0;
  int layer_begin = 0;
  int layer_count = 1;
  const int64_t* layer_start = nullptr;  // [layer_count]
  const uint16_t* keys = nullptr;
  // `keys` in device memory of the backend that stores them (a client's CUDA region), 16-byte
  // aligned: as SpanSelect's device queries, with *keys_nonfinite (host) set at the end.
  bool keys_on_device = false;
  int32_t* keys_nonfinite = nullptr;
  Bf16Summary keys_summary;  // of host keys

  // One past the last position any layer of the write reaches.
  int64_t EndPosition() const {
    int64_t end = 0;
    for (int l = 0; l < layer_count; ++l) {
      end = layer_start[l] + num_tokens > end ? layer_start[l] + num_tokens : end;
    }
    return end;
  }
};

}  // namespace indexer::kernels
