// The sparse page tables of SPEC.md, written on the device from rows' selected block ids: every
// top-k strategy ends with WritePageTables.
#pragma once

#include <cstdint>

#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/span_desc.h"
#include "kernels/select_types.h"

namespace indexer::kernels::cuda {

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

}  // namespace indexer::kernels::cuda
