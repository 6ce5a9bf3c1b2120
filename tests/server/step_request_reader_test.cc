// ReadStepRequest against protobuf's own parser, the reference: for generated requests, the same
// bytes re-encoded as protobuf may also send them (fields repeated and merged, unknown fields and
// groups, unpacked or overlong encodings), and corrupted copies of them, the reader accepts what
// protobuf accepts and gives the items protobuf's message describes.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "google/protobuf/stubs/logging.h"
#include "indexer/v1/indexer.pb.h"
#include "server/step_request_reader.h"
#include "tests/testing/test_seed.h"

namespace indexer::server {
namespace {

using engine::AppendRequest;
using engine::StepRequest;
using engine::WireDtype;

constexpr absl::string_view kTenant = "tenant-a";

// --- What protobuf's message says the items are ------------------------------------------------

WireDtype DtypeOf(v1::ValueDtype d) {
  if (d == v1::VALUE_DTYPE_BF16) return WireDtype::kBf16;
  if (d == v1::VALUE_DTYPE_FP32) return WireDtype::kFp32;
  return WireDtype::kUnspecified;
}

// An item as plain values, from either side, so that the two compare field by field.
struct Item {
  std::string sequence_id;
  int64_t layer = 0;
  bool has_append = false;
  std::string append_sequence_id;
  int64_t append_layer = 0;
  bool all_layers = false;
  WireDtype dtype = WireDtype::kUnspecified;
  std::string keys;
  std::vector<int32_t> attention_pages;
  std::optional<int64_t> append_num_tokens;
  std::optional<int64_t> start_position;
  int64_t num_heads = 0;
  WireDtype query_dtype = WireDtype::kUnspecified;
  std::string queries;
  std::optional<int64_t> topk, init_blocks, local_blocks, num_tokens;
  // field, region, offset, byte_size of each reference, in ItemRef::Field order
  std::vector<std::tuple<int, std::string, uint64_t, uint64_t>> refs;

  bool operator==(const Item&) const = default;
};

void PrintTo(const Item& i, std::ostream* os) {
  *os << "{id '" << i.sequence_id << "' layer " << i.layer << " append " << i.has_append << " ('"
      << i.append_sequence_id << "' layer " << i.append_layer << " all " << i.all_layers << " keys "
      << i.keys.size() << "B pages " << i.attention_pages.size() << ") heads " << i.num_heads
      << " queries " << i.queries.size() << "B refs " << i.refs.size() << "}";
}

void AddRef(int field, const v1::RegionRef& r, Item* out) {
  out->refs.emplace_back(field, r.region(), r.offset(), r.byte_size());
}

void FromAppend(const v1::AppendKeysRequest& a, Item* out) {
  out->has_append = true;
  out->append_sequence_id = a.sequence_id();
  out->append_layer = a.layer();
  out->all_layers = a.all_layers();
  out->dtype = DtypeOf(a.dtype());
  out->keys = a.keys();
  out->attention_pages.assign(a.attention_pages().begin(), a.attention_pages().end());
  if (a.has_num_tokens()) out->append_num_tokens = a.num_tokens();
  if (a.has_keys_ref()) AddRef(ItemRef::kKeys, a.keys_ref(), out);
}

Item FromSelect(const v1::SelectBlocksRequest& r) {
  Item out;
  out.sequence_id = r.sequence_id();
  out.layer = r.layer();
  if (r.has_append()) FromAppend(r.append(), &out);
  if (r.has_start_position()) out.start_position = r.start_position();
  out.num_heads = r.num_heads();
  out.query_dtype = DtypeOf(r.query_dtype());
  out.queries = r.queries();
  if (r.has_topk()) out.topk = r.topk();
  if (r.has_init_blocks()) out.init_blocks = r.init_blocks();
  if (r.has_local_blocks()) out.local_blocks = r.local_blocks();
  if (r.has_num_tokens()) out.num_tokens = r.num_tokens();
  if (r.has_queries_ref()) AddRef(ItemRef::kQueries, r.queries_ref(), &out);
  const v1::SelectOutputRefs& o = r.output_refs();
  if (o.has_block_ids()) AddRef(ItemRef::kBlockIds, o.block_ids(), &out);
  if (o.has_page_table()) AddRef(ItemRef::kPageTable, o.page_table(), &out);
  if (o.has_context_lens()) AddRef(ItemRef::kContextLens, o.context_lens(), &out);
  return out;
}

// protobuf's reading of `bytes` as `message`: nullopt when it does not parse.
std::optional<std::vector<Item>> ProtobufItems(StepMessage message, const std::string& bytes,
                                               uint64_t* request_id) {
  // protobuf logs every string that is not UTF-8; the corrupted inputs have thousands.
  static const bool quiet = (google::protobuf::SetLogHandler(nullptr), true);
  (void)quiet;
  *request_id = 0;
  if (message == StepMessage::kAppendKeys) {
    v1::AppendKeysRequest a;
    if (!a.ParseFromString(bytes)) return std::nullopt;
    Item item;
    FromAppend(a, &item);
    item.sequence_id = a.sequence_id();
    item.layer = a.all_layers() ? 0 : a.layer();
    return std::vector<Item>{item};
  }
  if (message == StepMessage::kSelectBlocks) {
    v1::SelectBlocksRequest r;
    if (!r.ParseFromString(bytes)) return std::nullopt;
    return std::vector<Item>{FromSelect(r)};
  }
  v1::BatchRequest b;
  if (!b.ParseFromString(bytes)) return std::nullopt;
  *request_id = b.request_id();
  std::vector<Item> items;
  for (const v1::SelectBlocksRequest& r : b.items()) items.push_back(FromSelect(r));
  return items;
}

// --- What the reader says they are ----------------------------------------------------------------

Item FromStep(const StepRequest& s, const std::vector<ItemRef>& refs, uint32_t index) {
  Item out;
  EXPECT_EQ(s.tenant, kTenant);
  EXPECT_TRUE(s.refused.ok());
  out.sequence_id = std::string(s.sequence_id);
  out.layer = s.layer;
  if (s.append) {
    const AppendRequest& a = *s.append;
    EXPECT_EQ(a.tenant, kTenant);
    out.has_append = true;
    out.append_sequence_id = std::string(a.sequence_id);
    out.append_layer = a.layer;
    out.all_layers = a.all_layers;
    out.dtype = a.dtype;
    out.keys = std::string(a.keys);
    out.attention_pages.assign(a.attention_pages.begin(), a.attention_pages.end());
    out.append_num_tokens = a.num_tokens;
  }
  out.start_position = s.start_position;
  out.num_heads = s.num_heads;
  out.query_dtype = s.query_dtype;
  out.queries = std::string(s.queries);
  out.topk = s.topk;
  out.init_blocks = s.init_blocks;
  out.local_blocks = s.local_blocks;
  out.num_tokens = s.num_tokens;
  for (const ItemRef& r : refs) {
    if (r.item == index) {
      out.refs.emplace_back(r.field, std::string(r.ref.region), r.ref.offset, r.ref.byte_size);
    }
  }
  std::sort(out.refs.begin(), out.refs.end());
  return out;
}

std::optional<std::vector<Item>> ReaderItems(StepMessage message, const std::string& bytes,
                                             uint64_t* request_id) {
  StepRequestWire wire;
  wire.items.resize(3);  // replaced
  const absl::Status status = ReadStepRequest(message, bytes, kTenant, &wire);
  if (!status.ok()) {
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(status.message(), ::testing::HasSubstr(StepMessageName(message)));
    return std::nullopt;
  }
  *request_id = wire.request_id;
  std::vector<Item> items;
  for (size_t i = 0; i < wire.items.size(); ++i) {
    items.push_back(FromStep(wire.items[i], wire.refs, static_cast<uint32_t>(i)));
  }
  return items;
}

// Both readings of `bytes`; true when they agree.
::testing::AssertionResult SameReading(StepMessage message, const std::string& bytes) {
  uint64_t pb_id = 0, our_id = 0;
  const std::optional<std::vector<Item>> pb = ProtobufItems(message, bytes, &pb_id);
  const std::optional<std::vector<Item>> ours = ReaderItems(message, bytes, &our_id);
  if (pb.has_value() != ours.has_value()) {
    return ::testing::AssertionFailure()
           << "protobuf " << (pb ? "parses" : "refuses") << " the " << bytes.size()
           << " bytes, the reader " << (ours ? "reads them" : "refuses them");
  }
  if (!pb) return ::testing::AssertionSuccess();
  std::vector<Item> expected = *pb;
  for (Item& i : expected) std::sort(i.refs.begin(), i.refs.end());
  if (expected != *ours) {
    return ::testing::AssertionFailure()
           << "the items differ: protobuf " << ::testing::PrintToString(expected) << ", reader "
           << ::testing::PrintToString(*ours);
  }
  if (pb_id != our_id) return ::testing::AssertionFailure() << "request_id differs";
  return ::testing::AssertionSuccess();
}

// --- Generated requests ------------------------------------------------------------------------

class Generator {
 public:
  explicit Generator(uint64_t seed) : rng_(seed) {}

  bool Coin(double p = 0.5) { return std::bernoulli_distribution(p)(rng_); }
  uint64_t Below(uint64_t n) { return std::uniform_int_distribution<uint64_t>(0, n - 1)(rng_); }
  // Small values mostly, now and then one that needs every varint byte.
  uint64_t Value() { return Coin(0.8) ? Below(300) : rng_(); }

  std::string Bytes(size_t max) {
    std::string s(Below(max + 1), '\0');
    for (char& c : s) c = static_cast<char>(Below(256));
    return s;
  }
  std::string Id() {
    static const char* const kPieces[] = {"seq", "-", "7", "é", "日本", "\xF0\x9F\x98\x80", "x"};
    std::string s;
    for (uint64_t n = Below(5); n > 0; --n) s += kPieces[Below(std::size(kPieces))];
    return s;
  }
  void Ref(v1::RegionRef* r) {
    if (Coin()) r->set_region(Id());
    if (Coin()) r->set_offset(Value());
    if (Coin()) r->set_byte_size(Value());
  }
  void Append(v1::AppendKeysRequest* a) {
    if (Coin()) a->set_sequence_id(Id());
    if (Coin()) a->set_layer(static_cast<uint32_t>(Value()));
    if (Coin(0.2)) a->set_all_layers(true);
    if (Coin()) a->set_dtype(static_cast<v1::ValueDtype>(Below(4)));
    if (Coin()) a->set_keys(Bytes(40));
    for (uint64_t n = Coin(0.3) ? Below(5) : 0; n > 0; --n) {
      a->add_attention_pages(static_cast<int32_t>(Coin(0.8) ? Below(100) : rng_()));
    }
    if (Coin()) a->set_num_tokens(static_cast<uint32_t>(Value()));
    if (Coin(0.2)) Ref(a->mutable_keys_ref());
  }
  void Select(v1::SelectBlocksRequest* r) {
    if (Coin(0.9)) r->set_sequence_id(Id());
    if (Coin()) r->set_layer(static_cast<uint32_t>(Value()));
    if (Coin()) Append(r->mutable_append());
    if (Coin(0.3)) r->set_start_position(static_cast<int64_t>(Value()));
    if (Coin()) r->set_num_heads(static_cast<uint32_t>(Value()));
    if (Coin()) r->set_query_dtype(static_cast<v1::ValueDtype>(Below(4)));
    if (Coin()) r->set_queries(Bytes(40));
    if (Coin()) r->set_topk(static_cast<uint32_t>(Value()));
    if (Coin()) r->set_init_blocks(static_cast<uint32_t>(Value()));
    if (Coin()) r->set_local_blocks(static_cast<uint32_t>(Value()));
    if (Coin()) r->set_num_tokens(static_cast<uint32_t>(Value()));
    if (Coin(0.2)) Ref(r->mutable_queries_ref());
    if (Coin(0.2)) {
      v1::SelectOutputRefs* o = r->mutable_output_refs();
      if (Coin()) Ref(o->mutable_block_ids());
      if (Coin()) Ref(o->mutable_page_table());
      if (Coin()) Ref(o->mutable_context_lens());
    }
  }
  // A serialized request of `message`'s type.
  std::string Request(StepMessage message) {
    if (message == StepMessage::kAppendKeys) {
      v1::AppendKeysRequest a;
      Append(&a);
      return a.SerializeAsString();
    }
    if (message == StepMessage::kSelectBlocks) {
      v1::SelectBlocksRequest r;
      Select(&r);
      return r.SerializeAsString();
    }
    v1::BatchRequest b;
    if (Coin()) b.set_request_id(Value());
    for (uint64_t n = Below(6); n > 0; --n) Select(b.add_items());
    return b.SerializeAsString();
  }

  std::mt19937_64& rng() { return rng_; }

 private:
  std::mt19937_64 rng_;
};

// --- Raw wire bytes --------------------------------------------------------------------------

std::string Varint(uint64_t v) {
  std::string s;
  do {
    s += static_cast<char>((v & 0x7F) | (v > 0x7F ? 0x80 : 0));
    v >>= 7;
  } while (v != 0);
  return s;
}
std::string Tag(uint32_t field, uint32_t type) { return Varint(uint64_t{field} << 3 | type); }
std::string Len(uint32_t field, const std::string& bytes) {
  return Tag(field, 2) + Varint(bytes.size()) + bytes;
}

// A field protobuf skips: an unknown number, or a known one with another wire type.
std::string UnknownField(Generator& g) {
  const uint32_t field = g.Coin() ? 1 + static_cast<uint32_t>(g.Below(20)) : 1000 + g.Below(99999);
  switch (g.Below(5)) {
    case 0: return Tag(field, 0) + Varint(g.Value());
    case 1: return Tag(field, 1) + std::string(8, 'f');
    case 2: return Len(field, g.Bytes(6));
    case 3: return Tag(field, 5) + std::string(4, 'g');
    default: return Tag(field, 3) + Tag(field + 1, 0) + Varint(1) + Tag(field, 4);  // a group
  }
}

TEST(StepRequestReader, GeneratedRequestsReadAsProtobufParsesThem) {
  const uint64_t seed = testing::TestSeed();
  SCOPED_TRACE(::testing::Message() << "INDEXER_TEST_SEED=" << seed);
  Generator g(seed);
  for (StepMessage m : {StepMessage::kAppendKeys, StepMessage::kSelectBlocks, StepMessage::kBatch}) {
    for (int i = 0; i < 2000; ++i) {
      const std::string one = g.Request(m);
      ASSERT_TRUE(SameReading(m, one)) << StepMessageName(m);
      // Two messages back to back are one message merged from both: later scalars win,
      // message fields merge, repeated fields append.
      const std::string two = one + g.Request(m);
      ASSERT_TRUE(SameReading(m, two)) << StepMessageName(m) << " concatenated";
      ASSERT_TRUE(SameReading(m, UnknownField(g) + one + UnknownField(g)))
          << StepMessageName(m) << " with unknown fields";
    }
  }
}

TEST(StepRequestReader, NestedMessagesMergeAndUnknownFieldsAreSkippedAtEveryLevel) {
  Generator g(testing::TestSeed());
  for (int i = 0; i < 500; ++i) {
    v1::AppendKeysRequest a1, a2;
    g.Append(&a1);
    g.Append(&a2);
    // An item whose append arrives in two pieces, with unknown fields between and inside.
    const std::string append = a1.SerializeAsString() + UnknownField(g) + a2.SerializeAsString();
    v1::RegionRef r1, r2;
    g.Ref(&r1);
    g.Ref(&r2);
    const std::string ref = r1.SerializeAsString() + UnknownField(g) + r2.SerializeAsString();
    const std::string item = Tag(1, 2) + Varint(3) + "abc" + Len(3, append) + UnknownField(g) +
                             Len(12, ref) + Len(13, Len(2, ref) + Len(2, r1.SerializeAsString())) +
                             Len(3, UnknownField(g));
    ASSERT_TRUE(SameReading(StepMessage::kSelectBlocks, item));
    ASSERT_TRUE(SameReading(StepMessage::kBatch, Len(2, item) + UnknownField(g) + Len(2, item)));
  }
}

TEST(StepRequestReader, AttentionPagesPackedUnpackedAndMixed) {
  const std::string packed = Len(6, Varint(5) + Varint(300) + Varint(uint64_t{1} << 40) +
                                        Varint(~uint64_t{0}));
  const std::string unpacked = Tag(6, 0) + Varint(7) + Tag(6, 0) + Varint(0xFFFFFFFF);
  for (const std::string& pages : {packed, unpacked, packed + unpacked + packed, Len(6, "")}) {
    EXPECT_TRUE(SameReading(StepMessage::kAppendKeys, pages + Len(5, "kk")));
    EXPECT_TRUE(SameReading(StepMessage::kBatch, Len(2, Len(3, pages) + Len(3, pages))));
  }
  EXPECT_TRUE(SameReading(StepMessage::kAppendKeys, Len(6, Varint(5) + "\x80")))
      << "a packed value cut by its field's end";
}

TEST(StepRequestReader, EncodingsProtobufAcceptsOrRefuses) {
  const std::string id = Len(1, "s");
  const std::vector<std::string> cases = {
      "",
      Tag(0, 0) + Varint(1),                           // field number 0
      Tag(0, 2) + Varint(0),
      std::string("\0", 1),                            // tag 0
      id + std::string("\0", 1),
      Tag(9, 4),                                       // an end tag with no group
      id + Tag(9, 4) + id,
      Tag(9, 6) + Varint(1),                           // wire types 6 and 7
      Tag(9, 7) + Varint(1),
      Tag(9, 3) + Tag(9, 4),                           // an empty group
      Tag(9, 3) + Tag(8, 4),                           // ended by another group's tag
      Tag(9, 3),                                       // never ended
      Tag(9, 3) + Tag(2, 0) + Varint(1) + Tag(9, 4),
      Tag(2, 0) + "\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",      // 10-byte varint
      Tag(2, 0) + "\xff\xff\xff\xff\xff\xff\xff\xff\xff\x7f",      // bits past 64
      Tag(2, 0) + "\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",  // 11 bytes
      Tag(2, 0) + "\x80\x80\x80\x80\x00",                          // overlong zero
      "\x90\x80\x80\x80\x00" + Varint(1),                          // overlong tag
      "\x90\x80\x80\x80\x80\x00" + Varint(1),                      // 6-byte tag
      "\x90\x80\x80\x80\x70" + Varint(1),                          // tag bits past 32
      Tag(1, 2) + "\x81\x80\x80\x80\x00" + "s",                    // overlong size
      Tag(1, 2) + "\x81\x80\x80\x80\x08" + "s",                    // size past 2 GiB
      Tag(1, 2) + "\x81\x80\x80\x80\x80\x00" + "s",                // 6-byte size
      Tag(1, 2) + Varint(5) + "abc",                               // past the end
      Tag(4, 0) + Varint(~uint64_t{0}),                            // start_position -1
      Tag(2, 0),                                                   // a tag and no value
      Tag(7, 1) + "12345678" + Tag(7, 5) + "1234" + Tag(7, 5) + "12",
  };
  for (StepMessage m : {StepMessage::kAppendKeys, StepMessage::kSelectBlocks, StepMessage::kBatch}) {
    for (size_t i = 0; i < cases.size(); ++i) {
      EXPECT_TRUE(SameReading(m, cases[i])) << StepMessageName(m) << " case " << i;
      EXPECT_TRUE(SameReading(StepMessage::kBatch, Len(2, cases[i]))) << "case " << i << " nested";
    }
  }
}

TEST(StepRequestReader, StringFieldsMustBeUtf8AsProtobufChecksThem) {
  const std::vector<std::string> strings = {
      "plain", "é", "日本", "\xF0\x9F\x98\x80", "\xF4\x8F\xBF\xBF",  // valid, U+10FFFF last
      "\xC3", "\xE6\x97", "\xF0\x9F\x98",                          // cut short
      "\x80", "\xBF", "\xFE", "\xFF", "\xC0\x80", "\xC1\xBF",      // stray, overlong
      "\xE0\x80\x80", "\xE0\x9F\xBF", "\xF0\x80\x80\x80",          // overlong
      "\xED\xA0\x80", "\xED\xBF\xBF", "\xED\x9F\xBF",              // surrogates, and U+D7FF
      "\xF4\x90\x80\x80", "\xF5\x80\x80\x80", "\xF8\x88\x80\x80\x80",  // past U+10FFFF
      "a\xC3(b", std::string("nul\0inside", 10),
  };
  std::vector<std::string> padded;
  for (const std::string& s : strings) {
    // ASCII around it, so that it falls at every offset from an eight-byte word's start.
    for (int pad : {0, 1, 7, 8, 13}) {
      padded.push_back(std::string(pad, 'x') + s);
      padded.push_back(std::string(pad, 'y') + s + std::string(9, 'z'));
    }
  }
  for (const std::string& s : padded) {
    const std::string ref = Len(1, s);
    EXPECT_TRUE(SameReading(StepMessage::kAppendKeys, Len(1, s))) << s;
    EXPECT_TRUE(SameReading(StepMessage::kSelectBlocks, Len(1, s) + Len(12, ref))) << s;
    EXPECT_TRUE(SameReading(StepMessage::kBatch, Len(2, Len(3, Len(8, ref))))) << s;
    EXPECT_TRUE(SameReading(StepMessage::kSelectBlocks, Len(13, Len(3, ref)))) << s;
    EXPECT_TRUE(SameReading(StepMessage::kSelectBlocks, Len(7, s)))
        << "bytes fields are not checked: " << s;
  }
}

TEST(StepRequestReader, NestingStopsWhereProtobufsDoes) {
  for (int depth : {1, 50, 97, 98, 99, 100, 101, 150}) {
    std::string group;
    for (int i = 0; i < depth; ++i) group = Tag(20, 3) + group + Tag(20, 4);
    EXPECT_TRUE(SameReading(StepMessage::kBatch, group)) << depth << " groups";
    EXPECT_TRUE(SameReading(StepMessage::kSelectBlocks, group)) << depth << " groups";
    EXPECT_TRUE(SameReading(StepMessage::kBatch, Len(2, group))) << depth << " groups in an item";
    EXPECT_TRUE(SameReading(StepMessage::kBatch, Len(2, Len(3, Len(8, group)))))
        << depth << " groups in a keys_ref";
    EXPECT_TRUE(SameReading(StepMessage::kBatch, Len(2, Len(13, Len(1, group)))))
        << depth << " groups in an output ref";
  }
}

TEST(StepRequestReader, CorruptedRequestsAreRefusedExactlyWhenProtobufRefusesThem) {
  const uint64_t seed = testing::TestSeed();
  SCOPED_TRACE(::testing::Message() << "INDEXER_TEST_SEED=" << seed);
  Generator g(seed);
  int refused = 0, total = 0;
  for (StepMessage m : {StepMessage::kAppendKeys, StepMessage::kSelectBlocks, StepMessage::kBatch}) {
    for (int i = 0; i < 4000; ++i) {
      std::string bytes = g.Request(m);
      if (bytes.empty()) continue;
      for (uint64_t edits = 1 + g.Below(3); edits > 0; --edits) {
        const size_t at = g.Below(bytes.size() + 1);
        switch (g.Below(4)) {
          case 0: if (at < bytes.size()) bytes[at] = static_cast<char>(g.Below(256)); break;
          case 1: bytes.resize(at); break;
          case 2: bytes.insert(at, g.Bytes(3)); break;
          default: if (at < bytes.size()) bytes[at] ^= static_cast<char>(1 << g.Below(8)); break;
        }
        if (bytes.empty()) break;
      }
      uint64_t id;
      refused += !ProtobufItems(m, bytes, &id).has_value();
      ++total;
      ASSERT_TRUE(SameReading(m, bytes)) << StepMessageName(m) << " corrupted, case " << i;
    }
  }
  // Both outcomes are exercised.
  EXPECT_GT(refused, total / 10);
  EXPECT_LT(refused, total * 9 / 10);
}

TEST(StepRequestReader, ItemsViewTheRequestsBytesAndKeysAndQueriesAreAligned) {
  v1::BatchRequest b;
  b.set_request_id(42);
  for (int i = 0; i < 8; ++i) {
    v1::SelectBlocksRequest* r = b.add_items();
    r->set_sequence_id(std::string(1 + i, 's'));  // moves the fields after it by one byte each
    r->set_queries(std::string(256, static_cast<char>('a' + i)));
    r->mutable_append()->set_keys(std::string(255 + i % 2, static_cast<char>('A' + i)));
    r->mutable_append()->add_attention_pages(i);
  }
  const std::string bytes = b.SerializeAsString();
  StepRequestWire wire;
  ASSERT_TRUE(ReadStepRequest(StepMessage::kBatch, bytes, kTenant, &wire).ok());
  ASSERT_EQ(wire.items.size(), 8u);
  EXPECT_EQ(wire.request_id, 42u);
  auto inside = [](absl::string_view v, const char* begin, size_t size) {
    return v.data() >= begin && v.data() + v.size() <= begin + size;
  };
  const auto* aligned = reinterpret_cast<const char*>(wire.aligned.data());
  int copied = 0;
  for (size_t i = 0; i < wire.items.size(); ++i) {
    const StepRequest& s = wire.items[i];
    EXPECT_TRUE(inside(s.sequence_id, bytes.data(), bytes.size())) << "item " << i;
    for (absl::string_view v : {s.queries, s.append->keys}) {
      EXPECT_EQ(reinterpret_cast<uintptr_t>(v.data()) % 2, 0u) << "item " << i;
      const bool in_place = inside(v, bytes.data(), bytes.size());
      EXPECT_TRUE(in_place || inside(v, aligned, wire.aligned.size() * 2)) << "item " << i;
      copied += !in_place;
    }
    EXPECT_EQ(s.queries, std::string(256, static_cast<char>('a' + i)));
    EXPECT_EQ(s.append->keys, std::string(255 + i % 2, static_cast<char>('A' + i)));
    EXPECT_THAT(s.append->attention_pages, ::testing::ElementsAre(static_cast<int32_t>(i)));
  }
  EXPECT_GT(copied, 0) << "some fields land at odd addresses";
  EXPECT_LT(copied, 16) << "and the others are read in place";
  EXPECT_TRUE(wire.refs.empty());
}

}  // namespace
}  // namespace indexer::server
