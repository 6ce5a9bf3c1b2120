// StepAnswer: the answer to one append-and-select call (an AppendKeysResponse, a
// SelectBlocksResponse or a BatchResponse), kept as plain values while the engine fills it and
// written to its wire bytes once, in one slice, with no message objects. StepCall owns one per
// call: the engine writes each item's selection outputs into memory this answer gives
// (Allocate), and the bytes are those protobuf's serializer writes for the same message (a test
// holds them to it), so that clients parse them with their generated code.
//
// Not thread-safe: the engine's OutputSink calls for one call come one at a time.
#pragma once

#include <grpcpp/support/byte_buffer.h>
#include <google/protobuf/arena.h>

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "engine/step_request.h"
#include "server/step_request_reader.h"

namespace indexer::server {

class StepAnswer {
 public:
  // An answer to `message` with `items` items (one for AppendKeys and SelectBlocks);
  // `request_id` is a BatchResponse's. `arena_bytes` sizes the first block of output memory.
  StepAnswer(StepMessage message, size_t items, uint64_t request_id, size_t arena_bytes);
  StepAnswer(const StepAnswer&) = delete;
  StepAnswer& operator=(const StepAnswer&) = delete;

  // Zeroed memory for item `item`'s outputs of `shape` (a field of 0 values gets none); it stays
  // valid as long as this answer.
  engine::SelectOutputs Allocate(size_t item, const engine::SelectShape& shape);
  // Item `item`'s lengths per layer after its append.
  void KeepLengths(size_t item, std::span<const int64_t> lengths);

  // Item `item` succeeded with `result` (its outputs and lengths as Allocate and KeepLengths
  // kept them); `pages_per_block` is reported when the selection has a page table.
  void Succeeded(size_t item, const engine::StepResult& result, int pages_per_block);
  // Item `item` failed: its answer is `status` alone, whatever outputs it was given.
  void Failed(size_t item, const absl::Status& status);

  // The answer's wire bytes, as one slice, into *out (replacing what it held). Every item must
  // have Succeeded or Failed; for AppendKeys and SelectBlocks only a success is written (a
  // failure is the call's status).
  void Write(grpc::ByteBuffer* out) const;

 private:
  struct Item {
    bool ok = false;
    uint32_t code = 0;
    std::string message;
    bool created = false;
    uint32_t num_blocks = 0;
    uint32_t num_tokens = 0, num_heads = 0, topk = 0, pages_per_block = 0;
    int64_t start_position = 0;
    std::span<const int32_t> block_ids, page_table, context_lens;
    std::span<const uint32_t> lengths;
  };
  size_t SelectSize(const Item& item) const;
  uint8_t* WriteSelect(const Item& item, uint8_t* p) const;
  size_t ItemSize(const Item& item, size_t select_size) const;

  const StepMessage message_;
  const uint64_t request_id_;
  google::protobuf::Arena arena_;
  std::vector<Item> items_;
};

}  // namespace indexer::server
