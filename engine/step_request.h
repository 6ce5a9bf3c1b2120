// The engine's request and result types for appends and selections (Engine::Append, Select,
// Batch). Requests are views into the caller's memory: nothing is copied until the engine stores
// keys or stages a selection, so the caller keeps the request alive until its answer.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "engine/config.h"
#include "engine/wire_values.h"

namespace indexer::engine {

// Keys to append to one sequence (SPEC.md "Append").
struct AppendRequest {
  absl::string_view sequence_id;
  int64_t layer = 0;
  bool all_layers = false;  // keys are [n][layers][head_dim] instead of [n][head_dim]
  WireDtype dtype = WireDtype::kUnspecified;
  absl::string_view keys;
  std::span<const int32_t> attention_pages;  // one per block the append opens, or none
  // The caller's tenant (last, so that positional initialisers need not name it). Inside a
  // StepRequest the step's tenant counts and this one is ignored.
  absl::string_view tenant = kDefaultTenant;
  // The tokens the caller says `keys` holds; checked against the byte size when set.
  std::optional<int64_t> num_tokens;
  // Where `keys` lives (wire_values.h): kHostTensor, or memory a device reads in place -- BF16
  // only (DeviceRowsView), stored only by a backend that TakesDeviceTensors of it; a sequence on
  // another device fails with FAILED_PRECONDITION.
  int keys_device = kHostTensor;
};

// Caller memory a selection writes its outputs to instead of the OutputSink's (the server
// points them into a client's shared-memory region). Each span, when non-empty, must hold the
// output's full shape whatever the sequence's attention pages (int32 [n][H][topk] block ids,
// [n][H][topk * pages_per_block] page table, [n][H] context lengths): PrepareStep checks it.
struct ProvidedOutputs {
  std::span<int32_t> block_ids;
  std::span<int32_t> page_table;
  std::span<int32_t> context_lens;
  // Where every non-empty span above lives (as AppendRequest::keys_device).
  int device = kHostTensor;
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
  absl::string_view tenant = kDefaultTenant;  // the caller's tenant
  // The query tokens the caller says `queries` holds; checked against the byte size when set.
  std::optional<int64_t> num_tokens;
  ProvidedOutputs outputs;
  int queries_device = kHostTensor;  // as AppendRequest::keys_device, for `queries`
  // Not OK when the caller found the item unusable while building it (a tensor reference that
  // does not resolve): the item fails with this status before any other check, applying nothing.
  absl::Status refused;
};

// Where a selection's outputs go, when the caller provides them (the server points them into
// its response): int32 [n][H][topk] block ids, and with attention pages the page-table rows and
// context lengths.
struct SelectOutputs {
  int32_t* block_ids = nullptr;
  int32_t* page_table = nullptr;
  int32_t* context_lens = nullptr;
};

// The shape of one item's selection outputs, in int32 values.
struct SelectShape {
  int64_t block_ids = 0;
  int64_t page_table = 0;    // 0 without attention pages
  int64_t context_lens = 0;  // 0 without attention pages
};

// Gives the memory a call's selection outputs are written to. Called once for each item whose
// selection is about to run (not for items that fail before), from the engine's threads; the
// memory must stay valid and untouched until the call's answer. Without a sink the engine writes
// the outputs into StepResult's vectors.
class OutputSink {
 public:
  virtual ~OutputSink() = default;
  virtual SelectOutputs Allocate(size_t item, const SelectShape& shape) = 0;
  // The item's lengths after its append (per layer), once, when the item applies (it may still
  // be rolled back and fail). A sink that keeps them returns true, and StepResult::lengths stays
  // empty; the default leaves them to StepResult.
  virtual bool KeepLengths(size_t /*item*/, std::span<const int64_t> /*lengths*/) { return false; }
};

struct StepResult {
  bool created = false;        // the append created the sequence
  std::vector<int64_t> lengths;  // per layer, after the append (unless an OutputSink kept them)
  int64_t num_blocks = 0;
  // The selection, when the step had queries.
  int num_tokens = 0;
  int num_heads = 0;
  int topk = 0;
  int64_t start_position = 0;
  bool has_page_table = false;  // the sequence has attention pages: page_table and context_lens
  // The outputs, unless the call gave an OutputSink (which then holds them).
  std::vector<int32_t> block_ids;     // [n][H][topk]
  std::vector<int32_t> page_table;    // [n][H][topk * pages_per_block], with attention pages
  std::vector<int32_t> context_lens;  // [n][H], with attention pages
};

}  // namespace indexer::engine
