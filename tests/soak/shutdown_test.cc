// Graceful shutdown under load, with the real indexer-server: SIGTERM arrives while many clients
// run unary calls, Batch calls and BatchStreams (and a long selection is in flight).
//  - Every call ends within the drain deadline; none hangs.
//  - A call started before SIGTERM is answered (OK, or the pool's RESOURCE_EXHAUSTED). A call
//    started after it is answered or refused with UNAVAILABLE; gRPC itself may also cancel one
//    that races with the listener closing (CANCELLED, never reaching the service). Nothing else.
//  - The process exits 0 within the drain deadline.
//  - Nothing acknowledged is lost: the server writes a snapshot on shutdown, and a server restored
//    from it holds every token whose append was answered OK (and at most the ones in doubt).
#include <signal.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/cpp/indexer_client.h"
#include "tests/testing/child_process.h"
#include "tests/testing/files.h"
#include "tests/testing/server_fixture.h"

namespace indexer::testing {
namespace {

using client::BatchStream;
using client::CallOptions;
using client::IndexerClient;

constexpr int kHeadDim = 64;
constexpr int kClients = 8;
constexpr double kDrainSeconds = 8;

// How each call ended, and the longest any took.
class Outcomes {
 public:
  void Add(absl::string_view what, const absl::Status& s, absl::Duration took, bool after_sigterm) {
    std::lock_guard<std::mutex> lock(mu_);
    ++counts_[absl::StrCat(what, after_sigterm ? " (after SIGTERM) " : " ",
                           absl::StatusCodeToString(s.code()))];
    if (after_sigterm) longest_after_ = std::max(longest_after_, took);
    const bool fine = s.ok() || s.code() == absl::StatusCode::kResourceExhausted ||
                      (after_sigterm && (s.code() == absl::StatusCode::kUnavailable ||
                                         s.code() == absl::StatusCode::kCancelled));
    if (!fine && bad_.size() < 10) bad_.push_back(absl::StrCat(what, ": ", s.ToString()));
  }
  std::string Report() const {
    std::lock_guard<std::mutex> lock(mu_);
    std::string out;
    for (const auto& [what, n] : counts_) absl::StrAppend(&out, "  ", what, ": ", n, "\n");
    return out;
  }
  std::vector<std::string> bad() const {
    std::lock_guard<std::mutex> lock(mu_);
    return bad_;
  }
  absl::Duration longest_after() const {
    std::lock_guard<std::mutex> lock(mu_);
    return longest_after_;
  }
  int64_t Count(absl::string_view prefix) const {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t n = 0;
    for (const auto& [what, c] : counts_) n += absl::StartsWith(what, prefix) ? c : 0;
    return n;
  }

 private:
  mutable std::mutex mu_;
  std::map<std::string, int64_t> counts_;
  std::vector<std::string> bad_;
  absl::Duration longest_after_;
};

TEST(ShutdownUnderLoad, SigtermWhileClientsRunAnswersOrRefusesEveryCallAndExitsZero) {
  TempDir dir;
  const std::string snapshot = dir.File("shutdown.snap");
  int port = 0;
  std::unique_ptr<Child> server = StartServerBinary(
      {"--head_dim=64", "--capacity=4096", "--cpu_threads=2", "--handler_threads=8",
       absl::StrCat("--drain_seconds=", kDrainSeconds), "--not_serving_seconds=0.5",
       absl::StrCat("--snapshot_on_shutdown=", snapshot)},
      &port);
  ASSERT_NE(server, nullptr);
  const std::string target = absl::StrCat("127.0.0.1:", port);
  absl::StatusOr<std::unique_ptr<IndexerClient>> admin = IndexerClient::Connect(target);
  ASSERT_TRUE(admin.ok());
  ASSERT_TRUE((*admin)->WaitUntilServing(absl::Seconds(20)).ok());

  // A long sequence for the slow selections that are sure to be in flight at SIGTERM.
  std::mt19937 setup_rng(5);
  constexpr int kLong = 8192;
  ASSERT_TRUE((*admin)->AppendKeys(client::MakeAppend("long", 0, IntValues(setup_rng, size_t{kLong} * kHeadDim))).ok());

  Outcomes outcomes;
  std::atomic<bool> sigterm_sent{false};
  std::atomic<bool> stop{false};
  std::atomic<int> drained{0};
  std::atomic<bool> slow_started{false};
  const auto after = [&] { return sigterm_sent.load(); };
  // Calls get a deadline far beyond the drain: one that runs into it has hung.
  const CallOptions patient = CallOptions::Timeout(absl::Seconds(60));
  // Per client: tokens whose append was answered OK, and tokens whose append may or may not
  // have been applied (the call failed after it was sent).
  std::vector<int64_t> acked(kClients, 0), in_doubt(kClients, 0);
  std::vector<std::thread> clients;
  for (int i = 0; i < kClients; ++i) {
    clients.emplace_back([&, i] {
      const auto count = [&](const absl::Status& s, int64_t tokens) {
        (s.ok() ? acked[i] : in_doubt[i]) += tokens;
      };
      absl::StatusOr<std::unique_ptr<IndexerClient>> c = IndexerClient::Connect(target);
      ASSERT_TRUE(c.ok());
      std::mt19937 rng(100 + i);
      const std::string id = absl::StrCat("c", i);
      int refused_in_a_row = 0;
      for (int step = 0; !stop.load() && refused_in_a_row < 20; ++step) {
        bool late = after();
        const absl::Time t0 = absl::Now();
        absl::Status s;
        const char* what = "";
        switch ((step + i) % 4) {
          case 0: {
            what = "AppendKeys";
            s = (*c)->AppendKeys(client::MakeAppend(id, 0, IntValues(rng, size_t{16} * kHeadDim)), patient).status();
            count(s, 16);
            break;
          }
          case 1: {
            what = "SelectBlocks";
            v1::SelectBlocksRequest r = client::MakeSelect(id, 0, 2, IntValues(rng, 2 * kHeadDim));
            *r.mutable_append() = client::MakeAppend("", 0, IntValues(rng, kHeadDim));
            s = (*c)->Select(r, patient).status();
            count(s, 1);
            break;
          }
          case 2: {
            what = "Batch";
            v1::BatchRequest b;
            *b.add_items() = client::MakeSelect(id, 0, 1, IntValues(rng, kHeadDim));
            b.mutable_items(0)->set_topk(4);
            absl::StatusOr<v1::BatchResponse> r = (*c)->Batch(b, patient);
            s = r.status();
            if (r.ok() && r->results_size() == 1) {
              const absl::Status item = client::ItemStatus(r->results(0));
              // An item's own status: OK, or NOT_FOUND before the first append landed.
              if (!item.ok() && item.code() != absl::StatusCode::kNotFound) s = item;
            }
            break;
          }
          default: {
            what = "BatchStream";
            std::unique_ptr<BatchStream> stream = (*c)->OpenBatchStream(patient);
            for (int k = 0; k < 5 && s.ok(); ++k) {
              v1::BatchRequest b;
              b.set_request_id(k);
              v1::SelectBlocksRequest* item = b.add_items();
              *item = client::MakeSelect(id, 0, 1, IntValues(rng, kHeadDim));
              *item->mutable_append() = client::MakeAppend("", 0, IntValues(rng, kHeadDim));
              s = stream->Step(b).status();
              count(s, 1);
            }
            if (s.ok()) s = stream->Finish();
            // A stream open when SIGTERM arrives may have its later messages refused: the drain
            // completes calls in flight, and a stream's unread messages are not (they are not
            // applied, and the client sees UNAVAILABLE). So it counts as after SIGTERM if it
            // ended after it.
            late = late || after();
            break;
          }
        }
        const absl::Duration took = absl::Now() - t0;
        outcomes.Add(what, s, took, late);
        refused_in_a_row = s.code() == absl::StatusCode::kUnavailable ? refused_in_a_row + 1 : 0;
        if (s.code() == absl::StatusCode::kUnavailable) absl::SleepFor(absl::Milliseconds(50));
      }
    });
  }
  // Slow selections, about a second each (sized from a measured one, so that sanitizer builds
  // get as many), one after another: some are in flight at SIGTERM and must be answered.
  std::thread slow([&] {
    absl::StatusOr<std::unique_ptr<IndexerClient>> c = IndexerClient::Connect(target);
    ASSERT_TRUE(c.ok());
    std::mt19937 rng(9);
    const auto call = [&](int tokens) {
      return (*c)->Select(client::MakeSelect("long", 0, 4, IntValues(rng, size_t{4} * tokens * kHeadDim)),
                          patient).status();
    };
    absl::Time t0 = absl::Now();
    ASSERT_TRUE(call(128).ok());
    const double per_token = absl::ToDoubleSeconds(absl::Now() - t0) / 128;
    const int tokens = std::clamp(static_cast<int>(1.0 / per_token), 8, 4096);
    while (!stop.load()) {
      const bool late = after();
      t0 = absl::Now();
      slow_started = true;
      const absl::Status s = call(tokens);
      outcomes.Add("slow SelectBlocks", s, absl::Now() - t0, late);
      if (!late && after() && s.ok()) ++drained;  // in flight at SIGTERM, and answered
      if (s.code() == absl::StatusCode::kUnavailable) break;
    }
  });

  // SIGTERM once the load has run a while and a slow call is under way.
  absl::SleepFor(absl::Seconds(2));
  for (int i = 0; i < 600 && !slow_started.load(); ++i) absl::SleepFor(absl::Milliseconds(100));
  absl::SleepFor(absl::Milliseconds(300));
  const absl::Time sigterm = absl::Now();
  sigterm_sent = true;
  ASSERT_EQ(kill(server->pid(), SIGTERM), 0);
  const std::optional<int> code = server->Wait(absl::Seconds(kDrainSeconds + 10));
  const absl::Duration exit_after = absl::Now() - sigterm;
  // Clients see the closed port and stop on their own; give them a moment, then stop them.
  absl::SleepFor(absl::Seconds(2));
  stop = true;
  for (auto& t : clients) t.join();
  slow.join();

  std::printf("shutdown: exit %d after %.2f s; longest call after SIGTERM %.2f s\n%s",
              code.value_or(-1000), absl::ToDoubleSeconds(exit_after),
              absl::ToDoubleSeconds(outcomes.longest_after()), outcomes.Report().c_str());
  ASSERT_TRUE(code.has_value()) << "indexer-server did not exit within the drain deadline\n"
                                << server->Log();
  EXPECT_EQ(*code, 0) << server->Log();
  EXPECT_LT(exit_after, absl::Seconds(kDrainSeconds + 2));
  EXPECT_THAT(outcomes.bad(), ::testing::IsEmpty())
      << "calls ended with something other than OK or RESOURCE_EXHAUSTED (before SIGTERM), or "
         "UNAVAILABLE or CANCELLED (after it)";
  EXPECT_LT(outcomes.longest_after(), absl::Seconds(kDrainSeconds + 2)) << "a call hung";
  EXPECT_GT(drained.load(), 0) << "no slow call was in flight at SIGTERM and answered";
  for (const char* report : {"ERROR: AddressSanitizer", "ERROR: LeakSanitizer",
                             "WARNING: ThreadSanitizer", "runtime error:"}) {
    EXPECT_THAT(server->Log(), ::testing::Not(::testing::HasSubstr(report)));
  }

  // Nothing acknowledged was lost: restore the shutdown snapshot and count every client's tokens.
  int restored_port = 0;
  std::unique_ptr<Child> restored = StartServerBinary(
      {"--head_dim=64", "--capacity=4096", absl::StrCat("--restore=", snapshot)}, &restored_port);
  ASSERT_NE(restored, nullptr);
  absl::StatusOr<std::unique_ptr<IndexerClient>> check =
      IndexerClient::Connect(absl::StrCat("127.0.0.1:", restored_port));
  ASSERT_TRUE(check.ok());
  int64_t total_acked = 0, total_doubt = 0;
  for (int i = 0; i < kClients; ++i) {
    absl::StatusOr<v1::GetSequenceResponse> g = (*check)->GetSequence(absl::StrCat("c", i));
    const int64_t length = g.ok() ? g->lengths(0) : 0;
    EXPECT_GE(length, acked[i]) << "client " << i << ": acknowledged tokens were lost";
    EXPECT_LE(length, acked[i] + in_doubt[i]) << "client " << i << ": tokens nobody sent";
    total_acked += acked[i];
    total_doubt += in_doubt[i];
  }
  std::printf("shutdown: the snapshot holds every one of %lld acknowledged tokens (%lld were in "
              "doubt)\n", static_cast<long long>(total_acked), static_cast<long long>(total_doubt));
  kill(restored->pid(), SIGTERM);
  EXPECT_EQ(restored->Wait(absl::Seconds(20)), std::optional<int>(0));
}

// Selections still running when the drain time is up are abandoned: the process writes its
// snapshot and exits soon after the drain instead of computing answers nobody will receive, and
// an idle client connection does not hold it up either. The selections are sized so that
// finishing even one would take many times the drain.
TEST(ShutdownPastTheDrain, RunningSelectionsAreAbandonedAndTheSnapshotIsWritten) {
  TempDir dir;
  const std::string snapshot = dir.File("past-drain.snap");
  constexpr double kDrain = 1;
  int port = 0;
  std::unique_ptr<Child> server = StartServerBinary(
      {"--head_dim=64", "--capacity=4096", "--cpu_threads=1", "--handler_threads=8",
       absl::StrCat("--drain_seconds=", kDrain), "--not_serving_seconds=0",
       absl::StrCat("--snapshot_on_shutdown=", snapshot)},
      &port);
  ASSERT_NE(server, nullptr);
  const std::string target = absl::StrCat("127.0.0.1:", port);
  absl::StatusOr<std::unique_ptr<IndexerClient>> idle = IndexerClient::Connect(target);
  ASSERT_TRUE(idle.ok());
  ASSERT_TRUE((*idle)->WaitUntilServing(absl::Seconds(20)).ok());

  std::mt19937 rng(3);
  constexpr int kLong = 8192;
  constexpr int kHeads = 16;
  ASSERT_TRUE((*idle)
                  ->AppendKeys(client::MakeAppend("long", 0,
                                                  IntValues(rng, size_t{kLong} * kHeadDim)))
                  .ok());
  const auto select = [&](IndexerClient& c, int tokens, std::mt19937& r) {
    return c.Select(client::MakeSelect("long", 0, kHeads,
                                       IntValues(r, size_t{kHeads} * tokens * kHeadDim)),
                    CallOptions::Timeout(absl::Seconds(120)))
        .status();
  };
  // Each selection takes about 8 s on its own (measured here, so that slower builds get as much
  // work): finishing even the first would take far past the drain.
  absl::Time t0 = absl::Now();
  ASSERT_TRUE(select(**idle, 64, rng).ok());
  const double per_token = absl::ToDoubleSeconds(absl::Now() - t0) / 64;
  const int tokens = std::clamp(static_cast<int>(8.0 / per_token), 64, kLong);

  // Requests and connections are made first, so that every selection is on its way at SIGTERM.
  std::vector<v1::SelectBlocksRequest> requests;
  std::vector<std::unique_ptr<IndexerClient>> clients;
  for (int i = 0; i < kClients; ++i) {
    requests.push_back(client::MakeSelect("long", 0, kHeads,
                                          IntValues(rng, size_t{kHeads} * tokens * kHeadDim)));
    absl::StatusOr<std::unique_ptr<IndexerClient>> c = IndexerClient::Connect(target);
    ASSERT_TRUE(c.ok());
    ASSERT_TRUE((*c)->WaitUntilServing(absl::Seconds(20)).ok());
    clients.push_back(*std::move(c));
  }
  std::atomic<int> answered{0}, sent{0};
  std::vector<std::thread> slow;
  for (int i = 0; i < kClients; ++i) {
    slow.emplace_back([&, i] {
      ++sent;
      const absl::Status s =
          clients[i]->Select(requests[i], CallOptions::Timeout(absl::Seconds(120))).status();
      if (s.ok()) ++answered;
    });
  }
  while (sent.load() < kClients) absl::SleepFor(absl::Milliseconds(10));
  absl::SleepFor(absl::Seconds(1));  // every selection arrived, running or queued
  const absl::Time sigterm = absl::Now();
  ASSERT_EQ(kill(server->pid(), SIGTERM), 0);
  const std::optional<int> code = server->Wait(absl::Seconds(60));
  const absl::Duration exit_after = absl::Now() - sigterm;
  for (std::thread& t : slow) t.join();
  std::printf("past the drain: %d tokens per selection, exit %d after %.2f s, %d of %d answered\n",
              tokens, code.value_or(-1000), absl::ToDoubleSeconds(exit_after), answered.load(),
              kClients);
  ASSERT_TRUE(code.has_value()) << server->Log();
  EXPECT_EQ(*code, 0) << server->Log();
  EXPECT_LT(exit_after, absl::Seconds(kDrain + 3))
      << "the server went on computing past the drain\n" << server->Log();
  EXPECT_EQ(answered.load(), 0) << "the selections were too quick to test anything";
  EXPECT_THAT(server->Log(), ::testing::HasSubstr("snapshot on shutdown: 1 sequences"));
  EXPECT_FALSE(ReadFile(snapshot).empty()) << "no snapshot at " << snapshot;
}

}  // namespace
}  // namespace indexer::testing
