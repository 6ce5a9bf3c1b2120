#include "engine/config.h"

#include <limits>

#include "absl/strings/str_cat.h"

namespace indexer::engine {
namespace {

absl::Status OutOfRange(absl::string_view name, int64_t value, int64_t lo, int64_t hi) {
  return absl::InvalidArgumentError(
      absl::StrCat(name, " is ", value, "; it must be in [", lo, ", ", hi, "]"));
}

}  // namespace

std::string TenantLabel(absl::string_view tenant) {
  return tenant.empty() ? std::string("the default tenant") : absl::StrCat("tenant '", tenant, "'");
}

absl::Status EngineConfig::Validate() const {
  if (head_dim != 64 && head_dim != 128 && head_dim != 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("head_dim is ", head_dim, "; it must be 64, 128 or 256"));
  }
  if (layers < 1 || layers > 1024) return OutOfRange("layers", layers, 1, 1024);
  // Page ids are int32 and a page id times 128 indexes tokens in int64 everywhere.
  if (capacity_pages < 1 || capacity_pages > std::numeric_limits<int32_t>::max()) {
    return OutOfRange("capacity_pages", capacity_pages, 1, std::numeric_limits<int32_t>::max());
  }
  if (max_index_heads < 1 || max_index_heads > 128) {
    return OutOfRange("max_index_heads", max_index_heads, 1, 128);
  }
  if (max_topk < 1 || max_topk > 2048) return OutOfRange("max_topk", max_topk, 1, 2048);
  if (defaults.topk < 1 || defaults.topk > max_topk) {
    return OutOfRange("default topk", defaults.topk, 1, max_topk);
  }
  if (defaults.init_blocks < 0) return OutOfRange("default init_blocks", defaults.init_blocks, 0, 1 << 30);
  if (defaults.local_blocks < 0) return OutOfRange("default local_blocks", defaults.local_blocks, 0, 1 << 30);
  if (page_table.pages_per_block < 1 || page_table.pages_per_block > 128) {
    return OutOfRange("pages_per_block", page_table.pages_per_block, 1, 128);
  }
  if (page_table.block_page_stride < page_table.pages_per_block ||
      page_table.block_page_stride > 1024) {
    return OutOfRange("block_page_stride", page_table.block_page_stride,
                      page_table.pages_per_block, 1024);
  }
  // Block ids travel as int32 and the CUDA selector packs them in 32 bits.
  if (max_tokens_per_sequence < 1 || max_tokens_per_sequence > (int64_t{1} << 28)) {
    return OutOfRange("max_tokens_per_sequence", max_tokens_per_sequence, 1, int64_t{1} << 28);
  }
  if (max_query_tokens < 1 || max_query_tokens > (1 << 20)) {
    return OutOfRange("max_query_tokens", max_query_tokens, 1, 1 << 20);
  }
  if (max_batch_items < 1 || max_batch_items > (1 << 20)) {
    return OutOfRange("max_batch_items", max_batch_items, 1, 1 << 20);
  }
  if (max_sequences < 0 || max_sequences > (int64_t{1} << 30)) {
    return OutOfRange("max_sequences", max_sequences, 0, int64_t{1} << 30);
  }
  if (tenant_max_sequences < 0 || tenant_max_sequences > (int64_t{1} << 30)) {
    return OutOfRange("tenant_max_sequences", tenant_max_sequences, 0, int64_t{1} << 30);
  }
  if (max_select_scores < 1 || max_select_scores > (int64_t{1} << 31)) {
    return OutOfRange("max_select_scores", max_select_scores, 1, int64_t{1} << 31);
  }
  if (cpu_threads < 0 || cpu_threads > 4096) return OutOfRange("cpu_threads", cpu_threads, 0, 4096);
  // Batching: named as the server's flags name them.
  if (batching.max_tasks < 1 || batching.max_tasks > (1 << 20)) {
    return OutOfRange("batch_max_tasks", batching.max_tasks, 1, 1 << 20);
  }
  if (batching.max_delay_us < 0 || batching.max_delay_us > 1000000) {
    return OutOfRange("batch_max_delay_us", batching.max_delay_us, 0, 1000000);
  }
  if (batching.queue_bound < 1 || batching.queue_bound > (int64_t{1} << 24)) {
    return OutOfRange("batch_queue_bound", batching.queue_bound, 1, int64_t{1} << 24);
  }
  if (batching.max_inflight < 1 || batching.max_inflight > 16) {
    return OutOfRange("batch_max_inflight", batching.max_inflight, 1, 16);
  }
  return absl::OkStatus();
}

}  // namespace indexer::engine
