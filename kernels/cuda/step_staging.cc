#include "kernels/cuda/step_staging.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace indexer::kernels::cuda {
namespace {

int64_t Align(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

// How far ahead WriteInputs fetches spans' memory: enough misses in flight to hide a DRAM
// latency behind a few spans' copies, few enough not to evict what is being copied.
constexpr size_t kPrefetchSpansAhead = 4;

// Copies `n` page ids as id - pages.first; the first id outside the range, or nullopt. Checked
// branch-free in 32-bit lanes (the loop vectorises), the offender found only when there is one.
std::optional<int32_t> StageTable(const int32_t* ids, int64_t n, PageRange pages, int32_t* dst) {
  if (pages.first < 0 || pages.first > INT32_MAX) {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t local = int64_t{ids[i]} - pages.first;
      if (local < 0 || local >= pages.count) return ids[i];
      dst[i] = static_cast<int32_t>(local);
    }
    return std::nullopt;
  }
  // With 0 <= first < 2^31, id - first lies in (-2^32, 2^31 - first): taken mod 2^32, the ids in
  // range land in [0, count) and every other id lands at or above 2^31 - first, or at or above
  // count. `limit` caps count there, which no id in range reaches anyway.
  const uint32_t first = static_cast<uint32_t>(pages.first);
  const int64_t room = (int64_t{1} << 31) - pages.first;
  const uint32_t limit = static_cast<uint32_t>(std::clamp<int64_t>(pages.count, 0, room));
  uint32_t outside = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t local = static_cast<uint32_t>(ids[i]) - first;
    outside |= static_cast<uint32_t>(local >= limit);
    dst[i] = static_cast<int32_t>(local);
  }
  if (outside == 0) return std::nullopt;
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

int64_t ChunksOf(int64_t values) { return (values + kInputChunkValues - 1) / kInputChunkValues; }

}  // namespace

StepStaging::DeviceInput StepStaging::PlanDeviceInput(const uint16_t* src, int64_t dst,
                                                      int64_t values) {
  DeviceInput in{static_cast<int64_t>(chunks_.size()), ChunksOf(values)};
  for (int64_t c = 0; c < in.count; ++c) {
    const int64_t begin = c * kInputChunkValues;
    chunks_.push_back(PlannedChunk{src + begin, dst + begin * 2,
                                   std::min(kInputChunkValues, values - begin)});
  }
  return in;
}

void StepStaging::Plan(std::span<const KeyWrite> writes, std::span<const StagedSpan> spans,
                       int head_dim, KeyStorage storage, PageTableParams page_table) {
  writes_ = writes;
  spans_ = spans;
  head_dim_ = head_dim;
  storage_ = storage;
  page_table_ = page_table;
  chunks_.clear();
  int64_t num_chunks = 0;
  for (const KeyWrite& w : writes) {
    if (w.keys_on_device) num_chunks += ChunksOf(w.num_tokens * w.layer_count * head_dim);
  }
  for (const StagedSpan& s : spans) {
    if (s.host.queries_on_device) {
      num_chunks += ChunksOf(int64_t{s.host.num_tokens} * s.host.num_heads * head_dim);
    }
  }
  int64_t in = spans.empty() ? 0 : Align(static_cast<int64_t>(SelectBatchDeviceBytes(spans.size())), 256);
  args_offset_ = in;
  in = Align(in + static_cast<int64_t>(writes.size() * sizeof(AppendArgs)), 256);
  chunks_offset_ = in;
  in = Align(in + num_chunks * static_cast<int64_t>(sizeof(InputChunk)), 256);
  // Device inputs' copies are placed after the host part; their offsets are made absolute below.
  int64_t tail = 0;
  auto place_input = [&](bool on_device, int64_t bytes) {
    int64_t* at = on_device ? &tail : &in;
    const int64_t offset = *at;
    *at = Align(*at + bytes, 16);
    return offset;
  };
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
    p.keys = place_input(w.keys_on_device, p.key_bytes);
    p.table = in;
    in = Align(in + p.blocks * 4, 16);
    p.starts = in;
    in = Align(in + int64_t{w.layer_count} * 8, 16);
    max_tokens_x_layers_ = std::max(max_tokens_x_layers_, w.num_tokens * w.layer_count);
  }
  int64_t out = Align(num_chunks * static_cast<int64_t>(sizeof(InputScan)), 16);
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
    p.queries = place_input(s.queries_on_device, rows * head_dim * 2);
    if (s.outputs_on_device) continue;  // the kernels write the caller's memory directly
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
  const int64_t tail_begin = Align(in, 256);
  device_in_bytes_ = tail > 0 ? tail_begin + tail : in;
  for (size_t i = 0; i < writes.size(); ++i) {
    WritePlace& p = write_places_[i];
    if (!writes[i].keys_on_device) continue;
    p.keys += tail_begin;
    p.device = PlanDeviceInput(writes[i].keys, p.keys, p.key_bytes / 2);
  }
  for (size_t i = 0; i < spans.size(); ++i) {
    const SpanSelect& s = spans[i].host;
    SpanPlace& p = span_places_[i];
    if (!s.queries_on_device) continue;
    p.queries += tail_begin;
    p.device = PlanDeviceInput(s.queries, p.queries, int64_t{s.num_tokens} * s.num_heads * head_dim);
  }
  out_bytes_ = out;
}

std::optional<int32_t> StepStaging::WriteInputs(char* h, char* din, char* dout, PageRange pages,
                                                WriteTarget target, int num_sms,
                                                DecodeTuning tuning) {
  for (size_t i = 0; i < writes_.size(); ++i) {
    const KeyWrite& w = writes_[i];
    const WritePlace& p = write_places_[i];
    if (auto bad = StageTable(w.block_table + p.first_block, p.blocks, pages,
                              reinterpret_cast<int32_t*>(h + p.table))) {
      return bad;
    }
    if (!w.keys_on_device) std::memcpy(h + p.keys, w.keys, p.key_bytes);
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
  InputChunk* chunks = reinterpret_cast<InputChunk*>(h + chunks_offset_);
  for (size_t c = 0; c < chunks_.size(); ++c) {
    const PlannedChunk& planned = chunks_[c];
    chunks[c] = InputChunk{planned.src, reinterpret_cast<uint16_t*>(din + planned.dst), planned.values};
  }
  descs_.resize(spans_.size());
  paths_.resize(spans_.size());
  for (size_t i = 0; i < spans_.size(); ++i) {
    // Each span's table and queries are in memory of their own, cold after the engine's checks
    // of a large step: fetched a few spans ahead so that their first misses overlap this one's.
    if (i + kPrefetchSpansAhead < spans_.size()) {
      const SpanSelect& ahead = spans_[i + kPrefetchSpansAhead].host;
      __builtin_prefetch(ahead.block_table);
      if (ahead.attn_pages != nullptr) __builtin_prefetch(ahead.attn_pages);
      if (!ahead.queries_on_device) __builtin_prefetch(ahead.queries);
    }
    const SpanSelect& s = spans_[i].host;
    const SpanPlace& p = span_places_[i];
    const int64_t rows = int64_t{s.num_tokens} * s.num_heads;
    const bool attn = s.attn_pages != nullptr;
    // Global page ids become the pool's indices here, in the one copy into the staging.
    if (auto bad = StageTable(s.block_table, p.visible, pages, reinterpret_cast<int32_t*>(h + p.table))) {
      return bad;
    }
    if (attn) std::memcpy(h + p.attn, s.attn_pages, static_cast<size_t>(p.visible) * 4);
    if (!s.queries_on_device) {
      std::memcpy(h + p.queries, s.queries, static_cast<size_t>(rows * head_dim_) * 2);
    }
    SpanDesc& d = descs_[i];
    d = SpanDesc{};
    d.keys = spans_[i].keys;
    d.block_table = reinterpret_cast<const int32_t*>(din + p.table);
    d.attn_pages = attn ? reinterpret_cast<const int32_t*>(din + p.attn) : nullptr;
    d.queries = reinterpret_cast<const uint16_t*>(din + p.queries);
    if (s.outputs_on_device) {
      d.block_ids = s.block_ids;
      d.page_table = attn ? s.page_table : nullptr;
      d.context_lens = attn ? s.context_lens : nullptr;
    } else {
      d.block_ids = reinterpret_cast<int32_t*>(dout + p.ids);
      d.page_table = attn ? reinterpret_cast<int32_t*>(dout + p.page_table) : nullptr;
      d.context_lens = attn ? reinterpret_cast<int32_t*>(dout + p.context_lens) : nullptr;
    }
    d.start_pos = s.start_pos;
    d.num_tokens = s.num_tokens;
    d.num_heads = s.num_heads;
    d.topk = s.params.topk;
    d.init_blocks = s.params.init_blocks;
    d.local_blocks = s.params.local_blocks;
    paths_[i] = spans_[i].path;
  }
  if (!spans_.empty()) {
    batch_ = PlanSelectBatch(descs_, paths_, num_sms, head_dim_, storage_, tuning);
    batch_.WriteDevice(h);
  } else {
    batch_ = SelectBatch{};
  }
  return std::nullopt;
}

cudaError_t StepStaging::Describe(const char* din, char* dout, float* scores, int* counters,
                                  LaunchList* out) const {
  if (!chunks_.empty()) {
    const cudaError_t err = DescribeCopyInputs(
        reinterpret_cast<const InputChunk*>(din + chunks_offset_), static_cast<int>(chunks_.size()),
        reinterpret_cast<InputScan*>(dout), out);
    if (err != cudaSuccess) return err;
  }
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
  bool nonfinite = false;
  for (size_t i = 0; i < writes_.size(); ++i) {
    const KeyWrite& w = writes_[i];
    if (!w.keys_on_device) continue;
    (void)ReduceScans(write_places_[i].device, host_out, &nonfinite);
    if (w.keys_nonfinite != nullptr) *w.keys_nonfinite = nonfinite ? 1 : 0;
  }
  for (size_t i = 0; i < spans_.size(); ++i) {
    const SpanSelect& s = spans_[i].host;
    const SpanPlace& p = span_places_[i];
    if (s.queries_on_device) {
      (void)ReduceScans(p.device, host_out, &nonfinite);
      if (s.queries_nonfinite != nullptr) *s.queries_nonfinite = nonfinite ? 1 : 0;
    }
    if (s.outputs_on_device) continue;
    const int64_t rows = int64_t{s.num_tokens} * s.num_heads;
    std::memcpy(s.block_ids, host_out + p.ids, static_cast<size_t>(rows * s.params.topk) * 4);
    if (s.attn_pages != nullptr) {
      std::memcpy(s.page_table, host_out + p.page_table,
                  static_cast<size_t>(rows * s.params.topk * page_table_.pages_per_block) * 4);
      std::memcpy(s.context_lens, host_out + p.context_lens, static_cast<size_t>(rows) * 4);
    }
  }
}

Bf16Range StepStaging::ReduceScans(const DeviceInput& in, const char* host_out,
                                   bool* nonfinite) const {
  const InputScan* scans = reinterpret_cast<const InputScan*>(host_out) + in.first;
  uint32_t max_bits = 0;
  bool outside = false;
  *nonfinite = false;
  for (int64_t c = 0; c < in.count; ++c) {
    max_bits = std::max(max_bits, scans[c].max_bits);
    outside = outside || scans[c].outside_f16 != 0;
    *nonfinite = *nonfinite || scans[c].nonfinite != 0;
  }
  Bf16Range r;
  r.max_abs = Bf16ToFloat(static_cast<uint16_t>(max_bits));
  r.fits_f16 = !outside;
  return r;
}

std::optional<Bf16Range> StepStaging::WriteScan(size_t i, const char* host_out) const {
  if (!writes_[i].keys_on_device) return std::nullopt;
  bool nonfinite = false;
  return ReduceScans(write_places_[i].device, host_out, &nonfinite);
}

std::optional<Bf16Range> StepStaging::SpanScan(size_t i, const char* host_out) const {
  if (!spans_[i].host.queries_on_device) return std::nullopt;
  bool nonfinite = false;
  return ReduceScans(span_places_[i].device, host_out, &nonfinite);
}

}  // namespace indexer::kernels::cuda
