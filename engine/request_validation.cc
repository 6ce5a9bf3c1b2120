#include "engine/request_validation.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "engine/status_macros.h"

namespace indexer::engine {
namespace {

// init/local block counts past any sequence's block count mean "every block"; clamping keeps
// arithmetic in int.
constexpr int64_t kMaxForcedBlocks = int64_t{1} << 30;

// INVALID_ARGUMENT when the caller's `num_tokens` disagrees with the rows its bytes hold.
absl::Status CheckDeclaredTokens(absl::string_view field, std::optional<int64_t> declared,
                                 int64_t rows, int64_t row_values) {
  if (!declared || *declared == rows) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      field, " holds ", rows, " tokens of ", row_values, " values, but num_tokens says ", *declared,
      ": the array's shape does not match the server's (check head_dim, layers and num_heads in "
      "ServerInfo)"));
}

absl::Status PrepareAppend(const EngineConfig& config, const AppendRequest& r,
                           absl::string_view step_sequence_id, PreparedAppend* out) {
  if (!r.sequence_id.empty() && r.sequence_id != step_sequence_id) {
    return absl::InvalidArgumentError(absl::StrCat("append.sequence_id '", r.sequence_id,
                                                   "' differs from the request's sequence_id '",
                                                   step_sequence_id, "'"));
  }
  if (r.all_layers) {
    out->layer_begin = 0;
    out->layer_count = config.layers;
  } else {
    INDEXER_RETURN_IF_ERROR(CheckRange("layer", r.layer, 0, config.layers - 1));
    out->layer_begin = static_cast<int>(r.layer);
    out->layer_count = 1;
  }
  const int64_t row = int64_t{out->layer_count} * config.head_dim;
  out->keys_device = r.keys_device;
  INDEXER_RETURN_IF_ERROR(r.keys_device != kHostTensor
                              ? DeviceRowsView(r.keys, r.dtype, row, "keys", &out->keys)
                              : DecodeRowsView(r.keys, r.dtype, row, "keys", &out->keys));
  out->num_tokens = out->keys.rows;
  INDEXER_RETURN_IF_ERROR(CheckDeclaredTokens("keys", r.num_tokens, out->num_tokens, row));
  if (out->num_tokens > config.max_tokens_per_sequence) {
    return absl::InvalidArgumentError(
        absl::StrCat("keys hold ", out->num_tokens, " tokens; max_tokens_per_sequence is ",
                     config.max_tokens_per_sequence));
  }
  // The last entry of a page-table row, id * block_page_stride + pages_per_block - 1, fits int32.
  const int64_t max_attn =
      (int64_t{std::numeric_limits<int32_t>::max()} - config.page_table.pages_per_block + 1) /
      config.page_table.block_page_stride;
  // The field's name is built only for the entry that fails.
  for (size_t i = 0; i < r.attention_pages.size(); ++i) {
    const int64_t page = r.attention_pages[i];
    if (page < 0 || page > max_attn) [[unlikely]] {
      return RangeError(absl::StrCat("attention_pages[", i, "]"), page, 0, max_attn);
    }
  }
  out->attn = r.attention_pages;
  return absl::OkStatus();
}

// INVALID_ARGUMENT when provided memory for an output is non-empty but smaller than its shape.
absl::Status CheckProvided(absl::string_view output, std::span<const int32_t> provided,
                           int64_t values) {
  if (provided.empty() || static_cast<int64_t>(provided.size()) >= values) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "the ", output, " output reference holds ", provided.size() * sizeof(int32_t),
      " bytes; this selection writes ", values * int64_t{sizeof(int32_t)}));
}

absl::Status PrepareSelect(const EngineConfig& config, const StepRequest& r, PreparedStep* out) {
  INDEXER_RETURN_IF_ERROR(CheckRange("num_heads", r.num_heads, 1, config.max_index_heads));
  out->num_heads = static_cast<int>(r.num_heads);
  const int64_t row = r.num_heads * config.head_dim;
  out->queries_device = r.queries_device;
  INDEXER_RETURN_IF_ERROR(
      r.queries_device != kHostTensor
          ? DeviceRowsView(r.queries, r.query_dtype, row, "queries", &out->queries)
          : DecodeRowsView(r.queries, r.query_dtype, row, "queries", &out->queries));
  const int64_t n = out->queries.rows;
  INDEXER_RETURN_IF_ERROR(CheckDeclaredTokens("queries", r.num_tokens, n, row));
  INDEXER_RETURN_IF_ERROR(CheckRange("query tokens (queries rows)", n, 1, config.max_query_tokens));
  out->num_tokens = static_cast<int>(n);
  if (r.start_position && *r.start_position < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("start_position is ", *r.start_position, "; it must be >= 0"));
  }
  out->start_position = r.start_position;
  const int64_t topk = r.topk.value_or(config.defaults.topk);
  INDEXER_RETURN_IF_ERROR(CheckRange("topk", topk, 1, config.max_topk));
  const int64_t init = r.init_blocks.value_or(config.defaults.init_blocks);
  const int64_t local = r.local_blocks.value_or(config.defaults.local_blocks);
  INDEXER_RETURN_IF_ERROR(CheckRange("init_blocks", init, 0, std::numeric_limits<int64_t>::max()));
  INDEXER_RETURN_IF_ERROR(CheckRange("local_blocks", local, 0, std::numeric_limits<int64_t>::max()));
  out->params.topk = static_cast<int>(topk);
  out->params.init_blocks = static_cast<int>(std::min(init, kMaxForcedBlocks));
  out->params.local_blocks = static_cast<int>(std::min(local, kMaxForcedBlocks));
  const int64_t rows = n * r.num_heads;
  INDEXER_RETURN_IF_ERROR(CheckProvided("block_ids", r.outputs.block_ids, rows * topk));
  INDEXER_RETURN_IF_ERROR(CheckProvided(
      "page_table", r.outputs.page_table, rows * topk * config.page_table.pages_per_block));
  INDEXER_RETURN_IF_ERROR(CheckProvided("context_lens", r.outputs.context_lens, rows));
  if (r.outputs.device != kHostTensor && (r.outputs.block_ids.empty() || r.outputs.page_table.empty() ||
                                r.outputs.context_lens.empty())) {
    return absl::InvalidArgumentError(
        "outputs in a CUDA region must name all three references (block_ids, page_table, "
        "context_lens); the last two are written only when the sequence has attention pages");
  }
  out->outputs = r.outputs;
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckId(absl::string_view id, absl::string_view field) {
  if (id.empty() || id.size() > kMaxIdBytes) {
    return absl::InvalidArgumentError(absl::StrCat(field, " has ", id.size(),
                                                   " bytes; it must have 1 to ", kMaxIdBytes));
  }
  return absl::OkStatus();
}

absl::Status RangeError(absl::string_view field, int64_t value, int64_t lo, int64_t hi) {
  return absl::InvalidArgumentError(
      absl::StrCat(field, " is ", value, "; it must be in [", lo, ", ", hi, "]"));
}

absl::Status PrepareStep(const EngineConfig& config, const StepRequest& r, PreparedStep* out) {
  if (!r.refused.ok()) return r.refused;
  INDEXER_RETURN_IF_ERROR(CheckId(r.sequence_id, "sequence_id"));
  INDEXER_RETURN_IF_ERROR(CheckRange("layer", r.layer, 0, config.layers - 1));
  out->tenant = r.tenant;
  out->sequence_id = r.sequence_id;
  out->layer = static_cast<int>(r.layer);
  out->has_append = r.append.has_value();
  if (out->has_append) {
    INDEXER_RETURN_IF_ERROR(PrepareAppend(config, *r.append, r.sequence_id, &out->append));
  }
  out->has_select = !r.queries.empty();
  if (!out->has_select) {
    if (!out->has_append) {
      return absl::InvalidArgumentError("queries is empty and there is no append: nothing to do");
    }
    return absl::OkStatus();
  }
  return PrepareSelect(config, r, out);
}

int64_t AnswerBytes(const EngineConfig& config, const PreparedStep& s, bool attn_pages) {
  // Results are packed int32; allow for field tags, lengths and the per-item envelope.
  int64_t bytes = 64 + int64_t{8} * config.layers;
  if (s.has_select) {
    const int64_t rows = int64_t{s.num_tokens} * s.num_heads;
    if (s.outputs.block_ids.empty()) bytes += 4 * rows * s.params.topk;
    if (attn_pages && s.outputs.page_table.empty()) {
      bytes += 4 * rows * int64_t{s.params.topk} * config.page_table.pages_per_block;
    }
    if (attn_pages && s.outputs.context_lens.empty()) bytes += 4 * rows;
  }
  return bytes;
}

int64_t ErrorAnswerBytes(const absl::Status& status) {
  return kItemEnvelopeBytes + static_cast<int64_t>(status.message().size());
}

bool AnswerBudget::Take(int64_t bytes) {
  if (left_ < 0 || bytes <= 0) return true;
  if (bytes > left_) return false;
  left_ -= bytes;
  return true;
}

void AnswerBudget::Give(int64_t bytes) {
  if (left_ >= 0 && bytes > 0) left_ += bytes;
}

int64_t LateMessageLimit(absl::string_view sequence_id) {
  return kMaxLateMessageBytes + static_cast<int64_t>(sequence_id.size());
}

int64_t LateErrorReservation(absl::string_view sequence_id) {
  return kItemEnvelopeBytes + LateMessageLimit(sequence_id);
}

absl::Status LimitLateMessage(absl::Status status, absl::string_view sequence_id) {
  const size_t limit = static_cast<size_t>(LateMessageLimit(sequence_id));
  const absl::string_view message = status.message();
  if (message.size() <= limit) return status;
  // Cut before a character, not inside one: the answer's message field must stay UTF-8, or
  // clients could not parse the answer at all.
  size_t keep = limit - 3;
  while (keep > 0 && (static_cast<unsigned char>(message[keep]) & 0xC0) == 0x80) --keep;
  return absl::Status(status.code(), absl::StrCat(message.substr(0, keep), "..."));
}

}  // namespace indexer::engine
