// Request validation: every check on a request that does not depend on a sequence's state, in
// one place, and the prepared form the engine runs. Engine::Batch prepares every item before it
// applies anything; checks that need the sequence (span bounds, attention pages, pool space) run
// under the sequence's lock (engine/wave.h).
//
// Errors are INVALID_ARGUMENT with a message naming the field and the limit. Pure functions of
// the config and the request: callable from any thread.
#pragma once

#include <cstdint>
#include <optional>
#include <span>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "engine/config.h"
#include "engine/step_request.h"
#include "engine/wire_values.h"
#include "kernels/select_types.h"

namespace indexer::engine {

// Sequence ids (and fork targets) are 1 to this many bytes.
inline constexpr size_t kMaxIdBytes = 256;

absl::Status CheckId(absl::string_view id, absl::string_view field);
// INVALID_ARGUMENT "<field> is <value>; it must be in [lo, hi]".
absl::Status RangeError(absl::string_view field, int64_t value, int64_t lo, int64_t hi);
// OK when lo <= value <= hi, else RangeError. Inline: every item of every call checks several.
inline absl::Status CheckRange(absl::string_view field, int64_t value, int64_t lo, int64_t hi) {
  if (value < lo || value > hi) [[unlikely]] return RangeError(field, value, lo, hi);
  return absl::OkStatus();
}

// An append whose request passed every check. `keys` and `attn` view the request's memory.
struct PreparedAppend {
  int layer_begin = 0;
  int layer_count = 1;
  int64_t num_tokens = 0;
  Bf16Rows keys;                    // [num_tokens][layer_count][head_dim]
  int keys_device = kHostTensor;    // where the keys live (wire_values.h)
  std::span<const int32_t> attn;    // attention pages for the blocks it opens
};

// A step whose request passed every check (views into the request).
struct PreparedStep {
  size_t index = 0;  // the item's position in its call
  absl::string_view tenant;
  absl::string_view sequence_id;
  int layer = 0;
  bool has_append = false;
  PreparedAppend append;
  bool has_select = false;
  std::optional<int64_t> start_position;
  int num_heads = 0;
  int num_tokens = 0;
  Bf16Rows queries;  // [num_tokens][num_heads][head_dim]
  int queries_device = kHostTensor;  // where the queries live (wire_values.h)
  kernels::SelectParams params;
  ProvidedOutputs outputs;  // checked to hold the selection's full shape

  // Tokens layer `l` of its sequence gains from this step's append.
  int64_t AppendedTo(int l) const {
    return has_append && l >= append.layer_begin && l < append.layer_begin + append.layer_count
               ? append.num_tokens
               : 0;
  }
};

// Checks `request` against `config` and fills *out (index aside). The request's memory must
// outlive *out.
absl::Status PrepareStep(const EngineConfig& config, const StepRequest& request, PreparedStep* out);

// Bytes of answer an item takes at most, beside its results: status code, lengths and the
// message envelope. An item that fails carries a message of at most kMaxLateMessageBytes bytes
// beside its sequence id when it fails after preparation (AnswerBudget reserves that much).
inline constexpr int64_t kItemEnvelopeBytes = 32;
inline constexpr int64_t kMaxLateMessageBytes = 192;

// Bytes of answer a successful step takes: the envelope, its lengths and its results (packed
// int32), with the page table when the sequence has attention pages; outputs written to
// provided memory take none.
int64_t AnswerBytes(const EngineConfig& config, const PreparedStep& step, bool attn_pages);

// Bytes of answer a failed item takes with this status (its message as sent: at most
// MessageLimit(id) bytes for a late failure).
int64_t ErrorAnswerBytes(const absl::Status& status);

// What a call's answer may still take (max_response_bytes, or no limit). Every item starts
// with a reservation for the error it may end with, so that however items fail the answer
// stays within the limit; a success takes what its results need beyond that.
class AnswerBudget {
 public:
  // `limit` <= 0: no limit.
  explicit AnswerBudget(int64_t limit) : left_(limit > 0 ? limit : -1), limit_(limit) {}

  bool unlimited() const { return left_ < 0; }
  int64_t left() const { return left_; }
  int64_t limit() const { return limit_; }
  // Takes `bytes` when they fit (always, without a limit); false, taking nothing, otherwise.
  bool Take(int64_t bytes);
  void Give(int64_t bytes);

 private:
  int64_t left_;
  int64_t limit_;
};

// The longest message an item that fails after preparation carries (its status is truncated to
// it), and the reservation it is answered within.
int64_t LateMessageLimit(absl::string_view sequence_id);
int64_t LateErrorReservation(absl::string_view sequence_id);
// `status` with its message cut to LateMessageLimit(sequence_id).
absl::Status LimitLateMessage(absl::Status status, absl::string_view sequence_id);

}  // namespace indexer::engine
