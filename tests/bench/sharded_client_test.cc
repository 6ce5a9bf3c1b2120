// ShardedClient (client/cpp/sharded_client.h) over two in-process servers: every call reaches
// the server the ring names, batches are split and merged in item order, a server that is down
// fails only its own items, the stream works the same way, and forks need colocated ids.
#include "client/cpp/sharded_client.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>

#include "absl/strings/str_cat.h"
#include "server/indexer_server.h"
#include "server/server_options.h"
#include "tests/testing/server_config.h"

namespace indexer::client {
namespace {

server::ServerOptions Options() {
  server::ServerOptions o = testing::LoopbackServerOptions();
  o.engine.capacity_pages = 256;
  o.engine.cpu_threads = 1;
  return o;
}

class ShardedClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (auto& s : servers_) {
      absl::StatusOr<std::unique_ptr<server::IndexerServer>> started =
          server::IndexerServer::Start(Options());
      ASSERT_TRUE(started.ok()) << started.status();
      s = std::move(*started);
      targets_.push_back(absl::StrCat("127.0.0.1:", s->port()));
      absl::StatusOr<std::unique_ptr<IndexerClient>> direct =
          IndexerClient::Connect(targets_.back());
      ASSERT_TRUE(direct.ok());
      direct_.push_back(std::move(*direct));
    }
    absl::StatusOr<std::unique_ptr<ShardedClient>> c = ShardedClient::Connect(targets_);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = std::move(*c);
  }
  void TearDown() override {
    client_.reset();
    for (auto& s : servers_) {
      if (s != nullptr) s->Shutdown(absl::Seconds(1));
    }
  }

  std::vector<float> Values(size_t n) {
    std::uniform_int_distribution<int> d(-3, 3);
    std::vector<float> v(n);
    for (float& x : v) x = static_cast<float>(d(rng_));
    return v;
  }

  // Ids spread over both servers: at least `each` on each.
  std::vector<std::string> SpreadIds(int each) {
    std::vector<std::string> ids;
    int on[2] = {0, 0};
    for (int i = 0; on[0] < each || on[1] < each; ++i) {
      const std::string id = absl::StrCat("seq-", i);
      ++on[client_->ServerIndex(id)];
      ids.push_back(id);
    }
    return ids;
  }

  std::unique_ptr<server::IndexerServer> servers_[2];
  std::vector<std::string> targets_;
  std::vector<std::unique_ptr<IndexerClient>> direct_;
  std::unique_ptr<ShardedClient> client_;
  std::mt19937 rng_{5};
};

TEST_F(ShardedClientTest, CallsReachTheOwningServer) {
  const std::vector<std::string> ids = SpreadIds(5);
  for (const std::string& id : ids) {
    ASSERT_TRUE(client_->AppendKeys(MakeAppendAllLayers(id, Values(200 * 2 * 64))).ok());
  }
  for (const std::string& id : ids) {
    const size_t owner = client_->ServerIndex(id);
    EXPECT_EQ(client_->TargetFor(id), targets_[owner]);
    EXPECT_TRUE(direct_[owner]->GetSequence(id).ok()) << id;
    EXPECT_EQ(direct_[1 - owner]->GetSequence(id).status().code(), absl::StatusCode::kNotFound)
        << id;
    absl::StatusOr<v1::GetSequenceResponse> got = client_->GetSequence(id);
    ASSERT_TRUE(got.ok());
    EXPECT_EQ(got->lengths(0), 200u);
    absl::StatusOr<Selection> sel = client_->Select(MakeSelect(id, 1, 2, Values(2 * 64)));
    ASSERT_TRUE(sel.ok()) << sel.status();
    EXPECT_EQ(sel->start_position, 199);
    ASSERT_TRUE(client_->TruncateSequence(id, 150).ok());
    ASSERT_TRUE(client_->ReleaseSequence(id).ok());
  }
  absl::StatusOr<std::vector<v1::ServerInfoResponse>> infos = client_->ServerInfoAll();
  ASSERT_TRUE(infos.ok());
  EXPECT_EQ(infos->size(), 2u);
  EXPECT_TRUE(client_->WaitUntilServing(absl::Seconds(5)).ok());
}

// A batch over both servers: answers in item order, as if one server held everything.
void ExpectBatchAnswers(const v1::BatchRequest& request, const v1::BatchResponse& response,
                        const std::map<std::string, int>& lengths) {
  ASSERT_EQ(response.results_size(), request.items_size());
  EXPECT_EQ(response.request_id(), request.request_id());
  for (int i = 0; i < request.items_size(); ++i) {
    const v1::BatchItemResult& r = response.results(i);
    ASSERT_EQ(r.code(), 0) << r.message();
    const std::string& id = request.items(i).sequence_id();
    EXPECT_EQ(r.result().start_position(), lengths.at(id) - 1) << id;
    EXPECT_EQ(r.result().num_heads(), request.items(i).num_heads()) << id;
  }
}

TEST_F(ShardedClientTest, BatchAndStreamSplitAndMerge) {
  const std::vector<std::string> ids = SpreadIds(4);
  std::map<std::string, int> lengths;
  for (const std::string& id : ids) {
    ASSERT_TRUE(client_->AppendKeys(MakeAppendAllLayers(id, Values(130 * 2 * 64))).ok());
    lengths[id] = 130;
  }
  std::unique_ptr<ShardedBatchStream> stream = client_->OpenBatchStream();
  for (int step = 0; step < 3; ++step) {
    v1::BatchRequest request;
    request.set_request_id(100 + step);
    for (size_t k = 0; k < ids.size(); ++k) {
      // Alternate heads so that a mixed-up merge would show.
      v1::SelectBlocksRequest* item = request.add_items();
      *item = MakeSelect(ids[k], 0, 1 + k % 2, Values((1 + k % 2) * 64));
      *item->mutable_append() = MakeAppendAllLayers("", Values(2 * 64));
      ++lengths[ids[k]];
    }
    const v1::BatchResponse response =
        step % 2 == 0 ? client_->Batch(request) : stream->Step(request);
    ExpectBatchAnswers(request, response, lengths);
  }
  EXPECT_TRUE(stream->Finish().ok());
  for (const std::string& id : ids) EXPECT_EQ(client_->GetSequence(id)->lengths(1), 133u);
}

TEST_F(ShardedClientTest, AServerDownFailsOnlyItsItems) {
  const std::vector<std::string> ids = SpreadIds(3);
  for (const std::string& id : ids) {
    ASSERT_TRUE(client_->AppendKeys(MakeAppendAllLayers(id, Values(10 * 2 * 64))).ok());
  }
  servers_[1]->Shutdown(absl::Seconds(1));
  servers_[1].reset();
  v1::BatchRequest request;
  for (const std::string& id : ids) *request.add_items() = MakeSelect(id, 0, 1, Values(64));
  CallOptions call = CallOptions::Timeout(absl::Seconds(2));
  for (int attempt = 0; attempt < 2; ++attempt) {
    const v1::BatchResponse response =
        attempt == 0 ? client_->Batch(request, call) : client_->OpenBatchStream()->Step(request);
    ASSERT_EQ(response.results_size(), request.items_size());
    for (int i = 0; i < request.items_size(); ++i) {
      const int code = response.results(i).code();
      if (client_->ServerIndex(ids[i]) == 0) {
        EXPECT_EQ(code, 0) << response.results(i).message();
      } else {
        EXPECT_EQ(code, static_cast<int>(absl::StatusCode::kUnavailable))
            << response.results(i).message();
        EXPECT_THAT(response.results(i).message(), ::testing::HasSubstr(targets_[1]));
      }
    }
  }
}

TEST_F(ShardedClientTest, ForksNeedOneServer) {
  ASSERT_TRUE(client_->AppendKeys(MakeAppendAllLayers("{chat9}.main", Values(300 * 2 * 64))).ok());
  absl::StatusOr<v1::ForkSequenceResponse> fork =
      client_->ForkSequence("{chat9}.main", "{chat9}.alt");
  ASSERT_TRUE(fork.ok()) << fork.status();
  EXPECT_EQ(fork->lengths(0), 300u);
  // Find a target that hashes elsewhere.
  std::string elsewhere;
  for (int i = 0; elsewhere.empty(); ++i) {
    const std::string id = absl::StrCat("other-", i);
    if (client_->ServerIndex(id) != client_->ServerIndex("{chat9}.main")) elsewhere = id;
  }
  EXPECT_EQ(client_->ForkSequence("{chat9}.main", elsewhere).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(ShardedClientConnectTest, RefusesBadLists) {
  EXPECT_EQ(ShardedClient::Connect({}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ShardedClient::Connect({"a:1", "a:1"}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ShardedClient::Connect({""}).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace indexer::client
