#include "server/step_answer.h"

#include <google/protobuf/io/coded_stream.h>
#include <grpcpp/support/slice.h>

#include <algorithm>
#include <cstring>

namespace indexer::server {
namespace {

// Field tags of the answers (field number << 3 | wire type; 0 varint, 2 length-delimited).
constexpr uint8_t Tag(int field, int type) { return static_cast<uint8_t>(field << 3 | type); }

using google::protobuf::io::CodedOutputStream;

size_t VarintSize(uint64_t v) { return CodedOutputStream::VarintSize64(v); }
uint8_t* PutVarint(uint64_t v, uint8_t* p) { return CodedOutputStream::WriteVarint64ToArray(v, p); }

// A varint field, left out when 0 (proto3).
size_t VarintFieldSize(uint64_t v) { return v == 0 ? 0 : 1 + VarintSize(v); }
uint8_t* PutVarintField(uint8_t tag, uint64_t v, uint8_t* p) {
  if (v == 0) return p;
  *p++ = tag;
  return PutVarint(v, p);
}

// A length-delimited field of `size` bytes.
size_t LengthFieldSize(size_t size) { return 1 + VarintSize(size) + size; }
uint8_t* PutLength(uint8_t tag, size_t size, uint8_t* p) {
  *p++ = tag;
  return PutVarint(size, p);
}

// A bytes field of int32 values, left out when empty.
size_t Int32sFieldSize(std::span<const int32_t> v) {
  return v.empty() ? 0 : LengthFieldSize(v.size_bytes());
}
uint8_t* PutInt32sField(uint8_t tag, std::span<const int32_t> v, uint8_t* p) {
  if (v.empty()) return p;
  p = PutLength(tag, v.size_bytes(), p);
  std::memcpy(p, v.data(), v.size_bytes());  // little-endian, as the proto says
  return p + v.size_bytes();
}

// A packed repeated uint32 field, left out when empty.
size_t PackedSize(std::span<const uint32_t> v) {
  size_t n = 0;
  for (uint32_t x : v) n += VarintSize(x);
  return n;
}
size_t PackedFieldSize(std::span<const uint32_t> v) {
  return v.empty() ? 0 : LengthFieldSize(PackedSize(v));
}
uint8_t* PutPackedField(uint8_t tag, std::span<const uint32_t> v, uint8_t* p) {
  if (v.empty()) return p;
  p = PutLength(tag, PackedSize(v), p);
  for (uint32_t x : v) p = PutVarint(x, p);
  return p;
}

google::protobuf::ArenaOptions ArenaOptionsFor(size_t bytes) {
  google::protobuf::ArenaOptions o;
  o.start_block_size = std::clamp<size_t>(bytes, 4096, size_t{1} << 20);
  o.max_block_size = size_t{1} << 22;
  return o;
}

}  // namespace

StepAnswer::StepAnswer(StepMessage message, size_t items, uint64_t request_id, size_t arena_bytes)
    : message_(message),
      request_id_(request_id),
      arena_(ArenaOptionsFor(arena_bytes)),
      items_(items) {}

engine::SelectOutputs StepAnswer::Allocate(size_t item, const engine::SelectShape& shape) {
  Item& it = items_[item];
  auto take = [this](int64_t values, std::span<const int32_t>* kept) -> int32_t* {
    if (values <= 0) return nullptr;
    int32_t* memory = google::protobuf::Arena::CreateArray<int32_t>(&arena_, values);
    std::memset(memory, 0, static_cast<size_t>(values) * sizeof(int32_t));
    *kept = std::span<const int32_t>(memory, static_cast<size_t>(values));
    return memory;
  };
  engine::SelectOutputs out;
  out.block_ids = take(shape.block_ids, &it.block_ids);
  out.page_table = take(shape.page_table, &it.page_table);
  out.context_lens = take(shape.context_lens, &it.context_lens);
  return out;
}

void StepAnswer::KeepLengths(size_t item, std::span<const int64_t> lengths) {
  uint32_t* kept = google::protobuf::Arena::CreateArray<uint32_t>(&arena_, lengths.size());
  for (size_t i = 0; i < lengths.size(); ++i) kept[i] = static_cast<uint32_t>(lengths[i]);
  items_[item].lengths = std::span<const uint32_t>(kept, lengths.size());
}

void StepAnswer::Succeeded(size_t item, const engine::StepResult& r, int pages_per_block) {
  Item& it = items_[item];
  it.ok = true;
  it.code = 0;
  it.created = r.created;
  it.num_blocks = static_cast<uint32_t>(r.num_blocks);
  it.num_tokens = static_cast<uint32_t>(r.num_tokens);
  it.num_heads = static_cast<uint32_t>(r.num_heads);
  it.topk = static_cast<uint32_t>(r.topk);
  it.start_position = r.start_position;
  it.pages_per_block = r.has_page_table ? static_cast<uint32_t>(pages_per_block) : 0;
}

void StepAnswer::Failed(size_t item, const absl::Status& status) {
  Item& it = items_[item];
  it = Item();  // outputs given before a roll-back are not answered
  it.code = static_cast<uint32_t>(status.code());
  it.message = std::string(status.message());
}

size_t StepAnswer::SelectSize(const Item& it) const {
  return VarintFieldSize(it.num_tokens) + VarintFieldSize(it.num_heads) +
         VarintFieldSize(it.topk) + VarintFieldSize(static_cast<uint64_t>(it.start_position)) +
         Int32sFieldSize(it.block_ids) + Int32sFieldSize(it.page_table) +
         Int32sFieldSize(it.context_lens) + VarintFieldSize(it.pages_per_block) +
         PackedFieldSize(it.lengths);
}

uint8_t* StepAnswer::WriteSelect(const Item& it, uint8_t* p) const {
  p = PutVarintField(Tag(1, 0), it.num_tokens, p);
  p = PutVarintField(Tag(2, 0), it.num_heads, p);
  p = PutVarintField(Tag(3, 0), it.topk, p);
  p = PutVarintField(Tag(4, 0), static_cast<uint64_t>(it.start_position), p);
  p = PutInt32sField(Tag(5, 2), it.block_ids, p);
  p = PutInt32sField(Tag(6, 2), it.page_table, p);
  p = PutInt32sField(Tag(7, 2), it.context_lens, p);
  p = PutVarintField(Tag(8, 0), it.pages_per_block, p);
  return PutPackedField(Tag(9, 2), it.lengths, p);
}

size_t StepAnswer::ItemSize(const Item& it, size_t select_size) const {
  return VarintFieldSize(it.code) + (it.message.empty() ? 0 : LengthFieldSize(it.message.size())) +
         (it.ok ? LengthFieldSize(select_size) : 0);
}

void StepAnswer::Write(grpc::ByteBuffer* out) const {
  size_t size = 0;
  std::vector<size_t> select_sizes(items_.size());
  switch (message_) {
    case StepMessage::kAppendKeys: {
      const Item& it = items_[0];
      size = PackedFieldSize(it.lengths) + VarintFieldSize(it.num_blocks) +
             VarintFieldSize(it.created ? 1 : 0);
      break;
    }
    case StepMessage::kSelectBlocks:
      size = select_sizes[0] = SelectSize(items_[0]);
      break;
    case StepMessage::kBatch:
      size = VarintFieldSize(request_id_);
      for (size_t i = 0; i < items_.size(); ++i) {
        select_sizes[i] = items_[i].ok ? SelectSize(items_[i]) : 0;
        size += LengthFieldSize(ItemSize(items_[i], select_sizes[i]));
      }
      break;
  }
  grpc::Slice slice(size);
  uint8_t* p = const_cast<uint8_t*>(slice.begin());
  switch (message_) {
    case StepMessage::kAppendKeys: {
      const Item& it = items_[0];
      p = PutPackedField(Tag(1, 2), it.lengths, p);
      p = PutVarintField(Tag(2, 0), it.num_blocks, p);
      p = PutVarintField(Tag(3, 0), it.created ? 1 : 0, p);
      break;
    }
    case StepMessage::kSelectBlocks:
      p = WriteSelect(items_[0], p);
      break;
    case StepMessage::kBatch:
      p = PutVarintField(Tag(1, 0), request_id_, p);
      for (size_t i = 0; i < items_.size(); ++i) {
        const Item& it = items_[i];
        p = PutLength(Tag(2, 2), ItemSize(it, select_sizes[i]), p);
        p = PutVarintField(Tag(1, 0), it.code, p);
        if (!it.message.empty()) {
          p = PutLength(Tag(2, 2), it.message.size(), p);
          std::memcpy(p, it.message.data(), it.message.size());
          p += it.message.size();
        }
        if (it.ok) p = WriteSelect(it, PutLength(Tag(3, 2), select_sizes[i], p));
      }
      break;
  }
  grpc::ByteBuffer bytes(&slice, 1);
  out->Swap(&bytes);
}

}  // namespace indexer::server
