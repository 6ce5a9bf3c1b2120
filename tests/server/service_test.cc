// The service as a whole: ServerInfo, health checking, reflection, deadlines, message size
// limits, binding, and draining on shutdown.
#include <google/protobuf/unknown_field_set.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/sync_stream.h>

#include <algorithm>
#include <chrono>
#include <future>
#include <thread>

#include "absl/strings/str_cat.h"
#include "flags/command_line.h"
#include "tests/testing/server_fixture.h"

namespace indexer::testing {
namespace {

using ::testing::HasSubstr;

class ServiceTest : public ServerTest {};

TEST_F(ServiceTest, ServerInfoDescribesTheConfiguration) {
  ASSERT_NO_FATAL_FAILURE(AppendRandom("a", 0, 300));
  absl::StatusOr<v1::ServerInfoResponse> info = client_->ServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->version(), flags::ProgramVersion());
  EXPECT_FALSE(info->version().empty());
  EXPECT_EQ(info->backend(), "cpu");
  EXPECT_FALSE(info->device().empty());
  EXPECT_EQ(info->head_dim(), 64u);
  EXPECT_EQ(info->layers(), 2u);
  EXPECT_EQ(info->key_storage(), v1::KEY_STORAGE_BF16);
  EXPECT_EQ(info->block_size(), 128u);
  EXPECT_EQ(info->max_index_heads(), 4u);
  EXPECT_EQ(info->max_topk(), 32u);
  EXPECT_EQ(info->default_topk(), 8u);
  EXPECT_EQ(info->default_init_blocks(), 0u);
  EXPECT_EQ(info->default_local_blocks(), 1u);
  EXPECT_EQ(info->pages_per_block(), 4u);
  EXPECT_EQ(info->block_page_stride(), 8u);
  EXPECT_EQ(info->total_pages(), 64u);
  EXPECT_EQ(info->free_pages(), 61u);
  EXPECT_EQ(info->bytes_per_page(), 128u * 64 * 2 * 2);
  EXPECT_EQ(info->live_sequences(), 1u);
  EXPECT_EQ(info->max_tokens_per_sequence(), 4096u);
  EXPECT_EQ(info->max_message_bytes(), 1u << 20);
  EXPECT_EQ(info->max_query_tokens(), 512u);
  EXPECT_EQ(info->max_batch_items(), 16u);
  EXPECT_EQ(info->tenant_sequences(), 1u);
  EXPECT_EQ(info->tenant_max_sequences(), 0u);
}

TEST_F(ServiceTest, HealthIsServingForTheServerAndTheIndexerService) {
  absl::StatusOr<client::HealthStatus> whole = client_->Health("");
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ(*whole, client::HealthStatus::kServing);
  absl::StatusOr<client::HealthStatus> unknown = client_->Health("no.such.Service");
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound) << unknown.status();
  EXPECT_TRUE(client_->WaitUntilServing(absl::Seconds(1)).ok());
  // Load balancers and Kubernetes probes ask by service name.
  absl::StatusOr<client::HealthStatus> indexer = client_->Health("indexer.v1.Indexer");
  ASSERT_TRUE(indexer.ok()) << "health check for 'indexer.v1.Indexer': " << indexer.status();
  EXPECT_EQ(*indexer, client::HealthStatus::kServing);
}

// Lists services through grpc.reflection.v1alpha (bidi stream, raw bytes: the request is
// {list_services: ""}; the answer is parsed field by field, no generated reflection code).
absl::StatusOr<std::vector<std::string>> ListServicesByReflection(grpc::Channel* channel) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  const grpc::internal::RpcMethod method("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                                         grpc::internal::RpcMethod::BIDI_STREAMING);
  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> stream(
      grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(
          channel, method, &context));
  const char request[] = {0x3a, 0x00};  // field 7 (list_services), length 0
  grpc::Slice slice(request, sizeof(request));
  grpc::ByteBuffer out(&slice, 1);
  grpc::ByteBuffer in;
  const bool exchanged = stream->Write(out) && stream->Read(&in);
  stream->WritesDone();
  const grpc::Status status = stream->Finish();
  if (!status.ok()) return client::FromGrpcStatus(status);
  if (!exchanged) return absl::UnknownError("no reflection answer");
  std::vector<grpc::Slice> slices;
  if (!in.Dump(&slices).ok()) return absl::UnknownError("cannot read the answer");
  std::string bytes;
  for (const grpc::Slice& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());

  google::protobuf::UnknownFieldSet response;
  if (!response.ParseFromString(bytes)) return absl::UnknownError("unparsable answer");
  std::vector<std::string> names;
  for (int i = 0; i < response.field_count(); ++i) {
    if (response.field(i).number() != 6) continue;  // list_services_response
    google::protobuf::UnknownFieldSet list;
    if (!list.ParseFromString(response.field(i).length_delimited())) continue;
    for (int j = 0; j < list.field_count(); ++j) {
      if (list.field(j).number() != 1) continue;  // service
      google::protobuf::UnknownFieldSet service;
      if (!service.ParseFromString(list.field(j).length_delimited())) continue;
      for (int k = 0; k < service.field_count(); ++k) {
        if (service.field(k).number() == 1) names.push_back(service.field(k).length_delimited());
      }
    }
  }
  return names;
}

TEST_F(ServiceTest, ReflectionListsTheIndexerService) {
  absl::StatusOr<std::vector<std::string>> names = ListServicesByReflection(client_->channel().get());
  ASSERT_TRUE(names.ok()) << names.status();
  EXPECT_THAT(*names, ::testing::Contains("indexer.v1.Indexer"));
  EXPECT_THAT(*names, ::testing::Contains("grpc.health.v1.Health"));
}

TEST_F(ServiceTest, ExpiredDeadlineIsDeadlineExceededAndAppliesNothing) {
  ASSERT_NO_FATAL_FAILURE(AppendRandom("a", 0, 10));
  const CallOptions expired = CallOptions::Deadline(absl::Now() - absl::Seconds(1));
  absl::StatusOr<v1::AppendKeysResponse> r =
      client_->AppendKeys(client::MakeAppend("b", 0, IntValues(rng_, head_dim())), expired);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();

  std::vector<float> q;
  v1::SelectBlocksRequest step = RandomSelect("a", 0, 1, 1, &q);
  *step.mutable_append() = client::MakeAppend("", 0, IntValues(rng_, head_dim()));
  EXPECT_EQ(client_->SelectBlocks(step, expired).status().code(), absl::StatusCode::kDeadlineExceeded);
  v1::BatchRequest batch;
  *batch.add_items() = step;
  EXPECT_EQ(client_->Batch(batch, expired).status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(client_->TruncateSequence("a", 0, expired).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(client_->ReleaseSequence("a", expired).status().code(),
            absl::StatusCode::kDeadlineExceeded);

  EXPECT_EQ(client_->GetSequence("b").status().code(), absl::StatusCode::kNotFound);
  absl::StatusOr<v1::GetSequenceResponse> a = client_->GetSequence("a");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->lengths(0), 10u);
}

// One handler thread, so that a call can be made to wait in the server's queue.
class OneHandlerTest : public ServerTest {
 protected:
  OneHandlerTest() {
    options_.handler_threads = 1;
    options_.max_message_bytes = 64 << 20;
    options_.engine.capacity_pages = 256;
    options_.engine.max_query_tokens = 2048;
    options_.engine.max_batch_items = 64;
    options_.engine.cpu_threads = 1;
  }

  // Starts a Batch that keeps the only handler thread busy for about `seconds` (items of 2048
  // query tokens x 4 heads over 4096 keys, as many as one measured item says fit, at least one:
  // sanitizer builds take longer) and returns its future.
  std::future<absl::StatusOr<v1::BatchResponse>> StartSlowCall(double seconds = 1.0) {
    for (int i = 0; i < 4; ++i) AppendRandom("slow", 0, 1024);
    std::vector<float> q;
    const v1::SelectBlocksRequest item = RandomSelect("slow", 0, 4, 2048, &q);
    const absl::Time t0 = absl::Now();
    EXPECT_TRUE(client_->SelectBlocks(item).ok());
    const double one = std::max(1e-3, absl::ToDoubleSeconds(absl::Now() - t0));
    v1::BatchRequest batch;
    slow_items_ = std::clamp(static_cast<int>(seconds / one), 1, 48);
    for (int i = 0; i < slow_items_; ++i) *batch.add_items() = item;
    return std::async(std::launch::async, [this, batch] {
      return client_->Batch(batch, CallOptions::Timeout(absl::Seconds(60)));
    });
  }

  int slow_items_ = 0;
};

TEST_F(OneHandlerTest, DeadlinePassingWhileQueuedAppliesNothing) {
  std::future<absl::StatusOr<v1::BatchResponse>> slow = StartSlowCall();
  absl::SleepFor(absl::Milliseconds(100));  // the slow call holds the handler thread
  const absl::Time t0 = absl::Now();
  absl::StatusOr<v1::AppendKeysResponse> r = client_->AppendKeys(
      client::MakeAppend("late", 0, IntValues(rng_, head_dim())), CallOptions::Timeout(absl::Milliseconds(100)));
  const absl::Duration waited = absl::Now() - t0;
  absl::StatusOr<v1::BatchResponse> done = slow.get();
  ASSERT_TRUE(done.ok()) << done.status();
  const absl::Duration slow_took = absl::Now() - t0;
  if (r.ok()) {
    GTEST_SKIP() << "the slow call finished within " << slow_took << "; nothing was queued";
  }
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
  EXPECT_LT(waited, absl::Seconds(2));
  // The append ran after its deadline (once the handler was free) and must not have applied.
  EXPECT_EQ(client_->GetSequence("late").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(OneHandlerTest, ShutdownDrainsInFlightCallsAndStopsServing) {
  std::future<absl::StatusOr<v1::BatchResponse>> slow = StartSlowCall(3.0);
  absl::SleepFor(absl::Milliseconds(100));
  // Health answers NOT_SERVING for a grace period, then new calls are refused; in-flight calls
  // finish either way.
  std::thread stopper([this] { server_->Shutdown(absl::Seconds(30), absl::Milliseconds(500)); });
  bool not_serving = false;
  for (int i = 0; i < 100 && !not_serving; ++i) {
    absl::StatusOr<client::HealthStatus> h = client_->Health("", CallOptions::Timeout(absl::Milliseconds(500)));
    not_serving = h.ok() && *h == client::HealthStatus::kNotServing;
    if (!not_serving) absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_TRUE(not_serving) << "health never answered NOT_SERVING during shutdown";
  // After the grace period, while the slow call still runs, a new call is refused by the server
  // itself (the connection stays open until the slow call's answer is out). During the grace
  // period it queues behind the slow call and runs into its short deadline.
  // (The slow call is looked at before each probe is sent: once it is answered, the connection
  // closes after IndexerServer::kLinger, and a later probe may be refused by gRPC instead.)
  absl::Status refused;
  bool slow_was_running = false;
  for (const absl::Time give_up = absl::Now() + absl::Seconds(20); absl::Now() < give_up;) {
    slow_was_running = slow.wait_for(std::chrono::seconds(0)) != std::future_status::ready;
    refused = client_->ServerInfo(CallOptions::Timeout(absl::Milliseconds(200))).status();
    if (refused.code() == absl::StatusCode::kUnavailable || !slow_was_running) break;
  }
  if (slow_was_running) {
    EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable) << refused;
    EXPECT_THAT(std::string(refused.message()), HasSubstr("shutting down"));
  } else {
    ADD_FAILURE() << "the slow call (" << slow_items_
                  << " items) ended before the drain began; last ServerInfo: " << refused;
  }
  absl::StatusOr<v1::BatchResponse> done = slow.get();
  stopper.join();
  ASSERT_TRUE(done.ok()) << "the in-flight call was not drained: " << done.status();
  ASSERT_EQ(done->results_size(), slow_items_);
  for (const auto& item : done->results()) EXPECT_TRUE(client::ItemStatus(item).ok());
  // After shutdown nothing answers.
  absl::StatusOr<v1::ServerInfoResponse> after = client_->ServerInfo(CallOptions::Timeout(absl::Seconds(2)));
  EXPECT_EQ(after.status().code(), absl::StatusCode::kUnavailable) << after.status();
}

TEST_F(ServiceTest, IdleBatchStreamDoesNotHoldUpShutdown) {
  // A scheduler keeps its stream open between steps. An idle stream has nothing to drain, so
  // shutdown should end it promptly instead of waiting out the whole drain time.
  ASSERT_NO_FATAL_FAILURE(AppendRandom("a", 0, 10));
  std::unique_ptr<client::BatchStream> stream = client_->OpenBatchStream();
  std::vector<float> q;
  v1::BatchRequest req;
  *req.add_items() = RandomSelect("a", 0, 1, 1, &q);
  ASSERT_TRUE(stream->Step(req).ok());
  const absl::Time t0 = absl::Now();
  server_->Shutdown(absl::Seconds(3));
  const absl::Duration took = absl::Now() - t0;
  EXPECT_LT(took, absl::Seconds(1)) << "Shutdown waited " << took
                                    << " for an idle BatchStream (drain limit 3 s)";
  // indexer.proto: UNAVAILABLE means the server is shutting down.
  const absl::Status end = stream->Finish();
  EXPECT_EQ(end.code(), absl::StatusCode::kUnavailable) << end;
}

TEST_F(ServiceTest, RequestOverMaxMessageBytesIsResourceExhausted) {
  // 1.5 MiB of keys against a 1 MiB limit: gRPC refuses it before the engine sees it.
  const int tokens = (3 << 19) / (2 * head_dim());
  absl::StatusOr<v1::AppendKeysResponse> r =
      client_->AppendKeys(client::MakeAppend("big", 0, IntValues(rng_, tokens * head_dim())));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  EXPECT_EQ(client_->GetSequence("big").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(FreePages(), options_.engine.capacity_pages);
  // Just under the limit is fine.
  ASSERT_NO_FATAL_FAILURE(AppendRandom("ok", 0, 4000));
}

TEST_F(ServiceTest, ResponseOverMaxMessageBytesFailsAndAppliesNothing) {
  // 512 tokens x 4 heads x topk 32 x 4 pages per block x 4 bytes = 1 MiB of page table alone: the
  // answer cannot be sent. The call fails, so (indexer.proto) its embedded append must not stick.
  ASSERT_NO_FATAL_FAILURE(AppendRandom("a", 0, 600, {0, 1, 2, 3, 4}));
  std::vector<float> q;
  v1::SelectBlocksRequest req = RandomSelect("a", 0, 4, 512, &q);
  req.set_topk(32);
  *req.mutable_append() = client::MakeAppend("", 0, IntValues(rng_, head_dim()));
  absl::StatusOr<v1::SelectBlocksResponse> r = client_->SelectBlocks(req);
  ASSERT_FALSE(r.ok()) << "a " << r->ByteSizeLong() << "-byte answer passed a 1 MiB limit";
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  EXPECT_EQ(client_->GetSequence("a")->lengths(0), 600u)
      << "SelectBlocks failed (" << r.status() << ") but its embedded append was applied";

  // The same through Batch: items are answered one by one, so the item that does not fit fails
  // with RESOURCE_EXHAUSTED (its append not applied) and a small item beside it still succeeds.
  const uint32_t before = client_->GetSequence("a")->lengths(0);
  v1::BatchRequest batch;
  *batch.add_items() = req;
  std::vector<float> q_small;
  *batch.add_items() = RandomSelect("a", 0, 1, 1, &q_small);
  absl::StatusOr<v1::BatchResponse> b = client_->Batch(batch);
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_EQ(b->results_size(), 2);
  EXPECT_EQ(client::ItemStatus(b->results(0)).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(client::ItemStatus(b->results(1)).ok()) << client::ItemStatus(b->results(1));
  EXPECT_EQ(client_->GetSequence("a")->lengths(0), before)
      << "the item that did not fit had its append applied";
}

TEST_F(ServiceTest, SecondServerOnATakenPortFailsToStart) {
  server::ServerOptions second = options_;
  second.listen = absl::StrCat("127.0.0.1:", server_->port());
  absl::StatusOr<std::unique_ptr<server::IndexerServer>> s = server::IndexerServer::Start(second);
  if (s.ok()) (*s)->Shutdown(absl::ZeroDuration());
  EXPECT_FALSE(s.ok()) << "a second server bound port " << server_->port()
                       << " already in use (SO_REUSEPORT): clients are now split between the two";
  if (!s.ok()) {
    EXPECT_EQ(s.status().code(), absl::StatusCode::kUnavailable) << s.status();
  }
}

}  // namespace
}  // namespace indexer::testing
