// Requests whose bytes do not parse, sent over gRPC as raw bytes: every unary RPC of both
// services answers INVALID_ARGUMENT naming the message type and why, and a BatchStream that
// receives such a message answers the requests before it and then ends with that status.
#include <grpcpp/generic/generic_stub.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/wire_messages.h"
#include "tests/testing/files.h"
#include "tests/testing/raw_call.h"
#include "tests/testing/server_fixture.h"

namespace indexer::testing {
namespace {

using ::testing::HasSubstr;

grpc::ByteBuffer Buffer(const std::string& bytes) {
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

// Field 1, length-delimited, holding bytes that are not UTF-8.
const std::string kBadUtf8Field1("\x0a\x02\xff\xfe", 4);
// Field 1 as a varint whose continuation bit promises a byte that never comes.
const std::string kTruncatedVarint("\x08\xff", 2);
// Not protobuf at all: a tag varint that never ends.
const std::string kGarbage("\xff\xff\xff\xff\xff", 5);

struct Method {
  std::string path;
  std::string type;  // the request's message type, named in the answer
  // Bytes with a string field that is not UTF-8 (empty: the message has no string field).
  std::string bad_utf8;
};

std::vector<Method> Methods() {
  const std::string in_item = absl::StrCat("\x12", std::string(1, char(kBadUtf8Field1.size())),
                                           kBadUtf8Field1);  // items[0].sequence_id
  return {
      {"/indexer.v1.Indexer/AppendKeys", "indexer.v1.AppendKeysRequest", kBadUtf8Field1},
      {"/indexer.v1.Indexer/SelectBlocks", "indexer.v1.SelectBlocksRequest", kBadUtf8Field1},
      {"/indexer.v1.Indexer/Batch", "indexer.v1.BatchRequest", in_item},
      {"/indexer.v1.Indexer/ReleaseSequence", "indexer.v1.ReleaseSequenceRequest",
       kBadUtf8Field1},
      {"/indexer.v1.Indexer/TruncateSequence", "indexer.v1.TruncateSequenceRequest",
       kBadUtf8Field1},
      {"/indexer.v1.Indexer/ForkSequence", "indexer.v1.ForkSequenceRequest", kBadUtf8Field1},
      {"/indexer.v1.Indexer/GetSequence", "indexer.v1.GetSequenceRequest", kBadUtf8Field1},
      {"/indexer.v1.Indexer/ServerInfo", "indexer.v1.ServerInfoRequest", ""},
      {"/indexer.v1.Indexer/GetStats", "indexer.v1.GetStatsRequest", ""},
      {"/indexer.v1.Indexer/RegisterSystemRegion", "indexer.v1.RegisterSystemRegionRequest",
       kBadUtf8Field1},
      {"/indexer.v1.Indexer/UnregisterRegion", "indexer.v1.UnregisterRegionRequest",
       kBadUtf8Field1},
      {"/indexer.v1.Indexer/ListRegions", "indexer.v1.ListRegionsRequest", kBadUtf8Field1},
      {"/indexer.v1.IndexerAdmin/Snapshot", "indexer.v1.SnapshotRequest", kBadUtf8Field1},
  };
}

class WireTest : public ServerTest {
 protected:
  void SetUp() override {
    options_.snapshot_dir = dir_.path();
    ServerTest::SetUp();
  }
  TempDir dir_;
};

TEST_F(WireTest, EveryUnaryRpcAnswersUnparsableBytesWithInvalidArgument) {
  for (const Method& m : Methods()) {
    std::vector<std::string> inputs = {kTruncatedVarint, kGarbage};
    if (!m.bad_utf8.empty()) inputs.push_back(m.bad_utf8);
    for (const std::string& bytes : inputs) {
      const grpc::Status s = RawUnary(client_->channel().get(), m.path, bytes);
      EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
          << m.path << ": " << s.error_message();
      EXPECT_THAT(s.error_message(), HasSubstr(m.type)) << m.path;
      EXPECT_THAT(s.error_message(), HasSubstr("do not parse")) << m.path;
    }
  }
  // What the C++ client sends for an id that is not UTF-8 (protobuf serializes it anyway).
  const absl::Status raw_id = client_->GetSequence("\xff\xfe").status();
  EXPECT_EQ(raw_id.code(), absl::StatusCode::kInvalidArgument) << raw_id;
  EXPECT_THAT(std::string(raw_id.message()), HasSubstr("UTF-8"));
  // Nothing was created or written.
  absl::StatusOr<v1::ServerInfoResponse> info = client_->ServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->live_sequences(), 0u);
}

// Waits for the completion queue's next event, which must be `tag`; whether it succeeded.
bool Await(grpc::CompletionQueue& cq, void* tag) {
  void* got = nullptr;
  bool ok = false;
  EXPECT_TRUE(cq.Next(&got, &ok));
  EXPECT_EQ(got, tag);
  return ok;
}

TEST_F(WireTest, ABatchStreamMessageThatDoesNotParseEndsTheStreamSayingWhy) {
  ASSERT_NO_FATAL_FAILURE(AppendRandom("s", 0, 200));
  std::vector<float> q;
  v1::BatchRequest good;
  good.set_request_id(1);
  *good.add_items() = RandomSelect("s", 0, 1, 1, &q);
  grpc::ByteBuffer good_bytes;
  server::SerializeMessage(good, &good_bytes);

  grpc::GenericStub stub(client_->channel());
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  grpc::CompletionQueue cq;
  int tag = 0;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call =
      stub.PrepareCall(&ctx, "/indexer.v1.Indexer/BatchStream", &cq);
  call->StartCall(&tag);
  ASSERT_TRUE(Await(cq, &tag));
  call->Write(good_bytes, &tag);
  ASSERT_TRUE(Await(cq, &tag));
  grpc::ByteBuffer answer;
  call->Read(&answer, &tag);
  ASSERT_TRUE(Await(cq, &tag)) << "the request before the bad one is answered";
  v1::BatchResponse response;
  ASSERT_TRUE(server::ParseMessage(answer, &response).ok());
  EXPECT_EQ(response.request_id(), 1u);
  ASSERT_EQ(response.results_size(), 1);
  EXPECT_EQ(response.results(0).code(), 0) << response.results(0).message();

  const grpc::ByteBuffer bad = Buffer(kGarbage);
  call->Write(bad, &tag);
  Await(cq, &tag);  // the server may already have ended the stream
  call->Read(&answer, &tag);
  EXPECT_FALSE(Await(cq, &tag)) << "a request that does not parse has no answer";
  grpc::Status status;
  call->Finish(&status, &tag);
  Await(cq, &tag);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("BatchStream request 2"));
  EXPECT_THAT(status.error_message(), HasSubstr("do not parse"));
  cq.Shutdown();
  void* ignored = nullptr;
  bool ok = false;
  while (cq.Next(&ignored, &ok)) {
  }
}

}  // namespace
}  // namespace indexer::testing
