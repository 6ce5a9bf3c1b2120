// Health under TLS, with the real binaries: indexer-server with --tls_cert/--tls_key and
// --health_listen answers grpc.health.v1 in plaintext on the health listener (what the kubelet's
// gRPC probe and the image's HEALTHCHECK, `indexer-cli health`, speak), while its main listener
// still requires TLS. Certificates come from tests/security/make_test_certs.sh.
#include <signal.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <optional>
#include <regex>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "tests/security/security_test_util.h"

namespace indexer::testing {
namespace {

using client::ClientOptions;
using client::HealthStatus;
using ::testing::HasSubstr;

// The port of the "health checks ... on port N" start-up line, once printed.
std::optional<int> HealthPort(Child& child) {
  const std::regex line("health checks \\(grpc.health.v1 only, plaintext\\) on port ([0-9]+)");
  for (int i = 0; i < 500; ++i) {
    std::smatch m;
    const std::string log = child.Log();
    if (std::regex_search(log, m, line)) return std::stoi(m[1]);
    absl::SleepFor(absl::Milliseconds(10));
  }
  return std::nullopt;
}

class HealthUnderTlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<TestPki> pki = MakeTestPki(dir_.File("pki"));
    ASSERT_TRUE(pki.ok()) << pki.status();
    pki_ = *pki;
    server_ = StartServerBinary({"--capacity=64", "--head_dim=64", "--tls_cert=" + pki_.server_cert,
                                 "--tls_key=" + pki_.server_key, "--health_listen=127.0.0.1:0",
                                 "--not_serving_seconds=2"},
                                &port_);
    ASSERT_NE(server_, nullptr);
    const std::optional<int> health = HealthPort(*server_);
    ASSERT_TRUE(health.has_value()) << server_->Log();
    health_port_ = *health;
  }

  std::unique_ptr<client::IndexerClient> Plain(int port) { return ConnectTo(port, ClientOptions{}); }
  std::unique_ptr<client::IndexerClient> Tls(int port) {
    ClientOptions o;
    o.tls_root_ca_pem = pki_.Pem(pki_.ca);
    return ConnectTo(port, o);
  }

  TempDir dir_;
  TestPki pki_;
  std::unique_ptr<Child> server_;
  int port_ = 0;
  int health_port_ = 0;
};

TEST_F(HealthUnderTlsTest, HealthIsPlaintextWhileTheMainPortRequiresTls) {
  auto health = Plain(health_port_);
  EXPECT_EQ(*health->Health("", Quick()), HealthStatus::kServing);
  EXPECT_EQ(*health->Health("indexer.v1.Indexer", Quick()), HealthStatus::kServing);
  EXPECT_EQ(health->ServerInfo(Quick()).status().code(), absl::StatusCode::kUnimplemented)
      << "the health listener serves nothing but grpc.health.v1";

  EXPECT_FALSE(Plain(port_)->Health("", Quick()).ok()) << "the main port must refuse plaintext";
  auto tls = Tls(port_);
  EXPECT_EQ(*tls->Health("", Quick()), HealthStatus::kServing);
  absl::StatusOr<v1::ServerInfoResponse> info = tls->ServerInfo(Quick());
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->head_dim(), 64u);
}

TEST_F(HealthUnderTlsTest, TheImageProbeCommandPassesOnTheHealthPort) {
  const char* cli = std::getenv("INDEXER_CLI_BINARY");
  if (cli == nullptr) GTEST_SKIP() << "INDEXER_CLI_BINARY is not set";
  // docker/Dockerfile's HEALTHCHECK: indexer-cli --server=127.0.0.1:<health port> health.
  const RunResult ok = RunToEnd({cli, absl::StrCat("--server=127.0.0.1:", health_port_),
                                 "--timeout=2s", "health"});
  EXPECT_EQ(ok.code, 0) << ok.output;
  EXPECT_THAT(ok.output, HasSubstr("SERVING"));
  // The same probe on the TLS port fails: why the health listener exists.
  const RunResult refused =
      RunToEnd({cli, absl::StrCat("--server=127.0.0.1:", port_), "--timeout=2s", "health"});
  EXPECT_EQ(refused.code, 1) << refused.output;
}

TEST_F(HealthUnderTlsTest, SigtermTurnsTheHealthListenerNotServing) {
  auto health = Plain(health_port_);
  ASSERT_EQ(*health->Health("indexer.v1.Indexer", Quick()), HealthStatus::kServing);
  ASSERT_EQ(kill(server_->pid(), SIGTERM), 0);
  bool not_serving = false;
  for (int i = 0; i < 200 && !not_serving; ++i) {
    absl::StatusOr<HealthStatus> h = health->Health("indexer.v1.Indexer", Quick());
    not_serving = h.ok() && *h == HealthStatus::kNotServing;
    if (!not_serving) absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_TRUE(not_serving) << server_->Log();
  EXPECT_EQ(server_->Wait(absl::Seconds(20)), std::optional<int>(0)) << server_->Log();
}

}  // namespace
}  // namespace indexer::testing
