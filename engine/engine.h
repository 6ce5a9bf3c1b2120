// Engine: the index-K cache service without any transport. It validates requests, keeps the
// page accounting and the sequence table, and runs selections on a KeyCacheBackend.
//
// Every method is thread-safe and may be called concurrently; calls on different sequences run
// in parallel, calls on one sequence are applied one at a time. Every failed request leaves the
// engine exactly as it found it. Errors are absl::Status values with a message naming the field
// and the limit: INVALID_ARGUMENT, NOT_FOUND, ALREADY_EXISTS, RESOURCE_EXHAUSTED,
// FAILED_PRECONDITION, DEADLINE_EXCEEDED, CANCELLED, or INTERNAL from the backend.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "engine/config.h"
#include "engine/key_cache_backend.h"
#include "engine/page_pool.h"
#include "engine/sequence_table.h"
#include "engine/wire_values.h"

namespace indexer::engine {

// Keys to append to one sequence (SPEC.md "Append"). Views into the caller's request.
struct AppendRequest {
  absl::string_view sequence_id;
  int64_t layer = 0;
  bool all_layers = false;  // keys are [n][layers][head_dim] instead of [n][head_dim]
  WireDtype dtype = WireDtype::kUnspecified;
  absl::string_view keys;
  std::span<const int32_t> attention_pages;  // one per block the append opens, or none
};

// One step for one sequence: an optional append, then a selection when `queries` is non-empty.
struct StepRequest {
  absl::string_view sequence_id;
  int64_t layer = 0;
  std::optional<AppendRequest> append;  // its sequence_id must be empty or equal
  std::optional<int64_t> start_position;
  int64_t num_heads = 0;
  WireDtype query_dtype = WireDtype::kUnspecified;
  absl::string_view queries;  // [n][H][head_dim]
  std::optional<int64_t> topk, init_blocks, local_blocks;
};

struct StepResult {
  bool created = false;        // the append created the sequence
  std::vector<int64_t> lengths;  // per layer, after the append
  int64_t num_blocks = 0;
  // The selection, when the step had queries.
  int num_tokens = 0;
  int num_heads = 0;
  int topk = 0;
  int64_t start_position = 0;
  std::vector<int32_t> block_ids;     // [n][H][topk]
  std::vector<int32_t> page_table;    // [n][H][topk * pages_per_block], with attention pages
  std::vector<int32_t> context_lens;  // [n][H], with attention pages
};

struct SequenceInfo {
  std::vector<int64_t> lengths;
  std::vector<int32_t> pages;
  std::vector<int32_t> attention_pages;
  int64_t shared_pages = 0;
};

struct TruncateResult {
  std::vector<int64_t> lengths;
  int64_t num_blocks = 0;
  int64_t pages_freed = 0;
};

struct ForkResult {
  std::vector<int64_t> lengths;
  int64_t num_blocks = 0;
  int64_t pages_shared = 0;
};

struct EngineStats {
  int64_t total_pages = 0;
  int64_t free_pages = 0;
  int64_t live_sequences = 0;
};

// Deadline and cancellation of the call a request belongs to. Checked before anything is
// applied; a request that has started applying runs to completion.
struct CallControl {
  absl::Time deadline = absl::InfiniteFuture();
  std::function<bool()> cancelled;  // may be empty
  absl::Status Check() const;
};

class Engine {
 public:
  // `config` must have passed Validate(). The backend must have been built for `config`.
  Engine(const EngineConfig& config, std::unique_ptr<KeyCacheBackend> backend);

  // Appends keys, creating the sequence on its first append.
  absl::StatusOr<StepResult> Append(const AppendRequest& request, const CallControl& control = {});

  // One append-and-select step; `queries` must be non-empty.
  absl::StatusOr<StepResult> Select(const StepRequest& request, const CallControl& control = {});

  // Many steps. Results are in item order, one status each. Items on different sequences are
  // selected together in one backend call; items on the same sequence apply in item order.
  std::vector<absl::StatusOr<StepResult>> Batch(std::span<const StepRequest> items,
                                                const CallControl& control = {});

  // Removes a sequence; returns the pages returned to the pool.
  absl::StatusOr<int64_t> Release(absl::string_view sequence_id);
  absl::StatusOr<TruncateResult> Truncate(absl::string_view sequence_id, int64_t length);
  absl::StatusOr<ForkResult> Fork(absl::string_view source_id, absl::string_view target_id,
                                  std::optional<int64_t> length);
  absl::StatusOr<SequenceInfo> Get(absl::string_view sequence_id) const;

  EngineStats Stats() const;
  const EngineConfig& config() const { return config_; }
  const KeyCacheBackend& backend() const { return *backend_; }

 private:
  struct PreparedAppend;
  struct PreparedStep;

  absl::Status PrepareAppend(const AppendRequest& request, absl::string_view step_sequence_id,
                             PreparedAppend* out) const;
  absl::Status PrepareStep(const StepRequest& request, PreparedStep* out) const;
  // Applies `append`. Pages it copied on write stay referenced in *replaced as (block, original
  // page): the caller releases them once the step has succeeded, or swaps them back.
  absl::Status ApplyAppend(Sequence& seq, const PreparedAppend& append,
                           std::vector<std::pair<int64_t, int32_t>>* replaced);
  absl::Status CheckSpan(const Sequence& seq, PreparedStep& step) const;
  // `budget`: bytes of answer the call may still return (negative: no limit).
  void RunWave(std::span<PreparedStep*> wave, std::vector<absl::StatusOr<StepResult>>& results,
               int64_t& budget);
  int64_t AnswerBytes(const PreparedStep& step, bool attn_pages) const;
  void ReleaseReplaced(const std::vector<std::pair<int64_t, int32_t>>& replaced);

  const EngineConfig config_;
  std::unique_ptr<KeyCacheBackend> backend_;
  PagePool pool_;
  SequenceTable sequences_;
};

}  // namespace indexer::engine
