// The pieces on their own: the token file and token checks (AccessControl), page quotas
// (PagePool), the snapshot checksum (CRC-32C) and snapshot names.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/crc32c.h"
#include "engine/page_pool.h"
#include "server/access_control.h"
#include "server/admin_service.h"
#include "tests/security/security_test_util.h"

namespace indexer::testing {
namespace {

using server::AccessControl;
using server::Caller;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr int64_t kPageBytes = 128 * 64 * 2;  // head_dim 64, bf16, one layer

std::string Bearer(const std::string& token) { return "Bearer " + token; }

TEST(AccessControl, ParsesTokensTenantsAdminsAndQuotas) {
  const std::string text = absl::StrCat(
      "# comment\n\n", kAlphaToken, " alpha admin quota=10\n", kAlphaToken2, "\talpha\n",
      kBetaToken, " beta quota=2MiB\n", kOpsToken, " ops quota=none admin\n");
  absl::StatusOr<AccessControl> access = AccessControl::Parse(text, "tokens", kPageBytes);
  ASSERT_TRUE(access.ok()) << access.status();
  EXPECT_TRUE(access->enabled());
  EXPECT_EQ(access->num_tokens(), 4u);
  struct Case {
    const char* token;
    const char* tenant;
    bool admin;
  };
  for (const Case& c : {Case{kAlphaToken, "alpha", true}, Case{kAlphaToken2, "alpha", false},
                        Case{kBetaToken, "beta", false}, Case{kOpsToken, "ops", true}}) {
    absl::StatusOr<Caller> caller = access->Authenticate(Bearer(c.token));
    ASSERT_TRUE(caller.ok()) << c.tenant << ": " << caller.status();
    EXPECT_EQ(caller->tenant, c.tenant);
    EXPECT_EQ(caller->admin, c.admin) << c.tenant;
  }
  // The scheme is case-insensitive; surrounding blanks are ignored.
  EXPECT_TRUE(access->Authenticate(absl::StrCat("  bearer   ", kBetaToken, " ")).ok());
  EXPECT_EQ(access->quotas().at("alpha"), 10);
  EXPECT_EQ(access->quotas().at("beta"), (2 << 20) / kPageBytes);
  EXPECT_EQ(access->quotas().at("ops"), 0);  // none: exempt from the default quota
}

TEST(AccessControl, WithoutATokenFileEveryCallerIsTheDefaultTenantWithAdminRights) {
  const AccessControl open;
  EXPECT_FALSE(open.enabled());
  for (std::optional<absl::string_view> header :
       {std::optional<absl::string_view>(), std::optional<absl::string_view>("Bearer whatever")}) {
    absl::StatusOr<Caller> caller = open.Authenticate(header);
    ASSERT_TRUE(caller.ok());
    EXPECT_EQ(caller->tenant, "");
    EXPECT_TRUE(caller->admin);
  }
}

TEST(AccessControl, RefusesWhatIsNotAKnownTokenAsUnauthenticated) {
  absl::StatusOr<AccessControl> access = AccessControl::Parse(TokenFileText(), "tokens", kPageBytes);
  ASSERT_TRUE(access.ok()) << access.status();
  const std::string alpha = kAlphaToken;
  const std::vector<std::optional<std::string>> refused = {
      std::nullopt,                      // no metadata
      "",                                // empty
      alpha,                             // no scheme
      "Basic " + alpha,                  // another scheme
      "Bearer ",                         // no token
      Bearer(alpha.substr(0, alpha.size() - 1)),  // a prefix of a real token
      Bearer(alpha + "x"),               // a real token and more
      Bearer(std::string(alpha.size(), 'a')),     // same length, other bytes
      Bearer(std::string(300, 'a')),     // longer than any token may be
      Bearer("ALPHA-TOKEN-0123456789ABCDEF"),     // tokens are case-sensitive
  };
  for (const std::optional<std::string>& header : refused) {
    std::optional<absl::string_view> view;
    if (header) view = *header;
    absl::StatusOr<Caller> caller = access->Authenticate(view);
    EXPECT_EQ(caller.status().code(), absl::StatusCode::kUnauthenticated)
        << (header ? *header : "(none)");
    // Refusals never echo what was presented.
    if (header && header->size() > 8) {
      EXPECT_THAT(std::string(caller.status().message()), Not(HasSubstr(header->substr(7))));
    }
  }
  EXPECT_THAT(std::string(access->Authenticate(std::nullopt).status().message()),
              HasSubstr("authorization: Bearer <token>"));
}

TEST(AccessControl, MalformedTokenFilesAreRefusedNamingTheLine) {
  const std::string ok_line = absl::StrCat(kAlphaToken, " alpha\n");
  struct Case {
    std::string text;
    std::string message;
  };
  const Case cases[] = {
      {ok_line + "short beta\n", "line 2: the token has 5 characters"},
      {ok_line + "# fine\n" + kBetaToken + "\n", "line 3: expected '<token> <tenant>"},
      {ok_line + kBetaToken + " be/ta\n", "line 2: tenant 'be/ta' is not"},
      {ok_line + kBetaToken + " beta superuser\n", "line 2: unknown field 'superuser'"},
      {ok_line + kAlphaToken + " beta\n", "line 2: the token is already on line 1"},
      {ok_line + kBetaToken + " beta quota=lots\n", "line 2: quota 'lots' is not"},
      {absl::StrCat(kAlphaToken, " alpha quota=5\n", kAlphaToken2, " alpha quota=6\n"),
       "line 2: tenant 'alpha' already has another quota on line 1"},
      {"# nothing but comments\n\n", "holds no tokens"},
      {ok_line + "bad\x01token-0123456789 beta\n", "line 2: the token holds a character"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<AccessControl> access = AccessControl::Parse(c.text, "tokens.txt", kPageBytes);
    EXPECT_EQ(access.status().code(), absl::StatusCode::kInvalidArgument) << c.text;
    EXPECT_THAT(std::string(access.status().message()), HasSubstr(c.message)) << c.text;
    EXPECT_THAT(std::string(access.status().message()), HasSubstr("tokens.txt")) << c.text;
    // The tokens themselves never appear in messages.
    EXPECT_THAT(std::string(access.status().message()), Not(HasSubstr(kAlphaToken)));
    EXPECT_THAT(std::string(access.status().message()), Not(HasSubstr(kBetaToken)));
  }
}

TEST(AccessControl, ReadsTheFileAndWarnsWhenOthersMayReadIt) {
  TempDir dir;
  const std::string path = dir.File("tokens");
  WriteFile(path, TokenFileText(), 0600);
  absl::StatusOr<AccessControl> access = AccessControl::FromTokenFile(path, kPageBytes);
  ASSERT_TRUE(access.ok()) << access.status();
  EXPECT_TRUE(access->warnings().empty());
  WriteFile(path, TokenFileText(), 0644);
  access = AccessControl::FromTokenFile(path, kPageBytes);
  ASSERT_TRUE(access.ok()) << access.status();
  ASSERT_EQ(access->warnings().size(), 1u);
  EXPECT_THAT(access->warnings()[0], HasSubstr("chmod 600"));
  EXPECT_EQ(AccessControl::FromTokenFile(dir.File("missing"), kPageBytes).status().code(),
            absl::StatusCode::kNotFound);
}

TEST(AccessControl, AdminCallsNeedAnAdmin) {
  EXPECT_TRUE(AccessControl::RequireAdmin(Caller{"ops", true}, "X").ok());
  const absl::Status denied = AccessControl::RequireAdmin(Caller{"beta", false}, "IndexerAdmin.Snapshot");
  EXPECT_EQ(denied.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(denied.message()), HasSubstr("IndexerAdmin.Snapshot needs an admin token"));
}

TEST(SnapshotPath, AcceptsPlainNamesOnly) {
  EXPECT_EQ(*server::SnapshotPath("/var/snap", "day-1.snap"), "/var/snap/day-1.snap");
  absl::StatusOr<std::string> stamped = server::SnapshotPath("/var/snap", "");
  ASSERT_TRUE(stamped.ok());
  EXPECT_THAT(*stamped, ::testing::MatchesRegex("/var/snap/indexer-[0-9]{8}T[0-9]{6}Z\\.snap"));
  for (const char* bad : {"../etc/passwd", "a/b", ".hidden", "..", "sp ace", "x\n"}) {
    EXPECT_EQ(server::SnapshotPath("/var/snap", bad).status().code(),
              absl::StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_FALSE(server::SnapshotPath("/d", std::string(201, 'a')).ok());
}

TEST(PagePool, QuotasLimitEachTenantAllOrNothing) {
  engine::PageQuotas quotas;
  quotas.default_pages = 4;
  quotas.per_tenant["small"] = 2;
  quotas.per_tenant["free"] = 0;  // exempt
  engine::PagePool pool(16, quotas);
  absl::StatusOr<std::vector<int32_t>> a = pool.Allocate(2, "small");
  ASSERT_TRUE(a.ok()) << a.status();
  absl::StatusOr<std::vector<int32_t>> more = pool.Allocate(1, "small");
  EXPECT_EQ(more.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(more.status().message()), HasSubstr("tenant 'small' holds 2 of its quota of 2 pages"));
  EXPECT_EQ(pool.free_pages(), 14);  // nothing taken by the refusal
  EXPECT_EQ(pool.TenantPages("small"), 2);
  // Shared pages count once; they stay charged until the last reference goes.
  pool.AddRef(*a);
  EXPECT_EQ(pool.TenantPages("small"), 2);
  EXPECT_EQ(pool.Release(*a), 0);
  EXPECT_EQ(pool.TenantPages("small"), 2);
  EXPECT_EQ(pool.Release(*a), 2);
  EXPECT_EQ(pool.TenantPages("small"), 0);
  EXPECT_TRUE(pool.Allocate(2, "small").ok());
  // The default quota, an exempt tenant, and restore's unenforced allocation.
  EXPECT_TRUE(pool.Allocate(4, "other").ok());
  EXPECT_FALSE(pool.Allocate(1, "other").ok());
  EXPECT_TRUE(pool.Allocate(6, "free").ok());
  EXPECT_TRUE(pool.Allocate(1, "other", /*enforce_quota=*/false).ok());
  EXPECT_EQ(pool.TenantPages("other"), 5);
  EXPECT_EQ(pool.TenantQuota("other"), 4);
  EXPECT_EQ(pool.TenantQuota("free"), 0);
  // The pool itself still runs out first when it must.
  absl::StatusOr<std::vector<int32_t>> full = pool.Allocate(5, "free");
  EXPECT_THAT(std::string(full.status().message()), HasSubstr("key cache is full"));
}

TEST(Crc32c, MatchesTheStandardCheckValueAndExtends) {
  const std::string check = "123456789";
  EXPECT_EQ(engine::Crc32c(0, check.data(), check.size()), 0xE3069283u);
  EXPECT_EQ(engine::Crc32c(0, "", 0), 0u);
  std::string data(1000, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 31 + 7);
  const uint32_t whole = engine::Crc32c(0, data.data(), data.size());
  for (size_t cut : {0, 1, 7, 8, 9, 500, 999, 1000}) {
    const uint32_t first = engine::Crc32c(0, data.data(), cut);
    EXPECT_EQ(engine::Crc32c(first, data.data() + cut, data.size() - cut), whole) << cut;
  }
  data[500] ^= 1;
  EXPECT_NE(engine::Crc32c(0, data.data(), data.size()), whole);
}

}  // namespace
}  // namespace indexer::testing
