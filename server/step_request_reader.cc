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
  bool Varint(uint64_t* value) {
    if (p_ < end_ && static_cast<unsigned char>(*p_) < 0x80) {  // most values: one byte
      *value = static_cast<unsigned char>(*p_++);
      return true;
    }
    uint64_t v = 0;
    for (int i = 0; i < 10 && p_ < end_; ++i) {
      const auto byte = static_cast<unsigned char>(*p_++);
      v |= uint64_t{byte & 0x7Fu} << (7 * i);
      if (byte < 0x80) {
        *value = v;
        return true;
      }
    }
    return false;
  }

  // A field's tag: a varint of at most 5 bytes, its value modulo 2^32.
  bool Tag(uint32_t* tag) {
    if (p_ < end_ && static_cast<unsigned char>(*p_) < 0x80) {  // fields 1 to 15
      *tag = static_cast<unsigned char>(*p_++);
      return true;
    }
    uint32_t v = 0;
    for (int i = 0; i < 5 && p_ < end_; ++i) {
      const auto byte = static_cast<unsigned char>(*p_++);
      v |= uint32_t{byte & 0x7Fu} << (7 * i);
      if (byte < 0x80) {
        *tag = v;
        return true;
      }
    }
    return false;
  }

  // A length-delimited field's bytes: a size of at most 5 bytes (under 2 GiB), then that many.
  bool Length(absl::string_view* bytes) {
    uint64_t size = 0;
    for (int i = 0;; ++i) {
      if (i == 5 || p_ == end_) return false;
      const auto byte = static_cast<unsigned char>(*p_++);
      if (i == 4 && byte >= 8) return false;
      size |= uint64_t{byte & 0x7Fu} << (7 * i);
      if (byte < 0x80) break;
    }
    if (size > static_cast<uint64_t>(INT_MAX - 16) || size > static_cast<uint64_t>(end_ - p_)) {
      return false;
    }
    *bytes = absl::string_view(p_, size);
    p_ += size;
    return true;
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

// Reads one request's messages into a StepRequestWire.
class Reader {
 public:
  Reader(absl::string_view tenant, StepRequestWire* out) : tenant_(tenant), out_(out) {}

  bool Batch(absl::string_view bytes) {
    Reserve(bytes);
    Cursor c(bytes);
    while (!c.done()) {
      uint32_t tag;
      if (!c.Tag(&tag)) return false;
      absl::string_view item;
      switch (tag) {
        case Tag(1, kVarint):
          if (!c.Varint(&out_->request_id)) return false;
          break;
        case Tag(2, kLength):
          if (!c.Length(&item) || !Item(item, kMaxDepth - 1)) return false;
          break;
        default:
          if (!c.Skip(tag, kMaxDepth)) return false;
      }
    }
    return true;
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
    Cursor c(bytes);
    while (!c.done()) {
      uint32_t tag;
      uint64_t v;
      absl::string_view b;
      if (!c.Tag(&tag)) return false;
      switch (tag) {
        case Tag(1, kLength):
          if (!c.Length(&b) || !ValidUtf8(b)) return false;
          step.sequence_id = b;
          break;
        case Tag(2, kVarint):
          if (!c.Varint(&v)) return false;
          step.layer = static_cast<uint32_t>(v);
          break;
        case Tag(3, kLength):
          if (!c.Length(&b) || depth - 1 < 0) return false;
          if (!step.append) step.append.emplace().tenant = tenant_;
          if (!AppendFields(b, &*step.append, depth - 1)) return false;
          break;
        case Tag(4, kVarint):
          if (!c.Varint(&v)) return false;
          step.start_position = static_cast<int64_t>(v);
          break;
        case Tag(5, kVarint):
          if (!c.Varint(&v)) return false;
          step.num_heads = static_cast<uint32_t>(v);
          break;
        case Tag(6, kVarint):
          if (!c.Varint(&v)) return false;
          step.query_dtype = DtypeOf(v);
          break;
        case Tag(7, kLength):
          if (!c.Length(&step.queries)) return false;
          break;
        case Tag(8, kVarint):
        case Tag(9, kVarint):
        case Tag(10, kVarint):
        case Tag(11, kVarint): {
          if (!c.Varint(&v)) return false;
          const int64_t value = static_cast<uint32_t>(v);
          if (tag == Tag(8, kVarint)) step.topk = value;
          if (tag == Tag(9, kVarint)) step.init_blocks = value;
          if (tag == Tag(10, kVarint)) step.local_blocks = value;
          if (tag == Tag(11, kVarint)) step.num_tokens = value;
          break;
        }
        case Tag(12, kLength):
          if (!c.Length(&b) || !Ref(b, ItemRef::kQueries, depth - 1)) return false;
          break;
        case Tag(13, kLength):
          if (!c.Length(&b) || !OutputRefs(b, depth - 1)) return false;
          break;
        default:
          if (!c.Skip(tag, depth)) return false;
      }
    }
    EndItem();
    return true;
  }

  // An AppendKeysRequest's fields merged into *a, `depth` nesting levels left below it.
  bool AppendFields(absl::string_view bytes, engine::AppendRequest* a, int depth) {
    Cursor c(bytes);
    while (!c.done()) {
      uint32_t tag;
      uint64_t v;
      absl::string_view b;
      if (!c.Tag(&tag)) return false;
      switch (tag) {
        case Tag(1, kLength):
          if (!c.Length(&b) || !ValidUtf8(b)) return false;
          a->sequence_id = b;
          break;
        case Tag(2, kVarint):
          if (!c.Varint(&v)) return false;
          a->layer = static_cast<uint32_t>(v);
          break;
        case Tag(3, kVarint):
          if (!c.Varint(&v)) return false;
          a->all_layers = v != 0;
          break;
        case Tag(4, kVarint):
          if (!c.Varint(&v)) return false;
          a->dtype = DtypeOf(v);
          break;
        case Tag(5, kLength):
          if (!c.Length(&a->keys)) return false;
          break;
        case Tag(6, kVarint):
          if (!c.Varint(&v)) return false;
          out_->attention_pages.push_back(static_cast<int32_t>(v));
          break;
        case Tag(6, kLength): {
          if (!c.Length(&b)) return false;
          Cursor packed(b);
          while (!packed.done()) {
            if (!packed.Varint(&v)) return false;
            out_->attention_pages.push_back(static_cast<int32_t>(v));
          }
          break;
        }
        case Tag(7, kVarint):
          if (!c.Varint(&v)) return false;
          a->num_tokens = static_cast<uint32_t>(v);
          break;
        case Tag(8, kLength):
          if (!c.Length(&b) || !Ref(b, ItemRef::kKeys, depth - 1)) return false;
          break;
        default:
          if (!c.Skip(tag, depth)) return false;
      }
    }
    return true;
  }

  bool OutputRefs(absl::string_view bytes, int depth) {
    if (depth < 0) return false;
    Cursor c(bytes);
    while (!c.done()) {
      uint32_t tag;
      absl::string_view b;
      if (!c.Tag(&tag)) return false;
      ItemRef::Field field;
      switch (tag) {
        case Tag(1, kLength): field = ItemRef::kBlockIds; break;
        case Tag(2, kLength): field = ItemRef::kPageTable; break;
        case Tag(3, kLength): field = ItemRef::kContextLens; break;
        default:
          if (!c.Skip(tag, depth)) return false;
          continue;
      }
      if (!c.Length(&b) || !Ref(b, field, depth - 1)) return false;
    }
    return true;
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
    Cursor c(bytes);
    while (!c.done()) {
      uint32_t tag;
      absl::string_view b;
      if (!c.Tag(&tag)) return false;
      switch (tag) {
        case Tag(1, kLength):
          if (!c.Length(&b) || !ValidUtf8(b)) return false;
          ref->region = b;
          break;
        case Tag(2, kVarint):
          if (!c.Varint(&ref->offset)) return false;
          break;
        case Tag(3, kVarint):
          if (!c.Varint(&ref->byte_size)) return false;
          break;
        default:
          if (!c.Skip(tag, depth)) return false;
      }
    }
    return true;
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
