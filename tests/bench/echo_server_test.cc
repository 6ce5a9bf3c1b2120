// indexer-echo-server, the binary: it starts on a free port and says which, answers health
// checks, answers every RPC OK with an answer of the right shape and size (block ids 0..topk-1,
// lengths of what the call appended), indexer-bench runs against it (reporting no server
// figures), and SIGTERM stops it with exit 0. On a Unix socket, with handler threads answering
// at once, a stream's pipelined requests are answered in order; with --check_num_tokens it
// refuses requests without num_tokens, and indexer-bench's (every style, pipelined streams
// too) all pass. INDEXER_ECHO_SERVER_BINARY and INDEXER_BENCH_BINARY come from
// tests/bench/CMakeLists.txt.
#include <gmock/gmock.h>
#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/cpp/indexer_client.h"
#include "tests/testing/child_process.h"

namespace indexer::bench {
namespace {

namespace v1 = indexer::v1;
using ::testing::HasSubstr;
using ::testing::Not;

using indexer::testing::Child;
using indexer::testing::ReadFile;
using indexer::testing::WaitForServingPort;
using indexer::testing::RunToEnd;

std::vector<int32_t> Ints(const std::string& bytes) {
  std::vector<int32_t> v(bytes.size() / 4);
  std::memcpy(v.data(), bytes.data(), v.size() * 4);
  return v;
}

class EchoServerTest : public ::testing::Test {
 protected:
  static constexpr int kHeadDim = 64;
  static constexpr int kLayers = 2;

  void SetUp() override {
    const char* binary = std::getenv("INDEXER_ECHO_SERVER_BINARY");
    ASSERT_NE(binary, nullptr) << "INDEXER_ECHO_SERVER_BINARY is not set (ctest sets it)";
    server_ = std::make_unique<Child>(std::vector<std::string>{
        binary, "--listen=127.0.0.1:0", absl::StrCat("--head_dim=", kHeadDim),
        absl::StrCat("--layers=", kLayers), "--topk=8"});
    ASSERT_GT(server_->pid(), 0);
    port_ = WaitForServingPort(*server_, absl::Seconds(5)).value_or(0);
    ASSERT_GT(port_, 0) << server_->Log();
    absl::StatusOr<std::unique_ptr<client::IndexerClient>> c =
        client::IndexerClient::Connect(absl::StrCat("127.0.0.1:", port_));
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = std::move(*c);
    ASSERT_TRUE(client_->WaitUntilServing(absl::Seconds(10)).ok());
  }

  void TearDown() override {
    client_.reset();
    if (server_ != nullptr && server_->pid() > 0) {
      kill(server_->pid(), SIGTERM);
      EXPECT_EQ(server_->Wait(absl::Seconds(10)), std::optional<int>(0)) << server_->Log();
    }
  }

  // `n` tokens of keys for every layer (bf16 zeros: the echo server never reads them).
  static v1::AppendKeysRequest Append(const std::string& id, int n) {
    v1::AppendKeysRequest a;
    a.set_sequence_id(id);
    a.set_all_layers(true);
    a.set_dtype(v1::VALUE_DTYPE_BF16);
    a.set_keys(std::string(static_cast<size_t>(n) * kLayers * kHeadDim * 2, '\0'));
    return a;
  }

  static v1::SelectBlocksRequest Select(const std::string& id, int n, int heads, int topk,
                                        v1::ValueDtype dtype) {
    v1::SelectBlocksRequest r;
    r.set_sequence_id(id);
    r.set_num_heads(heads);
    r.set_query_dtype(dtype);
    r.set_queries(std::string(static_cast<size_t>(n) * heads * kHeadDim *
                                  (dtype == v1::VALUE_DTYPE_FP32 ? 4 : 2),
                              '\0'));
    if (topk > 0) r.set_topk(topk);
    *r.mutable_append() = Append(id, 1);
    return r;
  }

  // The answer has n x H x topk ids, each row 0..topk-1, and lengths of one appended token.
  static void ExpectShape(const v1::SelectBlocksResponse& r, int n, int heads, int topk) {
    EXPECT_EQ(r.num_tokens(), static_cast<uint32_t>(n));
    EXPECT_EQ(r.num_heads(), static_cast<uint32_t>(heads));
    EXPECT_EQ(r.topk(), static_cast<uint32_t>(topk));
    const std::vector<int32_t> ids = Ints(r.block_ids());
    ASSERT_EQ(ids.size(), static_cast<size_t>(n * heads * topk));
    for (size_t i = 0; i < ids.size(); ++i) EXPECT_EQ(ids[i], static_cast<int32_t>(i % topk));
    EXPECT_THAT(r.lengths(), ::testing::ElementsAre(1, 1));
  }

  std::unique_ptr<Child> server_;
  int port_ = 0;
  std::unique_ptr<client::IndexerClient> client_;
};

TEST_F(EchoServerTest, AnswersEveryRpcWithTheRightShape) {
  absl::StatusOr<v1::ServerInfoResponse> info = client_->ServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->backend(), "echo");
  EXPECT_EQ(info->head_dim(), static_cast<uint32_t>(kHeadDim));
  EXPECT_EQ(info->layers(), static_cast<uint32_t>(kLayers));
  EXPECT_EQ(info->default_topk(), 8u);
  EXPECT_GT(info->free_pages(), 1000000u);
  absl::StatusOr<client::HealthStatus> health = client_->Health("indexer.v1.Indexer");
  ASSERT_TRUE(health.ok());
  EXPECT_EQ(*health, client::HealthStatus::kServing);

  absl::StatusOr<v1::AppendKeysResponse> appended = client_->AppendKeys(Append("a", 300));
  ASSERT_TRUE(appended.ok()) << appended.status();
  EXPECT_THAT(appended->lengths(), ::testing::ElementsAre(300, 300));
  EXPECT_EQ(appended->num_blocks(), 3u);

  absl::StatusOr<v1::SelectBlocksResponse> selected =
      client_->SelectBlocks(Select("a", 2, 3, 5, v1::VALUE_DTYPE_BF16));
  ASSERT_TRUE(selected.ok()) << selected.status();
  ExpectShape(*selected, 2, 3, 5);
  // fp32 queries are twice the bytes for the same shape; no topk: the default.
  selected = client_->SelectBlocks(Select("a", 3, 1, 0, v1::VALUE_DTYPE_FP32));
  ASSERT_TRUE(selected.ok()) << selected.status();
  ExpectShape(*selected, 3, 1, 8);

  v1::BatchRequest batch;
  batch.set_request_id(77);
  for (int i = 0; i < 3; ++i) *batch.add_items() = Select("b", 1, 4, 16, v1::VALUE_DTYPE_BF16);
  absl::StatusOr<v1::BatchResponse> answered = client_->Batch(batch);
  ASSERT_TRUE(answered.ok()) << answered.status();
  EXPECT_EQ(answered->request_id(), 77u);
  ASSERT_EQ(answered->results_size(), 3);
  for (const v1::BatchItemResult& r : answered->results()) {
    EXPECT_EQ(r.code(), 0);
    ExpectShape(r.result(), 1, 4, 16);
  }

  std::unique_ptr<client::BatchStream> stream = client_->OpenBatchStream();
  for (uint64_t step = 1; step <= 3; ++step) {
    batch.set_request_id(step);
    absl::StatusOr<v1::BatchResponse> r = stream->Step(batch);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->request_id(), step);
    EXPECT_EQ(r->results_size(), 3);
  }
  EXPECT_TRUE(stream->Finish().ok());

  EXPECT_TRUE(client_->TruncateSequence("a", 10).ok());
  EXPECT_TRUE(client_->ForkSequence("a", "c").ok());
  EXPECT_TRUE(client_->GetSequence("a").ok());
  EXPECT_TRUE(client_->ReleaseSequence("a").ok());
  absl::StatusOr<v1::GetStatsResponse> stats = client_->GetStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->families_size(), 0);
}

TEST_F(EchoServerTest, IndexerBenchRunsAgainstIt) {
  const char* bench = std::getenv("INDEXER_BENCH_BINARY");
  ASSERT_NE(bench, nullptr);
  const std::string json = ::testing::TempDir() + "/echo-bench.json";
  for (const char* style : {"unary", "batch", "stream"}) {
    const testing::RunResult run =
        RunToEnd({bench, absl::StrCat("--servers=127.0.0.1:", port_), absl::StrCat("--style=", style),
                  "--concurrency=2", "--batch=2", "--prefill=300", "--prefill_chunk=128",
                  "--decode_steps=1000", "--rewind=16", "--heads=2", "--duration=500ms",
                  "--warmup=100ms", "--progress=off", "--json=" + json});
    ASSERT_EQ(run.code, 0) << run.output;
    google::protobuf::Struct report;
    ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(ReadFile(json), &report).ok());
    const google::protobuf::Struct& stage =
        report.fields().at("stages").list_value().values(0).struct_value();
    EXPECT_GT(stage.fields().at("requests").struct_value().fields().at("ok").number_value(), 0)
        << style;
    const google::protobuf::Struct& server = stage.fields().at("server_stats").struct_value();
    EXPECT_FALSE(server.fields().at("available").bool_value());
    EXPECT_THAT(server.fields().at("note").string_value(), HasSubstr("no backend figures"));
  }
  unlink(json.c_str());
}

// On a Unix socket, answering on three handler threads, checking num_tokens.
TEST(EchoServerUnixTest, PipelinedStreamsInOrderAndNumTokensChecked) {
  const char* binary = std::getenv("INDEXER_ECHO_SERVER_BINARY");
  const char* bench = std::getenv("INDEXER_BENCH_BINARY");
  ASSERT_NE(binary, nullptr);
  ASSERT_NE(bench, nullptr);
  const std::string socket = absl::StrCat("/tmp/echo-test-", getpid(), ".sock");
  unlink(socket.c_str());
  Child server({binary, "--listen=unix:" + socket, "--head_dim=64", "--layers=2",
                "--handler_threads=3", "--check_num_tokens"});
  ASSERT_GT(server.pid(), 0);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (server.Log().find("serving on unix:" + socket) == std::string::npos &&
         absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_THAT(server.Log(), HasSubstr("serving on unix:" + socket));
  absl::StatusOr<std::unique_ptr<client::IndexerClient>> c =
      client::IndexerClient::Connect("unix:" + socket);
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE((*c)->WaitUntilServing(absl::Seconds(10)).ok());

  // Without num_tokens: refused.
  v1::SelectBlocksRequest select;
  select.set_sequence_id("s");
  select.set_num_heads(1);
  select.set_queries(std::string(64 * 2, '\0'));
  EXPECT_EQ((*c)->SelectBlocks(select).status().code(), absl::StatusCode::kInvalidArgument);
  select.set_num_tokens(2);  // one token's queries
  EXPECT_EQ((*c)->SelectBlocks(select).status().code(), absl::StatusCode::kInvalidArgument);
  select.set_num_tokens(1);
  EXPECT_TRUE((*c)->SelectBlocks(select).ok());

  // Twelve requests written before any answer is read, the first ones the largest (so that the
  // handler threads finish them last): the answers come in the order of the requests.
  std::unique_ptr<client::BatchStream> stream = (*c)->OpenBatchStream();
  for (uint64_t id = 1; id <= 12; ++id) {
    v1::BatchRequest request;
    request.set_request_id(id * 10);
    for (uint64_t i = 0; i < (13 - id) * 20; ++i) *request.add_items() = select;
    ASSERT_TRUE(stream->Write(request));
  }
  for (uint64_t id = 1; id <= 12; ++id) {
    v1::BatchResponse answer;
    ASSERT_TRUE(stream->Read(&answer));
    EXPECT_EQ(answer.request_id(), id * 10);
    EXPECT_EQ(answer.results_size(), static_cast<int>((13 - id) * 20));
    EXPECT_EQ(answer.results(0).code(), 0);
  }
  EXPECT_TRUE(stream->Finish().ok());

  // indexer-bench sets num_tokens on every append and selection, in every style.
  for (const std::vector<std::string>& style :
       {std::vector<std::string>{"--style=unary"}, {"--style=batch"}, {"--style=stream"},
        {"--style=stream", "--stream_inflight=2", "--speculative=2"}}) {
    std::vector<std::string> argv = {bench, "--servers=unix:" + socket, "--concurrency=2",
                                     "--batch=2", "--prefill=300", "--prefill_chunk=128",
                                     "--heads=2", "--duration=400ms", "--warmup=100ms",
                                     "--progress=off", "--summary=brief"};
    argv.insert(argv.end(), style.begin(), style.end());
    const testing::RunResult run = RunToEnd(argv);
    EXPECT_EQ(run.code, 0) << style[0] << ": " << run.output;
    EXPECT_THAT(run.output, HasSubstr(" 0 errors")) << run.output;
  }
  kill(server.pid(), SIGTERM);
  EXPECT_EQ(server.Wait(absl::Seconds(10)), std::optional<int>(0)) << server.Log();
  unlink(socket.c_str());
}

TEST(EchoServerFlags, RefusedValueExits2) {
  const char* binary = std::getenv("INDEXER_ECHO_SERVER_BINARY");
  ASSERT_NE(binary, nullptr);
  const testing::RunResult run = RunToEnd({binary, "--listen=127.0.0.1:0", "--head_dim=0"});
  EXPECT_EQ(run.code, 2);
  EXPECT_THAT(run.output, HasSubstr("--head_dim"));
}

TEST(EchoServerFlags, HelpSaysUnixSocketsWork) {
  const char* binary = std::getenv("INDEXER_ECHO_SERVER_BINARY");
  ASSERT_NE(binary, nullptr);
  const testing::RunResult run = RunToEnd({binary, "--help"});
  EXPECT_EQ(run.code, 0);
  EXPECT_THAT(run.output, HasSubstr("--listen=unix:/"));
  EXPECT_THAT(run.output, HasSubstr("unix:/path/to/socket for a Unix domain socket"));
  EXPECT_THAT(run.output, HasSubstr("  --max_message_bytes (default: 67108864)"));
  EXPECT_THAT(run.output, HasSubstr("Exit status:"));
  EXPECT_THAT(run.output, Not(HasSubstr("Flags from"))) << "absl's listing, with build paths";
}

// Usage errors exit 2 like every indexer program's, saying what was wrong.
TEST(EchoServerFlags, UsageErrorsExitTwo) {
  const char* binary = std::getenv("INDEXER_ECHO_SERVER_BINARY");
  ASSERT_NE(binary, nullptr);
  for (const auto& [arg, message] : std::vector<std::pair<std::string, std::string>>{
           {"--no_such_flag", "unknown flag --no_such_flag"},
           {"--layers=many", "--layers"},
           {"serve", "unexpected argument 'serve'"}}) {
    const testing::RunResult run = RunToEnd({binary, arg});
    EXPECT_EQ(run.code, 2) << arg << ":\n" << run.output;
    EXPECT_THAT(run.output, HasSubstr(message)) << arg;
  }
}

}  // namespace
}  // namespace indexer::bench
