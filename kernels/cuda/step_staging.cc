#include "kernels/cuda/step_staging.h"

#include <algorithm>
#include <cstring>

namespace indexer::kernels::cuda {
namespace {

int64_t Align(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

// Copies `n` page ids as id - pages.first; the first id outside the range, or nullopt. Checked
// branch-free (the loop vectorises), the offender found only when there is one.
std::optional<int32_t> StageTable(const int32_t* ids, int64_t n, PageRange pages, int32_t* dst) {
  bool outside = false;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t local = int64_t{ids[i]} - pages.first;
    outside |= local < 0 || local >= pages.count;
    dst[i] = static_cast<int32_t>(local);
  }
  if (!outside) return std::nullopt;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t local = int64_t{ids[i]} - pages.first;
    if (local < 0 || local >= pages.count) return ids[i];
  }
  return std::nullopt;
}

// The first block any layer of `w` writes into.
int64_t FirstBlock(const KeyWrite& w) {
  int64_t first = w.layer_start[0];
  for (int l = 1; l < w.layer_count; ++l) first = std::min(first, w.layer_start[l]);
  return first / kBlockSize;
}

}  // namespace

void StepStaging::Plan(std::span<const KeyWrite> writes, std::span<const StagedSpan> spans,
                       int head_dim, KeyStorage storage, PageTableParams page_table) {
  writes_ = writes;
  spans_ = spans;
  head_dim_ = head_dim;
  storage_ = storage;
  page_table_ = page_table;
  int64_t in = spans.empty() ? 0 : Align(static_cast<int64_t>(SelectBatchDeviceBytes(spans.size())), 256);
  args_offset_ = in;
  in = Align(in + static_cast<int64_t>(writes.size() * sizeof(AppendArgs)), 256);
  max_tokens_x_layers_ = 0;
  write_places_.resize(writes.size());
  for (size_t i = 0; i < writes.size(); ++i) {
    const KeyWrite& w = writes[i];
    WritePlace& p = write_places_[i];
    // Only the blocks the write reaches travel, with its positions made relative to the first
    // of them: a decode step's write stages one page id, not its sequence's whole table.
    p.first_block = FirstBlock(w);
    p.blocks = (w.EndPosition() + kBlockSize - 1) / kBlockSize - p.first_block;
    p.key_bytes = w.num_tokens * w.layer_count * head_dim * 2;
    p.keys = in;
    in = Align(in + p.key_bytes, 16);
    p.table = in;
    in = Align(in + p.blocks * 4, 16);
    p.starts = in;
    in = Align(in + int64_t{w.layer_count} * 8, 16);
    max_tokens_x_layers_ = std::max(max_tokens_x_layers_, w.num_tokens * w.layer_count);
  }
  int64_t out = 0;
  span_places_.resize(spans.size());
  for (size_t i = 0; i < spans.size(); ++i) {
    const SpanSelect& s = spans[i].host;
    const int64_t rows = int64_t{s.num_tokens} * s.num_heads;
    const bool attn = s.attn_pages != nullptr;
    SpanPlace& p = span_places_[i];
    p.visible = VisibleBlocks(s.start_pos + s.num_tokens - 1);
    p.table = in;
    in = Align(in + p.visible * 4, 16);
    p.attn = in;
    if (attn) in = Align(in + p.visible * 4, 16);
    p.queries = in;
    in = Align(in + rows * head_dim * 2, 16);
    p.ids = out;
    out += rows * s.params.topk * 4;
    p.page_table = out;
    p.context_lens = out;
    if (attn) {
      out += rows * s.params.topk * page_table.pages_per_block * 4;
      p.context_lens = out;
      out += rows * 4;
    }
  }
  in_bytes_ = in;
  out_bytes_ = out;
}

std::optional<int32_t> StepStaging::WriteInputs(char* h, char* din, char* dout, PageRange pages,
                                                WriteTarget target, int num_sms,
                                                int decode_chunk_blocks) {
  for (size_t i = 0; i < writes_.size(); ++i) {
    const KeyWrite& w = writes_[i];
    const WritePlace& p = write_places_[i];
    if (auto bad = StageTable(w.block_table + p.first_block, p.blocks, pages,
                              reinterpret_cast<int32_t*>(h + p.table))) {
      return bad;
    }
    std::memcpy(h + p.keys, w.keys, p.key_bytes);
    int64_t* starts = reinterpret_cast<int64_t*>(h + p.starts);
    for (int l = 0; l < w.layer_count; ++l) starts[l] = w.layer_start[l] - p.first_block * kBlockSize;
    AppendArgs args;
    args.pool = target.pool;
    args.layer_bytes = target.layer_bytes;
    args.block_table = reinterpret_cast<const int32_t*>(din + p.table);
    args.layer_start = reinterpret_cast<const int64_t*>(din + p.starts);
    args.layer_begin = w.layer_begin;
    args.layer_count = w.layer_count;
    args.num_tokens = w.num_tokens;
    args.keys = reinterpret_cast<const uint16_t*>(din + p.keys);
    std::memcpy(h + args_offset_ + static_cast<int64_t>(i * sizeof(args)), &args, sizeof(args));
  }
  descs_.resize(spans_.size());
  paths_.resize(spans_.size());
  for (size_t i = 0; i < spans_.size(); ++i) {
    const SpanSelect& s = spans_[i].host;
    const SpanPlace& p = span_places_[i];
    const int64_t rows = int64_t{s.num_tokens} * s.num_heads;
    const bool attn = s.attn_pages != nullptr;
    // Global page ids become the pool's indices here, in the one copy into the staging.
    if (auto bad = StageTable(s.block_table, p.visible, pages, reinterpret_cast<int32_t*>(h + p.table))) {
      return bad;
    }
    if (attn) std::memcpy(h + p.attn, s.attn_pages, static_cast<size_t>(p.visible) * 4);
    std::memcpy(h + p.queries, s.queries, static_cast<size_t>(rows * head_dim_) * 2);
    SpanDesc& d = descs_[i];
    d = SpanDesc{};
    d.keys = spans_[i].keys;
    d.block_table = reinterpret_cast<const int32_t*>(din + p.table);
    d.attn_pages = attn ? reinterpret_cast<const int32_t*>(din + p.attn) : nullptr;
    d.queries = reinterpret_cast<const uint16_t*>(din + p.queries);
    d.block_ids = reinterpret_cast<int32_t*>(dout + p.ids);
    d.page_table = attn ? reinterpret_cast<int32_t*>(dout + p.page_table) : nullptr;
    d.context_lens = attn ? reinterpret_cast<int32_t*>(dout + p.context_lens) : nullptr;
    d.start_pos = s.start_pos;
    d.num_tokens = s.num_tokens;
    d.num_heads = s.num_heads;
    d.topk = s.params.topk;
    d.init_blocks = s.params.init_blocks;
    d.local_blocks = s.params.local_blocks;
    paths_[i] = spans_[i].path;
  }
  if (!spans_.empty()) {
    batch_ = PlanSelectBatch(descs_, paths_, num_sms, head_dim_, storage_, decode_chunk_blocks);
    batch_.WriteDevice(h);
  } else {
    batch_ = SelectBatch{};
  }
  return std::nullopt;
}

cudaError_t StepStaging::Describe(const char* din, float* scores, int* counters,
                                  LaunchList* out) const {
  if (!writes_.empty()) {
    const cudaError_t err = DescribeAppendKeysBatch(
        reinterpret_cast<const AppendArgs*>(din + args_offset_), static_cast<int>(writes_.size()),
        max_tokens_x_layers_, storage_, head_dim_, out);
    if (err != cudaSuccess) return err;
  }
  if (spans_.empty()) return cudaSuccess;
  return DescribeSelectBatch(batch_, reinterpret_cast<const SpanDesc*>(din), storage_, head_dim_,
                             page_table_, scores, counters, out);
}

void StepStaging::Scatter(const char* host_out) const {
  for (size_t i = 0; i < spans_.size(); ++i) {
    const SpanSelect& s = spans_[i].host;
    const SpanPlace& p = span_places_[i];
    const int64_t rows = int64_t{s.num_tokens} * s.num_heads;
    std::memcpy(s.block_ids, host_out + p.ids, static_cast<size_t>(rows * s.params.topk) * 4);
    if (s.attn_pages != nullptr) {
      std::memcpy(s.page_table, host_out + p.page_table,
                  static_cast<size_t>(rows * s.params.topk * page_table_.pages_per_block) * 4);
      std::memcpy(s.context_lens, host_out + p.context_lens, static_cast<size_t>(rows) * 4);
    }
  }
}

}  // namespace indexer::kernels::cuda
