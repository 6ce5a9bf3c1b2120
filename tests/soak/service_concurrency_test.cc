// Many threads calling IndexerService's handlers at once, in-process (tests/testing/service_call.h):
// the server's own translation, authentication, handler threads (RequestExecutor), metrics and
// engine, without gRPC's transport. Threads contend on shared sequences (appends, selections,
// Batch items naming one sequence twice, forks from them) and churn sequences of their own
// (create, fork, truncate, release), near a full pool. Afterwards the page accounting must be
// exact and releasing everything must empty the pool.
//
// Its point is ThreadSanitizer (scripts/sanitize.sh tsan): every thread here runs this project's
// code (or header-only gRPC code built with it), so a report is a real race, with no
// suppression needed. Under plain builds it is a quick concurrency check.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/cpp/indexer_client.h"
#include "engine/cpu_backend.h"
#include "engine/engine.h"
#include "server/access_control.h"
#include "server/indexer_service.h"
#include "server/metrics.h"
#include "server/request_executor.h"
#include "tests/testing/engine_config.h"
#include "tests/testing/server_fixture.h"
#include "tests/testing/service_call.h"

namespace indexer::testing {
namespace {

using server::IndexerService;

constexpr int kThreads = 6;
constexpr int kShared = 3;
constexpr int kHeadDim = 64;

engine::EngineConfig Config() {
  engine::EngineConfig c = SmallEngineConfig();  // head_dim 64: kHeadDim
  c.layers = 2;
  c.capacity_pages = 96;
  c.max_topk = 16;
  c.defaults = kernels::SelectParams{8, 1, 1};
  c.max_tokens_per_sequence = 2048;
  c.max_batch_items = 16;
  c.max_sequences = 40;
  return c;
}

bool Expected(const grpc::Status& s) {
  return s.ok() || s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED ||
         s.error_code() == grpc::StatusCode::NOT_FOUND;  // another thread released it first
}

TEST(ServiceConcurrency, HandlersRunConcurrentlyWithoutRacesOrLostPages) {
  const engine::EngineConfig config = Config();
  ASSERT_TRUE(config.Validate().ok());
  engine::Engine engine(config, std::make_unique<engine::CpuBackend>(config));
  server::RequestExecutor executor(4);
  server::AccessControl access;
  server::ServiceMetrics metrics(&engine, "cpu");
  engine.SetObserver(&metrics);
  IndexerService service(&engine, &executor, &access, &metrics, "test", 64 << 20);

  std::atomic<int> unexpected{0};
  std::atomic<int64_t> calls{0};
  const auto check = [&](const grpc::Status& s, const std::string& what) {
    ++calls;
    if (!Expected(s) && unexpected.fetch_add(1) < 10) {
      ADD_FAILURE() << what << ": " << s.error_code() << " " << s.error_message();
    }
  };
  const auto append = [&](const std::string& id, std::mt19937& rng, int tokens) {
    v1::AppendKeysRequest r = client::MakeAppendAllLayers(id, IntValues(rng, size_t{2} * tokens * kHeadDim));
    v1::AppendKeysResponse resp;
    check(CallHandler(service, &IndexerService::AppendKeys, r, &resp), "append " + id);
  };
  for (int i = 0; i < kShared; ++i) {
    std::mt19937 rng(i);
    append(absl::StrCat("shared", i), rng, 300);
  }

  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(100 + t);
      std::set<std::string> mine;
      int next = 0;
      const auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
      for (int step = 0; step < 400; ++step) {
        const std::string shared = absl::StrCat("shared", pick(0, kShared - 1));
        switch (pick(0, 9)) {
          case 0: case 1: {  // a decode step on a shared sequence
            v1::SelectBlocksRequest r = client::MakeSelect(shared, pick(0, 1), 2, IntValues(rng, 2 * kHeadDim));
            *r.mutable_append() = client::MakeAppendAllLayers("", IntValues(rng, 2 * kHeadDim));
            v1::SelectBlocksResponse resp;
            check(CallHandler(service, &IndexerService::SelectBlocks, r, &resp), "decode " + shared);
            break;
          }
          case 2: {  // a Batch naming one shared sequence twice and another once
            v1::BatchRequest b;
            for (const std::string& id : {shared, shared, absl::StrCat("shared", (t + 1) % kShared)}) {
              *b.add_items() = client::MakeSelect(id, 0, 1, IntValues(rng, kHeadDim));
              *b.mutable_items(b.items_size() - 1)->mutable_append() =
                  client::MakeAppendAllLayers("", IntValues(rng, 2 * kHeadDim));
            }
            v1::BatchResponse resp;
            check(CallHandler(service, &IndexerService::Batch, b, &resp), "batch");
            for (const auto& item : resp.results()) {
              check(grpc::Status(static_cast<grpc::StatusCode>(item.code()), item.message()), "batch item");
            }
            break;
          }
          case 3: {  // fork a shared sequence into one of mine, then write into the shared page
            const std::string id = absl::StrCat("t", t, "-", next++);
            v1::ForkSequenceRequest r;
            r.set_source_id(shared);
            r.set_target_id(id);
            v1::ForkSequenceResponse resp;
            const grpc::Status s = CallHandler(service, &IndexerService::ForkSequence, r, &resp);
            check(s, "fork " + id);
            if (s.ok()) {
              mine.insert(id);
              append(id, rng, pick(1, 20));
            }
            break;
          }
          case 4: case 5: {  // a sequence of my own
            const std::string id = absl::StrCat("t", t, "-", next++);
            append(id, rng, pick(1, 400));
            mine.insert(id);
            break;
          }
          case 6: {  // truncate one of mine, or a shared one back to its first blocks
            const std::string id = mine.empty() ? shared : *mine.begin();
            v1::TruncateSequenceRequest r;
            r.set_sequence_id(id);
            r.set_length(mine.empty() ? 300 : pick(0, 200));
            v1::TruncateSequenceResponse resp;
            check(CallHandler(service, &IndexerService::TruncateSequence, r, &resp), "truncate " + id);
            break;
          }
          case 7: case 8: {  // release one of mine
            if (mine.empty()) break;
            auto it = mine.begin();
            std::advance(it, pick(0, static_cast<int>(mine.size()) - 1));
            v1::ReleaseSequenceRequest r;
            r.set_sequence_id(*it);
            v1::ReleaseSequenceResponse resp;
            check(CallHandler(service, &IndexerService::ReleaseSequence, r, &resp), "release " + *it);
            mine.erase(it);
            break;
          }
          default: {  // read-only calls
            v1::ServerInfoRequest ir;
            v1::ServerInfoResponse info;
            check(CallHandler(service, &IndexerService::ServerInfo, ir, &info), "info");
            v1::GetSequenceRequest gr;
            gr.set_sequence_id(shared);
            v1::GetSequenceResponse g;
            check(CallHandler(service, &IndexerService::GetSequence, gr, &g), "get " + shared);
            v1::GetStatsRequest sr;
            v1::GetStatsResponse stats;
            check(CallHandler(service, &IndexerService::GetStats, sr, &stats), "stats");
            break;
          }
        }
      }
      for (const std::string& id : mine) (void)engine.Release(id);
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(unexpected.load(), 0);

  // Exactly the shared sequences' pages are in use, then none.
  std::set<int32_t> pages;
  for (int i = 0; i < kShared; ++i) {
    absl::StatusOr<engine::SequenceInfo> info = engine.Get(absl::StrCat("shared", i));
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->shared_pages, 0);
    pages.insert(info->pages.begin(), info->pages.end());
  }
  engine::EngineStats stats = engine.Stats();
  EXPECT_EQ(stats.live_sequences, kShared);
  EXPECT_EQ(stats.total_pages - stats.free_pages, static_cast<int64_t>(pages.size()));
  for (int i = 0; i < kShared; ++i) ASSERT_TRUE(engine.Release(absl::StrCat("shared", i)).ok());
  stats = engine.Stats();
  EXPECT_EQ(stats.free_pages, stats.total_pages);
  executor.Stop();
  std::printf("service concurrency: %lld calls from %d threads\n", static_cast<long long>(calls.load()),
              kThreads);
}

}  // namespace
}  // namespace indexer::testing
