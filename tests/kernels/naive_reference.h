// A second, deliberately naive selector, written from SPEC.md alone (not from cpu_reference.cc),
// to check kernels::SelectSpan against. Every step is the plainest code that states the rule:
// decode each key on its own, one fp32 dot product per (token, head, key) summed in index order,
// a max that skips NaN, forcing, then a full std::sort of (score, id) with an explicit
// comparator. Slow on purpose; tests only.
//
// Also IsValidTopK: whether a selection is a correct top-k order of the naive scores when scores
// may differ from the naive ones by the rounding of the dot products' summation order.
#pragma once

#include <cstdint>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/numeric.h"

namespace indexer::testing {

// One span of query tokens against one sequence's paged keys (SPEC.md "Select: a span").
struct NaiveSpan {
  const void* pool = nullptr;  // pages as kernels::StoreKey writes them (bf16, fp8 or fp4)
  kernels::KeyStorage storage = kernels::KeyStorage::kBf16;
  int head_dim = 128;
  const int32_t* block_table = nullptr;
  const int32_t* attn_pages = nullptr;  // or nullptr: no page-table rows
  int64_t start_pos = 0;
  int num_tokens = 1;
  int num_heads = 1;
  const uint16_t* queries = nullptr;  // bf16 bits [n][H][head_dim]
  int topk = 16;
  int init_blocks = 0;
  int local_blocks = 1;
  int pages_per_block = 8;
  int block_page_stride = 8;
};

// The answer for one (token, head).
struct NaiveRow {
  int64_t pos = 0;
  std::vector<float> raw;        // raw score of each visible block (NaN dots skipped, -1e30 empty)
  std::vector<float> score;      // after forcing
  std::vector<bool> forced;      // init or local
  std::vector<double> magnitude; // per block: max over its visible keys of sum |q_d * k_d|
  std::vector<int32_t> selected; // topk entries, -1 padded
  std::vector<int32_t> page_row; // topk * pages_per_block, when attn_pages
  int32_t context_len = 0;
};

// Rows in [token][head] order.
std::vector<NaiveRow> NaiveSelect(const NaiveSpan& span);

// Independent decoders of a stored element (bf16 bits / e4m3 byte) to float.
float NaiveBf16ToFloat(uint16_t bits);
float NaiveFp8ToFloat(uint8_t byte);

// SPEC.md's sparse page-table row and context length for `selected` (topk entries) at `pos`.
void NaivePageTableRow(const std::vector<int32_t>& selected, int64_t pos, const int32_t* attn_pages,
                       int pages_per_block, int block_page_stride, std::vector<int32_t>* row,
                       int32_t* context_len);

// Whether `got` (topk entries) is a valid selection for `ref`: entries past min(topk, V) are -1,
// the rest distinct visible blocks; forced blocks and exact scores in exact order (ties to the
// lower id); other blocks in descending order and above every unselected block, where two
// non-forced blocks a, b may trade places when their scores differ by at most
// rel_tol * (magnitude[a] + magnitude[b]). rel_tol = 0 demands exactly the naive order.
::testing::AssertionResult IsValidTopK(const NaiveRow& ref, const int32_t* got, int topk,
                                       double rel_tol);

}  // namespace indexer::testing
