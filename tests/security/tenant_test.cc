// Tenant isolation and page quotas end to end: two tenants' tokens against one server. No RPC
// of one tenant reads, selects, forks, truncates or releases another's sequence, and an id of
// another tenant looks exactly like an id nobody uses.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "tests/security/security_test_util.h"
#include "tests/testing/server_fixture.h"

namespace indexer::testing {
namespace {

using ::testing::HasSubstr;

class TenantTest : public ::testing::Test {
 protected:
  void SetUp() override {
    WriteFile(dir_.File("tokens"), TokenFileText("3"));
    options_ = SmallServerOptions();
    options_.token_file = dir_.File("tokens");
    options_.tenant_quota_pages = 20;  // alpha's and ops' quota; beta has its own, 3
    server_ = StartServer(options_);
    ASSERT_NE(server_, nullptr);
    alpha_ = ConnectTo(server_->port(), WithToken(kAlphaToken));
    beta_ = ConnectTo(server_->port(), WithToken(kBetaToken));
  }

  // Appends `tokens` integer keys to layer 0 of `id` through `c`, recording them in `host`.
  absl::StatusOr<v1::AppendKeysResponse> Append(client::IndexerClient& c, HostSequence& host,
                                                const std::string& id, int tokens,
                                                std::vector<int32_t> attn = {}) {
    const std::vector<float> keys = IntValues(rng_, static_cast<size_t>(tokens) * 64);
    v1::AppendKeysRequest r = client::MakeAppend(id, 0, keys);
    for (int32_t a : attn) r.add_attention_pages(a);
    absl::StatusOr<v1::AppendKeysResponse> got = c.AppendKeys(r);
    if (got.ok()) {
      host.Append(0, keys);
      host.attention_pages.insert(host.attention_pages.end(), attn.begin(), attn.end());
    }
    return got;
  }

  // Selects the last token of layer 0 of `id` and checks the answer against `host`.
  void ExpectSelectionMatches(client::IndexerClient& c, const HostSequence& host,
                              const std::string& id) {
    const std::vector<float> q = IntValues(rng_, 2 * 64);
    absl::StatusOr<client::Selection> got = c.Select(client::MakeSelect(id, 0, 2, q));
    ASSERT_TRUE(got.ok()) << id << ": " << got.status();
    ExpectSameSelection(*got, host.Select(0, q, 2, host.length(0) - 1, options_.engine.defaults,
                                          options_.engine.page_table),
                        id);
  }

  uint64_t TenantPages(client::IndexerClient& c) {
    absl::StatusOr<v1::ServerInfoResponse> info = c.ServerInfo();
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? info->tenant_pages() : ~0ull;
  }

  TempDir dir_;
  server::ServerOptions options_;
  std::unique_ptr<server::IndexerServer> server_;
  std::unique_ptr<client::IndexerClient> alpha_, beta_;
  std::mt19937 rng_{2024};
};

TEST_F(TenantTest, NoRpcReachesAnotherTenantsSequence) {
  HostSequence alpha_s(2, 64), alpha_t(2, 64);
  ASSERT_TRUE(Append(*alpha_, alpha_s, "s", 300, {1, 2, 3}).ok());
  ASSERT_TRUE(Append(*alpha_, alpha_t, "t", 100).ok());
  absl::StatusOr<v1::GetSequenceResponse> before = alpha_->GetSequence("s");
  ASSERT_TRUE(before.ok());

  // Beta sees what it would see for an id nobody uses.
  const auto expect_missing = [](const absl::Status& s, const std::string& rpc) {
    EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << rpc << ": " << s;
    EXPECT_EQ(std::string(s.message()), "sequence 's' does not exist") << rpc;
  };
  const std::vector<float> q(2 * 64, 1.0f);
  expect_missing(beta_->GetSequence("s").status(), "GetSequence");
  expect_missing(beta_->SelectBlocks(client::MakeSelect("s", 0, 2, q)).status(), "SelectBlocks");
  v1::BatchRequest batch;
  *batch.add_items() = client::MakeSelect("s", 0, 2, q);
  absl::StatusOr<v1::BatchResponse> b = beta_->Batch(batch);
  ASSERT_TRUE(b.ok());
  expect_missing(client::ItemStatus(b->results(0)), "Batch");
  absl::StatusOr<v1::BatchResponse> streamed = beta_->OpenBatchStream()->Step(batch);
  ASSERT_TRUE(streamed.ok()) << streamed.status();
  expect_missing(client::ItemStatus(streamed->results(0)), "BatchStream");
  expect_missing(beta_->TruncateSequence("s", 0).status(), "TruncateSequence");
  expect_missing(beta_->ReleaseSequence("s").status(), "ReleaseSequence");
  expect_missing(beta_->ForkSequence("s", "stolen").status(), "ForkSequence");
  // A select that carries an append creates beta's own "s"; it does not touch alpha's.
  v1::SelectBlocksRequest with_append = client::MakeSelect("s", 0, 2, q);
  *with_append.mutable_append() = client::MakeAppend("", 0, std::vector<float>(64 * 5, 2.0f));
  absl::StatusOr<client::Selection> own = beta_->Select(with_append);
  ASSERT_TRUE(own.ok()) << own.status();
  EXPECT_EQ(own->lengths[0], 5u);
  // Ids another tenant uses are free: beta forks its "s" to "t", which alpha also has.
  ASSERT_TRUE(beta_->ForkSequence("s", "t").ok());
  EXPECT_EQ(beta_->GetSequence("t")->lengths(0), 5u);
  ASSERT_TRUE(beta_->ReleaseSequence("t").ok());
  ASSERT_TRUE(beta_->TruncateSequence("s", 1).ok());

  // Alpha's sequences are exactly as they were, through either of its tokens.
  auto alpha2 = ConnectTo(server_->port(), WithToken(kAlphaToken2));
  for (client::IndexerClient* c : {alpha_.get(), alpha2.get()}) {
    absl::StatusOr<v1::GetSequenceResponse> now = c->GetSequence("s");
    ASSERT_TRUE(now.ok()) << now.status();
    EXPECT_EQ(now->DebugString(), before->DebugString());
    ExpectSelectionMatches(*c, alpha_s, "s");
    ExpectSelectionMatches(*c, alpha_t, "t");
  }
  // And beta's own sequence holds beta's keys only.
  EXPECT_EQ(beta_->GetSequence("s")->lengths(0), 1u);
}

TEST_F(TenantTest, PageQuotasStopATenantWithoutTouchingOthers) {
  HostSequence q1(2, 64);
  ASSERT_TRUE(Append(*beta_, q1, "q1", 3 * 128).ok());
  EXPECT_EQ(TenantPages(*beta_), 3u);
  EXPECT_EQ(beta_->ServerInfo()->tenant_page_quota(), 3u);
  const uint64_t free_before = beta_->ServerInfo()->free_pages();

  // One more block would pass the quota: refused, naming it, nothing applied.
  absl::StatusOr<v1::AppendKeysResponse> over = Append(*beta_, q1, "q1", 1);
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(over.status().message()), HasSubstr("tenant 'beta' holds 3 of its quota of 3 pages"));
  v1::SelectBlocksRequest select_with_append = client::MakeSelect("q1", 0, 1, IntValues(rng_, 64));
  *select_with_append.mutable_append() = client::MakeAppend("", 0, IntValues(rng_, 64));
  EXPECT_EQ(beta_->Select(select_with_append).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(beta_->GetSequence("q1")->lengths(0), 384u);
  EXPECT_EQ(beta_->ServerInfo()->free_pages(), free_before);
  ExpectSelectionMatches(*beta_, q1, "q1");

  // A fork shares pages: free. Writing into a shared page needs a copy: over the quota.
  ASSERT_TRUE(beta_->ForkSequence("q1", "q2", 300u).ok());
  EXPECT_EQ(TenantPages(*beta_), 3u);
  HostSequence scratch(2, 64);
  EXPECT_EQ(Append(*beta_, scratch, "q2", 1).status().code(), absl::StatusCode::kResourceExhausted);

  // Other tenants are not held back by beta's quota, only by their own (here the default, 20).
  HostSequence big(2, 64);
  ASSERT_TRUE(Append(*alpha_, big, "big", 20 * 128).ok());
  EXPECT_EQ(TenantPages(*alpha_), 20u);
  EXPECT_EQ(alpha_->ServerInfo()->tenant_page_quota(), 20u);
  absl::StatusOr<v1::AppendKeysResponse> alpha_over = Append(*alpha_, big, "big", 1);
  EXPECT_EQ(alpha_over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(alpha_over.status().message()), HasSubstr("quota of 20 pages"));
  ExpectSelectionMatches(*alpha_, big, "big");

  // Releasing gives the quota back once no sequence of the tenant holds the pages.
  EXPECT_EQ(beta_->ReleaseSequence("q1")->pages_freed(), 0u);  // q2 still shares them
  EXPECT_EQ(TenantPages(*beta_), 3u);
  EXPECT_EQ(beta_->ReleaseSequence("q2")->pages_freed(), 3u);
  EXPECT_EQ(TenantPages(*beta_), 0u);
  HostSequence again(2, 64);
  ASSERT_TRUE(Append(*beta_, again, "q3", 3 * 128).ok());
  ExpectSelectionMatches(*beta_, again, "q3");
}

// Zero-page forks cost no quota, so without a per-tenant sequence limit one tenant could fill
// max_sequences and lock the others out. With --tenant_max_sequences it is stopped at its own
// limit, and the others still create theirs.
TEST_F(TenantTest, ASequenceLimitPerTenantKeepsOneTenantFromLockingOthersOut) {
  options_.engine.max_sequences = 6;
  options_.engine.tenant_max_sequences = 4;
  server_.reset();
  server_ = StartServer(options_);
  ASSERT_NE(server_, nullptr);
  alpha_ = ConnectTo(server_->port(), WithToken(kAlphaToken));
  beta_ = ConnectTo(server_->port(), WithToken(kBetaToken));

  HostSequence root(2, 64);
  ASSERT_TRUE(Append(*alpha_, root, "root", 10).ok());
  for (int i = 1; i < 4; ++i) {
    ASSERT_TRUE(alpha_->ForkSequence("root", absl::StrCat("f", i), 0).ok()) << i;
  }
  const absl::Status more = alpha_->ForkSequence("root", "f4", 0).status();
  EXPECT_EQ(more.code(), absl::StatusCode::kResourceExhausted) << more;
  EXPECT_THAT(std::string(more.message()), HasSubstr("tenant_max_sequences 4"));
  EXPECT_EQ(alpha_->ServerInfo()->tenant_sequences(), 4u);
  EXPECT_EQ(alpha_->ServerInfo()->tenant_max_sequences(), 4u);

  HostSequence b1(2, 64), b2(2, 64);
  ASSERT_TRUE(Append(*beta_, b1, "b1", 10).ok()) << "beta is not locked out by alpha";
  ASSERT_TRUE(Append(*beta_, b2, "b2", 10).ok());
  EXPECT_EQ(beta_->ServerInfo()->tenant_sequences(), 2u);
  // The pool-wide limit still holds over both.
  HostSequence b3(2, 64);
  absl::StatusOr<v1::AppendKeysResponse> full = Append(*beta_, b3, "b3", 10);
  EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(full.status().message()), HasSubstr("max_sequences 6"));
}

}  // namespace
}  // namespace indexer::testing
