// HostKeyPool: a paged key pool in host memory, to feed kernels::SelectSpan in tests.
//
// Tests hold a sequence's keys as bf16 bits laid out [len][head_dim] (what a client sends after
// rounding) and place them into pages through a block table, stored as bf16, fp8 or fp4 exactly
// as a backend stores them (kernels::StoreKey). Slots never written hold a poison value (a large
// key), so a selector that reads past a token's causal limit or past the sequence gets a visibly
// wrong answer.
//
// Also: RunSelectSpan, which runs kernels::SelectSpan with outputs poisoned beforehand, so that
// entries a selector forgets to write are caught. Header-only.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/cpu_reference.h"
#include "kernels/numeric.h"
#include "kernels/select_types.h"
#include "tests/testing/bf16.h"

namespace indexer::testing {

// Written into every output entry before a selection runs; no valid output ever equals it.
inline constexpr int32_t kPoison = 0x7eadbeef;

class HostKeyPool {
 public:
  HostKeyPool(int head_dim, kernels::KeyStorage storage, int64_t num_pages)
      : head_dim_(head_dim), storage_(storage), num_pages_(num_pages) {
    const size_t elems = static_cast<size_t>(num_pages) * kernels::kBlockSize * head_dim;
    if (storage == kernels::KeyStorage::kBf16) {
      bytes_.resize(elems * 2);
      const uint16_t poison = Bf16(4096.0f);
      for (size_t i = 0; i < elems; ++i) std::memcpy(&bytes_[i * 2], &poison, 2);
    } else if (storage == kernels::KeyStorage::kFp8E4M3) {
      bytes_.assign(elems, kernels::FloatToFp8E4M3(448.0f));
    } else {
      // Codes 6 and scales 448: every value 2688.
      bytes_.assign(static_cast<size_t>(num_pages * kernels::PageBytes(storage, head_dim)), 0x77);
      for (int64_t p = 0; p < num_pages; ++p) {
        std::fill_n(&bytes_[kernels::Fp4ScalesOffset(p, 0, head_dim)],
                    kernels::kBlockSize * head_dim / kernels::kFp4GroupSize,
                    kernels::FloatToFp8E4M3(448.0f));
      }
    }
  }

  // Writes keys[t] (bf16 bits, head_dim each) for t in [0, len) to page block_table[t / 128],
  // slot t % 128, converting to the storage type.
  void Write(const std::vector<int32_t>& block_table, const uint16_t* keys, int64_t len) {
    for (int64_t t = 0; t < len; ++t) {
      kernels::StoreKey(bytes_.data(), storage_, head_dim_, block_table[t / kernels::kBlockSize],
                        static_cast<int>(t % kernels::kBlockSize), keys + t * head_dim_);
    }
  }

  kernels::KeyPoolView view() const {
    return kernels::KeyPoolView{bytes_.data(), storage_, head_dim_};
  }
  const void* data() const { return bytes_.data(); }
  int head_dim() const { return head_dim_; }
  kernels::KeyStorage storage() const { return storage_; }
  int64_t num_pages() const { return num_pages_; }

 private:
  int head_dim_;
  kernels::KeyStorage storage_;
  int64_t num_pages_;
  std::vector<uint8_t> bytes_;
};

inline int64_t BlocksFor(int64_t tokens) {
  return (tokens + kernels::kBlockSize - 1) / kernels::kBlockSize;
}

inline std::vector<int32_t> IdentityTable(int64_t blocks) {
  std::vector<int32_t> t(blocks);
  std::iota(t.begin(), t.end(), 0);
  return t;
}

// `blocks` distinct pages drawn at random from [0, num_pages).
inline std::vector<int32_t> ShuffledTable(int64_t blocks, int64_t num_pages, std::mt19937_64& rng) {
  std::vector<int32_t> all(num_pages);
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(blocks);
  return all;
}

// Outputs of one span selection: [n][H][topk] ids, [n][H][topk * pages_per_block] rows, [n][H].
struct SpanResult {
  std::vector<int32_t> block_ids;
  std::vector<int32_t> page_table;
  std::vector<int32_t> context_lens;
};

// Runs kernels::SelectSpan on poisoned outputs. `attn_pages` may be empty (no page table).
inline SpanResult RunSelectSpan(const kernels::KeyPoolView& keys,
                                const std::vector<int32_t>& block_table,
                                const std::vector<int32_t>& attn_pages, int64_t start_pos,
                                int num_tokens, int num_heads, const std::vector<uint16_t>& queries,
                                const kernels::SelectParams& params,
                                const kernels::PageTableParams& pt = {}) {
  SpanResult r;
  const int64_t rows = int64_t{num_tokens} * num_heads;
  r.block_ids.assign(rows * params.topk, kPoison);
  kernels::SpanSelect span;
  span.block_table = block_table.data();
  span.start_pos = start_pos;
  span.num_tokens = num_tokens;
  span.num_heads = num_heads;
  span.queries = queries.data();
  span.params = params;
  span.block_ids = r.block_ids.data();
  if (!attn_pages.empty()) {
    r.page_table.assign(rows * params.topk * pt.pages_per_block, kPoison);
    r.context_lens.assign(rows, kPoison);
    span.attn_pages = attn_pages.data();
    span.page_table = r.page_table.data();
    span.context_lens = r.context_lens.data();
  }
  kernels::SelectSpan(keys, span, pt);
  return r;
}

}  // namespace indexer::testing
