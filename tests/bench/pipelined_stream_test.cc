// PipelinedStream (client/bench/pipelined_stream.h) against small in-process BatchStream servers
// whose behaviour the test picks: several requests go out before any answer comes back; answers
// are merged in item order across two servers; answers out of order are caught (INTERNAL, counted);
// a stream that ends early fails what it owed and the next request opens a new one.
#include "client/bench/pipelined_stream.h"

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "indexer/v1/indexer.grpc.pb.h"

namespace indexer::bench {
namespace {

namespace v1 = indexer::v1;

enum class Mode {
  kInGroups,   // read `group` requests, then answer them in order
  kReversed,   // read two requests, answer the second first
  kEndAfterOne  // answer one request, read the next and end the call with an error
};

// Answers each item with code 0 and message "<name>:<sequence id>", so a test can tell which
// server answered which item.
class FakeStreams final : public v1::Indexer::Service {
 public:
  FakeStreams(std::string name, Mode mode, int group = 1)
      : name_(std::move(name)), mode_(mode), group_(group) {}

  grpc::Status BatchStream(
      grpc::ServerContext* /*context*/,
      grpc::ServerReaderWriter<v1::BatchResponse, v1::BatchRequest>* stream) override {
    for (;;) {
      const int want = mode_ == Mode::kReversed ? 2 : mode_ == Mode::kInGroups ? group_ : 1;
      std::vector<v1::BatchRequest> got(static_cast<size_t>(want));
      for (int i = 0; i < want; ++i) {
        if (!stream->Read(&got[static_cast<size_t>(i)])) return grpc::Status::OK;
      }
      if (mode_ == Mode::kReversed) std::swap(got[0], got[1]);
      for (const v1::BatchRequest& request : got) stream->Write(Answer(request));
      if (mode_ == Mode::kEndAfterOne) {
        v1::BatchRequest next;
        stream->Read(&next);
        return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "no more for now");
      }
    }
  }

 private:
  v1::BatchResponse Answer(const v1::BatchRequest& request) const {
    v1::BatchResponse r;
    r.set_request_id(request.request_id());
    for (const v1::SelectBlocksRequest& item : request.items()) {
      r.add_results()->set_message(absl::StrCat(name_, ":", item.sequence_id()));
    }
    return r;
  }

  const std::string name_;
  const Mode mode_;
  const int group_;
};

struct Fake {
  std::unique_ptr<FakeStreams> service;
  std::unique_ptr<grpc::Server> server;
  std::string target;
};

Fake StartFake(const std::string& name, Mode mode, int group = 1) {
  Fake f;
  f.service = std::make_unique<FakeStreams>(name, mode, group);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(f.service.get());
  f.server = builder.BuildAndStart();
  f.target = absl::StrCat("127.0.0.1:", port);
  return f;
}

// Cancels whatever is still open, at once.
void Stop(Fake& f) { f.server->Shutdown(std::chrono::system_clock::now()); }

std::unique_ptr<client::ShardedClient> Connect(const std::vector<std::string>& targets) {
  absl::StatusOr<std::unique_ptr<client::ShardedClient>> c = client::ShardedClient::Connect(targets);
  EXPECT_TRUE(c.ok()) << c.status();
  return std::move(*c);
}

v1::BatchRequest Request(uint64_t id, const std::vector<std::string>& sequences) {
  v1::BatchRequest r;
  r.set_request_id(id);
  for (const std::string& s : sequences) r.add_items()->set_sequence_id(s);
  return r;
}

TEST(PipelinedStreamTest, KeepsSeveralInFlightAndAnswersOldestFirst) {
  // The server answers only once it has read three requests: Send must not wait for answers.
  Fake fake = StartFake("a", Mode::kInGroups, 3);
  auto client = Connect({fake.target});
  PipelinedStream stream(*client);
  for (uint64_t id = 1; id <= 6; ++id) {
    stream.Send(Request(id, {absl::StrCat("s", id), absl::StrCat("t", id)}));
    if (id == 3) {
      EXPECT_EQ(stream.in_flight(), 3u);
    }
  }
  Clock::time_point last_done;
  for (uint64_t id = 1; id <= 6; ++id) {
    PipelinedStream::Answer a = stream.Next();
    EXPECT_EQ(a.response.request_id(), id);
    ASSERT_EQ(a.response.results_size(), 2);
    EXPECT_EQ(a.response.results(0).code(), 0);
    EXPECT_EQ(a.response.results(0).message(), absl::StrCat("a:s", id));
    EXPECT_EQ(a.response.results(1).message(), absl::StrCat("a:t", id));
    EXPECT_GE(a.done, last_done);
    last_done = a.done;
  }
  EXPECT_EQ(stream.in_flight(), 0u);
  EXPECT_EQ(stream.out_of_order(), 0);
  EXPECT_TRUE(stream.Finish(absl::Seconds(5)).ok());
  Stop(fake);
}

TEST(PipelinedStreamTest, SplitsByServerAndMergesInItemOrder) {
  Fake a = StartFake("a", Mode::kInGroups, 1), b = StartFake("b", Mode::kInGroups, 1);
  auto client = Connect({a.target, b.target});
  std::vector<std::string> ids;
  for (int i = 0; i < 40; ++i) ids.push_back(absl::StrCat("seq-", i));
  PipelinedStream stream(*client);
  stream.Send(Request(7, ids));
  stream.Send(Request(8, {ids[3]}));
  PipelinedStream::Answer first = stream.Next();
  ASSERT_EQ(first.response.results_size(), 40);
  int on_b = 0;
  for (int i = 0; i < 40; ++i) {
    const std::string server = client->ServerIndex(ids[static_cast<size_t>(i)]) == 0 ? "a" : "b";
    on_b += server == "b";
    EXPECT_EQ(first.response.results(i).message(), absl::StrCat(server, ":", ids[static_cast<size_t>(i)]));
  }
  EXPECT_GT(on_b, 0);
  EXPECT_LT(on_b, 40);
  EXPECT_EQ(stream.Next().response.results(0).code(), 0);
  EXPECT_TRUE(stream.Finish(absl::Seconds(5)).ok());
  Stop(a);
  Stop(b);
}

TEST(PipelinedStreamTest, CatchesAnswersOutOfOrder) {
  Fake fake = StartFake("a", Mode::kReversed);
  auto client = Connect({fake.target});
  PipelinedStream stream(*client);
  stream.Send(Request(1, {"x"}));
  stream.Send(Request(2, {"y"}));
  for (uint64_t id : {1, 2}) {
    const PipelinedStream::Answer a = stream.Next();
    EXPECT_EQ(a.response.request_id(), id);
    EXPECT_EQ(a.response.results(0).code(), static_cast<int>(absl::StatusCode::kInternal));
    EXPECT_TRUE(absl::StrContains(a.response.results(0).message(), "out of order"))
        << a.response.results(0).message();
  }
  EXPECT_EQ(stream.out_of_order(), 2);
  Stop(fake);
}

TEST(PipelinedStreamTest, AStreamThatEndsFailsWhatItOwedAndIsReopened) {
  Fake fake = StartFake("a", Mode::kEndAfterOne);
  auto client = Connect({fake.target});
  PipelinedStream stream(*client);
  stream.Send(Request(1, {"x"}));
  stream.Send(Request(2, {"y", "z"}));
  EXPECT_EQ(stream.Next().response.results(0).code(), 0);
  const PipelinedStream::Answer failed = stream.Next();
  ASSERT_EQ(failed.response.results_size(), 2);
  for (const v1::BatchItemResult& r : failed.response.results()) {
    EXPECT_EQ(r.code(), static_cast<int>(absl::StatusCode::kResourceExhausted));
    EXPECT_TRUE(absl::StrContains(r.message(), fake.target)) << r.message();
    EXPECT_TRUE(absl::StrContains(r.message(), "no more for now")) << r.message();
  }
  stream.Send(Request(3, {"w"}));  // a new stream
  const PipelinedStream::Answer again = stream.Next();
  EXPECT_EQ(again.response.results(0).code(), 0);
  EXPECT_EQ(again.response.results(0).message(), "a:w");
  Stop(fake);
}

}  // namespace
}  // namespace indexer::bench
