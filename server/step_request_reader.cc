#include "server/step_request_reader.h"

#include <climits>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace indexer::server {
namespace {

// protobuf's default recursion limit: nested messages and groups below the top level.
constexpr int kMaxDepth = 100;

enum WireType : uint32_t {
  kVarint = 0,
  kFixed64 = 1,
  kLength = 2,
  kStartGroup = 3,
  kEndGroup = 4,
  kFixed32 = 5,
};

constexpr uint32_t Tag(uint32_t field, WireType type) { return field << 3 | type; }

// Strict UTF-8, as protobuf checks string fields: no overlong forms, surrogates or code points
// past U+10FFFF, no truncated sequences.
bool ValidUtf8(absl::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const auto* const end = p + s.size();
  while (p < end) {
    // Ids and region names are ASCII: eight bytes at a time while no high bit is set.
    if (end - p >= 8) {
      uint64_t word;
      std::memcpy(&word, p, 8);
      if ((word & 0x8080808080808080u) == 0) {
        p += 8;
        continue;
      }
    }
    const unsigned c = *p;
    if (c < 0x80) {
      ++p;
      continue;
    }
    int more;
    uint32_t cp, min;
    if ((c & 0xE0) == 0xC0) {
      more = 1, cp = c & 0x1F, min = 0x80;
    } else if ((c & 0xF0) == 0xE0) {
      more = 2, cp = c & 0x0F, min = 0x800;
    } else if ((c & 0xF8) == 0xF0) {
      more = 3, cp = c & 0x07, min = 0x10000;
    } else {
      return false;
    }
    if (end - p <= more) return false;
    for (int i = 1; i <= more; ++i) {
      if ((p[i] & 0xC0) != 0x80) return false;
      cp = cp << 6 | (p[i] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    p += more + 1;
  }
  return true;
}

engine::WireDtype DtypeOf(uint64_t value) {
  switch (static_cast<int32_t>(value)) {
    case 1: return engine::WireDtype::kBf16;  // VALUE_DTYPE_BF16
    case 2: return engine::WireDtype::kFp32;  // VALUE_DTYPE_FP32
    default: return engine::WireDtype::kUnspecified;
  }
}

// A read position in one message's bytes. Every read fails (false) rather than pass the end.
class Cursor {
 public:
  explicit Cursor(absl::string_view bytes) : p_(bytes.data()), end_(bytes.data() + bytes.size()) {}

  bool done() const { return p_ == end_; }

  // A varint of at most 10 bytes, its value modulo 2^64.
  bool Varint(uint64_t* value) { return VarintOf(10, value); }

  // A field's tag: a varint of at most 5 bytes, its value modulo 2^32.
  bool Tag(uint32_t* tag) {
    uint64_t v;
    if (!VarintOf(5, &v)) return false;
    *tag = static_cast<uint32_t>(v);
    return true;
  }

  // A length-delimited field's bytes: a size of at most 5 bytes (under 2 GiB), then that many.
  bool Length(absl::string_view* bytes) {
    uint64_t size;
    if (!VarintOf(5, &size)) return false;
    if (size > static_cast<uint64_t>(INT_MAX - 16) || size > static_cast<uint64_t>(end_ - p_)) {
      return false;
    }
    *bytes = absl::string_view(p_, size);
    p_ += size;
    return true;
  }

  // Typed values, as protobuf stores them: uint32 keeps a varint's low 32 bits, int64 and the
  // enum their bits, bool whether any is set; a string must be UTF-8.
  bool Uint32(int64_t* out) {
    uint64_t v;
    if (!Varint(&v)) return false;
    *out = static_cast<uint32_t>(v);
    return true;
  }
  bool Uint32(std::optional<int64_t>* out) {
    int64_t v;
    if (!Uint32(&v)) return false;
    *out = v;
    return true;
  }
  bool Int64(std::optional<int64_t>* out) {
    uint64_t v;
    if (!Varint(&v)) return false;
    *out = static_cast<int64_t>(v);
    return true;
  }
  bool Bool(bool* out) {
    uint64_t v;
    if (!Varint(&v)) return false;
    *out = v != 0;
    return true;
  }
  bool Dtype(engine::WireDtype* out) {
    uint64_t v;
    if (!Varint(&v)) return false;
    *out = DtypeOf(v);
    return true;
  }
  bool String(absl::string_view* out) { return Length(out) && ValidUtf8(*out); }

  // A varint of at most `max_bytes` bytes; protobuf drops the bits past a value's width.
  bool VarintOf(int max_bytes, uint64_t* value) {
    if (p_ < end_ && static_cast<unsigned char>(*p_) < 0x80) {  // most values and tags: one byte
      *value = static_cast<unsigned char>(*p_++);
      return true;
    }
    uint64_t v = 0;
    for (int i = 0; i < max_bytes && p_ < end_; ++i) {
      const auto byte = static_cast<unsigned char>(*p_++);
      v |= uint64_t{byte & 0x7Fu} << (7 * i);
      if (byte < 0x80) {
        *value = v;
        return true;
      }
    }
    return false;
  }

  bool Bytes(size_t n) {
    if (static_cast<size_t>(end_ - p_) < n) return false;
    p_ += n;
    return true;
  }

  // Skips the value of a field this reader does not know (`tag` read); groups nest within
  // `depth` more levels and must end with their own field's end tag.
  bool Skip(uint32_t tag, int depth) {
    if ((tag >> 3) == 0) return false;
    uint64_t ignored;
    absl::string_view bytes;
    switch (tag & 7) {
      case kVarint: return Varint(&ignored);
      case kFixed64: return Bytes(8);
      case kLength: return Length(&bytes);
      case kFixed32: return Bytes(4);
      case kStartGroup: {
        if (--depth < 0) return false;
        for (;;) {
          uint32_t inner;
          if (done() || !Tag(&inner)) return false;
          if ((inner & 7) == kEndGroup) return inner == tag + 1;  // this group's end
          if (!Skip(inner, depth)) return false;
        }
      }
      default: return false;  // an end tag outside its group, or wire types 6 and 7
    }
  }

 private:
  const char* p_;
  const char* end_;
};

// What a message's reader made of one field.
enum class Field { kRead, kUnknown, kBad };
Field ReadIf(bool read) { return read ? Field::kRead : Field::kBad; }

// Reads each field of a message's `bytes` with `on_field(tag, cursor)`, which reads the value of
// a field it knows (kRead, or kBad when the value does not read) or leaves it (kUnknown) to be
// skipped, groups within `depth` more levels.
template <typename OnField>
bool ForEachField(absl::string_view bytes, int depth, OnField&& on_field) {
  Cursor c(bytes);
  while (!c.done()) {
    uint32_t tag;
    if (!c.Tag(&tag)) return false;
    switch (on_field(tag, c)) {
      case Field::kRead: break;
      case Field::kBad: return false;
      case Field::kUnknown:
        if (!c.Skip(tag, depth)) return false;
        break;
    }
  }
  return true;
}

// Reads one request's messages into a StepRequestWire.
class Reader {
 public:
  Reader(absl::string_view tenant, StepRequestWire* out) : tenant_(tenant), out_(out) {}

  bool Batch(absl::string_view bytes) {
    Reserve(bytes);
    return ForEachField(bytes, kMaxDepth, [this](uint32_t tag, Cursor& c) {
      absl::string_view item;
      switch (tag) {
        case Tag(1, kVarint): return ReadIf(c.Varint(&out_->request_id));
        case Tag(2, kLength): return ReadIf(c.Length(&item) && Item(item, kMaxDepth - 1));
        default: return Field::kUnknown;
      }
    });
  }

  // Room for a BatchRequest's items, counted first so that no item moves once read. A request
  // that does not read is left to the reading to refuse.
  void Reserve(absl::string_view bytes) {
    Cursor c(bytes);
    size_t items = 0;
    uint32_t tag;
    absl::string_view item;
    while (!c.done() && c.Tag(&tag)) {
      if (tag == Tag(2, kLength) ? !c.Length(&item) : !c.Skip(tag, kMaxDepth)) break;
      if (tag == Tag(2, kLength)) ++items;
    }
    out_->items.reserve(items);
    pages_.reserve(items);
  }

  // A SelectBlocksRequest as one item.
  bool Select(absl::string_view bytes) { return Item(bytes, kMaxDepth); }

  // An AppendKeysRequest as one item that only appends.
  bool Append(absl::string_view bytes) {
    engine::StepRequest& step = NewItem();
    step.append.emplace().tenant = tenant_;
    if (!AppendFields(bytes, &*step.append, kMaxDepth)) return false;
    step.sequence_id = step.append->sequence_id;
    step.layer = step.append->all_layers ? 0 : step.append->layer;
    EndItem();
    return true;
  }

  // Points each append's attention_pages into their storage, which no longer grows, and copies
  // keys and queries at odd addresses into aligned storage.
  void Finish() {
    std::vector<engine::StepRequest>& items = out_->items;
    size_t odd = 0;
    for (size_t i = 0; i < items.size(); ++i) {
      engine::StepRequest& s = items[i];
      odd += OddValues(s.queries);
      if (!s.append) continue;
      s.append->attention_pages = std::span<const int32_t>(
          out_->attention_pages.data() + pages_[i].first, pages_[i].second);
      odd += OddValues(s.append->keys);
    }
    if (odd == 0) return;
    out_->aligned.resize(odd);
    uint16_t* next = out_->aligned.data();
    for (engine::StepRequest& s : items) {
      next = Align(&s.queries, next);
      if (s.append) next = Align(&s.append->keys, next);
    }
  }

 private:
  engine::StepRequest& NewItem() {
    engine::StepRequest& step = out_->items.emplace_back();
    step.tenant = tenant_;
    pages_.emplace_back(out_->attention_pages.size(), 0);
    return step;
  }
  void EndItem() { pages_.back().second = out_->attention_pages.size() - pages_.back().first; }

  // A SelectBlocksRequest's fields, `depth` nesting levels left below it.
  bool Item(absl::string_view bytes, int depth) {
    engine::StepRequest& step = NewItem();
    const bool read = ForEachField(bytes, depth, [&](uint32_t tag, Cursor& c) {
      absl::string_view b;
      switch (tag) {
        case Tag(1, kLength): return ReadIf(c.String(&step.sequence_id));
        case Tag(2, kVarint): return ReadIf(c.Uint32(&step.layer));
        case Tag(3, kLength):
          if (!c.Length(&b) || depth - 1 < 0) return Field::kBad;
          if (!step.append) step.append.emplace().tenant = tenant_;
          return ReadIf(AppendFields(b, &*step.append, depth - 1));
        case Tag(4, kVarint): return ReadIf(c.Int64(&step.start_position));
        case Tag(5, kVarint): return ReadIf(c.Uint32(&step.num_heads));
        case Tag(6, kVarint): return ReadIf(c.Dtype(&step.query_dtype));
        case Tag(7, kLength): return ReadIf(c.Length(&step.queries));
        case Tag(8, kVarint): return ReadIf(c.Uint32(&step.topk));
        case Tag(9, kVarint): return ReadIf(c.Uint32(&step.init_blocks));
        case Tag(10, kVarint): return ReadIf(c.Uint32(&step.local_blocks));
        case Tag(11, kVarint): return ReadIf(c.Uint32(&step.num_tokens));
        case Tag(12, kLength): return ReadIf(c.Length(&b) && Ref(b, ItemRef::kQueries, depth - 1));
        case Tag(13, kLength): return ReadIf(c.Length(&b) && OutputRefs(b, depth - 1));
        default: return Field::kUnknown;
      }
    });
    if (read) EndItem();
    return read;
  }

  // An AppendKeysRequest's fields merged into *a, `depth` nesting levels left below it.
  bool AppendFields(absl::string_view bytes, engine::AppendRequest* a, int depth) {
    return ForEachField(bytes, depth, [&](uint32_t tag, Cursor& c) {
      absl::string_view b;
      switch (tag) {
        case Tag(1, kLength): return ReadIf(c.String(&a->sequence_id));
        case Tag(2, kVarint): return ReadIf(c.Uint32(&a->layer));
        case Tag(3, kVarint): return ReadIf(c.Bool(&a->all_layers));
        case Tag(4, kVarint): return ReadIf(c.Dtype(&a->dtype));
        case Tag(5, kLength): return ReadIf(c.Length(&a->keys));
        case Tag(6, kVarint): return ReadIf(AttentionPage(c));
        case Tag(6, kLength): {  // packed
          if (!c.Length(&b)) return Field::kBad;
          Cursor packed(b);
          while (!packed.done()) {
            if (!AttentionPage(packed)) return Field::kBad;
          }
          return Field::kRead;
        }
        case Tag(7, kVarint): return ReadIf(c.Uint32(&a->num_tokens));
        case Tag(8, kLength): return ReadIf(c.Length(&b) && Ref(b, ItemRef::kKeys, depth - 1));
        default: return Field::kUnknown;
      }
    });
  }

  // One attention page id (an int32 keeps a varint's low 32 bits).
  bool AttentionPage(Cursor& c) {
    uint64_t v;
    if (!c.Varint(&v)) return false;
    out_->attention_pages.push_back(static_cast<int32_t>(v));
    return true;
  }

  bool OutputRefs(absl::string_view bytes, int depth) {
    if (depth < 0) return false;
    return ForEachField(bytes, depth, [&](uint32_t tag, Cursor& c) {
      absl::string_view b;
      ItemRef::Field field;
      switch (tag) {
        case Tag(1, kLength): field = ItemRef::kBlockIds; break;
        case Tag(2, kLength): field = ItemRef::kPageTable; break;
        case Tag(3, kLength): field = ItemRef::kContextLens; break;
        default: return Field::kUnknown;
      }
      return ReadIf(c.Length(&b) && Ref(b, field, depth - 1));
    });
  }

  // A RegionRef's fields merged into the current item's reference for `field` (made if there
  // was none).
  bool Ref(absl::string_view bytes, ItemRef::Field field, int depth) {
    if (depth < 0) return false;
    const auto item = static_cast<uint32_t>(out_->items.size() - 1);
    RegionRefView* ref = nullptr;
    for (auto it = out_->refs.rbegin(); it != out_->refs.rend() && it->item == item; ++it) {
      if (it->field == field) ref = &it->ref;
    }
    if (ref == nullptr) ref = &out_->refs.emplace_back(ItemRef{item, field, {}}).ref;
    return ForEachField(bytes, depth, [ref](uint32_t tag, Cursor& c) {
      switch (tag) {
        case Tag(1, kLength): return ReadIf(c.String(&ref->region));
        case Tag(2, kVarint): return ReadIf(c.Varint(&ref->offset));
        case Tag(3, kVarint): return ReadIf(c.Varint(&ref->byte_size));
        default: return Field::kUnknown;
      }
    });
  }

  // The uint16 values that hold `bytes` when they lie at an odd address, else 0.
  static size_t OddValues(absl::string_view bytes) {
    return reinterpret_cast<uintptr_t>(bytes.data()) % 2 != 0 ? (bytes.size() + 1) / 2 : 0;
  }
  // Copies `bytes` to `to` when they lie at an odd address and points them there; where the next
  // copy goes.
  static uint16_t* Align(absl::string_view* bytes, uint16_t* to) {
    const size_t values = OddValues(*bytes);
    if (values == 0) return to;
    std::memcpy(to, bytes->data(), bytes->size());
    *bytes = absl::string_view(reinterpret_cast<const char*>(to), bytes->size());
    return to + values;
  }

  const absl::string_view tenant_;
  StepRequestWire* const out_;
  std::vector<std::pair<size_t, size_t>> pages_;  // per item: first attention page, count
};

}  // namespace

absl::string_view StepMessageName(StepMessage message) {
  switch (message) {
    case StepMessage::kAppendKeys: return "indexer.v1.AppendKeysRequest";
    case StepMessage::kSelectBlocks: return "indexer.v1.SelectBlocksRequest";
    case StepMessage::kBatch: return "indexer.v1.BatchRequest";
  }
  return "?";
}

absl::Status ReadStepRequest(StepMessage message, absl::string_view bytes,
                             absl::string_view tenant, StepRequestWire* out) {
  out->request_id = 0;
  out->items.clear();
  out->refs.clear();
  out->attention_pages.clear();
  out->aligned.clear();
  Reader reader(tenant, out);
  bool read = false;
  switch (message) {
    case StepMessage::kAppendKeys: read = reader.Append(bytes); break;
    case StepMessage::kSelectBlocks: read = reader.Select(bytes); break;
    case StepMessage::kBatch: read = reader.Batch(bytes); break;
  }
  if (!read) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the request is not a valid ", StepMessageName(message),
        ": its bytes do not parse (malformed or truncated, or a string field such as sequence_id "
        "that is not valid UTF-8)"));
  }
  reader.Finish();
  return absl::OkStatus();
}

}  // namespace indexer::server
