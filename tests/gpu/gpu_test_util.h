// Helpers for the GPU tests: random key pools and spans, the CPU reference run on the same
// inputs, and a checker that accepts a selection when it equals the reference, or, for
// real-valued inputs, differs from it only where block scores differ by rounding.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/span_desc.h"
#include "kernels/numeric.h"
#include "kernels/select_types.h"

namespace indexer::testing {

enum class Values { kIntegers, kReal };

// A host key pool in storage format plus the spans to select, with reference answers.
struct SpanCase {
  int64_t length = 1;  // tokens in the sequence
  int num_tokens = 1;  // n
  int num_heads = 1;   // H
  kernels::SelectParams params;
  bool attn = false;
  int64_t start_pos = -1;  // default: length - n
  // Filled by BuildCase:
  std::vector<int32_t> block_table, attn_pages;
  std::vector<uint16_t> queries;
  std::vector<int32_t> ref_ids, ref_table, ref_ctx;
  std::vector<float> ref_raw;  // [rows][V] raw scores of the reference
};

struct PoolCase {
  int head_dim = 128;
  kernels::KeyStorage storage = kernels::KeyStorage::kBf16;
  Values values = Values::kReal;
  // Fraction of tokens whose keys get +-3e38 in two dimensions, so that some dot products are
  // +-Inf or NaN (bf16 storage with integer values only).
  double huge_token_fraction = 0.0;
  kernels::PageTableParams pt;
  std::vector<SpanCase> spans;
  int64_t num_pages = 0;
  std::vector<uint8_t> pool;  // num_pages pages as kernels::StoreKey writes them
  float max_abs_key = 0.0f;   // over the keys written (not the garbage past sequence ends)
  int decode_warps = 0;       // when set, the decode plan's warps per block (DecodeTuning)
};

// A span of 1 to max_len tokens with 1 to max_n query tokens, heads up to max_rows rows in all,
// random topk (1 to 64), forced blocks and page-table request.
SpanCase RandomSpan(std::mt19937_64& rng, int64_t max_len, int max_n, int max_rows);

// Fills block tables (a random permutation of the pool), keys, queries and attention pages, and
// runs the reference. `rng` is seeded by the caller (printed on failure).
void BuildCase(PoolCase& c, std::mt19937_64& rng);

// The span's inputs as a selection (block table, attention pages when it asks for a page table,
// positions, queries, params); its outputs are left null for the caller to point.
kernels::SpanSelect SpanInputs(const SpanCase& s);

// Checks one span's device answers against its reference. Returns "" when they agree, else a
// description of the first disagreement.
std::string CheckSpan(const PoolCase& c, const SpanCase& s, const int32_t* ids,
                      const int32_t* table, const int32_t* ctx);

}  // namespace indexer::testing
