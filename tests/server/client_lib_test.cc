// indexer_client's pure helpers, without a server: status translation, wire packing (bf16 ties
// to even), int32 unpacking and the Selection view.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "client/cpp/indexer_client.h"
#include "kernels/numeric.h"

namespace indexer::client {
namespace {

uint16_t Bits(const std::string& packed, size_t i) {
  uint16_t b;
  std::memcpy(&b, packed.data() + 2 * i, 2);
  return b;
}

TEST(ClientStatusTest, GrpcStatusTranslatesCodeAndMessage) {
  EXPECT_TRUE(FromGrpcStatus(grpc::Status::OK).ok());
  const std::pair<grpc::StatusCode, absl::StatusCode> pairs[] = {
      {grpc::StatusCode::CANCELLED, absl::StatusCode::kCancelled},
      {grpc::StatusCode::INVALID_ARGUMENT, absl::StatusCode::kInvalidArgument},
      {grpc::StatusCode::DEADLINE_EXCEEDED, absl::StatusCode::kDeadlineExceeded},
      {grpc::StatusCode::NOT_FOUND, absl::StatusCode::kNotFound},
      {grpc::StatusCode::ALREADY_EXISTS, absl::StatusCode::kAlreadyExists},
      {grpc::StatusCode::RESOURCE_EXHAUSTED, absl::StatusCode::kResourceExhausted},
      {grpc::StatusCode::FAILED_PRECONDITION, absl::StatusCode::kFailedPrecondition},
      {grpc::StatusCode::INTERNAL, absl::StatusCode::kInternal},
      {grpc::StatusCode::UNAVAILABLE, absl::StatusCode::kUnavailable},
      {grpc::StatusCode::UNAUTHENTICATED, absl::StatusCode::kUnauthenticated},
  };
  for (const auto& [g, a] : pairs) {
    const absl::Status s = FromGrpcStatus(grpc::Status(g, "why"));
    EXPECT_EQ(s.code(), a);
    EXPECT_EQ(s.message(), "why");
  }
  v1::BatchItemResult item;
  EXPECT_TRUE(ItemStatus(item).ok());
  item.set_code(5);
  item.set_message("sequence 'x' does not exist");
  EXPECT_EQ(ItemStatus(item), absl::NotFoundError("sequence 'x' does not exist"));
}

TEST(ClientPackTest, Bf16RoundsToNearestTiesToEven) {
  const float values[] = {1.0f,
                          1.0f + 1.0f / 256,          // tie between 1 and 1+2^-7: even is 1
                          1.0f + 3.0f / 256,          // tie: even is 1+2^-6
                          1.0f + 1.0f / 256 + 1e-6f,  // just above the tie: up
                          -2.5f,
                          3.4e38f,                    // past bf16's range: Inf (the server refuses it)
                          std::numeric_limits<float>::quiet_NaN()};
  const std::string packed = PackBf16(values);
  ASSERT_EQ(packed.size(), 14u);
  EXPECT_EQ(Bits(packed, 0), 0x3f80);
  EXPECT_EQ(Bits(packed, 1), 0x3f80);
  EXPECT_EQ(Bits(packed, 2), 0x3f82);
  EXPECT_EQ(Bits(packed, 3), 0x3f81);
  EXPECT_EQ(Bits(packed, 4), 0xc020);
  EXPECT_EQ(Bits(packed, 5), 0x7f80);
  EXPECT_TRUE(std::isnan(Bf16BitsToFloat(Bits(packed, 6))));
  for (size_t i = 0; i < 5; ++i) EXPECT_EQ(Bits(packed, i), kernels::FloatToBf16(values[i]));
  EXPECT_EQ(RoundToBf16(1.0f + 3.0f / 256), 1.0f + 4.0f / 256);

  const uint16_t raw[] = {0x1234, 0xabcd};
  EXPECT_EQ(PackBf16Bits(raw), std::string("\x34\x12\xcd\xab", 4));
}

TEST(ClientPackTest, Fp32IsLittleEndianIeee) {
  const float values[] = {1.0f, -0.5f};
  EXPECT_EQ(PackFp32(values), std::string("\x00\x00\x80\x3f\x00\x00\x00\xbf", 8));
  absl::StatusOr<std::string> p = PackValues(values, v1::VALUE_DTYPE_FP32);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->size(), 8u);
  p = PackValues(values, v1::VALUE_DTYPE_BF16);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(*p, std::string("\x80\x3f\x00\xbf", 4));
  EXPECT_EQ(PackValues(values, v1::VALUE_DTYPE_UNSPECIFIED).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ClientPackTest, UnpackInt32) {
  const int32_t v[] = {-1, 0, 7, 123456789};
  absl::StatusOr<std::vector<int32_t>> u =
      UnpackInt32(absl::string_view(reinterpret_cast<const char*>(v), sizeof(v)));
  ASSERT_TRUE(u.ok());
  EXPECT_EQ(*u, (std::vector<int32_t>{-1, 0, 7, 123456789}));
  EXPECT_TRUE(UnpackInt32("").ok());
  absl::StatusOr<std::vector<int32_t>> bad = UnpackInt32("abcde", "block_ids");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("block_ids"), absl::string_view::npos);
}

// A client whose model has head_dim 64 talking to a head_dim-128 server: the bytes of 2 tokens
// are one token to the server, so only the stated num_tokens reveals the mistake.
TEST(ClientShapesTest, StatedTokensThatDoNotMatchTheServersShapeAreRefusedNamingHeadDim) {
  const ServerShapes server{128, 2};
  const std::vector<float> keys(2 * 64, 1.0f);
  EXPECT_TRUE(CheckShapes(server, MakeAppend("w1", 0, keys)).ok()) << "nothing stated";
  const absl::Status append = CheckShapes(server, MakeAppend("w1", 0, 2, keys));
  EXPECT_EQ(append.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(append.message().find("head_dim 128"), absl::string_view::npos) << append;
  EXPECT_NE(append.message().find("num_tokens says 2"), absl::string_view::npos) << append;
  EXPECT_TRUE(CheckShapes(server, MakeAppend("w1", 0, 1, keys)).ok());

  const std::vector<float> rows(2 * 2 * 128, 1.0f);  // [2 tokens][layers 2][head_dim 128]
  EXPECT_TRUE(CheckShapes(server, MakeAppendAllLayers("w1", 2, rows)).ok());
  EXPECT_FALSE(CheckShapes(server, MakeAppendAllLayers("w1", 4, rows)).ok());
  EXPECT_FALSE(CheckShapes(server, MakeAppendAllLayers("w1", 1, std::vector<float>(300))).ok())
      << "not whole tokens";
  EXPECT_TRUE(CheckShapes(server, MakeAppendAllLayers("w1", std::vector<float>(300))).ok())
      << "no count stated: the server's own checks say what is wrong";

  const std::vector<float> queries(2 * 4 * 64, 1.0f);  // [2][4 heads][64]
  const absl::Status select = CheckShapes(server, MakeSelect("w1", 0, 4, 2, queries));
  EXPECT_EQ(select.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(select.message().find("queries"), absl::string_view::npos) << select;
  v1::SelectBlocksRequest step = MakeSelect("w1", 0, 4, 1, queries);
  *step.mutable_append() = MakeAppend("", 0, 2, keys);
  v1::BatchRequest batch;
  *batch.add_items() = MakeSelect("w1", 0, 4, 1, queries);
  *batch.add_items() = step;
  const absl::Status in_batch = CheckShapes(server, batch);
  EXPECT_EQ(in_batch.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(in_batch.message().find("items[1]: append: keys"), absl::string_view::npos)
      << in_batch;
}

std::string Int32Bytes(const std::vector<int32_t>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * 4);
}

TEST(ClientSelectionTest, ParsesShapesAndIndexes) {
  v1::SelectBlocksResponse r;
  r.set_num_tokens(2);
  r.set_num_heads(3);
  r.set_topk(2);
  r.set_start_position(40);
  std::vector<int32_t> ids(12);
  for (int i = 0; i < 12; ++i) ids[i] = i;
  r.set_block_ids(Int32Bytes(ids));
  r.add_lengths(42);
  absl::StatusOr<Selection> s = ParseSelection(r);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_FALSE(s->has_page_table());
  EXPECT_EQ(s->at(0, 0, 0), 0);
  EXPECT_EQ(s->at(0, 2, 1), 5);
  EXPECT_EQ(s->at(1, 1, 0), 8);
  EXPECT_EQ(s->at(1, 2, 1), 11);
  EXPECT_EQ(std::vector<int32_t>(s->blocks(1, 0).begin(), s->blocks(1, 0).end()),
            (std::vector<int32_t>{6, 7}));
  EXPECT_EQ(s->position(1), 41);
  EXPECT_EQ(s->lengths, (std::vector<uint32_t>{42}));

  r.set_pages_per_block(2);
  std::vector<int32_t> table(2 * 3 * 2 * 2);
  for (size_t i = 0; i < table.size(); ++i) table[i] = 100 + static_cast<int32_t>(i);
  r.set_page_table(Int32Bytes(table));
  r.set_context_lens(Int32Bytes({1, 2, 3, 4, 5, 6}));
  s = ParseSelection(r);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE(s->has_page_table());
  EXPECT_EQ(std::vector<int32_t>(s->page_row(1, 2).begin(), s->page_row(1, 2).end()),
            (std::vector<int32_t>{120, 121, 122, 123}));
  EXPECT_EQ(s->context_len(1, 0), 4);

  // Sizes that disagree with the declared shape are refused.
  v1::SelectBlocksResponse short_ids = r;
  short_ids.set_block_ids(Int32Bytes({1, 2, 3}));
  EXPECT_EQ(ParseSelection(short_ids).status().code(), absl::StatusCode::kInvalidArgument);
  v1::SelectBlocksResponse short_table = r;
  short_table.set_context_lens(Int32Bytes({1}));
  EXPECT_EQ(ParseSelection(short_table).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ClientBuildersTest, RequestsCarryWhatTheyWereGiven) {
  const std::vector<float> keys(2 * 64, 1.0f);
  v1::AppendKeysRequest a = MakeAppend("s", 1, keys, v1::VALUE_DTYPE_FP32);
  EXPECT_EQ(a.sequence_id(), "s");
  EXPECT_EQ(a.layer(), 1u);
  EXPECT_FALSE(a.all_layers());
  EXPECT_EQ(a.dtype(), v1::VALUE_DTYPE_FP32);
  EXPECT_EQ(a.keys().size(), 2u * 64 * 4);
  v1::AppendKeysRequest all = MakeAppendAllLayers("s", keys);
  EXPECT_TRUE(all.all_layers());
  EXPECT_EQ(all.keys().size(), 2u * 64 * 2);
  v1::SelectBlocksRequest q = MakeSelect("s", 0, 2, keys);
  EXPECT_EQ(q.num_heads(), 2u);
  EXPECT_EQ(q.query_dtype(), v1::VALUE_DTYPE_BF16);
  EXPECT_FALSE(q.has_topk());
  EXPECT_FALSE(q.has_start_position());
  EXPECT_FALSE(q.has_append());
}

TEST(ClientConnectTest, EmptyTargetIsRefusedAndUnreachableServerIsUnavailable) {
  EXPECT_EQ(IndexerClient::Connect("").status().code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<std::unique_ptr<IndexerClient>> c = IndexerClient::Connect("127.0.0.1:1");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ((*c)->ServerInfo(CallOptions::Timeout(absl::Seconds(5))).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ((*c)->WaitUntilServing(absl::Milliseconds(200)).code(), absl::StatusCode::kDeadlineExceeded);
}

}  // namespace
}  // namespace indexer::client
