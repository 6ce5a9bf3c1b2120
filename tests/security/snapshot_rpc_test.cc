// Snapshots end to end, in-process: two tenants build every kind of state, an admin asks for a
// snapshot over IndexerAdmin.Snapshot, the server goes away, a new server restores the file, and
// every selection, sequence description and tenant's page count is the same (bf16 and fp8).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "tests/security/security_test_util.h"
#include "tests/testing/server_fixture.h"
#include "tests/testing/storages.h"

namespace indexer::testing {
namespace {

using ::testing::HasSubstr;

class SnapshotRpcTest : public ::testing::TestWithParam<kernels::KeyStorage> {
 protected:
  server::ServerOptions Options() {
    WriteFile(dir_.File("tokens"), TokenFileText());
    server::ServerOptions o = SmallServerOptions();
    o.engine.key_storage = GetParam();
    o.token_file = dir_.File("tokens");
    o.snapshot_dir = dir_.path();
    return o;
  }

  TempDir dir_;
};

TEST_P(SnapshotRpcTest, RestoredServerAnswersEverySelectionIdentically) {
  server::ServerOptions options = Options();
  auto first = StartServer(options);
  ASSERT_NE(first, nullptr);
  auto alpha = ConnectTo(first->port(), WithToken(kAlphaToken));
  auto beta = ConnectTo(first->port(), WithToken(kBetaToken));
  std::mt19937 rng(31);
  BuildRichState(*alpha, "", 64, 2, rng);
  BuildRichState(*beta, "", 64, 2, rng);  // the same ids, other keys
  BuildRichState(*beta, "x-", 64, 2, rng);
  const std::vector<SelectionProbe> alpha_probes = Probe(*alpha, "", 64, 2, rng);
  std::vector<SelectionProbe> beta_probes = Probe(*beta, "", 64, 2, rng);
  const std::vector<SelectionProbe> more = Probe(*beta, "x-", 64, 2, rng);
  beta_probes.insert(beta_probes.end(), more.begin(), more.end());
  std::vector<std::string> beta_ids = RichStateIds("");
  for (const std::string& id : RichStateIds("x-")) beta_ids.push_back(id);
  const auto alpha_described = Describe(*alpha, RichStateIds(""));
  const auto beta_described = Describe(*beta, beta_ids);
  const v1::ServerInfoResponse alpha_info = *alpha->ServerInfo();
  const v1::ServerInfoResponse beta_info = *beta->ServerInfo();

  absl::StatusOr<v1::SnapshotResponse> snap = alpha->Snapshot("round-trip.snap");
  ASSERT_TRUE(snap.ok()) << snap.status();
  EXPECT_EQ(snap->sequences(), 3 * RichStateIds("").size());
  EXPECT_EQ(snap->pages(), alpha_info.total_pages() - alpha_info.free_pages());
  EXPECT_GT(snap->bytes(), snap->pages() * alpha_info.bytes_per_page());
  alpha.reset();
  beta.reset();
  first.reset();

  options.restore = snap->path();
  auto second = StartServer(options);
  ASSERT_NE(second, nullptr);
  alpha = ConnectTo(second->port(), WithToken(kAlphaToken));
  beta = ConnectTo(second->port(), WithToken(kBetaToken));
  ExpectSameAnswers(*alpha, alpha_probes, "alpha");
  ExpectSameAnswers(*beta, beta_probes, "beta");
  ExpectSameSequences(alpha_described, *alpha, RichStateIds(""));
  ExpectSameSequences(beta_described, *beta, beta_ids);
  for (auto [c, want] : {std::pair{alpha.get(), &alpha_info}, std::pair{beta.get(), &beta_info}}) {
    const v1::ServerInfoResponse now = *c->ServerInfo();
    EXPECT_EQ(now.free_pages(), want->free_pages());
    EXPECT_EQ(now.live_sequences(), want->live_sequences());
    EXPECT_EQ(now.tenant_pages(), want->tenant_pages()) << now.tenant();
  }
  // Tenants stay apart after a restore, and the released sequence stays gone.
  EXPECT_EQ(beta->GetSequence("x-a").status().code(), absl::StatusCode::kOk);
  EXPECT_EQ(alpha->GetSequence("x-a").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(alpha->GetSequence("gone").status().code(), absl::StatusCode::kNotFound);
  // The restored server carries on: appends and selections work, forks still copy on write.
  // ("d" shares a's first two blocks, the second partially: this append copies it.)
  ASSERT_TRUE(alpha->AppendKeys(client::MakeAppend("d", 0, std::vector<float>(64 * 3, 0.5f))).ok());
  ExpectSameAnswers(*alpha, {alpha_probes.front()}, "alpha's a after appending to its fork");
}

INSTANTIATE_TEST_SUITE_P(Storage, SnapshotRpcTest, ::indexer::testing::EveryStorage(),
                         ::indexer::testing::StorageTestName);

TEST(SnapshotRestoreStart, ARefusedRestoreStopsTheServerFromStarting) {
  TempDir dir;
  server::ServerOptions o = SmallServerOptions();
  o.snapshot_dir = dir.path();
  auto server = StartServer(o);
  ASSERT_NE(server, nullptr);
  auto c = ConnectTo(server->port());
  ASSERT_TRUE(c->AppendKeys(client::MakeAppend("s", 0, std::vector<float>(64 * 200, 1.0f))).ok());
  absl::StatusOr<v1::SnapshotResponse> snap = c->Snapshot("s.snap");
  ASSERT_TRUE(snap.ok()) << snap.status();
  server.reset();

  o.restore = snap->path();
  o.engine.head_dim = 128;
  absl::StatusOr<std::unique_ptr<server::IndexerServer>> s = server::IndexerServer::Start(o);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("--restore"));
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("head_dim 64 (this server: 128)"));
}

}  // namespace
}  // namespace indexer::testing
