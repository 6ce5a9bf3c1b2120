// ReadStepRequest: the append-and-select requests (AppendKeysRequest, SelectBlocksRequest,
// BatchRequest) read straight from their wire bytes into the engine's StepRequest views, with no
// message objects and no allocation per item: sequence ids, keys and queries are views into the
// request's bytes (keys and queries at an odd address are copied, all into one buffer, so that
// the engine reads them as bf16 in place). StepCall is its caller in the server: a decode step
// of hundreds of items would otherwise pay protobuf's message objects, string copies and their
// heap blocks item by item.
//
// The bytes are read as protobuf's generated parser reads these messages, which a test holds it
// to on generated and corrupted inputs: the last occurrence of a scalar, string or bytes field
// wins; a message field that occurs again merges into the first (so does an item's `append`);
// repeated fields append; attention_pages is read packed or not; fields of unknown numbers, or
// of a known number with another wire type, are skipped (groups included); string fields must be
// valid UTF-8; nesting is limited to protobuf's default of 100 levels. A request that does not
// read is INVALID_ARGUMENT, worded as ParseMessage words it.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "engine/step_request.h"
#include "server/regions/region_ref.h"

namespace indexer::server {

// A tensor an item passes by reference: which field of the request named it, and the reference.
struct ItemRef {
  enum Field : uint8_t { kKeys, kQueries, kBlockIds, kPageTable, kContextLens };
  uint32_t item = 0;
  Field field = kKeys;  // the append's keys_ref, queries_ref, or output_refs' fields
  RegionRefView ref;
};

// A request read: its items for the engine, the tensors they pass by reference (by item, at most
// one per field; most items have none), and the storage their attention pages view.
struct StepRequestWire {
  uint64_t request_id = 0;  // BatchRequest's
  std::vector<engine::StepRequest> items;
  std::vector<ItemRef> refs;  // in item order
  std::vector<int32_t> attention_pages;
  std::vector<uint16_t> aligned;  // keys and queries that arrived at odd addresses, copied
};

// The message a call's bytes hold.
enum class StepMessage { kAppendKeys, kSelectBlocks, kBatch };

// Reads `bytes` as `message` into *out (replacing what it held), the items in `tenant`. An
// AppendKeysRequest is one item with only an append, on the append's sequence and layer (layer
// 0 with all_layers); a SelectBlocksRequest is one item. The items view `bytes` and
// out->attention_pages and out->aligned, and `tenant`: all must outlive them.
absl::Status ReadStepRequest(StepMessage message, absl::string_view bytes,
                             absl::string_view tenant, StepRequestWire* out);

// The protobuf message type `message` names ("indexer.v1.BatchRequest"), for errors.
absl::string_view StepMessageName(StepMessage message);

}  // namespace indexer::server
