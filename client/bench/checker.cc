#include "client/bench/checker.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/bench/workload.h"
#include "kernels/cpu_reference.h"
#include "kernels/numeric.h"

namespace indexer::bench {
namespace {

float ForcedScore(float raw, int64_t b, int64_t v, const kernels::SelectParams& p) {
  if (b < p.init_blocks) raw = kernels::kInitScore;
  if (b >= v - p.local_blocks) raw = kernels::kLocalScore;
  return raw;
}

std::string Ids(std::span<const int32_t> ids) {
  return absl::StrCat("[", absl::StrJoin(ids, " "), "]");
}

// Whether `got` is an acceptable top-k of `raw` (V visible blocks) within `tolerance`, given the
// reference's choice `want`. Empty when acceptable, else why not.
std::string WithinTolerance(std::span<const int32_t> got, std::span<const int32_t> want,
                            const float* raw, int64_t v, const kernels::SelectParams& p,
                            double tolerance) {
  const int64_t k = std::min<int64_t>(p.topk, v);
  std::vector<int32_t> seen;
  for (int64_t j = 0; j < static_cast<int64_t>(got.size()); ++j) {
    const int32_t b = got[j];
    if (j >= k) {
      if (b != -1) return absl::StrCat("entry ", j, " is ", b, ", expected -1 padding");
      continue;
    }
    if (b < 0 || b >= v) return absl::StrCat("block ", b, " is outside [0, ", v, ")");
    if (std::find(seen.begin(), seen.end(), b) != seen.end())
      return absl::StrCat("block ", b, " twice");
    seen.push_back(b);
  }
  float kth = std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < k; ++j) kth = std::min(kth, ForcedScore(raw[want[j]], want[j], v, p));
  const double slack = tolerance * std::max(1.0, std::fabs(static_cast<double>(kth)));
  for (int32_t b : seen) {
    const float s = ForcedScore(raw[b], b, v, p);
    if (static_cast<double>(s) < static_cast<double>(kth) - slack) {
      return absl::StrCat("block ", b, " scores ", s, ", below the reference's k-th score ", kth,
                          " by more than the tolerance");
    }
  }
  return "";
}

}  // namespace

HostKeys::HostKeys(int checked_layers, int head_dim, kernels::KeyStorage storage)
    : head_dim_(head_dim), storage_(storage), layers_(checked_layers) {}

void HostKeys::AppendAllLayers(const uint16_t* bits, int64_t tokens, int server_layers) {
  const int64_t page_bytes = kernels::PageBytes(storage_, head_dim_);
  const size_t needed = static_cast<size_t>(BlocksFor(length_ + tokens) * page_bytes);
  for (size_t l = 0; l < layers_.size(); ++l) {
    std::vector<uint8_t>& dst = layers_[l];
    if (dst.size() < needed) dst.resize(needed, 0);
    for (int64_t t = 0; t < tokens; ++t) {
      const uint16_t* src = bits + (static_cast<size_t>(t) * server_layers + l) * head_dim_;
      const int64_t pos = length_ + t;
      kernels::StoreKey(dst.data(), storage_, head_dim_, pos / kernels::kBlockSize,
                        static_cast<int>(pos % kernels::kBlockSize), src);
    }
  }
  length_ += tokens;
}

void HostKeys::Truncate(int64_t length) {
  if (length >= length_) return;
  const int64_t page_bytes = kernels::PageBytes(storage_, head_dim_);
  const int64_t blocks = BlocksFor(length);
  for (std::vector<uint8_t>& l : layers_) {
    // Zero the dropped rows: the reference never reads past a query's position, but a later
    // append must not find stale values in a reused row either.
    for (int64_t t = length; t < blocks * kernels::kBlockSize; ++t) {
      kernels::ClearKey(l.data(), storage_, head_dim_, t / kernels::kBlockSize,
                        static_cast<int>(t % kernels::kBlockSize));
    }
    l.resize(static_cast<size_t>(blocks * page_bytes));
  }
  length_ = length;
}

kernels::KeyPoolView HostKeys::View(int layer) const {
  return kernels::KeyPoolView{layers_[layer].data(), storage_, head_dim_};
}

CheckOutcome CheckSelection(const HostKeys& keys, int layer, std::span<const int32_t> attn_pages,
                            const uint16_t* query_bits, const client::Selection& got,
                            const CheckParams& params) {
  CheckOutcome out;
  const int n = got.num_tokens;
  const int heads = got.num_heads;
  const kernels::SelectParams& p = params.select;
  if (n < 1 || heads < 1 || got.topk != p.topk) {
    out.mismatch = absl::StrCat("shape ", n, "x", heads, "x", got.topk, ", expected topk ", p.topk);
    return out;
  }
  const int64_t p0 = got.start_position;
  if (p0 != keys.length() - n) {
    out.mismatch = absl::StrCat("start_position ", p0, ", expected ", keys.length() - n,
                                " (length ", keys.length(), " - n ", n, ")");
    return out;
  }
  const bool with_pages = !attn_pages.empty();
  if (got.has_page_table() != with_pages) {
    out.mismatch = with_pages ? "no page table, expected one" : "a page table, expected none";
    return out;
  }
  const int64_t v_max = kernels::VisibleBlocks(p0 + n - 1);
  std::vector<int32_t> table(static_cast<size_t>(v_max));
  std::iota(table.begin(), table.end(), 0);
  kernels::SpanSelect span;
  span.block_table = table.data();
  span.start_pos = p0;
  span.num_tokens = n;
  span.num_heads = heads;
  span.queries = query_bits;
  span.params = p;
  const int rows = n * heads;
  std::vector<float> raw(static_cast<size_t>(rows) * v_max);
  kernels::ScoreBlocks(keys.View(layer), span, 0, v_max, raw.data(), v_max);
  std::vector<uint64_t> scratch(static_cast<size_t>(v_max));
  std::vector<int32_t> want(p.topk);
  const int width = p.topk * params.page_table.pages_per_block;
  std::vector<int32_t> want_row(static_cast<size_t>(width));
  for (int i = 0; i < n; ++i) {
    const int64_t pos = p0 + i;
    const int64_t v = kernels::VisibleBlocks(pos);
    for (int h = 0; h < heads; ++h) {
      const int row = i * heads + h;
      const float* row_raw = &raw[static_cast<size_t>(row) * v_max];
      kernels::SelectFromScores(row_raw, v, p, scratch.data(), want.data());
      const std::span<const int32_t> ids = got.blocks(i, h);
      ++out.rows;
      if (!std::equal(ids.begin(), ids.end(), want.begin())) {
        std::string why = "differs";
        if (!params.exact) why = WithinTolerance(ids, want, row_raw, v, p, params.tolerance);
        if (!why.empty()) {
          out.mismatch =
              absl::StrCat("position ", pos, " head ", h, ": blocks ", Ids(ids), ", reference ",
                           Ids(want), params.exact ? "" : absl::StrCat(": ", why));
          return out;
        }
        ++out.tolerated;
      }
      if (with_pages) {
        int32_t want_len = 0;
        kernels::BuildPageTableRow(ids.data(), p.topk, pos, attn_pages.data(), params.page_table,
                                   want_row.data(), &want_len);
        const std::span<const int32_t> got_row = got.page_row(i, h);
        if (!std::equal(got_row.begin(), got_row.end(), want_row.begin()) ||
            got.context_len(i, h) != want_len) {
          out.mismatch = absl::StrCat("position ", pos, " head ", h, ": page-table row ",
                                      Ids(got_row), " context_len ", got.context_len(i, h),
                                      ", reference ", Ids(want_row), " context_len ", want_len);
          return out;
        }
      }
    }
  }
  return out;
}

}  // namespace indexer::bench
