// TLS, mutual TLS and bearer tokens end to end: an in-process server with certificates made by
// the openssl tool at test time, and clients with and without the right credentials.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "tests/security/security_test_util.h"
#include "tests/testing/server_fixture.h"

namespace indexer::testing {
namespace {

using client::ClientOptions;
using client::HealthStatus;
using ::testing::HasSubstr;

class TlsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    absl::StatusOr<TestPki> pki = MakeTestPki(dir_->File("pki"));
    ASSERT_TRUE(pki.ok()) << pki.status();
    pki_ = new TestPki(*pki);
  }
  static void TearDownTestSuite() {
    delete pki_;
    delete dir_;
  }
  void SetUp() override {
    if (pki_ == nullptr) GTEST_SKIP() << "no test certificates";
  }

  server::ServerOptions TlsOptions(bool mutual) const {
    server::ServerOptions o = SmallServerOptions();
    o.tls_cert = pki_->server_cert;
    o.tls_key = pki_->server_key;
    if (mutual) o.tls_client_ca = pki_->ca;
    return o;
  }
  ClientOptions TrustingCa() const {
    ClientOptions c;
    c.tls_root_ca_pem = pki_->Pem(pki_->ca);
    return c;
  }

  static TempDir* dir_;
  static TestPki* pki_;
};

TempDir* TlsTest::dir_ = nullptr;
TestPki* TlsTest::pki_ = nullptr;

TEST_F(TlsTest, TlsClientsAreServedAndPlainClientsAreNot) {
  auto server = StartServer(TlsOptions(false));
  ASSERT_NE(server, nullptr);
  auto tls = ConnectTo(server->port(), TrustingCa());
  absl::StatusOr<v1::ServerInfoResponse> info = tls->ServerInfo(Quick());
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->head_dim(), 64u);
  EXPECT_EQ(*tls->Health("", Quick()), HealthStatus::kServing);
  ASSERT_TRUE(tls->AppendKeys(client::MakeAppend("s", 0, std::vector<float>(64 * 3, 1.0f))).ok());

  auto plain = ConnectTo(server->port());
  EXPECT_EQ(plain->ServerInfo(Quick()).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(plain->Health("", Quick()).status().code(), absl::StatusCode::kUnavailable);

  // A client that trusts another CA refuses the server's certificate.
  ClientOptions wrong_ca;
  wrong_ca.tls_root_ca_pem = pki_->Pem(pki_->rogue_cert);
  EXPECT_EQ(ConnectTo(server->port(), wrong_ca)->ServerInfo(Quick()).status().code(),
            absl::StatusCode::kUnavailable);
  // The certificate names 127.0.0.1 and localhost: another name does not match.
  ClientOptions wrong_name = TrustingCa();
  wrong_name.tls_server_name = "indexer.example.com";
  EXPECT_EQ(ConnectTo(server->port(), wrong_name)->ServerInfo(Quick()).status().code(),
            absl::StatusCode::kUnavailable);
  ClientOptions localhost = TrustingCa();
  localhost.tls_server_name = "localhost";
  EXPECT_TRUE(ConnectTo(server->port(), localhost)->ServerInfo(Quick()).ok());
}

TEST_F(TlsTest, MutualTlsRequiresAClientCertificateTheCaSigned) {
  auto server = StartServer(TlsOptions(true));
  ASSERT_NE(server, nullptr);
  EXPECT_EQ(ConnectTo(server->port(), TrustingCa())->ServerInfo(Quick()).status().code(),
            absl::StatusCode::kUnavailable)
      << "a TLS client without a certificate was served";
  ClientOptions rogue = TrustingCa();
  rogue.tls_cert_chain_pem = pki_->Pem(pki_->rogue_cert);
  rogue.tls_private_key_pem = pki_->Pem(pki_->rogue_key);
  EXPECT_EQ(ConnectTo(server->port(), rogue)->ServerInfo(Quick()).status().code(),
            absl::StatusCode::kUnavailable)
      << "a client certificate the CA did not sign was accepted";
  ClientOptions good = TrustingCa();
  good.tls_cert_chain_pem = pki_->Pem(pki_->client_cert);
  good.tls_private_key_pem = pki_->Pem(pki_->client_key);
  auto c = ConnectTo(server->port(), good);
  EXPECT_TRUE(c->ServerInfo(Quick()).ok());
  EXPECT_EQ(*c->Health("", Quick()), HealthStatus::kServing);

  ClientOptions half = TrustingCa();
  half.tls_cert_chain_pem = pki_->Pem(pki_->client_cert);
  EXPECT_EQ(client::IndexerClient::Connect("127.0.0.1:1", half).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(TlsTest, BadTlsFilesStopTheServerFromStarting) {
  server::ServerOptions o = TlsOptions(false);
  o.tls_key = dir_->File("missing.key");
  absl::StatusOr<std::unique_ptr<server::IndexerServer>> s = server::IndexerServer::Start(o);
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("--tls_key"));

  o = TlsOptions(false);
  o.tls_key = pki_->client_key;  // a key that is not the certificate's
  s = server::IndexerServer::Start(o);
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("TLS certificate and key"));
}

TEST_F(TlsTest, TlsAndTokensTogether) {
  TempDir dir;
  WriteFile(dir.File("tokens"), TokenFileText());
  server::ServerOptions o = TlsOptions(true);
  o.token_file = dir.File("tokens");
  auto server = StartServer(o);
  ASSERT_NE(server, nullptr);
  ClientOptions c = TrustingCa();
  c.tls_cert_chain_pem = pki_->Pem(pki_->client_cert);
  c.tls_private_key_pem = pki_->Pem(pki_->client_key);
  EXPECT_EQ(ConnectTo(server->port(), c)->ServerInfo(Quick()).status().code(),
            absl::StatusCode::kUnauthenticated);
  absl::StatusOr<v1::ServerInfoResponse> info =
      ConnectTo(server->port(), WithToken(kBetaToken, c))->ServerInfo(Quick());
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->tenant(), "beta");
}

// ---------------------------------------------------------------------------------------------
// Tokens.

class AuthTest : public ::testing::Test {
 protected:
  void SetUp() override {
    WriteFile(dir_.File("tokens"), TokenFileText());
    options_ = SmallServerOptions();
    options_.token_file = dir_.File("tokens");
    options_.snapshot_dir = dir_.path();
    server_ = StartServer(options_);
    ASSERT_NE(server_, nullptr);
  }

  TempDir dir_;
  server::ServerOptions options_;
  std::unique_ptr<server::IndexerServer> server_;
};

// Every RPC of Indexer and IndexerAdmin, called through `c`: the status of each.
std::vector<std::pair<std::string, absl::Status>> CallEverything(client::IndexerClient& c) {
  std::vector<std::pair<std::string, absl::Status>> out;
  const std::vector<float> keys(64 * 2, 1.0f), queries(64, 1.0f);
  out.emplace_back("AppendKeys", c.AppendKeys(client::MakeAppend("s", 0, keys)).status());
  out.emplace_back("SelectBlocks", c.SelectBlocks(client::MakeSelect("s", 0, 1, queries)).status());
  v1::BatchRequest batch;
  *batch.add_items() = client::MakeSelect("s", 0, 1, queries);
  out.emplace_back("Batch", c.Batch(batch).status());
  std::unique_ptr<client::BatchStream> stream = c.OpenBatchStream();
  out.emplace_back("BatchStream", stream->Step(batch).status());
  out.emplace_back("ReleaseSequence", c.ReleaseSequence("s").status());
  out.emplace_back("TruncateSequence", c.TruncateSequence("s", 1).status());
  out.emplace_back("ForkSequence", c.ForkSequence("s", "t").status());
  out.emplace_back("GetSequence", c.GetSequence("s").status());
  out.emplace_back("ServerInfo", c.ServerInfo().status());
  out.emplace_back("Snapshot", c.Snapshot("x.snap").status());
  return out;
}

TEST_F(AuthTest, CallsWithoutAValidTokenAreUnauthenticatedAndApplyNothing) {
  for (const std::string& token : {std::string(), std::string("not-a-real-token-000000000"),
                                  std::string(kAlphaToken) + "0"}) {
    auto c = ConnectTo(server_->port(), WithToken(token));
    for (const auto& [rpc, status] : CallEverything(*c)) {
      EXPECT_EQ(status.code(), absl::StatusCode::kUnauthenticated)
          << rpc << " with token '" << token << "': " << status;
      if (!token.empty()) {
        EXPECT_THAT(std::string(status.message()), ::testing::Not(HasSubstr(token)));
      }
    }
  }
  EXPECT_EQ(server_->engine().Stats().live_sequences, 0);
  EXPECT_FALSE(FileExists(dir_.File("x.snap")));
}

TEST_F(AuthTest, HealthCheckingStaysOpen) {
  auto anonymous = ConnectTo(server_->port());
  EXPECT_EQ(*anonymous->Health(""), HealthStatus::kServing);
  EXPECT_EQ(*anonymous->Health("indexer.v1.Indexer"), HealthStatus::kServing);
}

TEST_F(AuthTest, TokensDecideTenantAndAdminRights) {
  auto beta = ConnectTo(server_->port(), WithToken(kBetaToken));
  absl::StatusOr<v1::ServerInfoResponse> info = beta->ServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->tenant(), "beta");
  // Every Indexer call works for a plain token; the admin call needs an admin token.
  for (const auto& [rpc, status] : CallEverything(*beta)) {
    if (rpc == "Snapshot") {
      EXPECT_EQ(status.code(), absl::StatusCode::kPermissionDenied) << status;
      EXPECT_THAT(std::string(status.message()), HasSubstr("needs an admin token"));
    } else {
      EXPECT_NE(status.code(), absl::StatusCode::kUnauthenticated) << rpc << ": " << status;
      EXPECT_NE(status.code(), absl::StatusCode::kPermissionDenied) << rpc << ": " << status;
    }
  }
  EXPECT_FALSE(FileExists(dir_.File("x.snap")));
  ASSERT_TRUE(beta->AppendKeys(client::MakeAppend("kept", 0, std::vector<float>(64, 1.0f))).ok());
  // A second token of a tenant is the same tenant, without the first one's admin rights.
  auto alpha2 = ConnectTo(server_->port(), WithToken(kAlphaToken2));
  EXPECT_EQ(alpha2->ServerInfo()->tenant(), "alpha");
  EXPECT_EQ(alpha2->Snapshot("y.snap").status().code(), absl::StatusCode::kPermissionDenied);
  auto ops = ConnectTo(server_->port(), WithToken(kOpsToken));
  absl::StatusOr<v1::SnapshotResponse> snap = ops->Snapshot("y.snap");
  ASSERT_TRUE(snap.ok()) << snap.status();
  EXPECT_EQ(snap->path(), dir_.File("y.snap"));
  EXPECT_TRUE(FileExists(dir_.File("y.snap")));
  EXPECT_EQ(snap->sequences(), 1u);  // beta's "kept"
}

TEST_F(AuthTest, SnapshotNamesCannotLeaveTheSnapshotFolder) {
  auto ops = ConnectTo(server_->port(), WithToken(kOpsToken));
  for (const char* name : {"../escape.snap", "/tmp/abs.snap", ".hidden"}) {
    EXPECT_EQ(ops->Snapshot(name).status().code(), absl::StatusCode::kInvalidArgument) << name;
  }
  absl::StatusOr<v1::SnapshotResponse> stamped = ops->Snapshot("");
  ASSERT_TRUE(stamped.ok()) << stamped.status();
  EXPECT_THAT(stamped->path(), HasSubstr(dir_.path() + "/indexer-"));
}

TEST(AuthOff, WithoutATokenFileEverythingIsOpenAsBefore) {
  TempDir dir;
  server::ServerOptions o = SmallServerOptions();
  auto server = StartServer(o);
  ASSERT_NE(server, nullptr);
  auto c = ConnectTo(server->port());
  for (const auto& [rpc, status] : CallEverything(*c)) {
    EXPECT_NE(status.code(), absl::StatusCode::kUnauthenticated) << rpc;
    EXPECT_NE(status.code(), absl::StatusCode::kPermissionDenied) << rpc;
  }
  EXPECT_EQ(c->ServerInfo()->tenant(), "");
  // No --snapshot_dir: the admin call says so.
  const absl::Status snap = c->Snapshot("x.snap").status();
  EXPECT_EQ(snap.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(snap.message()), HasSubstr("--snapshot_dir"));
  // A token sent to a server that checks none is ignored.
  EXPECT_TRUE(ConnectTo(server->port(), WithToken("anything-at-all-here"))->ServerInfo().ok());
}

TEST(AuthStart, BadTokenFilesAndFoldersStopTheServerFromStarting) {
  TempDir dir;
  server::ServerOptions o = SmallServerOptions();
  o.token_file = dir.File("tokens");
  WriteFile(o.token_file, absl::StrCat(kAlphaToken, " alpha\nshort beta\n"));
  absl::StatusOr<std::unique_ptr<server::IndexerServer>> s = server::IndexerServer::Start(o);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("line 2"));
  o.token_file = dir.File("missing");
  EXPECT_FALSE(server::IndexerServer::Start(o).ok());
  o = SmallServerOptions();
  o.snapshot_dir = dir.File("missing-folder");
  s = server::IndexerServer::Start(o);
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("--snapshot_dir"));
}

}  // namespace
}  // namespace indexer::testing
