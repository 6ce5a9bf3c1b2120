// Engine requests of bf16 keys and queries, as tests build them. Requests view their bytes
// (absl::string_view, std::span): the strings and vectors passed in must outlive the request.
// Header-only.
#pragma once

#include <cstdint>
#include <span>

#include "absl/strings/string_view.h"
#include "engine/engine.h"

namespace indexer::testing {

// Appends bf16 `keys` ([n][head_dim], or [n][layers][head_dim] with all_layers) to `id`.
inline engine::AppendRequest Bf16Append(absl::string_view id, int64_t layer, absl::string_view keys,
                                        bool all_layers = false, std::span<const int32_t> attention_pages = {}) {
  return engine::AppendRequest{id, layer, all_layers, engine::WireDtype::kBf16, keys, attention_pages};
}

// Selects with bf16 `queries` ([n][heads][head_dim]) on `layer` of `id`, at the end of the
// sequence and with the engine's default parameters unless the caller sets them.
inline engine::StepRequest Bf16Select(absl::string_view id, int64_t layer, int64_t heads, absl::string_view queries) {
  engine::StepRequest r;
  r.sequence_id = id;
  r.layer = layer;
  r.num_heads = heads;
  r.query_dtype = engine::WireDtype::kBf16;
  r.queries = queries;
  return r;
}

}  // namespace indexer::testing
