// EngineConfig: everything that fixes the shape of the cache and the limits of requests.
// Built once at start (the server fills it from flags) and immutable afterwards.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "kernels/numeric.h"
#include "kernels/select_types.h"

namespace indexer::engine {

// Tenants scope sequence ids: two tenants may use the same id for different sequences, and no
// call of one tenant reaches another's. Callers that do not authenticate share the default
// tenant, "". Tenant names never hold a NUL byte (the server's come from its token file).
inline constexpr absl::string_view kDefaultTenant = "";

// "tenant 'name'", or "the default tenant", for messages.
std::string TenantLabel(absl::string_view tenant);

// How the SelectBatcher merges the selections of concurrent calls into backend launches
// (engine/select_batcher.h). The server's flags --batching and --batch_* fill it.
struct BatcherConfig {
  bool enabled = true;         // false: every call runs its own backend Select on its own thread
  int max_tasks = 256;         // span selections one launch gathers before it starts
  int64_t max_delay_us = 0;    // the longest a queued selection waits for more (0: none)
  int64_t queue_bound = 8192;  // span selections waiting at once; more are refused
  int max_inflight = 2;        // backend Select calls running at once, per device
};

struct EngineConfig {
  int head_dim = 128;                  // 64, 128 or 256
  int layers = 1;                      // caches sharing each sequence's block table
  kernels::KeyStorage key_storage = kernels::KeyStorage::kBf16;
  int64_t capacity_pages = 8192;       // pages in the pool (each holds one block, every layer)
  int max_index_heads = 16;            // H limit per request
  int max_topk = 256;                  // topk limit per request
  kernels::SelectParams defaults;      // topk / init_blocks / local_blocks when a request omits them
  kernels::PageTableParams page_table; // pages_per_block, block_page_stride
  int64_t max_tokens_per_sequence = int64_t{1} << 20;
  int max_query_tokens = 16384;        // n limit of one select span
  int max_batch_items = 4096;          // items of one Batch call
  // Sequences held at once, every tenant together (0: no limit). Each costs memory even with
  // no pages (forks of length 0, truncation to 0), so the default bounds it.
  int64_t max_sequences = 65536;
  // Sequences one tenant may hold at once (0: no limit but max_sequences), so that one tenant
  // cannot fill max_sequences (with zero-page forks, say) and lock the others out.
  int64_t tenant_max_sequences = 0;
  // Raw block scores (4 bytes each) one span may need, and one backend call may hold: a span
  // over more is refused (RESOURCE_EXHAUSTED), a wave over more is selected in several calls.
  int64_t max_select_scores = int64_t{1} << 28;
  int cpu_threads = 0;                 // CPU backend workers; 0 = hardware concurrency
  int64_t max_response_bytes = 0;      // largest answer of one call (0: no limit)
  BatcherConfig batching;

  // Bytes one page occupies across all layers.
  int64_t BytesPerPage() const {
    return kernels::PageBytes(key_storage, head_dim) * layers;
  }
  int64_t MaxBlocksPerSequence() const {
    return (max_tokens_per_sequence + kernels::kBlockSize - 1) / kernels::kBlockSize;
  }

  // INVALID_ARGUMENT naming the first setting out of range, else OK.
  absl::Status Validate() const;
};

// "bf16", "fp8" or "fp4".
using kernels::KeyStorageName;

}  // namespace indexer::engine
